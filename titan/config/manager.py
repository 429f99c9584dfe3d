"""Build a JobConfig from defaults <- TOML file (and the files it extends) <- CLI flags.

The option list, the types and the help text all come from the section dataclasses
(titan/config/sections/, assembled in job_config.py).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import os
import sys
import types
import typing
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from titan.config import dialects
from titan.config.compose import EXTENDS, read_layers
from titan.config.job_config import JobConfig
from titan.errors import TitanError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib  # pyright: ignore[reportMissingImports] (a dependency on 3.10 only)

_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})


# ---------------------------------------------------------------- schema
# The three lookups below read the dataclass definitions, which never change while a process runs;
# they are memoized and hand out read-only mappings, so no caller can alter what the next one sees.
@functools.cache
def field_docs(cls: type) -> Mapping[str, str]:
    """Attribute docstrings: the string literal placed right under each field."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return MappingProxyType({})
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return MappingProxyType(docs)


@functools.cache
def sections() -> Mapping[str, type]:
    """Section name -> dataclass type."""
    hints = typing.get_type_hints(JobConfig)
    return MappingProxyType({f.name: hints[f.name] for f in dataclasses.fields(JobConfig)})


@functools.cache
def section_fields(section_cls: type) -> Mapping[str, Any]:
    """Field name -> resolved type annotation."""
    hints = typing.get_type_hints(section_cls)
    return MappingProxyType({f.name: hints[f.name] for f in dataclasses.fields(section_cls)})


@functools.cache
def titan_keys() -> Mapping[str, Any]:
    """'section.field' -> resolved type, for every option."""
    return MappingProxyType({f"{s}.{f}": tp for s, cls in sections().items() for f, tp in section_fields(cls).items()})


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin is list:
        (inner,) = typing.get_args(tp)
        return f"list[{type_name(inner)}]"
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))


def did_you_mean(name: str, options: list[str]) -> str:
    match = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else f"; valid: {', '.join(options)}"


def _suggest_key(section: str, name: str) -> str:
    """Did-you-mean for an unknown 'section.name', looking at every section: an option of that
    name elsewhere ('training.lr' -> 'optimizer.lr') first, else the closest option name, where a
    tie goes to the section typed ('training.stepz' -> 'training.steps', not 'validation.steps')."""
    scored: list[tuple[float, str]] = []
    for other, cls in sections().items():
        for option in section_fields(cls):
            ratio = difflib.SequenceMatcher(None, name, option).ratio()
            scored.append((ratio + (0.01 if other == section else 0.0), f"{other}.{option}"))
    best = max(score for score, _ in scored)
    if best < 0.6:
        return f"; valid in [{section}]: {', '.join(section_fields(sections()[section]))}"
    top = [key for score, key in scored if score == best]
    if len(top) == 1:
        return f"; did you mean '{top[0]}'?"
    return "; did you mean " + " or ".join(f"'{k}'" for k in top[:3]) + "?"


def resolve_key(key: str) -> tuple[str, str, Any]:
    """'section.field' -> (section, field, type), with a suggestion on a typo."""
    section, _, name = key.partition(".")
    secs = sections()
    if section not in secs or not name:
        if not name and section in secs:
            raise TitanError(f"config key '{key}' names a section, not an option; use '{key}.<option>'")
        raise TitanError(f"unknown config section '{section}'" + did_you_mean(section, list(secs)))
    fields = section_fields(secs[section])
    if name not in fields:
        raise TitanError(f"unknown config key '{key}'" + _suggest_key(section, name))
    return section, name, fields[name]


# ---------------------------------------------------------------- values
def _convert(key: str, value: Any, tp: Any, *, from_cli: bool) -> Any:
    """Check/convert one value to the field's type; TOML values are typed, CLI values are str."""

    def bad() -> TitanError:
        return TitanError(f"config key '{key}' got {value!r}, expected {type_name(tp)}")

    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        options = typing.get_args(tp)
        if isinstance(value, str) and value in options:
            return value
        raise TitanError(f"config key '{key}' got {value!r}; valid: {', '.join(options)}")
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if type(None) in args and (value is None or (from_cli and str(value).lower() in ("none", "null"))):
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(key, value, arg, from_cli=from_cli)
            except TitanError:
                continue
        raise bad()
    if origin is list:
        (inner,) = typing.get_args(tp)
        if from_cli and isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                try:
                    items = tomllib.loads(f"v = {text}")["v"]
                except tomllib.TOMLDecodeError:
                    raise bad() from None
                return [_convert(key, v, inner, from_cli=False) for v in items]
            items = [v.strip() for v in text.split(",") if v.strip()]
            return [_convert(key, v, inner, from_cli=True) for v in items]
        if not isinstance(value, list):
            raise bad()
        return [_convert(key, v, inner, from_cli=from_cli) for v in value]
    if dataclasses.is_dataclass(tp):  # one table of an array of tables ([[training.mixture]])
        if not isinstance(value, dict):
            raise bad()
        fields = section_fields(tp)
        for name in value:
            if name not in fields:
                raise TitanError(f"config key '{key}' has unknown field '{name}'; valid: {', '.join(fields)}")
        kwargs = {name: _convert(f"{key}.{name}", v, fields[name], from_cli=from_cli) for name, v in value.items()}
        return typing.cast(Any, tp)(**kwargs)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_cli and isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise bad()
    if tp is int:
        if isinstance(value, bool):
            raise bad()
        if isinstance(value, int):
            return value
        if from_cli and isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise bad() from None
        raise bad()
    if tp is float:
        if isinstance(value, bool):
            raise bad()
        if isinstance(value, (int, float)):
            return float(value)
        if from_cli and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise bad() from None
        raise bad()
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad()
    raise TitanError(f"config key '{key}' has an unsupported type {type_name(tp)}")


