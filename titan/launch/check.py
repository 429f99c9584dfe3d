"""``python -m titan.launch.check [--world_size N] [train.py options]``: check a run in one process
and exit: 0 when it can start, 2 with titan's one line when not; it writes nothing. The launchers
run it before torchrun / srun start, so a bad setting fails in seconds, before any rank (or a Slurm
job's nodes) is busy with it. It runs titan.training.checks.check_job, the check every rank and
the dry run run too: the merged config (TOML + flags + environment defaults), the model's shape
(flavor, overrides, experts, the tokenizer's vocabulary), the layout for N ranks on this machine's
device type (without --world_size the layout is not checked), the tokenizer, data, hub dataset
and checkpoint files the config names. A bad flag or TOML value fails before torch is imported.

``--help [SECTION | SECTION.KEY]`` is answered here too, for the launcher and the ranks alike.

``--print_value SECTION.KEY``: after the check, print that key's merged value (TOML + flags +
environment defaults) on stdout, alone. The launch scripts read ``job.dump_folder`` this way to
place each replica group's folder under it: the one parser that the ranks use, not a re-parse in
bash that would miss a TOML-set value."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from titan.errors import TitanError
from titan.launch.report import debug_requested, exit_status

if TYPE_CHECKING:
    from titan.config import JobConfig


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


WORLD_SIZE = "--world_size"


def split_world_size(argv: list[str]) -> tuple[list[str], int | None]:
    """(train.py's options, the N of --world_size N or None)."""
    if WORLD_SIZE not in argv:
        return argv, None
    at = argv.index(WORLD_SIZE)
    value = argv[at + 1] if at + 1 < len(argv) else ""
    if not value.isdigit() or int(value) < 1:
        raise TitanError(f"{WORLD_SIZE} needs the number of ranks (1 or more), e.g. {WORLD_SIZE} 8; got {value!r}")
    return argv[:at] + argv[at + 2 :], int(value)


def run_check(argv: list[str], loaded: Callable[[], None] | None = None) -> JobConfig:
    """Load the merged config and run titan.training.checks.check_job on it, for ``--world_size N``
    ranks (without it, the checks that need the layout are skipped) on this machine's device type.
    What reads files or the network runs here unless a launcher already ran it for these ranks.
    ``loaded``: called once the config has parsed, before torch is imported and the checks run."""
    from titan.config import load_config
    from titan.config.manager import resolve_key
    from titan.training.checks import check_job, checked_by_launcher

    args, key = split_print_value(argv)
    args, world_size = split_world_size(args)
    if key is not None:
        resolve_key(key)  # a typo'd key: its line, before the config is loaded
    config = load_config(args)  # a bad flag or TOML value: before torch is imported
    if loaded is not None:
        loaded()

    import torch

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    check_job(config, world_size, device_type, once=not checked_by_launcher())
    if key is not None:
        section, _, name = key.partition(".")
        print(format_value(getattr(getattr(config, section), name)), flush=True)
    return config


def main(argv: list[str], loaded: Callable[[], None] | None = None) -> int:
    if wants_help(argv):
        return print_help(argv)

    def check() -> int:
        run_check(argv, loaded)
        return 0

    return exit_status(check, debug=lambda: debug_requested(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
