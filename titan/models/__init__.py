"""Model registry: name -> everything the trainer and tools need from one model family.

The spec is the only way generic code (trainer, dry run, memory estimate, checkpoint formats,
generation, converters) reaches a model family; titan/parallel holds the mechanisms and names no
model. A family outside titan joins with ``register_model_spec(spec)``, a new size of a registered
family with ``register_flavor(name, flavor, args)``; ``model.name`` and ``model.flavor`` then find
them. Specs and their flavor tables are read-only: registering replaces the whole spec.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from titan.config.sections.model import SHAPE_OVERRIDES
from titan.errors import TitanError


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_cls: type
    """model_cls(args), built on the meta device. The instance keeps `model_args`, has
    init_weights(buffer_device) (after to_empty) and init_buffers(device) (derived buffers only,
    before loading weights), and forward(tokens, kv_cache=None, doc_ids=None): an optional
    titan.models.kv_cache.KVCache for generation, and with attn_mask_type block_causal the batch's
    document ids (titan.models.documents.document_ids). It builds its own attention masks.

    The hand-over to the loss (training.loss_chunk_tokens > 0, titan.training.loss.TokenLoss):
    a model (and each pipeline part of it) with an ``output: nn.Linear | None`` projection and a
    final ``norm`` has a bool attribute ``loss_owns_output`` (False after __init__; the trainer sets
    it before splitting and parallelizing). When True, the part that holds ``output`` returns the
    normed hidden states [B, S, dim] instead of the logits and never calls ``output`` itself: the
    loss calls ``output`` chunk by chunk (so FSDP and TP hooks on that module run) and never holds
    the whole [tokens x vocab] logits. Llama's ``Transformer.forward_tail`` implements it; families
    built on that skeleton reuse it. A family without the attribute runs with the full logits only."""
    args_cls: type
    """The args dataclass (flavors, model_args.json in DCP folders)."""
    flavors: Mapping[str, Any]
    """Read-only name -> args table (register_flavor adds to it); use get_flavor /
    model_args_from_config for a copy."""
    parallelize_fn: Callable
    """(model part, ParallelDims, JobConfig) -> model part, with TP/SP, CP, AC, compile and
    FSDP/HSDP/DDP applied in the family's order."""
    get_nparams_and_flops: Callable
    """(model part, seq_len) -> (parameters, training FLOPs per token)."""
    pipelining_fn: Callable | None = None
    """Splits the meta model into pipeline stages: (model, dims, config, device, parallelize_fn,
    loss_fn) -> (schedule, model_parts, has_first_stage, has_last_stage)."""
    tensor_parallel_fn: Callable | None = None
    """(model, tp_mesh, loss_parallel=...) -> None: the TP/SP plan alone (generation uses it)."""
    cp_buffers_fn: Callable | None = None
    """model part -> [(module, attribute, seq dim)]: position-indexed buffers that context
    parallelism shards with the batch (titan.parallel.cp.cp_shard_batch)."""
    state_dict_adapter: Any = None
    """titan <-> Hugging Face key/layout mapping (to_hf, from_hf, config conversion, expected
    shapes, args from checkpoint shapes); None: no HF interop."""


def _llama3() -> ModelSpec:
    from titan.models.llama import args as llama_args
    from titan.models.llama import model as llama_model
    from titan.models.llama.parallelize import apply_tp, cp_buffers, parallelize_llama
    from titan.models.llama.pipeline import pipeline_llama
    from titan.models.llama.state_dict_adapter import LlamaStateDictAdapter

    return ModelSpec(
        "llama3",
        llama_model.Transformer,
        llama_args.TransformerModelArgs,
        llama_args.llama3_configs,
        parallelize_llama,
        llama_args.get_nparams_and_flops,
        pipeline_llama,
        tensor_parallel_fn=apply_tp,
        cp_buffers_fn=cp_buffers,
        state_dict_adapter=LlamaStateDictAdapter,
    )


class _Registry:
    """The registered specs by name. The shipped families are built on first use, so importing
    titan.models (as the config check does) does not import torch's model code."""

    def __init__(self, builtin: Mapping[str, Callable[[], ModelSpec]]) -> None:
        self._builtin = builtin
        self._specs: dict[str, ModelSpec] | None = None

    def specs(self) -> dict[str, ModelSpec]:
        if self._specs is None:
            self._specs = {name: build() for name, build in self._builtin.items()}
        return self._specs


