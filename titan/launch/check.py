"""``python -m titan.launch.check [train.py options]``: load and validate the merged config (TOML +
flags + environment defaults) in one process and exit: 0 when it is valid, 2 with titan's one line
when not. The launchers run it before torchrun / srun start, so a typo fails in seconds, before
any rank (or a Slurm job's nodes) is busy with it. A bad flag or TOML value fails before torch is
imported; the checks that need the model registry and the other features import it. A hub
dataset streamed by id is looked up here too (its config and split; no network: one line).

``--help [SECTION | SECTION.KEY]`` is answered here too, for the launcher and the ranks alike."""

from __future__ import annotations

import os
import sys

from titan.launch.report import debug_requested, exit_status


def wants_help(argv: list[str]) -> bool:
    return "-h" in argv or "--help" in argv


def print_help(argv: list[str]) -> int:
    """--help [SECTION | SECTION.KEY]: print it; 0, or 2 with titan's line for an unknown topic."""
    at = next(i for i, a in enumerate(argv) if a in ("-h", "--help"))
    topic = argv[at + 1] if at + 1 < len(argv) and not argv[at + 1].startswith("-") else None

    def show() -> int:
        from titan.config import format_help

        text = format_help(topic)
        try:
            print(text, flush=True)
        except BrokenPipeError:  # `--help | head`: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0

    return exit_status(show)  # help is not a run: --job.debug asks for no traceback here


def main(argv: list[str]) -> int:
    if wants_help(argv):
        return print_help(argv)

    def check() -> int:
        from titan.data.build import check_hub
        from titan.training.checks import load_job

        check_hub(load_job(argv))  # offline or a typo'd hub config: one line here, not one per rank
        return 0

    return exit_status(check, debug=lambda: debug_requested(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
