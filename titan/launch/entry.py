"""Training entry point: `python -m titan.train [--job.config_file FILE.toml] [--section.key VALUE ...]`.

train.py at the repository root calls main() here, so `torchrun ... train.py ...` (run_train.sh,
the Slurm script) and `torchrun ... -m titan.train ...` run the same code.
"""

from __future__ import annotations

import os
import sys

from titan.errors import TitanError
from titan.launch.check import debug_requested
from titan.launch.report import PEER_LOST_PHRASE, report as _report, write_error_file


_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "communicator was aborted",
              "Broken pipe", "NCCL error", "Socket Timeout")


def _peer_lost(error: BaseException) -> bool:
    import torch.distributed as dist

    return isinstance(error, dist.DistError) or any(p in str(error) for p in _PEER_LOST)


def _peer_lost_cause(error: BaseException) -> str:
    """The transport's words for it, whole: the matched phrase, else the first line of the error."""
    text = str(error)
    found = next((p for p in _PEER_LOST if p in text), None)
    if found:
        return found
    return (text.splitlines()[0] if text.strip() else type(error).__name__).strip()


def print_help(argv: list[str]) -> int | None:
    """--help [SECTION | SECTION.KEY]: print and return the exit status; None without --help."""
    at = next((i for i, a in enumerate(argv) if a in ("-h", "--help")), None)
    if at is None:
        return None
    from titan.config import format_help

    topic = argv[at + 1] if at + 1 < len(argv) and not argv[at + 1].startswith("-") else None
    try:
        print(format_help(topic), flush=True)
    except TitanError as e:
        _report(e, after_init=False)
        return 2
    except BrokenPipeError:  # `--help | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    status = print_help(argv)
    if status is not None:
        return status
    debug = debug_requested(argv)
    if "LOCAL_RANK" in os.environ:  # started by a launcher (torchrun): stop if it dies
        from titan.launch.parent import watch_parent

        watch_parent()
    try:
        from titan.training.checks import load_job

        # Every config error fails here, before any process group or model exists; a bad flag or
        # TOML value even before torch is imported.
        config = load_job(argv)
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
        from titan.tools.dry_run import main as dry_run_main

        try:
            return dry_run_main(config)
        except TitanError as e:
            if debug:
                raise
            _report(e, after_init=False)
            return 2

    import torch.distributed as dist

    from titan.parallel.utils import destroy_distributed
    from titan.training.trainer import Trainer

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
        line = (f"titan: error on rank {os.environ.get('RANK', '0')}: {PEER_LOST_PHRASE}"
                f" ({_peer_lost_cause(e)}); that rank's message (the launcher's last line, or torchrun's 'Root Cause')"
                " says why")
        print(line, file=sys.stderr)
        write_error_file(line)
        return 3
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
