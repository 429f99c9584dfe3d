"""``python -m titan.launch.check [train.py options]``: load and validate the merged config (TOML +
flags + environment defaults) in one process and exit: 0 when it is valid, 2 with titan's one line
when not. The launchers run it before torchrun / srun start, so a typo fails in seconds, before
any rank (or a Slurm job's nodes) is busy with it. A bad flag or TOML value fails before torch is
imported; the checks that need the model registry and the other features import it. A hub
dataset streamed by id is looked up here too (its config and split; no network: one line).

``--help [SECTION | SECTION.KEY]`` is answered here too, for the launcher and the ranks alike.

``--print_value SECTION.KEY``: after the check, print that key's merged value (TOML + flags +
environment defaults) on stdout, alone. The launch scripts read ``job.dump_folder`` this way to
place each replica group's folder under it: the one parser that the ranks use, not a re-parse in
bash that would miss a TOML-set value."""

from __future__ import annotations

import json
import os
import sys

from titan.errors import TitanError
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


PRINT_VALUE = "--print_value"


def split_print_value(argv: list[str]) -> tuple[list[str], str | None]:
    """(train.py's options, the key of --print_value KEY or None)."""
    if PRINT_VALUE not in argv:
        return argv, None
    at = argv.index(PRINT_VALUE)
    key = argv[at + 1] if at + 1 < len(argv) else ""
    if not key or key.startswith("-"):
        raise TitanError(f"{PRINT_VALUE} needs a config key (section.key), e.g. {PRINT_VALUE} job.dump_folder")
    return argv[:at] + argv[at + 2 :], key


def format_value(value: object) -> str:
    """A string as it is (a path for a script to use), anything else as JSON (true, 3, [..])."""
    return value if isinstance(value, str) else json.dumps(value, default=str)


def main(argv: list[str]) -> int:
    if wants_help(argv):
        return print_help(argv)

    def check() -> int:
        from titan.config.manager import resolve_key
        from titan.data.build import check_hub
        from titan.training.checks import load_job

        args, key = split_print_value(argv)
        if key is not None:
            resolve_key(key)  # a typo'd key: its line, before the config is loaded
        config = load_job(args)
        check_hub(config)  # offline or a typo'd hub config: one line here, not one per rank
        if key is not None:
            section, _, name = key.partition(".")
            print(format_value(getattr(getattr(config, section), name)), flush=True)
        return 0

    return exit_status(check, debug=lambda: debug_requested(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
