"""``python -m titan.launch.check [train.py options]``: load and validate the merged config (TOML +
flags + environment defaults) in one process and exit: 0 when it is valid, 2 with titan's one line
when not. The launchers run it before torchrun / srun start, so a typo fails in seconds, before
any rank (or a Slurm job's nodes) is busy with it. A bad flag or TOML value fails before torch is
imported; the checks that need the model registry and the other features import it."""

from __future__ import annotations

import os
import sys

from titan.errors import TitanError


def wants_help(argv: list[str]) -> bool:
    return "-h" in argv or "--help" in argv


def debug_requested(argv: list[str]) -> bool:
    # looked for in argv: a config that fails to load has no job.debug yet
    return bool(os.environ.get("TITAN_DEBUG")) or "--job.debug" in argv


def main(argv: list[str]) -> int:
    if wants_help(argv):
        from titan.launch.entry import print_help

        return print_help(argv)
    try:
        from titan.training.checks import load_job

        load_job(argv)
    except TitanError as e:
        if debug_requested(argv):
            raise
        print(f"titan: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
