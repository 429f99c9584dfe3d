"""Model registry: name -> everything the trainer and tools need from one model family.

The spec is the only way generic code (trainer, dry run, memory estimate, checkpoint formats,
generation, converters) reaches a model family; titan/parallel holds the mechanisms and names no
model. Specs and flavor tables are read-only.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from titan.config.checks import SHAPE_OVERRIDES
from titan.errors import TitanError


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_cls: type
    """model_cls(args), built on the meta device. The instance keeps `model_args`, has
    init_weights(buffer_device) (after to_empty) and init_buffers(device) (derived buffers only,
    before loading weights), and forward(tokens, kv_cache=None, doc_ids=None): an optional
    titan.models.kv_cache.KVCache for generation, and with attn_mask_type block_causal the batch's
    document ids (titan.models.documents.document_ids). It builds its own attention masks."""
    args_cls: type
    """The args dataclass (flavors, model_args.json in DCP folders)."""
    flavors: Mapping[str, Any]
    """Read-only name -> args table; use get_flavor / model_args_from_config for a copy."""
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
        "llama3", llama_model.Transformer, llama_args.TransformerModelArgs,
        # Read at call time, so a test that swaps the table (tests/helpers/tiny.py) is seen.
        llama_args.llama3_configs, parallelize_llama, llama_args.get_nparams_and_flops, pipeline_llama,
        tensor_parallel_fn=apply_tp, cp_buffers_fn=cp_buffers, state_dict_adapter=LlamaStateDictAdapter,
    )


_REGISTRY: Mapping[str, Callable[[], ModelSpec]] = MappingProxyType({"llama3": _llama3})


def get_model_spec(name: str) -> ModelSpec:
    if name not in _REGISTRY:
        raise TitanError(f"config key 'model.name' got {name!r}; valid: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]()


def spec_for_args(args: Any) -> ModelSpec:
    """The spec whose args class `args` is (checkpoint writers get args, not a name)."""
    for build in _REGISTRY.values():
        spec = build()
        if isinstance(args, spec.args_cls):
            return spec
    raise TitanError(f"no registered model uses args of type {type(args).__name__}")


def spec_for_hf_model_type(model_type: str) -> ModelSpec:
    """The spec whose state-dict adapter reads Hugging Face configs of `model_type`."""
    known = []
    for build in _REGISTRY.values():
        spec = build()
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
