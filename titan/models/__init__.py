"""Model registry: name -> everything the trainer needs to build and parallelize that model."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from titan.config.checks import SHAPE_OVERRIDES
from titan.errors import TitanError


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_cls: type
    flavors: dict[str, Any]
    parallelize_fn: Callable
    get_nparams_and_flops: Callable
    pipelining_fn: Callable | None = None
    """Splits the meta model into pipeline stages: (model, dims, config, device, parallelize_fn,
    loss_fn) -> (schedule, model_parts, has_first_stage, has_last_stage)."""
    state_dict_adapter: Any = None
    """titan <-> Hugging Face key/layout mapping (to_hf, from_hf, config conversion); None: no HF interop."""


def _llama3() -> ModelSpec:
    from titan.models.llama import Transformer, get_nparams_and_flops, llama3_configs
    from titan.models.llama.parallelize import parallelize_llama
    from titan.models.llama.pipeline import pipeline_llama
    from titan.models.llama.state_dict_adapter import LlamaStateDictAdapter

    return ModelSpec(
        "llama3", Transformer, llama3_configs, parallelize_llama, get_nparams_and_flops, pipeline_llama,
        state_dict_adapter=LlamaStateDictAdapter,
    )


_REGISTRY: dict[str, Callable[[], ModelSpec]] = {"llama3": _llama3}


def get_model_spec(name: str) -> ModelSpec:
    if name not in _REGISTRY:
        raise TitanError(f"config key 'model.name' got {name!r}; valid: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]()


def get_flavor(spec: ModelSpec, flavor: str) -> Any:
    if flavor not in spec.flavors:
        raise TitanError(f"config key 'model.flavor' got {flavor!r}; valid for {spec.name}: {', '.join(spec.flavors)}")
    return spec.flavors[flavor]


def model_args_from_config(spec: ModelSpec, model_config: Any) -> Any:
    """A copy of the flavor's args with the [model] shape overrides applied, validated."""
    args = copy.deepcopy(get_flavor(spec, model_config.flavor))
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