# ---------------------------------------------------------------- sources
def _flatten_toml(data: dict[str, Any], path: str, where: str = "") -> list[tuple[str, Any]]:
    """``where``: how errors name the file (default "config file '<path>'")."""
    where = where or f"config file '{path}'"
    items = []
    for section, body in data.items():
        if not isinstance(body, dict):
            if section in sections():
                raise TitanError(f"{where}: '{section}' must be a [section] table")
            if section == EXTENDS:
                raise TitanError(f"{where}: '{EXTENDS}' must come first, before any [section]")
            raise TitanError(f"{where}: unknown config section '{section}'" + did_you_mean(section, list(sections())))
        for name, value in body.items():
            if isinstance(value, dict):
                raise TitanError(f"{where}: unknown config section '{section}.{name}' (sections are one level deep)")
            if name == EXTENDS and section in sections() and name not in section_fields(sections()[section]):
                raise TitanError(f"{where}: '{EXTENDS}' must come first, before any [section] (it is in [{section}])")
            items.append((f"{section}.{name}", value))
    return items


def parse_cli(argv: list[str]) -> list[tuple[str, str]]:
    """'--a.b v', '--a.b=v', bare '--a.b' for booleans -> [(key, raw str value)]. torchtitan's
    spellings (tyro's hyphens and --section.no-key, the 2024 names) come back as they are, for
    titan.config.dialects to translate."""
    pairs: list[tuple[str, str]] = []
    hint = dialects.dialect_hint(
        (dialects.cli_key(a[2:].partition("=")[0], titan_keys())[0] for a in argv if a.startswith("--")), titan_keys()
    )
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) <= 2:
            raise TitanError(
                f"unexpected command-line argument '{arg}'; options look like --section.key value (see --help)"
            )
        key, eq, value = arg[2:].partition("=")
        if key == "config_file":  # SageMaker-style hyperparameter
            key = "job.config_file"
        key, negated = dialects.cli_key(key, titan_keys())
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if negated:
            pairs.append((key, "false"))
            i += 1
            continue
        if dialects.is_dialect_key(key, titan_keys()):
            # torchtitan has no positional arguments: a key followed by another option is a flag.
            if eq or nxt is None or nxt.startswith("--"):
                pairs.append((key, value if eq else "true"))
                i += 1
            else:
                pairs.append((key, nxt))
                i += 2
            continue
        if hint and key not in titan_keys():
            raise dialects.unknown_key(key, titan_keys(), hint)
        _, _, tp = resolve_key(key)
        if eq:
            pairs.append((key, value))
            i += 1
            continue
        is_bool = tp is bool
        if is_bool and (nxt is None or nxt.startswith("--") or nxt.lower() not in _TRUE | _FALSE):
            pairs.append((key, "true"))
            i += 1
            continue
        if nxt is None:
            raise TitanError(f"command-line option '--{key}' needs a value ({type_name(tp)})")
        pairs.append((key, nxt))
        i += 2
    return pairs


def _attr(config: JobConfig, key: str) -> tuple[Any, str]:
    section, _, name = key.partition(".")
    return getattr(config, section), name


def _set(config: JobConfig, key: str, value: Any, *, from_cli: bool) -> None:
    section, name, tp = resolve_key(key)
    setattr(getattr(config, section), name, _convert(key, value, tp, from_cli=from_cli))


def load_config(argv: list[str] | None = None, *, env: dict[str, str] | None = None) -> JobConfig:
    """defaults <- TOML (job.config_file) <- CLI flags, each value checked against its field's type
    and choices; then the checks that need nothing but the config (``JobConfig.validate``: each
    section's own, then the rules between sections).

    Checks that need runtime knowledge (model registry, optimizer and schedule names, ...) are
    titan.training.checks.validate_job; titan.training.checks.load_job runs both."""
    argv = list(sys.argv[1:] if argv is None else argv)
    translator = dialects.Translator(titan_keys())
    raw_cli = parse_cli(argv)
    config = JobConfig()
    sources: dict[str, str] = {}  # where each set option came from (--job.print_config_sources)
    from titan.config.environment import environment_defaults

    for key, value in environment_defaults(os.environ if env is None else env):
        _set(config, key, value, from_cli=False)
        sources[key] = "environment"
    config_file = next((v for k, v in reversed(raw_cli) if k == "job.config_file"), "")
    if config_file:
        for layer in read_layers(config_file, translator):  # its bases first (extends), then the file
            for key, value in _flatten_toml(layer.table, layer.path, layer.where):
                try:
                    _set(config, key, value, from_cli=False)
                except TitanError as e:
                    raise TitanError(f"{layer.where}: {e}") from None
                sources[key] = layer.source(key)
    for key, value in translator.translate(raw_cli):
        _set(config, key, value, from_cli=True)
        sources[key] = "command line"

    def implied(key: str, value: Any) -> None:
        _set(config, key, value, from_cli=False)
        sources[key] = "implied by a torchtitan key"

    translator.finish(lambda key: getattr(*_attr(config, key)), implied)
    config.job.config_file = config_file
    if config_file:
        sources["job.config_file"] = "command line"
    config.sources = MappingProxyType(sources)
    config.translations = tuple(translator.lines)
    config.validate()
    return config


# ---------------------------------------------------------------- output
def to_dict(config: JobConfig) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(config)