def _llama4() -> ModelSpec:
    from titan.models.llama.parallelize import cp_buffers
    from titan.models.llama.pipeline import pipeline_llama
    from titan.models.llama4 import args as llama4_args
    from titan.models.llama4.model import Llama4Transformer
    from titan.models.llama4.parallelize import apply_tp as llama4_tp
    from titan.models.llama4.parallelize import parallelize_llama4
    from titan.models.llama4.state_dict_adapter import Llama4StateDictAdapter

    return ModelSpec(
        "llama4",
        Llama4Transformer,
        llama4_args.Llama4ModelArgs,
        llama4_args.llama4_configs,
        parallelize_llama4,
        llama4_args.get_nparams_and_flops,
        pipeline_llama,
        tensor_parallel_fn=llama4_tp,
        cp_buffers_fn=cp_buffers,
        state_dict_adapter=Llama4StateDictAdapter,
    )


def _gpt_oss() -> ModelSpec:
    from titan.models.gpt_oss import args as gpt_oss_args
    from titan.models.gpt_oss.model import GptOssTransformer
    from titan.models.gpt_oss.parallelize import parallelize_gpt_oss
    from titan.models.gpt_oss.state_dict_adapter import GptOssStateDictAdapter
    from titan.models.llama.pipeline import pipeline_llama

    return ModelSpec(
        "gpt_oss",
        GptOssTransformer,
        gpt_oss_args.GptOssModelArgs,
        gpt_oss_args.gpt_oss_configs,
        parallelize_gpt_oss,
        gpt_oss_args.get_nparams_and_flops,
        pipeline_llama,
        state_dict_adapter=GptOssStateDictAdapter,
    )


def _deepseek_v3() -> ModelSpec:
    from titan.models.deepseek_v3 import args as ds_args
    from titan.models.deepseek_v3.model import DeepSeekV3Transformer
    from titan.models.deepseek_v3.parallelize import parallelize_deepseek_v3
    from titan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
    from titan.models.llama.parallelize import cp_buffers
    from titan.models.llama.pipeline import pipeline_llama

    return ModelSpec(
        "deepseek_v3",
        DeepSeekV3Transformer,
        ds_args.DeepSeekV3ModelArgs,
        ds_args.deepseek_v3_configs,
        parallelize_deepseek_v3,
        ds_args.get_nparams_and_flops,
        pipeline_llama,
        cp_buffers_fn=cp_buffers,
        state_dict_adapter=DeepSeekV3StateDictAdapter,
    )


def _qwen3() -> ModelSpec:
    from titan.models.llama.parallelize import cp_buffers
    from titan.models.llama.pipeline import pipeline_llama
    from titan.models.qwen3 import args as qwen3_args
    from titan.models.qwen3.model import Qwen3Transformer
    from titan.models.qwen3.parallelize import apply_tp as qwen3_tp
    from titan.models.qwen3.parallelize import parallelize_qwen3
    from titan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    return ModelSpec(
        "qwen3",
        Qwen3Transformer,
        qwen3_args.Qwen3ModelArgs,
        qwen3_args.qwen3_configs,
        parallelize_qwen3,
        qwen3_args.get_nparams_and_flops,
        pipeline_llama,
        tensor_parallel_fn=qwen3_tp,
        cp_buffers_fn=cp_buffers,
        state_dict_adapter=Qwen3StateDictAdapter,
    )


def _qwen3_5() -> ModelSpec:
    from titan.models.llama.pipeline import pipeline_llama
    from titan.models.qwen3_5 import args as qwen3_5_args
    from titan.models.qwen3_5.model import Qwen35Transformer
    from titan.models.qwen3_5.parallelize import parallelize_qwen3_5
    from titan.models.qwen3_5.state_dict_adapter import Qwen35StateDictAdapter

    # No tensor_parallel_fn: generation runs on one rank (a recurrent state cannot take TP's padding).
    return ModelSpec(
        "qwen3_5",
        Qwen35Transformer,
        qwen3_5_args.Qwen35ModelArgs,
        qwen3_5_args.qwen3_5_configs,
        parallelize_qwen3_5,
        qwen3_5_args.get_nparams_and_flops,
        pipeline_llama,
        state_dict_adapter=Qwen35StateDictAdapter,
    )


# The one table that changes at run time: the registry that users and tests add to.
_REGISTRY = _Registry(
    MappingProxyType(
        {
            "llama3": _llama3,
            "llama4": _llama4,
            "qwen3": _qwen3,
            "qwen3_5": _qwen3_5,
            "deepseek_v3": _deepseek_v3,
            "gpt_oss": _gpt_oss,
        }
    )
)


