"""Training entry point: `python -m titan.train [--job.config_file FILE.toml] [--section.key VALUE ...]`.

train.py at the repository root calls main() here, so `torchrun ... train.py ...` (run_train.sh,
the Slurm script) and `torchrun ... -m titan.train ...` run the same code.
"""

from __future__ import annotations

import os
import sys

from titan.errors import TitanError


def _report(error: TitanError, after_init: bool) -> None:
    rank = os.environ.get("RANK", "0")
    # Before the process group exists every rank hits the same error: rank 0 reports it.
    # Later errors can be rank-specific, so a failing rank reports with its id.
    if rank == "0":
        print(f"titan: error: {error}", file=sys.stderr)
    elif after_init and not getattr(error, "same_on_all_ranks", False):
        print(f"titan: error on rank {rank}: {error}", file=sys.stderr)


_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "communicator was aborted",
              "Broken pipe", "NCCL error", "Socket Timeout")


def _peer_lost(error: BaseException) -> bool:
    import torch.distributed as dist

    return isinstance(error, dist.DistError) or any(p in str(error) for p in _PEER_LOST)


def _help(argv: list[str]) -> int | None:
    """--help [SECTION | SECTION.KEY]: print and return the exit status; None without --help."""
    at = next((i for i, a in enumerate(argv) if a in ("-h", "--help")), None)
    if at is None:
        return None
    from titan.config import format_help

    topic = argv[at + 1] if at + 1 < len(argv) and not argv[at + 1].startswith("-") else None
    try:
        print(format_help(topic))
    except TitanError as e:
        _report(e, after_init=False)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    status = _help(argv)
    if status is not None:
        return status
    # --job.debug is looked for in argv too: a config that fails to load has no job.debug yet
    debug = bool(os.environ.get("TITAN_DEBUG")) or "--job.debug" in argv
    try:
        from titan.config import load_config

        config = load_config(argv)  # bad flags fail here, before torch is even imported
    except TitanError as e:
        if debug:
            raise
        _report(e, after_init=False)
        return 2
    debug = debug or config.job.debug
    if config.job.print_config and os.environ.get("RANK", "0") == "0":
        from titan.config import to_toml

        print(to_toml(config), flush=True)

    if config.job.dry_run:
        from titan.dry_run import main as dry_run_main

        try:
            return dry_run_main(config)
        except TitanError as e:
            if debug:
                raise
            _report(e, after_init=False)
            return 2

    import torch.distributed as dist

    from titan.parallel.utils import destroy_distributed
    from titan.trainer import Trainer

    try:
        Trainer(config).train()
    except TitanError as e:
        if debug:
            raise
        _report(e, after_init=dist.is_initialized())
        return 2
    except Exception as e:
        # A peer rank failed (or was killed) while this one waited in a collective: that rank (or
        # torchrun's "Root Cause") has the real message; this one only says why it stops too.
        if debug or not (dist.is_initialized() and _peer_lost(e)):
            raise
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"titan: error on rank {os.environ.get('RANK', '0')}: another rank failed during a collective"
              f" ({first[:160]}); its message, or torchrun's 'Root Cause', says why", file=sys.stderr)
        return 3
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
