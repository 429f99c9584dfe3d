"""Float8 training through torchao: swap nn.Linear for Float8Linear before parallelizing.

The swap happens on the meta model (no weights exist yet); Float8Linear keeps its weight in high
precision and casts weight, input and grad_output to float8 per matmul, with dynamic scales.
With FSDP2, ``enable_fsdp_float8_all_gather`` casts the local shard to float8 before the
all-gather, and ``precompute_float8_dynamic_scale_for_fsdp`` computes every weight's scale
after the optimizer step in one all-reduce, instead of one small all-reduce per layer in forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from titan.config.job_config import Float8 as Float8Config
from titan.errors import TitanError
from titan.log import import_torchao, logger

__all__ = [
    "check_float8_hardware",
    "convert_to_float8",
    "apply_float8",
    "apply_float8_grouped_mm",
    "check_float8_grouped_mm",
    "build_precompute_hook",
    "register_float8_precompute",
]

# Which options combine is Float8.validate's (titan/config/sections/float8.py); this module checks
# what needs the device and torchao.


def check_float8_hardware(cfg: Float8Config, device: torch.device) -> None:
    """float8 matmuls need SM89+ (Ada, Hopper, Blackwell) on CUDA; CPUs have a reference kernel."""
    if not cfg.enable_float8_linear or cfg.emulate or device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise TitanError(
            f"float8.enable_float8_linear needs a GPU with compute capability >= 8.9 (this one: {major}.{minor});"
            " set float8.emulate = true to test the numerics without float8 hardware"
        )


def _keep_in_high_precision(module: nn.Linear, fqn: str, filter_fqns: list[str]) -> str | None:
    """Why a Linear stays in high precision, or None to convert it."""
    if any(f and f in fqn for f in filter_fqns):
        return "in filter_fqns"
    out_features, in_features = module.weight.shape
    if in_features % 16 or out_features % 16:
        return f"dims {in_features}x{out_features} not multiples of 16"
    return None


def convert_to_float8(model: nn.Module, cfg: Float8Config, *, fsdp_enabled: bool) -> list[str]:
    """Swap eligible nn.Linear modules in place; returns the names of the converted ones."""
    if not cfg.enable_float8_linear:
        return []
    try:
        torchao_float8 = import_torchao("torchao.float8")
    except ImportError as e:
        raise TitanError(f"float8.enable_float8_linear needs torchao (pip install torchao): {e}") from None

    all_gather = cfg.enable_fsdp_float8_all_gather
    if all_gather and not fsdp_enabled:
        logger.warning(
            "float8.enable_fsdp_float8_all_gather (and precompute_float8_dynamic_scale_for_fsdp) have no effect:"
            " FSDP is not enabled in this run"
        )
        all_gather = False
    base = torchao_float8.Float8LinearConfig.from_recipe_name(cfg.recipe)
    # Float8LinearConfig is frozen; replace() re-runs its checks on the new combination.
    from dataclasses import replace

    config = replace(base, enable_fsdp_float8_all_gather=all_gather, emulate=cfg.emulate)

    converted: list[str] = []
    skipped: dict[str, str] = {}

    def module_filter(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        reason = _keep_in_high_precision(module, fqn, cfg.filter_fqns)
        if reason:
            skipped[fqn] = reason
            return False
        converted.append(fqn)
        return True

    torchao_float8.convert_to_float8_training(model, config=config, module_filter_fn=module_filter)
    for fqn, reason in skipped.items():
        logger.info(f"float8: kept {fqn} in high precision ({reason})")
    logger.info(
        f"float8 ({cfg.recipe}{', emulated' if cfg.emulate else ''}{', fsdp float8 all-gather' if all_gather else ''}):"
        f" converted {len(converted)} Linear layers"
    )
    return converted


def apply_float8(model: nn.Module, cfg: Float8Config, device: torch.device, *, fsdp_enabled: bool) -> list[str]:
    """The run's float8 set-up on the meta model: the hardware check for `device`, then the swap.
    Returns the converted Linear names (empty when float8 is off)."""
    check_float8_hardware(cfg, device)
    return convert_to_float8(model, cfg, fsdp_enabled=fsdp_enabled) + apply_float8_grouped_mm(model, cfg)


def check_float8_grouped_mm(cfg: Float8Config, device_type: str, pp: int, cp: int) -> None:
    """What torchao's float8 MoE training needs, checked before any process group exists."""
    if not cfg.enable_float8_grouped_mm:
        return
    if device_type != "cuda":
        raise TitanError(
            "float8.enable_float8_grouped_mm needs CUDA SM89+ (torchao's scaled grouped GEMM has no CPU kernel"
            f" and no emulation); this run is on {device_type}: set it to false"
        )
    if pp > 1 or cp > 1:
        raise TitanError(
            "float8.enable_float8_grouped_mm does not combine with pipeline or context parallel (torchao's float8"
            " MoE training prototype); set it to false or use degree 1"
        )


def apply_float8_grouped_mm(model: nn.Module, cfg: Float8Config) -> list[str]:
    """Wrap the weights of the modules named in grouped_mm_fqns so that torch._grouped_mm on them runs
    torchao's dynamically scaled float8 grouped GEMM. Returns the wrapped modules' names."""
    if not cfg.enable_float8_grouped_mm:
        return []
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 9):
            raise TitanError(
                "float8.enable_float8_grouped_mm needs a GPU with compute capability >= 8.9"
                f" (this one: {major}.{minor})"
            )
    try:
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig
        from torchao.quantization.quant_api import quantize_
    except ImportError as e:
        raise TitanError(f"float8.enable_float8_grouped_mm needs torchao with MoE training support: {e}") from None

    def named(module: nn.Module, fqn: str) -> bool:
        return any(f in fqn for f in cfg.grouped_mm_fqns) and hasattr(module, "w1")

    names = [fqn for fqn, m in model.named_modules() if named(m, fqn)]
    if not names:
        raise TitanError(
            f"config key 'float8.grouped_mm_fqns' got {cfg.grouped_mm_fqns!r}; it names no routed-experts module"
            " of this model (their names end in 'moe.experts')"
        )
    quantize_(model, config=Float8TrainingOpConfig(), filter_fn=named)
    logger.info(f"float8 grouped GEMMs (rowwise dynamic scales) for {len(names)} expert modules")
    return names


def build_precompute_hook(
    model_parts: list[nn.Module], cfg: Float8Config, fsdp_enabled: bool
) -> Callable[[], None] | None:
    """The optimizer post-step hook that precomputes float8 scales, when the config asks for it."""
    if not (
        cfg.enable_float8_linear
        and cfg.enable_fsdp_float8_all_gather
        and cfg.precompute_float8_dynamic_scale_for_fsdp
        and fsdp_enabled
    ):
        return None
    precompute_float8_dynamic_scale_for_fsdp = import_torchao("torchao.float8").precompute_float8_dynamic_scale_for_fsdp

    def hook() -> None:
        for part in model_parts:
            precompute_float8_dynamic_scale_for_fsdp(part)

    return hook


def register_float8_precompute(optimizers, model_parts: list[nn.Module], cfg: Float8Config, fsdp_enabled: bool) -> None:
    """Run the scale precompute after every optimizer step, when the config asks for it.
    ``optimizers``: anything with ``register_step_post_hook`` (titan's OptimizersContainer)."""
    hook = build_precompute_hook(model_parts, cfg, fsdp_enabled)
    if hook is not None:
        optimizers.register_step_post_hook(hook)