def register_model_spec(spec: ModelSpec, *, replace: bool = False) -> None:
    """Make ``spec`` the family ``model.name = spec.name`` selects. A name that is registered
    already is refused unless ``replace`` (then the old spec is gone: keep it to put it back)."""
    specs = _REGISTRY.specs()
    if spec.name in specs and not replace:
        raise TitanError(f"model {spec.name!r} is registered already; pass replace=True to replace its spec")
    specs[spec.name] = dataclasses.replace(spec, flavors=MappingProxyType(dict(spec.flavors)))


def register_flavor(name: str, flavor: str, args: Any, *, replace: bool = False) -> None:
    """Add ``flavor`` (an instance of the family's args class) to the registered model ``name``.
    A flavor it has already is refused unless ``replace``."""
    spec = get_model_spec(name)
    if not isinstance(args, spec.args_cls):
        raise TitanError(
            f"flavor {flavor!r} of model {name!r} must be a {spec.args_cls.__name__}, got {type(args).__name__}"
        )
    if flavor in spec.flavors and not replace:
        raise TitanError(f"model {name!r} has a flavor {flavor!r} already; pass replace=True to replace it")
    register_model_spec(dataclasses.replace(spec, flavors={**spec.flavors, flavor: copy.deepcopy(args)}), replace=True)


def get_model_spec(name: str) -> ModelSpec:
    specs = _REGISTRY.specs()
    if name not in specs:
        raise TitanError(f"config key 'model.name' got {name!r}; valid: {', '.join(specs)}")
    return specs[name]


def spec_for_args(args: Any) -> ModelSpec:
    """The spec whose args class `args` is (checkpoint writers get args, not a name); the exact
    class first, as one family's args may subclass another's (llama4's extend llama3's)."""
    specs = list(_REGISTRY.specs().values())
    for spec in [s for s in specs if type(args) is s.args_cls] + [s for s in specs if isinstance(args, s.args_cls)]:
        return spec
    raise TitanError(f"no registered model uses args of type {type(args).__name__}")


def spec_for_hf_model_type(model_type: str) -> ModelSpec:
    """The spec whose state-dict adapter reads Hugging Face configs of `model_type`."""
    known = []
    for spec in _REGISTRY.specs().values():
        types = getattr(spec.state_dict_adapter, "hf_model_types", ())
        if model_type in types:
            return spec
        known += types
    raise TitanError(f"config.json model_type is {model_type!r}; supported: {', '.join(repr(t) for t in known)}")


def get_flavor(spec: ModelSpec, flavor: str) -> Any:
    """A copy of the flavor's args (the table's entries are shared and never mutated)."""
    if flavor not in spec.flavors:
        raise TitanError(f"config key 'model.flavor' got {flavor!r}; valid for {spec.name}: {', '.join(spec.flavors)}")
    return copy.deepcopy(spec.flavors[flavor])


def model_args_from_config(spec: ModelSpec, model_config: Any) -> Any:
    """A copy of the flavor's args with the [model] shape overrides applied, validated."""
    args = get_flavor(spec, model_config.flavor)
    overrides = {k: getattr(model_config, k) for k in SHAPE_OVERRIDES if getattr(model_config, k) is not None}
    depth = getattr(model_config, "mtp_depth", 0) or 0
    if depth and not hasattr(args, "mtp_depth"):
        with_mtp = [
            s.name for s in _REGISTRY.specs().values() if "mtp_depth" in getattr(s.args_cls, "__dataclass_fields__", {})
        ]
        raise TitanError(
            f"config key 'model.mtp_depth' got {depth}; valid: 0 (model {spec.name} has no multi-token"
            f" prediction modules; families with them: {', '.join(with_mtp)})"
        )
    if depth:
        overrides["mtp_depth"] = depth
    for key, value in overrides.items():
        setattr(args, key, value)
    try:
        args.validate()
    except TitanError as e:
        if not overrides:
            raise
        given = ", ".join(f"model.{k} = {v}" for k, v in overrides.items())
        raise TitanError(f"{e} (flavor {model_config.flavor!r} with {given})") from None
    return args


def model_names() -> list[str]:
    """The registered families' ``model.name`` values (the shipped ones first, then those added
    with register_model_spec): what a tool that covers every family loops over."""
    return list(_REGISTRY.specs())
