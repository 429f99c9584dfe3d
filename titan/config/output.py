"""What the config system writes: --help text and the merged config as TOML.

The TOML holds every option of every section, so loading it back (``--job.config_file
<dump_folder>/config.toml``) gives an equal config whatever the defaults of a later titan are.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Any

import tomli_w

from titan.config.job_config import JobConfig
from titan.config.manager import did_you_mean, field_docs, resolve_key, section_fields, sections, type_name
from titan.errors import TitanError

__all__ = ["format_help", "to_toml", "save_config", "CONFIG_FILE_NAME"]

CONFIG_FILE_NAME = "config.toml"


# ---------------------------------------------------------------- --help
def _option_lines(section: str, cls: type, only: str | None = None) -> list[str]:
    lines = []
    defaults = cls()
    docs = field_docs(cls)
    for name, tp in section_fields(cls).items():
        if only is not None and name != only:
            continue
        lines.append(f"  --{section}.{name} ({type_name(tp)}, default: {getattr(defaults, name)!r})")
        lines += [f"      {doc_line}" for doc_line in docs.get(name, "").splitlines()]
    return lines


def format_help(topic: str | None = None) -> str:
    """Every option (topic None), one section ('checkpoint') or one option ('checkpoint.folder')."""
    secs = sections()
    if topic:
        section, _, name = topic.partition(".")
        if section not in secs:
            raise TitanError(f"--help: unknown config section '{section}'" + did_you_mean(section, list(secs)))
        if name:
            resolve_key(topic)  # unknown option: the usual did-you-mean
        return "\n".join([f"[{section}]", *_option_lines(section, secs[section], name or None)])
    lines = [
        "usage: train.py [--job.config_file FILE.toml] [--section.key VALUE ...]",
        "       train.py --help [SECTION | SECTION.KEY]   (one section or option, e.g. --help checkpoint)",
        "",
        "Options come from the TOML sections below; a command-line flag overrides the file.",
        "Booleans may be given bare (--metrics.enable_tensorboard) or with true/false.",
        'Lists: comma-separated (a,b) or TOML syntax (\'["a", "b"]\').',
        f"Sections: {', '.join(secs)}.",
    ]
    for section, cls in secs.items():
        lines += ["", f"[{section}]", *_option_lines(section, cls)]
    return "\n".join(lines)


# ---------------------------------------------------------------- TOML
def _toml_sections(config: JobConfig) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for f in dataclasses.fields(config):
        section = getattr(config, f.name)
        body = {}
        for name in section_fields(type(section)):
            value = getattr(section, name)
            # TOML has no null: a None is left out, which loads back as the field's default
            # (every option that can be None defaults to None; a test keeps it so).
            if value is None or (f.name, name) == ("job", "config_file"):
                continue  # config_file is where the options came from, read from the command line only
            # a list of tables ([[training.mixture]]) is written as TOML's array of tables
            body[name] = (
                [dataclasses.asdict(v) for v in value]
                if isinstance(value, list) and value and dataclasses.is_dataclass(value[0])
                else value
            )
        out[f.name] = body
    return out


def to_toml(config: JobConfig, sources: bool = False) -> str:
    """The merged config (defaults <- TOML <- CLI) as TOML; loads back to an equal config. With
    ``sources`` each value ends with a comment saying where it came from (config.sources)."""
    source = config.job.config_file or "no file"
    header = (
        f"# titan: merged config (defaults <- {source} <- command line).\n"
        "# Repeat the run: CONFIG_FILE=<this file> ./run_train.sh, or python train.py --job.config_file <this file>\n\n"
    )
    if not sources:
        return header + tomli_w.dumps(_toml_sections(config))
    return header + _with_sources(_toml_sections(config), config.sources)


def _with_sources(body: dict[str, dict[str, Any]], sources: Any) -> str:
    """TOML text with "# <source>" after each value; arrays of tables close their section."""
    out: list[str] = []
    for section, values in body.items():
        out.append(f"[{section}]")
        tables = []
        for name, value in values.items():
            origin = sources.get(f"{section}.{name}", "default")
            if isinstance(value, list) and value and isinstance(value[0], dict):
                tables.append((name, value, origin))
                continue
            out.append(f"{tomli_w.dumps({name: value}).rstrip()}  # {origin}")
        for name, value, origin in tables:
            out.append(f"# {section}.{name}: {origin}")
            out.append(tomli_w.dumps({section: {name: value}}).rstrip())
        out.append("")
    return "\n".join(out)


def save_config(config: JobConfig, folder: str | None = None) -> str:
    """Write to_toml(config) to <folder or job.dump_folder>/config.toml atomically (a temporary
    file in the same folder, then a rename: a reader never sees half a file); returns the path."""
    folder = folder or config.job.dump_folder
    path = os.path.join(folder, CONFIG_FILE_NAME)
    tmp = None
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{CONFIG_FILE_NAME}.", dir=folder)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(to_toml(config))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise TitanError(
            f"job.dump_folder '{folder}': cannot write {CONFIG_FILE_NAME} ({e.strerror or e});"
            " set --job.dump_folder to a writable folder"
        ) from None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    return path
