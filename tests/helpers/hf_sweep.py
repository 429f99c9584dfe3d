"""config.json sweeps against transformers, one engine for every family with a Hugging Face format.

Import (``sweep_import``): a tiny config.json with one field changed, left out or null, and its
RoPE settings spelled every way transformers takes them, is built and run by transformers with
random weights; titan must read the folder (those weights beside that config.json) as the same
model, logits within 1e-4 in fp32, or refuse it in one line. Where transformers cannot build or run
the config, titan must refuse it. Where the base model's weights contradict the config.json (other
shapes), ``from_hf`` must refuse before writing anything. Every model titan reads must export to a
config.json that reads back as the same model (and the base's export runs in transformers'
from_pretrained as the same model).

Export (``sweep_export``): titan model args with one field changed must export to a folder that
transformers runs as the same model, or be refused in one line with nothing left behind.

Each transformers model is built once per config, and everything runs in this process. A variant
that breaks the contract is recorded as a failure (``failures``) so that one run lists them all.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from titan.checkpointing.hf import import_hf_to_dcp, load_hf, save_hf
from titan.checkpointing.hf_check import check_export_config
from titan.errors import TitanError
from titan.models import spec_for_args, spec_for_hf_model_type

ABSENT: Any = type("Absent", (), {"__repr__": lambda self: "<absent>"})()
"""A change that leaves the field out of config.json (transformers then takes its default)."""
TOL = 1e-4
TOKENS = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
# A config with a size above MAX_SIZE (transformers' default width, vocabulary, ...) whose model has
# more than MAX_PARAMS parameters, or with more than MAX_LAYERS layers (transformers' default depth,
# where fp32 rounding alone grows past the tolerance), is only checked for refusals and shapes: its
# model is built on the meta device.
MAX_SIZE, MAX_PARAMS, MAX_LAYERS = 1024, 1_000_000, 8
_SIZE_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "intermediate_size_mlp", "moe_intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts",
    "num_local_experts", "n_routed_experts", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim",
)  # fmt: skip


@dataclass(frozen=True)
class HfFamily:
    """One transformers config class (config.json's model_type), as the import sweep sees it."""

    base: Mapping[str, Any]
    """A tiny config.json (model_type included) that both libraries run, its vocabulary >= 64."""
    changes: Mapping[str, tuple[Any, ...]]
    """Each field of the config class -> the values tried alone (ABSENT: left out); a field of the
    class missing here fails the sweep (transformers added one)."""
    ropes: tuple[Mapping[str, Any], ...] = ()
    """rope_parameters the family computes: each is tried as rope_parameters, as the older
    rope_scaling, beside a top-level rope_theta, with each key null or left out, and so on."""
    extra: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Labelled changes of several fields at once (combinations that matter)."""


@dataclass(frozen=True)
class Outcome:
    label: str
    kind: str
    """match (titan = transformers), refused (titan refuses what transformers runs), unrunnable
    (transformers cannot run it and titan refused), contradiction (the folder's tensors disagree
    with its config.json and from_hf refused, writing nothing), FAIL (the contract is broken)."""
    changed: bool = False
    """transformers' logits differ from the base config's: the change is visible to the sweep."""
    message: str = ""


class _Failed(Exception):
    """A variant that breaks the contract."""


def own_fields(config_cls: type) -> set[str]:
    """The config class's fields beyond PreTrainedConfig's."""
    from transformers import PreTrainedConfig

    return {f.name for f in dataclasses.fields(config_cls)} - {f.name for f in dataclasses.fields(PreTrainedConfig)}


def config_class(model_type: str) -> type:
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Parameters well away from init (norms around 1, the rest N(0, 0.2)), so that a setting read
    differently shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.3 * noise if "norm" in name else 0.2 * noise)


def failures(outcomes: Mapping[str, Outcome]) -> list[str]:
    return [f"{o.label}: {o.message}" for o in outcomes.values() if o.kind == "FAIL"]


# --- the variants ---------------------------------------------------------------------------------


def _with(config: Mapping[str, Any], key: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(dict(config))
    if value is ABSENT:
        out.pop(key, None)
    else:
        out[key] = copy.deepcopy(value)
    return out


def _rope_spellings(i: int, rope: Mapping[str, Any], other: Mapping[str, Any]) -> Iterator[tuple[str, dict]]:
    """(label, the config.json's RoPE fields) for one RoPE setting, every way transformers takes it."""
    rope = dict(rope)
    plain = {k: v for k, v in rope.items() if k != "rope_theta"}
    legacy = {("type" if k == "rope_type" else k): v for k, v in plain.items()}
    yield f"rope {i}", {"rope_parameters": rope}
    yield f"rope {i} as legacy rope_scaling + rope_theta", {"rope_scaling": legacy, "rope_theta": 3e3}
    yield f"rope {i} beside a top-level rope_theta", {"rope_parameters": rope, "rope_theta": 3e3}
    yield f"rope {i} without theta, top-level rope_theta", {"rope_parameters": plain, "rope_theta": 3e3}
    yield f"rope {i} without any theta", {"rope_parameters": plain}
    yield f"rope {i} without theta, top-level rope_theta null", {"rope_parameters": plain, "rope_theta": None}
    if other != rope:
        yield (
            f"rope {i} as rope_scaling beside rope {other['rope_type']}",
            {"rope_scaling": rope, "rope_parameters": other},
        )
    yield f"rope {i} beside rope_scaling {{}}", {"rope_scaling": {}, "rope_parameters": rope}
    yield f"rope {i} beside top-level partial_rotary_factor", {"rope_parameters": rope, "partial_rotary_factor": 0.5}
    yield (
        f"rope {i} beside top-level original_max_position_embeddings",
        {
            "rope_parameters": rope,
            "original_max_position_embeddings": 12,
        },
    )
    yield f"rope {i} per layer type", {"rope_parameters": {"full_attention": rope, "sliding_attention": rope}}
    for key in rope:
        for value in (None, ABSENT):
            yield f"rope {i} {key}={value!r}", {"rope_parameters": _with(rope, key, value)}


def variants(family: HfFamily) -> Iterator[tuple[str, dict[str, Any]]]:
    """(label, config.json) for every change the sweep tries."""
    base = dict(family.base)
    seen = set()
    for key, values in family.changes.items():
        for value in values:
            seen.add((key, repr(value)))
            yield f"{key}={value!r}", _with(base, key, value)
    for key in base:  # every field the base states: left out, or null
        for value in (ABSENT, None):
            if key != "model_type" and (key, repr(value)) not in seen:
                yield f"{key}={value!r}", _with(base, key, value)
    without = _with(base, "rope_parameters", ABSENT)
    for i, rope in enumerate(family.ropes):
        for label, fields in _rope_spellings(i, rope, family.ropes[(i + 1) % len(family.ropes)]):
            yield label, {**without, **copy.deepcopy(fields)}
    yield "rope_parameters={}", _with(base, "rope_parameters", {})
    yield "rope_parameters='default'", _with(base, "rope_parameters", "default")
    for label, changes in family.extra.items():
        config = base
        for key, value in changes.items():
            config = _with(config, key, value)
        yield label, config


# --- transformers' side ---------------------------------------------------------------------------


def _transformers(config: dict[str, Any]) -> tuple[Any, bool]:
    """(transformers' causal LM of config.json with random weights and its logits in ``.logits``,
    True), a meta-device model for its shapes only (``, False``) when it is large, or (None, True)
    when transformers cannot build or run the config."""
    from transformers import AutoModelForCausalLM

    try:
        hf_config = config_class(config["model_type"]).from_dict(copy.deepcopy(config), attn_implementation="eager")
        deep = isinstance(hf_config.num_hidden_layers, int) and hf_config.num_hidden_layers > MAX_LAYERS
        wide = any(isinstance(n, int) and n > MAX_SIZE for n in (getattr(hf_config, k, None) for k in _SIZE_KEYS))
        if deep or wide:
            with torch.device("meta"):
                meta = AutoModelForCausalLM.from_config(hf_config)
            if deep or sum(p.numel() for p in meta.parameters()) > MAX_PARAMS:
                return meta, False
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(hf_config).eval()
        randomize(model)
        with torch.no_grad():
            model.logits = model(TOKENS, use_cache=False).logits
    except Exception:  # transformers refuses or fails on this config: titan must refuse it
        return None, True
    return (model, True) if torch.isfinite(model.logits).all() else (None, True)


def _hf_state(model: Any) -> dict[str, torch.Tensor]:
    """The tensors an HF folder holds (a tied lm_head is the embedding, stored once)."""
    out = model.get_output_embeddings()
    tied = out is not None and out.weight is model.get_input_embeddings().weight
    return {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}


def _hf_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in _hf_state(model).items()}


def _folder(out: Path, config: dict[str, Any], model: Any = None, weights: Path | None = None) -> Path:
    """An HF folder: ``config`` beside ``model``'s tensors (the layout transformers holds in memory,
    which every titan family reads; the release layouts have tests of their own) or beside the
    safetensors of the folder ``weights`` (linked)."""
    out.mkdir(parents=True)
    if model is not None:
        state = {k: v.contiguous() for k, v in _hf_state(model).items()}
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in weights.glob("*.safetensors") if weights is not None else ():
        (out / f.name).symlink_to(f)
    (out / "config.json").write_text(json.dumps(config))
    return out


# --- titan's side ---------------------------------------------------------------------------------


def _refusal(e: TitanError) -> str:
    message = str(e)
    if "\n" in message:
        raise _Failed(f"refusal is not one line: {message!r}")
    return message


def _titan(folder: Path) -> tuple[Any, torch.nn.Module]:
    state, args = load_hf(folder)
    model = spec_for_args(args).model_cls(args)  # tiny: faster on the CPU than through meta kernels
    model.load_state_dict(state, strict=True)
    return args, model.eval()


def check_export(args: Any, model: torch.nn.Module, out: Path) -> Outcome:
    """titan's export of ``model`` into ``out``: transformers' from_pretrained runs it as the same
    model, or the export is refused in one line and leaves nothing behind."""
    from transformers import AutoModelForCausalLM

    try:
        save_hf(model.state_dict(), args, out)
    except TitanError as e:
        if out.exists():
            raise _Failed(f"a refused export left {out}") from None
        return Outcome(str(out), "refused", message=_refusal(e))
    try:
        hf = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
        with torch.no_grad():
            theirs = hf(TOKENS, use_cache=False).logits
    except Exception as e:
        raise _Failed(f"transformers cannot run the export ({type(e).__name__}: {e})") from None
    with torch.no_grad():
        err = float((model(TOKENS) - theirs).abs().max())
    if err > TOL:
        raise _Failed(f"the exported model's logits differ by {err:.3g} in transformers")
    return Outcome(str(out), "match")


def _exports(args: Any) -> str:
    """ "" when the config.json titan exports for ``args`` reads back (through transformers' config
    class and titan's reader) as the same model, else the refusal: the round trip of every model the
    import sweep reads. Whether transformers runs an export as the same model is the export sweep's
    (and, for each family's base, the import sweep's) from_pretrained check."""
    adapter = spec_for_args(args).state_dict_adapter
    try:
        check_export_config(adapter, args, adapter.args_to_hf_config(args))
    except TitanError as e:
        return _refusal(e)
    return ""


def _differing(args: Any, base: Any) -> str:
    """The names of the settings in which ``args`` differs from ``base``."""
    names = [
        f.name
        for f in dataclasses.fields(args)
        if f.name != "moe_args" and getattr(args, f.name) != getattr(base, f.name)
    ]
    moe, base_moe = getattr(args, "moe_args", None), getattr(base, "moe_args", None)
    if moe is not None and base_moe is not None:
        names += [
            f"moe_args.{f.name}" for f in dataclasses.fields(moe) if getattr(moe, f.name) != getattr(base_moe, f.name)
        ]
    return ",".join(names)


# --- the sweeps -----------------------------------------------------------------------------------


class _ImportSweep:
    def __init__(self, family: HfFamily, tmp: Path) -> None:
        self.tmp = tmp
        self.base, _ = _transformers(dict(family.base))
        assert self.base is not None, "transformers must run the base config"
        self.shapes = _hf_shapes(self.base)
        self.weights = _folder(tmp / "base", dict(family.base), model=self.base)
        self.base_args, model = _titan(self.weights)
        with torch.no_grad():
            err = float((model(TOKENS) - self.base.logits).abs().max())
        assert err <= TOL, f"the base model's logits differ from transformers' by {err:.3g}"
        exported = check_export(self.base_args, model, tmp / "base_export")
        assert exported.kind == "match", exported
        self.exports: dict[str, str] = {"": ""}

    def contradiction(self, label: str, config: dict[str, Any], runs: bool, tmp: Path) -> Outcome:
        """The base weights under ``config``: from_hf must refuse them before writing anything."""
        folder = _folder(tmp / "contradiction", config, weights=self.weights)
        try:
            import_hf_to_dcp(folder, tmp / "dcp")
        except TitanError as e:
            if (tmp / "dcp").exists():
                raise _Failed("a refused from_hf left a folder") from None
            return Outcome(label, "contradiction" if runs else "unrunnable", message=_refusal(e))
        raise _Failed(f"from_hf converted a folder transformers {'reads with other shapes' if runs else 'cannot run'}")

    def one(self, label: str, config: dict[str, Any], tmp: Path) -> Outcome:
        hf, small = _transformers(config)
        outcome = None
        if hf is None or _hf_shapes(hf) != self.shapes:
            outcome = self.contradiction(label, config, hf is not None, tmp)
            if hf is None or not small:
                return outcome
        if outcome is None and torch.equal(hf.logits, self.base.logits):  # the base's weights and logits
            try:
                args = spec_for_hf_model_type(config["model_type"]).state_dict_adapter.hf_config_to_args(config)
            except TitanError as e:
                return Outcome(label, "refused", message=_refusal(e))
            if args == self.base_args:  # titan reads the base model, which was checked (and exported)
                return Outcome(label, "match")
        try:
            args, model = _titan(_folder(tmp / "own", config, model=hf))
        except TitanError as e:
            return outcome or Outcome(label, "refused", message=_refusal(e))
        with torch.no_grad():
            err = float((model(TOKENS) - hf.logits).abs().max())
        if err > TOL:
            raise _Failed(f"titan's logits differ from transformers' by {err:.3g}")
        key = _differing(args, self.base_args)  # an export is checked once per set of changed settings
        if key not in self.exports:
            self.exports[key] = _exports(args)
        if self.exports[key]:
            raise _Failed(f"the export of what titan read is refused: {self.exports[key]}")
        changed = hf.logits.shape != self.base.logits.shape or bool((hf.logits - self.base.logits).abs().max() > 1e-3)
        return outcome or Outcome(label, "match", changed=changed)


def _recorded(label: str, run: Any, *args: Any) -> Outcome:
    try:
        return dataclasses.replace(run(*args), label=label)
    except Exception as e:  # a traceback is a broken contract too
        return Outcome(label, "FAIL", message=f"{type(e).__name__}: {e}")


def sweep_import(family: HfFamily, tmp: Path) -> dict[str, Outcome]:
    """Every variant of ``family.base`` as a folder titan reads: label -> outcome."""
    config_cls = config_class(family.base["model_type"])
    missing = own_fields(config_cls) - set(family.changes)
    assert not missing, f"{config_cls.__name__} fields the sweep does not change: {sorted(missing)}"
    sweep = _ImportSweep(family, tmp)
    return {
        label: _recorded(label, sweep.one, label, config, tmp / str(n))
        for n, (label, config) in enumerate(variants(family))
    }


def _export_one(spec: Any, args: Any, out: Path) -> Outcome:
    torch.manual_seed(0)
    model = spec.model_cls(args)
    model.init_weights()
    randomize(model, seed=1)
    return check_export(args, model.eval(), out)


def sweep_export(
    base_args: Any, changes: Mapping[str, tuple[Any, ...]], per_run: set[str], tmp: Path
) -> dict[str, Outcome]:
    """titan model args with each field changed alone (``field`` or ``moe_args.field``; values titan
    refuses to build are skipped), exported: label -> outcome. ``per_run``: fields an export does not
    describe (how the model trains)."""
    names = {f.name for f in dataclasses.fields(base_args)}
    moe: Any = getattr(base_args, "moe_args", None)
    if moe is not None:
        names = (names - {"moe_args"}) | {f"moe_args.{f.name}" for f in dataclasses.fields(moe)}
    missing = names - set(changes) - per_run
    assert not missing, f"{type(base_args).__name__} fields the export sweep does not change: {sorted(missing)}"
    spec = spec_for_args(base_args)
    outcomes = {}
    for name, values in changes.items():
        for value in values:
            if name.startswith("moe_args."):
                args = dataclasses.replace(base_args, moe_args=dataclasses.replace(moe, **{name[9:]: value}))
            else:
                args = dataclasses.replace(base_args, **{name: value})
            try:
                args.validate()
            except TitanError:
                continue  # not a model titan builds

            label = f"{name}={value!r}"
            outcomes[label] = _recorded(label, _export_one, spec, args, tmp / str(len(outcomes)))
    return outcomes
