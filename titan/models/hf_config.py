"""Reading a Hugging Face config.json the way transformers 5 reads it: what every family shares.

``HfConfig`` reads fields: an absent one is transformers' default for the class, a present one
(null included) is taken as written, and a value titan cannot take is refused in one line that
names the field. ``hf_rope`` resolves the RoPE settings as transformers' config classes do
(``RotaryEmbeddingConfigMixin``), whichever way the file spells them:

- ``rope_scaling`` (the older name) wins over ``rope_parameters`` when it is a non-empty mapping;
  absent or null, the class's default (``{}`` for most, gpt-oss's YaRN);
- ``rope_theta`` inside that mapping wins over a top-level ``rope_theta``, which wins over the
  class's default theta; ``partial_rotary_factor`` likewise;
- ``type`` is the older name of ``rope_type`` (``rope_type`` wins); absent: ``default``;
- for llama3 and yarn, a top-level ``original_max_position_embeddings`` wins over the mapping's
  (transformers re-standardizes when it builds the rotary table), which defaults to
  ``max_position_embeddings``.

A null where transformers' rotary code computes with the value (a theta, a factor, a context
length) is refused: transformers fails on it too. Nulls transformers replaces are replaced the same
way: yarn's beta_fast / beta_slow (32 / 1), attention_factor and factor (derived), mscale /
mscale_all_dim (off), truncate (a null does not truncate).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from titan.errors import TitanError
from titan.models.rope import YarnScaling

# The keys transformers' rotary code reads for each RoPE type (besides rope_type / type and
# partial_rotary_factor); a key outside them is refused rather than silently dropped.
ROPE_KEYS: Mapping[str, frozenset[str]] = {
    "default": frozenset({"rope_theta"}),
    "llama3": frozenset(
        {"rope_theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    ),
    "yarn": frozenset(
        {
            "rope_theta",
            "factor",
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "attention_factor",
            "truncate",
        }
    ),
}
_REQUIRED = {"llama3": ("factor", "low_freq_factor", "high_freq_factor"), "yarn": ("factor",)}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class HfConfig:
    """config.json (a dict) with transformers' defaults for the fields it leaves out. ``aliases``:
    the class's attribute_map (another name -> the field it sets); transformers sets an alias after
    the fields, so an alias in the file wins over its field."""

    def __init__(
        self, raw: Mapping[str, Any], defaults: Mapping[str, Any], family: str, aliases: Mapping[str, str] | None = None
    ) -> None:
        self.raw, self.defaults, self.family = raw, defaults, family
        self.names = {field: alias for alias, field in (aliases or {}).items() if alias in raw}

    def name(self, key: str) -> str:
        """The name config.json gives ``key`` (its alias where the file uses one)."""
        return self.names.get(key, key)

    def __contains__(self, key: str) -> bool:
        return self.name(key) in self.raw

    def get(self, key: str) -> Any:
        """The value as written (null included); absent: transformers' default (None if it has none)."""
        key = self.name(key)
        return self.raw[key] if key in self.raw else self.defaults.get(key)

    def refuse(self, key: str, value: Any, why: str) -> TitanError:
        return TitanError(f"config.json {self.name(key)} = {value!r} is not supported by titan's {self.family}: {why}")

    def int(self, key: str, minimum: int = 1) -> int:
        value = self.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise self.refuse(key, value, f"an integer >= {minimum} is needed")
        return value

    def number(self, key: str) -> float:
        value = self.get(key)
        if not _is_number(value) or value <= 0:
            raise self.refuse(key, value, "a number > 0 is needed")
        return float(value)

    def flag(self, key: str) -> bool:
        value = self.get(key)
        if not isinstance(value, bool):
            raise self.refuse(key, value, "true or false is needed")
        return value

    def only(self, key: str, ok: Any, why: str) -> None:
        """Refuse unless the field (or transformers' default for it) is ``ok``."""
        value = self.get(key)
        if value != ok or type(value) is not type(ok):
            raise self.refuse(key, value, f"only {ok!r} ({why})")


_LEGACY_LAYER_TYPES = {"attention": "full_attention"}  # transformers renames these on load


def hf_layer_types(config: HfConfig, n_layers: int) -> list[str] | None:
    """config.json's layer_types as transformers takes it (None when absent or null): one name
    per layer, legacy names renamed."""
    types = config.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != n_layers or not all(isinstance(t, str) for t in types):
        raise config.refuse("layer_types", types, f"one name per layer (num_hidden_layers {n_layers}) is needed")
    return [_LEGACY_LAYER_TYPES[t] if t in _LEGACY_LAYER_TYPES else t for t in types]


