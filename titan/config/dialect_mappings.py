"""The pieces torchtitan's dialect table (dialect_rules.py) is written with: a rule (rename, refuse,
mapped value, no effect) and the value mappings its rules apply."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from titan.errors import TitanError

Pairs = list[tuple[str, Any]]

# Where torchtitan used a spelling: its 2024 argparse CLI/TOML (and the SageMaker guide), the
# dataclass config of v0.1.0 (2025), the v0.2.x releases.
Y2024, V010, V02 = "2024", "v0.1.0", "v0.2.x"


@dataclass(frozen=True)
class Rule:
    key: str
    """torchtitan's key."""
    era: str
    """Where torchtitan used it (for the docs and the unknown-key message)."""
    to: str = ""
    """titan's key (documentation: what convert writes); "" for a refused key."""
    convert: Callable[[Any], Pairs] | None = None
    """value -> titan (key, value) pairs; None with `to` set: the value is kept as is."""
    why: str = ""
    """Refused: why titan has no such setting and what to use instead."""
    neutral: tuple[Any, ...] = ()
    """Refused keys: values that do nothing in torchtitan either, accepted with a note."""
    must_equal: bool = False
    """Accepted only when the merged config's value of `to` is the same (titan has one setting
    where torchtitan had two)."""
    any_value_is_neutral: bool = False
    """Refused keys that have no effect in torchtitan whatever their value (e.g. only read by a
    feature that is itself refused when switched on)."""

    @property
    def refused(self) -> bool:
        return not self.to


def norm(value: Any) -> str:
    """A spelling-independent form of a value ("True" on a command line = true in TOML)."""
    if isinstance(value, (list, tuple)):
        return ",".join(norm(v) for v in value)
    text = str(value).strip().strip("'\"")
    low = text.lower()
    if low in ("true", "false", "none"):
        return low
    try:
        return repr(float(text))
    except ValueError:
        return text


def as_bool(key: str, value: Any) -> bool:
    n = norm(value)
    if n in ("true", "1.0", "yes", "on"):
        return True
    if n in ("false", "0.0", "no", "off"):
        return False
    raise TitanError(f"torchtitan key '{key}' got {value!r}, expected true or false")


def as_list(value: Any) -> list[str]:
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return [v.strip() for v in str(value).strip("[]").split(",") if v.strip().strip("'\"")]


def rename(key: str, to: str, era: str) -> Rule:
    return Rule(key, era, to)


def negate(key: str, to: str, era: str) -> Rule:
    return Rule(key, era, to, lambda v: [(to, not as_bool(key, v))])


def mapped(key: str, to: str, era: str, fn: Callable[[Any], Pairs]) -> Rule:
    return Rule(key, era, to, fn)


def refuse(key: str, era: str, why: str, *neutral: Any) -> Rule:
    return Rule(key, era, why=why, neutral=neutral)


def no_effect(key: str, era: str, why: str) -> Rule:
    return Rule(key, era, why=why, any_value_is_neutral=True)


def value_map(key: str, to: str, table: Mapping[str, Any], refused: str) -> Callable[[Any], Pairs]:
    def fn(value: Any) -> Pairs:
        n = norm(value)
        if n not in table:
            raise TitanError(
                f"torchtitan key '{key}' is not supported by titan: {value!r} is not implemented; {refused}"
            )
        return [(to, table[n])]

    return fn


# ---------------------------------------------------------------- values with meaning
FLAVORS = MappingProxyType(
    {
        # torchtitan's attention variants as flavors -> titan's flavor + the attention keys.
        "debugmodel_flex_attn": ("debugmodel", "flex"),
        "debugmodel_varlen_attn": ("debugmodel", "varlen"),
        "8B_flex": ("8B", "flex"),
        "8B_varlen": ("8B", "varlen"),
    }
)


def flavor(value: Any) -> Pairs:
    if str(value) in FLAVORS:
        flavor, attn = FLAVORS[str(value)]
        return [("model.flavor", flavor), ("model.attn_type", attn), ("model.attn_mask_type", "block_causal")]
    return [("model.flavor", value)]


FLOAT8 = ("float8", "quantize.linear.float8")
FLOAT8_GROUPED_MM = "quantize.grouped_mm.float8"
NOT_FLOAT8 = "MX (microscaling) formats are not in titan; float8 linears and float8 grouped GEMMs (MoE) are"


def converters(value: Any) -> Pairs:
    names = as_list(value)
    for name in names:
        if name not in (*FLOAT8, FLOAT8_GROUPED_MM):
            raise TitanError(
                f"torchtitan key 'model.converters' is not supported by titan: {name!r} is not"
                f" implemented; {NOT_FLOAT8}"
            )
    pairs: Pairs = []
    if any(n in FLOAT8 for n in names):
        pairs.append(("float8.enable_float8_linear", True))
    if FLOAT8_GROUPED_MM in names:
        pairs.append(("float8.enable_float8_grouped_mm", True))
    return pairs


def recipe(key: str) -> Callable[[Any], Pairs]:
    return value_map(
        key,
        "float8.recipe",
        {"none": "tensorwise", "tensorwise": "tensorwise", "rowwise": "rowwise"},
        "titan's float8 recipes are tensorwise and rowwise",
    )


def dataset(key: str, to: str, offline: str) -> Callable[[Any], Pairs]:
    # torchtitan's c4_test is a 2k-document C4 sample inside its own source tree; titan's offline
    # counterpart for smoke tests and CI is its embedded corpus.
    return lambda v: [(to, offline if str(v) == "c4_test" else v)]


def selective_option(value: Any) -> Pairs:
    # torchtitan spells "every 2nd block" as the string "2"; titan takes the integer.
    text = str(value)
    return [("activation_checkpoint.selective_ac_option", int(text) if text.isdigit() else value)]


def layers_per_stage(value: Any) -> Pairs:
    return [("parallelism.pipeline_parallel_layers_per_stage", -1 if norm(value) == "none" else value)]


def optional_str(to: str) -> Callable[[Any], Pairs]:
    return lambda v: [(to, "" if norm(v) == "none" else v)]


def log_rank(all_ranks: bool) -> Callable[[Any], Pairs]:
    def fn(value: Any) -> Pairs:
        on = as_bool("metrics", value)
        return [("metrics.log_rank", -1 if on == all_ranks else 0)]

    return fn


def fused(value: Any) -> Pairs:
    return [("optimizer.implementation", "fused" if as_bool("optimizer.fused", value) else "foreach")]


def comm_mode(value: Any) -> Pairs:
    n = norm(value)
    if n == "default":
        return []
    if n == "fake_backend":
        return [("job.dry_run", True)]
    raise TitanError(
        f"torchtitan key 'comm.mode' is not supported by titan: {value!r} is not implemented;"
        " --job.dry_run checks a layout on one process (fake_backend)"
    )


FT_CONFIG_MODULE = "torchtitan.components.ft.config"


def config_module(value: Any) -> Pairs:
    """job.custom_config_module: empty, or the one module torchtitan's llama3_ft config names (its
    [fault_tolerance] keys are titan's own section); any other plug-in module is refused."""
    if norm(value) in ("", FT_CONFIG_MODULE):
        return []
    raise TitanError(
        f"torchtitan key 'job.custom_config_module' is not supported by titan: {value!r} is a plug-in config"
        f" module; titan accepts only {FT_CONFIG_MODULE!r} (its [fault_tolerance] section is built in)"
        " and has no other plug-ins: add a section module under titan/config/sections/"
    )
