"""Activation checkpointing per TransformerBlock: full, selective per op, every N-th block, or
compile's memory budget.

Applied after TP/CP and before compile and FSDP (by each model's parallelize function), so compile sees the checkpointed
block and FSDP shards the wrapper. The wrapper adds "_checkpoint_wrapped_module." to parameter
names; DCP's state-dict helpers and titan.parallel.init.canonical_fqn strip it. memory_budget wraps
nothing: the budget steers compile's min-cut partitioner, which picks the activations each
compiled block keeps.
"""

from __future__ import annotations

import dataclasses
import os
from collections import defaultdict
from collections.abc import Callable

import torch
import torch._functorch.config as functorch_config
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.tensor import DTensor
from torch.utils import checkpoint as torch_checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titan.config.choices import ACMode, choices
from titan.config.sections.activation_checkpoint import ActivationCheckpoint, parse_selective_option
from titan.errors import TitanError
from titan.log import logger
from titan.parallel.utils import blocks_of

__all__ = [
    "AC_MODES",
    "ATTENTION_OPS",
    "apply_ac",
    "parse_selective_option",
    "MATMUL_OPS",
    "SAVED_OPS",
    "recomputed_attention_breaks_compile",
]

AC_MODES = choices(ACMode)

aten = torch.ops.aten
# Matmuls: the expensive ops whose outputs are worth keeping. _scaled_mm is the float8 matmul.
MATMUL_OPS = frozenset({aten.mm.default, aten._scaled_mm.default})
ATTENTION_OPS = frozenset(
    {
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        # flex attention is a higher-order op of newer torch releases
        *([torch.ops.higher_order.flex_attention] if hasattr(torch.ops.higher_order, "flex_attention") else []),
    }
)
# Always kept: attention (recomputing it costs as much as the forward) and TP reduce-scatters
# (recomputing would repeat the communication).
SAVED_OPS = frozenset(
    {
        *ATTENTION_OPS,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        # expert parallel's token dispatch/combine: recomputing would repeat the all-to-all
        torch.ops._c10d_functional.all_to_all_single.default,
        # torchao computes float8 scales from abs().max(); keeping the amax avoids re-reducing.
        aten.max.default,
    }
)
# torch's own settings, restored for a later compiled model of this process that asks for no budget.
_PARTITIONER_DEFAULTS = {
    key: getattr(functorch_config, key)
    for key in ("activation_memory_budget", "visualize_memory_budget_pareto", "memory_budget_pareto_dir")
}


# The profiler's record_function annotations: no tensor computation, nothing to keep or recompute.
PROFILER_OPS = frozenset(
    getattr(packet, overload)
    for packet in (
        torch.ops.profiler._record_function_enter,
        torch.ops.profiler._record_function_enter_new,
        torch.ops.profiler._record_function_exit,
    )
    for overload in packet.overloads()
)


def ignore_profiler_ops_in_sac() -> None:
    """Let torch's selective checkpointing pass the profiler's annotations through unmatched.

    Since torch 2.13 SAC matches every op of the recompute, by name and call index, to one the
    forward recorded (recomputed ones included). A nested FSDP unit inside a checkpointed block
    (the routed experts under EP, sharded on their own mesh) does not annotate the same way twice:
    in the forward the model's root FSDP state is running, in the recompute (during backward)
    none is, so the experts' state opens one more "FSDP::root_pre_forward" record_function and the
    recompute stops with "profiler._record_function_enter_new.default invocation index N
    encountered during backward but not found in storage". The annotations carry no activations,
    so leaving them out of the matching, as torch already does for detach, changes no result and
    lines up the recompute's ops with the forward's. Added to torch's own set (SAC_IGNORED_OPS,
    read by both SAC modes at each op); a no-op where a torch release already lists them.
    """
    torch_checkpoint.SAC_IGNORED_OPS.update(PROFILER_OPS)


