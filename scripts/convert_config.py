"""Rewrite a torchtitan TOML config (2024 / SageMaker guide, v0.1.0, v0.2.x) in titan's own keys.

    python scripts/convert_config.py torchtitan/llama3_8b.toml -o train_configs/my_8b.toml
    python scripts/convert_config.py old.toml            # print to stdout

The new file holds every key the old one set (renamed and value-mapped as titan's loader does; see
docs/config_reference.md, "torchtitan keys") plus what torchtitan implied by them, so
`--job.config_file` on either file gives the same merged config. Keys titan does not implement stop
the conversion with the same line the loader prints; nothing is written then. An existing output
file is never replaced. Errors print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import tomli_w  # noqa: E402

from titan.config import JobConfig, load_config  # noqa: E402
from titan.config.compose import load_toml  # noqa: E402
from titan.config.dialects import Translator, translate_toml  # noqa: E402
from titan.config.manager import titan_keys  # noqa: E402
from titan.errors import TitanError  # noqa: E402


def convert(path: str) -> str:
    """The titan-native TOML text for the config file at ``path``."""
    table = translate_toml(load_toml(path), path, Translator(titan_keys()))
    merged = load_config(["--job.config_file", path], env={})
    default = JobConfig()
    out: dict[str, dict[str, Any]] = {}
    for f in dataclasses.fields(merged):
        section, base = getattr(merged, f.name), getattr(default, f.name)
        body = {}
        for field in dataclasses.fields(section):
            value = getattr(section, field.name)
            if (field.name in table.get(f.name, {}) or value != getattr(base, field.name)) and value is not None:
                body[field.name] = value
        body.pop("config_file", None)
        if body:
            out[f.name] = body
    header = f"# titan config converted from {path} by scripts/convert_config.py\n\n"
    return header + tomli_w.dumps(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="torchtitan (or titan) TOML file")
    p.add_argument("-o", "--output", help="titan TOML file to write (default: stdout); must not exist")
    args = p.parse_args(argv)
    try:
        if args.output and Path(args.output).exists():
            raise TitanError(f"output file {args.output} already exists; choose a new name")
        text = convert(args.config)
        if args.output:
            Path(args.output).write_text(text)
            print(f"wrote {args.output}", file=sys.stderr)
        else:
            sys.stdout.write(text)
    except TitanError as e:
        print(f"titan: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
