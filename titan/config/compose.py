"""Config files that build on others: ``extends = "base.toml"`` (or a list of files) at the top of
a TOML file, before its first [section].

The files are applied in layers: a file's bases first, depth first and in the order listed, then
the file's own values on top, so a later value wins; the command line comes after the last file.
A base's path is relative to the file that names it. A base reached twice (two variants of one
base, extended together) is applied once, where it was first reached, so it cannot undo what the
files between the two mentions set. Each file may use torchtitan's spellings (translated per file).
A cycle, a missing base or a bad ``extends`` value stops with one line naming the file and the
chain of files that led to it; a value a file sets wrongly names the same chain (the loader,
titan/config/manager.py).

Every layer keeps the line of each key it sets, for ``--job.print_config_sources``.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titan.config import dialects
from titan.errors import TitanError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib  # pyright: ignore[reportMissingImports] (a dependency on 3.10 only)

__all__ = ["EXTENDS", "Layer", "load_toml", "read_layers"]

EXTENDS = "extends"
_HEADER = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(?:#.*)?$")
_KEY = re.compile(r"""^\s*((?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*'))*)\s*=""")


def load_toml(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise TitanError(
            f"config file '{path}' does not exist (set --job.config_file to a TOML file,"
            " e.g. train_configs/debug_model.toml)"
        )
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise TitanError(f"config file '{path}' is not valid TOML: {e}") from None
    except UnicodeDecodeError:
        raise TitanError(f"config file '{path}' is not valid TOML: not UTF-8 text") from None


def _dotted(text: str) -> str:
    """A TOML key as written (bare, quoted, dotted) -> 'a.b'."""
    return ".".join(p.strip("\"'") for p in re.findall(r"\"[^\"]*\"|'[^']*'|[A-Za-z0-9_-]+", text))


def key_lines(text: str) -> dict[str, int]:
    """'table.key' -> the line (1-based) where a TOML text sets it first; an array of tables
    ([[a.b]]) by its first header."""
    lines: dict[str, int] = {}
    table = ""
    in_multiline = False
    for number, line in enumerate(text.splitlines(), start=1):
        if in_multiline:  # inside a multi-line string: no keys here
            in_multiline = line.count('"""') % 2 == 0 and line.count("'''") % 2 == 0
            continue
        if m := _HEADER.match(line):
            table = _dotted(m[1])
            lines.setdefault(table, number)
            continue
        if m := _KEY.match(line):
            lines.setdefault(f"{table}.{_dotted(m[1])}" if table else _dotted(m[1]), number)
            rest = line[m.end() :]
            in_multiline = rest.count('"""') % 2 == 1 or rest.count("'''") % 2 == 1
    return lines


@dataclass(frozen=True)
class Layer:
    """One file of the chain: its path, the files that led to it, its values in titan's spelling
    ({section: {key: value}}) and the line of each key it sets."""

    path: str
    chain: tuple[str, ...]
    table: dict[str, Any]
    lines: Mapping[str, int]

    @property
    def where(self) -> str:
        """How messages name the file: "config file 'base.toml' (chain: variant.toml -> base.toml)"."""
        via = f" (chain: {' -> '.join(self.chain)})" if len(self.chain) > 1 else ""
        return f"config file '{self.path}'{via}"

    def source(self, key: str) -> str:
        """'file:line' where this file sets ``key`` (the file alone for a key it sets in
        torchtitan's spelling)."""
        line = self.lines.get(key)
        return f"{self.path}:{line}" if line else f"{self.path} (torchtitan spelling)"


def _bases(data: dict[str, Any], path: str, chain: tuple[str, ...]) -> list[str]:
    value = data.pop(EXTENDS, [])
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        via = f" (chain: {' -> '.join(chain)})" if len(chain) > 1 else ""
        raise TitanError(
            f"config file '{path}'{via}: '{EXTENDS}' got {value!r}; valid: a path or a list of paths"
            ' to TOML files, relative to this file, at the top of the file (extends = "base.toml")'
        )
    return [os.path.normpath(os.path.join(os.path.dirname(path), n)) for n in names]


def read_layers(path: str, translator: dialects.Translator) -> list[Layer]:
    """The layers of ``path`` in the order they apply: bases depth first, each once, then the file."""
    layers: list[Layer] = []
    applied: set[str] = set()

    def visit(file: str, chain: tuple[str, ...]) -> None:
        real = os.path.realpath(file)
        if real in applied:
            return
        try:
            data = load_toml(file)
            text = Path(file).read_text(encoding="utf-8")
        except TitanError:
            if len(chain) == 1:
                raise
            raise TitanError(
                f"config file '{chain[-2]}' extends '{file}', which does not exist or is not valid TOML"
                f" (chain: {' -> '.join(chain)}); paths in '{EXTENDS}' are relative to the file naming them"
            ) from None
        for base in _bases(data, file, chain):
            earlier = [c for c in chain if os.path.realpath(c) == os.path.realpath(base)]
            if earlier:
                raise TitanError(
                    f"config file '{file}' extends '{base}', which is already in its chain: a cycle"
                    f" ({' -> '.join((*chain, base))})"
                )
            visit(base, (*chain, base))
        applied.add(real)
        layers.append(Layer(file, chain, _translate(data, file, chain, translator), key_lines(text)))

    visit(path, (path,))
    return layers


def _translate(data: dict[str, Any], path: str, chain: tuple[str, ...], translator: dialects.Translator) -> dict:
    """titan's {section: {key: value}} of one file; top-level values that are not tables stay as
    they are, for the loader's own line about them."""
    items, out = dialects.flatten_toml(data)
    via = f" (chain: {' -> '.join(chain)})" if len(chain) > 1 else ""
    for key, value in translator.translate(items, f"config file '{path}'{via}: "):
        section, _, name = key.partition(".")
        out.setdefault(section, {})[name] = value
    return out