def _op_policy(force_recompute_shapes: frozenset[tuple[int, ...]] = frozenset()) -> Callable:
    """A fresh policy per checkpointed call: keeps every other matmul output, attention and the
    listed ops; recomputes the cheap pointwise work (norms, RoPE, SiLU) in backward. Matmuls whose
    weight has one of ``force_recompute_shapes`` are recomputed and not counted. Copies from an
    accelerator to the host are kept: the recompute of an MoE block then reads EP's all-to-all
    split sizes from the kept host copy instead of synchronising with the device again.

    Counting separately in forward and in recompute gives both passes the same decisions.
    """
    counts: dict[bool, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func == aten._to_copy.default and _device_to_host(args[0], kwargs):
            return CheckpointPolicy.MUST_SAVE
        if func in MATMUL_OPS:
            if func == aten.mm.default and tuple(args[1].shape) in force_recompute_shapes:
                return CheckpointPolicy.PREFER_RECOMPUTE
            counts[ctx.is_recompute] += 1
            # Save the 1st, 3rd, ... matmul: halves matmul recompute at half the memory.
            keep = counts[ctx.is_recompute] % 2 == 1
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _device_to_host(source: torch.Tensor, kwargs: dict) -> bool:
    target = kwargs.get("device")
    return source.device.type != "cpu" and target is not None and torch.device(target).type == "cpu"


def _attention_kept_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Full recomputation except attention (see recomputed_attention_breaks_compile)."""
    return CheckpointPolicy.MUST_SAVE if func in ATTENTION_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def recomputed_attention_breaks_compile(device_type: str, tp_enabled: bool, compiled: bool) -> bool:
    """True where torch 2.13's compile fails a checkpointed block that recomputes attention:
    "expected all tensors_saved_with_vc_check to be Tensors, got types: [..., DeviceMesh]".

    A TP block holds DTensors, so its compiled graph saves the DeviceMesh (an opaque object) for
    backward. SDPA counts as a random op (it takes a dropout probability), so when the
    partitioner recomputes it, functionalize_rng_ops saves the forward's RNG state, and on devices
    without graph-safe RNG state (CPU) appends it after the opaque objects, where AOT autograd's
    runtime expects only opaque objects and SymInts: every saved slice is off by one. Keeping the
    attention output (it is never recomputed) avoids the RNG state. docs/troubleshooting.md has a
    reproduction; remove this once torch's functionalize_rng_ops places RNG states before opaque
    objects (check with that reproduction on a new torch release).
    """
    if not (compiled and tp_enabled):
        return False
    try:
        from torch._functorch._aot_autograd.utils import supports_graphsafe_rng
    except ImportError:  # older torch: no graph-safe RNG on any device
        return True
    return not supports_graphsafe_rng(torch.device(device_type))


def _force_recompute_shapes(block: nn.Module, fqns: list[str], block_fqn: str) -> frozenset[tuple[int, ...]]:
    """The (in, out) shapes of the mm right-hand sides of the named Linears of ``block``."""
    shapes = set()
    for name, module in block.named_modules():
        full = f"{block_fqn}.{name}" if name else block_fqn
        if not any(f in full for f in fqns):
            continue
        if not isinstance(module, nn.Linear):
            raise TitanError(
                "config key 'activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns' matched"
                f" {full} ({type(module).__name__}); valid: names of nn.Linear modules"
            )
        weight = module.weight
        # A TP weight reaches the policy as the DTensor (global shape) or as its local shard: list both.
        for out_f, in_f in {
            tuple(weight.shape),
            *([tuple(weight.to_local().shape)] if isinstance(weight, DTensor) else []),
        }:
            shapes.add((in_f, out_f))
    return frozenset(shapes)


def _context_fn(op_shapes: frozenset | None, keep_attention: bool) -> Callable | None:
    """The selective-checkpoint policy of a wrapped block: per op (``op_shapes``: the matmul shapes
    always recomputed), keep attention only, or None (recompute everything)."""
    if op_shapes is not None or keep_attention:
        ignore_profiler_ops_in_sac()
    if op_shapes is not None:
        return lambda: create_selective_checkpoint_contexts(_op_policy(op_shapes))
    if keep_attention:
        return lambda: create_selective_checkpoint_contexts(_attention_kept_policy)
    return None


def _wrap(block: nn.Module, ac: ActivationCheckpoint, context_fn: Callable | None) -> nn.Module:
    kwargs = {
        "preserve_rng_state": ac.preserve_rng_state,
        "early_stop": ac.early_stop,
        "determinism_check": ac.determinism_check,
        "debug": ac.debug,
    }
    if context_fn is not None:
        kwargs["context_fn"] = context_fn
    return checkpoint_wrapper(block, **kwargs)


def _set_memory_budget(ac: ActivationCheckpoint, compiled: bool, dump_folder: str) -> None:
    """The partitioner reads a process-wide setting when it compiles each block (lazily, at the
    first forward), as torchtitan sets it."""
    if not compiled:
        raise TitanError(
            "config key 'activation_checkpoint.mode' = \"memory_budget\" needs compile: set compile.enable = true"
            ' with "model" in compile.components'
        )
    functorch_config.activation_memory_budget = float(ac.memory_budget)
    if ac.visualize_memory_budget_pareto:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise TitanError(
                "config key 'activation_checkpoint.visualize_memory_budget_pareto' needs matplotlib to draw"
                " its SVG files: pip install matplotlib, or set it to false"
            ) from None
        pareto_dir = os.path.join(dump_folder, "memory_budget_pareto")
        os.makedirs(pareto_dir, exist_ok=True)
        functorch_config.memory_budget_pareto_dir = pareto_dir
        functorch_config.visualize_memory_budget_pareto = True
        logger.info(f"memory-budget Pareto curves go to {pareto_dir}")


def apply_ac(
    model: nn.Module,
    ac: ActivationCheckpoint | str,
    selective_ac_option: int | str | None = None,
    *,
    compiled: bool = False,
    keep_attention: bool = False,
    dump_folder: str = ".",
) -> list[str]:
    """Wrap blocks of ``model.layers`` in place; returns the names of the wrapped blocks.

    ``ac`` is the [activation_checkpoint] section, or a mode name with the section's other keys at
    their defaults (``selective_ac_option`` then overrides that key). ``compiled``: the blocks
    will be compiled (memory_budget needs it). ``keep_attention``: full / every-N-th blocks keep
    their attention outputs (see recomputed_attention_breaks_compile).

    Blocks keep their layer-id names, so with pipeline stages "every N-th" stays a property of
    the layer, not of its position inside a stage. The mode is checked again here (the config
    loader did it for the trainer) because any other string would silently mean full AC.
    """
    if isinstance(ac, str):
        ac = ActivationCheckpoint(mode=ac)  # type: ignore[arg-type]  # checked next
    if selective_ac_option is not None:
        ac = dataclasses.replace(ac, selective_ac_option=selective_ac_option)
    mode = ac.mode
    if mode not in AC_MODES:
        raise TitanError(f"config key 'activation_checkpoint.mode' got {mode!r}; valid: {', '.join(AC_MODES)}")
    if compiled:
        for key, value in _PARTITIONER_DEFAULTS.items():
            setattr(functorch_config, key, value)
    if mode == "memory_budget":
        _set_memory_budget(ac, compiled, dump_folder)
        logger.info(f"activation memory budget {ac.memory_budget} for the compiled blocks (compile's partitioner)")
        return []
    if mode == "none":
        return []
    option = parse_selective_option(ac.selective_ac_option) if mode == "selective" else None
    wrapped = []
    blocks = blocks_of(model)
    for name, block in list(blocks.named_children()):
        if isinstance(option, int) and int(name) % option != 0:
            continue
        shapes = (
            _force_recompute_shapes(block, ac.per_op_sac_force_recompute_mm_shapes_by_fqns, f"layers.{name}")
            if option == "op"
            else None
        )
        blocks.register_module(name, _wrap(block, ac, _context_fn(shapes, keep_attention)))
        wrapped.append(name)
    what = {None: "full", "op": "selective per op"}.get(option, f"full on every {option}-th block")
    kept = " (attention outputs kept)" if keep_attention and option != "op" else ""
    logger.info(f"applied activation checkpointing ({what}){kept} to {len(wrapped)} of {len(blocks)} blocks")
    return wrapped