def hf_rope(
    config: HfConfig,
    *,
    types: tuple[str, ...],
    default_theta: float,
    class_default: Mapping[str, Any] | None = None,
    partial: float | None = None,
    ignored: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """config.json's RoPE as transformers resolves it (see the module docstring): rope_type,
    rope_theta and the type's keys, checked; ``types`` are the ones the family computes. A key the
    type does not read is refused (a per-layer-type mapping among them), but ``ignored`` ones
    (which the family's text model does not read). ``partial``: the family's default RoPE rotates
    ``partial_rotary_factor`` of each head, and its config class defaults the top-level field to
    this; the result then holds the factor. Without it default RoPE ignores the factor (as the
    families' rotary tables do) and the scaled types need 1."""
    scaling, params = config.get("rope_scaling"), config.get("rope_parameters")
    where = "rope_scaling" if scaling else "rope_parameters"
    rope = scaling or (params if params is not None else class_default) or {}
    if not isinstance(rope, Mapping):
        raise config.refuse(where, rope, "a mapping of RoPE settings is needed")
    rope = dict(rope)
    rope.setdefault("rope_theta", config.raw.get("rope_theta", default_theta))
    top_partial = config.raw["partial_rotary_factor"] if "partial_rotary_factor" in config.raw else partial
    if top_partial is not None:
        rope.setdefault("partial_rotary_factor", top_partial)
    for key in ignored:
        rope.pop(key, None)
    rope_type = rope.setdefault("rope_type", rope.get("type", "default"))
    rope.pop("type", None)
    if rope_type not in types:
        raise config.refuse(f"{where}.rope_type", rope_type, f"valid: {', '.join(types)}")
    known = ROPE_KEYS[rope_type] | {"rope_type", "partial_rotary_factor"}
    unknown = sorted(set(rope) - known)
    if unknown:
        raise config.refuse(f"{where}.{unknown[0]}", rope[unknown[0]], f"{rope_type} RoPE reads {sorted(known)}")
    if not _is_number(rope["rope_theta"]) or rope["rope_theta"] <= 0:
        raise config.refuse(f"{where}.rope_theta", rope["rope_theta"], "a number > 0 is needed")
    factor = rope.pop("partial_rotary_factor", 1.0)
    if partial is not None and rope_type == "default":
        if not _is_number(factor) or not 0 < factor <= 1:
            raise config.refuse(f"{where}.partial_rotary_factor", factor, "a number in (0, 1] is needed")
        rope["partial_rotary_factor"] = float(factor)
    elif rope_type != "default" and factor != 1:  # families' default rotary tables ignore it
        raise config.refuse(f"{where}.partial_rotary_factor", factor, "every feature rotates (1.0)")
    for key in _REQUIRED.get(rope_type, ()):
        if key not in rope:
            raise config.refuse(f"{where}.{key}", None, f"transformers requires it for {rope_type} RoPE")
    if rope_type in ("llama3", "yarn"):
        original = rope.get("original_max_position_embeddings", config.get("max_position_embeddings"))
        if "original_max_position_embeddings" in config:  # transformers prefers the top-level field
            original, where_original = config.raw["original_max_position_embeddings"], ""
        else:
            where_original = f"{where}."
        if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
            raise config.refuse(f"{where_original}original_max_position_embeddings", original, "a positive integer")
        rope["original_max_position_embeddings"] = original
    numbers = ("factor", "low_freq_factor", "high_freq_factor") if rope_type == "llama3" else ()
    numbers += ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "factor")
    for key in numbers:
        value = rope.get(key)
        if key in rope and not (_is_number(value) or (value is None and rope_type == "yarn")):
            raise config.refuse(f"{where}.{key}", value, "a number is needed")
    return rope


def yarn_scaling(rope: Mapping[str, Any], max_position: int) -> YarnScaling:
    """transformers' YaRN (``_compute_yarn_parameters``) of a resolved yarn ``hf_rope``: a null
    factor is max_position_embeddings over the original context, null betas are 32 and 1, a null
    truncate does not truncate."""
    original = rope["original_max_position_embeddings"]
    factor = rope["factor"] if rope["factor"] is not None else max_position / original
    return YarnScaling(
        factor=float(factor),
        original_max_position_embeddings=original,
        beta_fast=float(rope.get("beta_fast") or 32),
        beta_slow=float(rope.get("beta_slow") or 1),
        truncate=bool(rope.get("truncate", True)),
        mscale=rope.get("mscale"),
        mscale_all_dim=rope.get("mscale_all_dim"),
        attention_factor=rope.get("attention_factor"),
    )


_T = TypeVar("_T")


def reset(obj: _T, names: Iterable[str]) -> _T:
    """The dataclass ``obj`` with the fields ``names`` at their defaults (an ``hf_view`` resets the
    settings that have no effect on the model, so that two spellings of one model compare equal)."""
    names = set(names)
    values = {
        f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
        for f in dataclasses.fields(obj)  # type: ignore[arg-type]
        if f.name in names
    }
    return dataclasses.replace(obj, **values)  # type: ignore[type-var]


def moe_view(moe: Any) -> Any:
    """MoEArgs as an export states them: the SwiGLU clamp's gain only with the clamp, the kept
    groups only with groups, the shared expert's width and gate only with a shared expert."""
    names = ["swiglu_alpha"] if moe.swiglu_limit is None else []
    names += ["num_limited_groups"] if moe.num_expert_groups is None else []
    return reset(moe, names + (["shared_hidden_dim", "shared_expert_gate"] if not moe.num_shared_experts else []))


__all__ = ["ROPE_KEYS", "HfConfig", "hf_layer_types", "hf_rope", "moe_view", "reset", "yarn_scaling"]
