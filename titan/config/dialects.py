"""torchtitan's config dialects, read as titan's: the loader (titan/config/manager.py) hands every
TOML file and command line to a Translator before it sets any value.

- TOML: torchtitan's nested tables ([quantize.linear.float8], [training.dataloader]) are flattened
  to dotted keys, then each key goes through the table in dialect_rules.py.
- Command line: tyro's spellings as torchtitan v0.2.x accepted them (hyphens for underscores,
  ``--section.no-key`` / ``--section.no_key`` for false, ``--key=value``) and the 2024 argparse ones.

Each translated key logs one line, once per load: the loader runs before logging is set up, so the
lines are kept on the config (``JobConfig.translations``) and ``log_translations`` logs them once the
trainer or the dry run has set up its logger. Two spellings of one setting that disagree in the
same file or command line stop with one line naming both. A key titan does not implement stops with
"torchtitan key 'X' is not supported by titan: <why>" unless its value is one that does nothing in
torchtitan either (logged, then ignored). An unknown key in a torchtitan-looking config names the
dialect it looks like and the closest titan key.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from titan.config.dialect_mappings import Rule, norm
from titan.config.dialect_rules import RULES
from titan.errors import TitanError

logger = logging.getLogger("titan")

# Sections that exist only in torchtitan's config tree.
TORCHTITAN_SECTIONS = frozenset(
    {"quantize", "debug", "fault_tolerance", "experimental", "mx", "memory_estimation", "estimate"}
)


@dataclass(frozen=True)
class _Default:
    """A value torchtitan implies when the key is not set anywhere (and `when` is true, if given)."""

    value: Any
    when: str = ""


def torchtitan_defaults(key: str, value: Any) -> list[tuple[str, Any]]:
    """What torchtitan implies alongside an explicit key, where titan's default differs."""
    if key == "model.converters" and norm(value):
        # torchtitan converts every eligible linear, output included, unless filter_fqns says so;
        # titan's filter_fqns defaults to ["output"].
        return [("float8.filter_fqns", _Default([]))]
    if key == "model.hf_assets_path":
        # torchtitan reads HF weights from hf_assets_path when initial_load_path is not given.
        return [("checkpoint.initial_load_path", _Default(value, when="checkpoint.initial_load_in_hf"))]
    return []


def cli_key(raw: str, titan_keys: Mapping[str, Any]) -> tuple[str, bool]:
    """A command-line key as titan names it, and whether it was tyro's negative form."""
    key = raw.replace("-", "_")
    if key.startswith("no_") and key[3:] in titan_keys:
        raise TitanError(
            f"'--{raw}' is not an option; a false boolean is --{key[3:]} false (or tyro's"
            f" --{key[3:].replace('.', '.no-', 1)})"
        )
    section, dot, name = key.rpartition(".")
    if dot and name.startswith("no_") and key not in titan_keys and key not in RULES:
        positive = f"{section}.{name[3:]}"
        if positive in titan_keys or positive in RULES:
            return positive, True
    return key, False


def is_dialect_key(key: str, titan_keys: Mapping[str, Any]) -> bool:
    """A key the translator handles (torchtitan's spelling, or shaped like one) rather than titan's
    own loader."""
    if key in titan_keys:
        return False
    return key in RULES or _looks_torchtitan(key)


def _looks_torchtitan(key: str) -> bool:
    parts = key.split(".")
    return len(parts) > 2 or parts[0] in TORCHTITAN_SECTIONS


def _era_of(key: str) -> str:
    rule = RULES.get(key)
    if rule is not None:
        return rule.era
    parts = key.split(".")
    return "v0.2.x" if parts[0] in ("quantize", "debug") or len(parts) > 2 else "2024–v0.1.0"


