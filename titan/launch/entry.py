"""What every rank runs: `python -m titan.train [--job.config_file FILE.toml] [--section.key VALUE ...]`.

train.py at the repository root calls main() here, so `torchrun ... train.py ...` (run_train.sh,
the Slurm script, SageMaker) and `torchrun ... -m titan.train ...` run the same code: load the
config, then train it (the Trainer validates it first) or dry-run its layout.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from titan.errors import TitanError
from titan.launch.check import print_help, wants_help
from titan.launch.report import PEER_LOST_PHRASE, PEER_LOST_STATUS, debug_requested, emit, exit_status

if TYPE_CHECKING:
    from titan.config import JobConfig

_PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "communicator was aborted",
    "Broken pipe",
    "NCCL error",
    "Socket Timeout",
)


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


def _train(config: JobConfig, debug: bool) -> int:
    import torch.distributed as dist

    from titan.training.trainer import Trainer

    try:
        Trainer(config).train()
    except TitanError:
        raise
    except Exception as e:
        # A peer rank failed (or was killed) while this one waited in a collective: that rank (or
        # torchrun's "Root Cause") has the real message; this one only says why it stops too.
        if debug or not (dist.is_initialized() and _peer_lost(e)):
            raise
        line = (
            f"titan: error on rank {os.environ.get('RANK', '0')}: {PEER_LOST_PHRASE}"
            f" ({_peer_lost_cause(e)}); that rank's message (the launcher's last line, or torchrun's 'Root Cause')"
            " says why"
        )
        emit(line)
        return PEER_LOST_STATUS
    return 0


def _run(config: JobConfig, debug: bool) -> int:
    if (config.job.print_config or config.job.print_config_sources) and os.environ.get("RANK", "0") == "0":
        from titan.config import to_toml

        print(to_toml(config, sources=config.job.print_config_sources), flush=True)
    if config.job.dry_run:
        from titan.tools.dry_run import main as dry_run

        return dry_run(config)
    return _train(config, debug)


def main(argv: list[str] | None = None) -> int:
    """The exit status: 0, 2 after a user error (its one line printed), 3 when only a peer failed."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if wants_help(argv):
        return print_help(argv)
    if "LOCAL_RANK" in os.environ:  # started by a launcher (torchrun): stop if it dies
        from titan.launch.parent import watch_parent

        watch_parent()
    config: JobConfig | None = None

    def debug() -> bool:
        return debug_requested(argv) or (config is not None and config.job.debug)

    def load_and_run() -> int:
        nonlocal config
        from titan.config import load_config

        # A bad flag or TOML value fails here, before torch is imported; the checks that need the
        # model registry, the world size or the device run first thing in the Trainer (or dry run).
        config = load_config(argv)
        return _run(config, debug())

    try:
        return exit_status(load_and_run, debug=debug)
    finally:
        if "torch.distributed" in sys.modules:  # after the report: a rank's line says whether it was initialized
            from titan.parallel.utils import destroy_distributed

            destroy_distributed()
