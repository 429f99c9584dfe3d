"""Context parallelism: each sequence is split over the CP ranks (ring attention).

Sequences are cut into 2 x cp chunks and rank r keeps chunks r and 2cp-1-r (head-tail load
balancing: with a causal mask the early chunks are cheap and the late ones expensive, so each
rank gets one of each). inputs, labels and the position-indexed buffers the model names (e.g. a
RoPE table) are sharded the same way; attention then needs every rank's keys/values:
- SDPA: q/k/v become sequence-sharded DTensors and torch's CP dispatcher runs ring attention;
- flex: k/v are all-gathered before the kernel, and the model builds its BlockMask (once per
  batch, outside the blocks) for the local, rearranged query rows against all keys.
This file is the mechanism only: the model's parallelize function says which modules are its
attention kernels, which mask_mod its flex mask uses and which buffers follow the sequence.
Training with CP needs CUDA (see check_layout): on CPU SDPA has no CP sharding rule and flex
attention has no backward. The forward (e.g. evaluation) with flex runs anywhere.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.experimental._attention import (
    _context_parallel_shard,
    _ContextParallel,
    _disable_context_parallel_dispatcher,
    _enable_context_parallel_dispatcher,
    _HeadTailLoadBalancer,
    context_parallel_unshard,
    set_rotate_method,
)
from torch.nn.attention.flex_attention import _DEFAULT_SPARSE_BLOCK_SIZE, BlockMask, create_block_mask

from titan.errors import TitanError
from titan.log import logger

# q/k/v reach the attention kernel as [B, H, S, Dh].
_QKV_SEQ_DIM = 2

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
SeqBuffer = tuple[nn.Module, str, int]
"""(module, attribute name, sequence dim): a tensor cp_shard_batch swaps for its local shard."""


def check_cp_seq_len(seq_len: int, cp: int, attn_type: str) -> None:
    """Head-tail balancing cuts each sequence into 2 x cp chunks; the flex CP block mask also
    needs every rank's chunks to be whole mask blocks."""
    multiple = 2 * cp * (_DEFAULT_SPARSE_BLOCK_SIZE if attn_type == "flex" else 1)
    if seq_len % multiple:
        whole_blocks = " of whole 128-token mask blocks" if attn_type == "flex" else ""
        raise TitanError(
            f"training.seq_len ({seq_len}) must be divisible by {multiple} with context_parallel_degree {cp}"
            f" and attn_type {attn_type} (2 x cp chunks{whole_blocks})"
        )


def cp_block_mask(mask_mod: MaskMod, cp_mesh: DeviceMesh, local_len: int, device: torch.device) -> BlockMask:
    """The global `mask_mod` mask restricted to this rank's (head-tail rearranged) query rows,
    against all keys: what flex needs once the CP hook has all-gathered k/v."""
    import torch.distributed.tensor.experimental._context_parallel._attention as cp_impl

    full = local_len * cp_mesh.size()
    if device.type == "cpu" and getattr(cp_impl, "_compiled_create_block_mask", 0) is None:
        # torch compiles create_block_mask here (GPU memory); on CPU that costs ~20 s per process
        # for a mask built once, so use the eager function (same result).
        cp_impl._compiled_create_block_mask = create_block_mask
    return cp_impl._create_cp_block_mask(
        mask_mod, 1, 1, full, full, cp_mesh, _HeadTailLoadBalancer(full, cp_mesh.size(), device)
    )


def cp_mask_builder(mask_mod: MaskMod, cp_mesh: DeviceMesh) -> Callable[[int, torch.device], BlockMask]:
    """(local length, device) -> BlockMask: the builder a model's flex mask cache uses under CP."""
    return functools.partial(cp_block_mask, mask_mod, cp_mesh)


def apply_cp(attention_kernels: Iterable[nn.Module], cp_mesh: DeviceMesh, attn_type: str) -> None:
    """Hook each attention kernel module (called as kernel(q, k, v, ...) with [B, H, S, Dh]
    tensors) for CP: SDPA dispatches to ring attention, flex gets k/v all-gathered."""
    kind = _ContextParallel.AttentionType.FLEX if attn_type == "flex" else _ContextParallel.AttentionType.SDPA
    for kernel in attention_kernels:
        _ContextParallel(seq_dim=_QKV_SEQ_DIM, attention_type=kind)._apply(kernel, cp_mesh)
    logger.info(f"applied context parallel (degree {cp_mesh.size()}, {attn_type}, head-tail load balancing)")


@contextlib.contextmanager
def cp_shard_batch(
    cp_mesh: DeviceMesh,
    inputs: torch.Tensor | None,
    labels: torch.Tensor | None,
    buffers: Sequence[SeqBuffer] = (),
    rotate_method: str = "allgather",
) -> Iterator[tuple[torch.Tensor | None, torch.Tensor | None]]:
    """Within the block: (local inputs, local labels), and each (module, name, dim) of `buffers`
    swapped for its shard. Run forward *and* backward inside (SDPA's ring attention dispatches
    in both)."""
    first = next(t for t in (inputs, labels) if t is not None)
    balancer = _HeadTailLoadBalancer(first.shape[1], cp_mesh.size(), first.device)
    batch = [t for t in (inputs, labels) if t is not None]
    originals = [getattr(m, name) for m, name, _ in buffers]
    seq_dims = [1] * len(batch) + [d for _, _, d in buffers]
    # Typed list[Tensor | BlockMask] for mixed inputs; each shard has its input's type, and these are tensors.
    shards = cast(list[torch.Tensor], _context_parallel_shard(cp_mesh, batch + originals, seq_dims, balancer))
    for (m, name, _), shard in zip(buffers, shards[len(batch) :]):
        setattr(m, name, shard)
    it = iter(shards)
    local_inputs = next(it) if inputs is not None else None
    local_labels = next(it) if labels is not None else None
    set_rotate_method(rotate_method)
    _enable_context_parallel_dispatcher()
    try:
        yield local_inputs, local_labels
    finally:
        _disable_context_parallel_dispatcher()
        for (m, name, _), original in zip(buffers, originals):
            setattr(m, name, original)


def cp_sum(cp_mesh: DeviceMesh) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function summing a statistic without gradient (e.g. per-sequence counts) over the CP ranks,
    i.e. over the parts of the same sequences."""
    group = cp_mesh.get_group()

    def reduce(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return t

    return reduce


def cp_unshard(cp_mesh: DeviceMesh, tensor: torch.Tensor, seq_dim: int = 1) -> torch.Tensor:
    """Gather a CP-sharded tensor (e.g. logits) back into the original token order."""
    seq_len = tensor.shape[seq_dim] * cp_mesh.size()
    balancer = _HeadTailLoadBalancer(seq_len, cp_mesh.size(), tensor.device)
    return context_parallel_unshard(cp_mesh, [tensor], [seq_dim], balancer)[0]