class Translator:
    """One per load_config: remembers what it logged, which titan keys any source set, the values
    torchtitan implies, and the checks that need the merged config."""

    def __init__(self, titan_keys: Mapping[str, Any]) -> None:
        self.titan_keys = titan_keys
        self.hint = ""
        self._logged: set[str] = set()
        self.lines: list[str] = []  # what each translated key did, logged by log_translations
        self._explicit: set[str] = set()
        self._defaults: dict[str, tuple[str, _Default]] = {}
        self._checks: list[tuple[str, Any, Rule]] = []

    # ------------------------------------------------------------ one source
    def translate(self, items: Iterable[tuple[str, Any]], where: str = "") -> list[tuple[str, Any]]:
        """(key, value) pairs in either dialect -> titan's pairs. ``where`` prefixes errors
        ("config file 'x.toml': ")."""
        items = list(items)
        if not self.hint:
            self.hint = dialect_hint((key for key, _ in items), self.titan_keys)
        seen: dict[str, tuple[str, Any, Any]] = {}
        out: list[tuple[str, Any]] = []
        for key, value in items:
            try:
                pairs = self._one(key, value)
            except TitanError as e:
                raise TitanError(f"{where}{e}") from None
            for tkey, tvalue in pairs:
                if isinstance(tvalue, _Default):
                    self._defaults.setdefault(tkey, (key, tvalue))
                    continue
                prev = seen.get(tkey)
                if prev is not None and prev[0] != key and norm(prev[2]) != norm(tvalue):
                    raise TitanError(
                        f"{where}'{prev[0]}' = {prev[1]!r} and '{key}' = {value!r} set the same titan"
                        f" key '{tkey}' to different values; keep one of them"
                    )
                seen[tkey] = (key, value, tvalue)
                self._explicit.add(tkey)
                out.append((tkey, tvalue))
        return out

    def _one(self, key: str, value: Any) -> list[tuple[str, Any]]:
        rule = RULES.get(key)
        if rule is None:
            if key not in self.titan_keys and (self.hint or _looks_torchtitan(key)):
                raise self.unknown(key)
            return [(key, value)]  # titan's key, or titan's own unknown-key line from the loader
        if rule.must_equal:
            self._checks.append((key, value, rule))
            return []
        if rule.refused:
            if rule.any_value_is_neutral or any(norm(value) == norm(n) for n in rule.neutral):
                self._log(key, f"torchtitan key '{key}' = {value!r} does nothing in titan ({rule.why}); ignored")
                return []
            raise TitanError(f"torchtitan key '{key}' is not supported by titan: {rule.why}")
        pairs = rule.convert(value) if rule.convert is not None else [(rule.to, value)]
        pairs = pairs + torchtitan_defaults(key, value)
        shown = [(k, v) for k, v in pairs if not isinstance(v, _Default)]
        if shown != [(key, value)]:
            target = ", ".join(f"{k} = {v!r}" for k, v in shown) or "nothing"
            self._log(key, f"torchtitan key '{key}' = {value!r} -> titan key {target}")
        return pairs

    def _log(self, key: str, line: str) -> None:
        if key not in self._logged:
            self._logged.add(key)
            self.lines.append(line)

    # ------------------------------------------------------------ errors
    def unknown(self, key: str) -> TitanError:
        return unknown_key(key, self.titan_keys, self.hint)

    # ------------------------------------------------------------ the merged config
    def finish(self, get: Callable[[str], Any], set_value: Callable[[str, Any], None]) -> None:
        """Apply the values torchtitan implies where no source set the key, then the checks that
        compare a torchtitan key with the merged config."""
        for tkey, (source_key, default) in self._defaults.items():
            if tkey in self._explicit or (default.when and not get(default.when)):
                continue
            set_value(tkey, default.value)
            self._log(
                f"{source_key}->{tkey}",
                f"torchtitan key '{source_key}' implies {tkey} = {default.value!r}"
                " (torchtitan's default; set it to override)",
            )
        for key, value, rule in self._checks:
            have = get(rule.to)
            if norm(have) != norm(value):
                raise TitanError(
                    f"torchtitan key '{key}' is not supported by titan: {rule.why} (got {value!r},"
                    f" {rule.to} is {have!r})"
                )
            self._log(key, f"torchtitan key '{key}' = {value!r} equals {rule.to}; accepted")


def log_translations(lines: Iterable[str]) -> None:
    """One INFO line per translated key (``JobConfig.translations``), after init_logger."""
    for line in lines:
        logger.info(line)


def dialect_hint(keys: Iterable[str], titan_keys: Mapping[str, Any]) -> str:
    """The first key spelled torchtitan's way and not titan's ("" if none): what an unknown key is
    compared with."""
    return next((key for key in keys if key not in titan_keys and (key in RULES or _looks_torchtitan(key))), "")


def unknown_key(key: str, titan_keys: Mapping[str, Any], hint: str = "") -> TitanError:
    """One line: the key, the dialect its config looks like, the closest titan key."""
    example = f" (like '{hint}')" if hint and hint != key else ""
    nested = (
        " (nested tables are torchtitan's spelling; titan's sections are one level deep)"
        if len(key.split(".")) > 2
        else ""
    )
    return TitanError(
        f"unknown config key '{key}' in a config that looks like torchtitan {_era_of(hint or key)}'s"
        f"{example}{nested}; closest titan key: '{closest_titan_key(key, titan_keys)}'"
    )


def closest_titan_key(key: str, titan_keys: Mapping[str, Any]) -> str:
    """The titan key nearest to ``key``: through torchtitan's table when the key is close to one of
    its spellings, else by name."""
    candidates: dict[str, str] = {k: k for k in titan_keys}
    for old, rule in RULES.items():
        if rule.to:
            candidates.setdefault(old, rule.to)
    name = key.rsplit(".", 1)[-1]
    best, best_score = "", -1.0
    for cand, target in candidates.items():
        whole = difflib.SequenceMatcher(None, key, cand).ratio()
        tail = difflib.SequenceMatcher(None, name, cand.rsplit(".", 1)[-1]).ratio()
        score = max(whole, tail - 0.05)
        if score > best_score:
            best, best_score = target, score
    return best


def flatten_toml(data: Mapping[str, Any]) -> tuple[list[tuple[str, Any]], dict[str, Any]]:
    """Nested tables -> dotted (key, value) pairs; top-level values that are not tables are handed
    back untouched, for the loader's own line about them."""
    items: list[tuple[str, Any]] = []
    loose: dict[str, Any] = {}

    def walk(prefix: str, body: Mapping[str, Any]) -> None:
        for name, value in body.items():
            if isinstance(value, dict):
                walk(f"{prefix}.{name}", value)
            else:
                items.append((f"{prefix}.{name}", value))

    for section, body in data.items():
        if isinstance(body, dict):
            walk(section, body)
        else:
            loose[section] = body
    return items, loose


def translate_toml(data: Mapping[str, Any], path: str, translator: Translator) -> dict[str, Any]:
    """A TOML file's table in either dialect -> titan's one-level {section: {key: value}}."""
    items, out = flatten_toml(data)
    for key, value in translator.translate(items, f"config file '{path}': "):
        section, _, name = key.partition(".")
        out.setdefault(section, {})[name] = value
    return out
