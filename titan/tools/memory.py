"""Per-rank training memory estimate, without materializing the model.

Static state is counted from the meta model's shapes: fp32 parameters, gradients and AdamW's two
moments, each split over the FSDP shard group (dim-0 sharding, padded like FSDP2). The dynamic
part is measured: one forward + backward of the real model code (activation checkpointing
applied as configured) runs on fake tensors at the per-rank micro-batch, and a dispatch mode
tracks the bytes of every live tensor storage. Each parameter gradient is swapped for one of its
sharded size as soon as it is accumulated, as FSDP2 keeps only the reduce-scattered shard, so the
peak covers activations plus the gradients that exist at that moment (zero_grad frees them before
each forward, so they are not all alive at the activation peak). With FSDP the
gathered (unsharded) parameters in use are added: the root module (kept gathered through forward
and backward by default) plus two blocks (the current one and the prefetched next one).

Not modelled: allocator caching and fragmentation, communication buffers, CUDA context and
kernel workspaces, compile (which usually lowers activation memory), float8 casts.
"""

from __future__ import annotations

import copy
import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from titan.config.job_config import JobConfig
from titan.errors import TitanError
from titan.parallel.ac import apply_ac
from titan.parallel.dims import ParallelDims
from titan.parallel.fsdp import DTYPES

__all__ = ["MemoryEstimate", "LiveBytes", "estimate_memory"]

_FP32 = 4
_ADAM_STATES = 2


class LiveBytes(TorchDispatchMode):
    """Tracks the bytes of storages created by ops while active: current and peak."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.current -= nbytes

    def ignore(self, tensors) -> None:  # noqa: ANN001
        """Storages that exist before tracking (parameters, inputs): ops that return views of them
        (F.linear's weight.t(), slices) allocate nothing, so they must not be counted."""
        for t in tensors:
            self._seen.add(id(t.untyped_storage()))

    def track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._seen:
            return
        nbytes = storage.nbytes()
        self._seen.add(key)
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key, nbytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out


@dataclass
class MemoryEstimate:
    world_size: int
    dp_shard: int
    params: int
    """Parameters held by this rank (after sharding)."""
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    gathered_param_bytes: float
    activation_bytes: float
    """Peak of activations + transients + the gradients accumulated so far, in forward/backward
    (fake-tensor measurement); grad_bytes is the part of it reached by the end of backward."""

    @property
    def total_bytes(self) -> float:
        return self.param_bytes + self.optimizer_bytes + self.gathered_param_bytes + self.activation_bytes

    def rows(self) -> list[tuple[str, float | None]]:
        return [
            ("parameters (fp32, sharded)", self.param_bytes),
            ("optimizer states (AdamW, 2 x fp32)", self.optimizer_bytes),
            ("gathered parameters (FSDP)", self.gathered_param_bytes),
            ("activations + gradients so far (peak)", self.activation_bytes),
            ("  of which gradients after backward (fp32, sharded)", self.grad_bytes),
            ("total", self.total_bytes),
        ]


def _shard_numel(p: torch.Tensor, shards: int) -> int:
    if p.dim() == 0 or shards == 1:
        return p.numel()
    rows = math.ceil(p.shape[0] / shards)
    return rows * (p.numel() // p.shape[0])


def _module_numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters(recurse=False))


def _fake_peak_bytes(model_cls: type, model_args, config: JobConfig, dtype: torch.dtype, shards: int) -> int:
    """Peak live bytes of forward + loss + backward on fake tensors, grads kept at sharded size."""
    from titan.loss import cross_entropy_sum

    t = config.training
    ac = config.activation_checkpoint
    previous = torch.get_default_dtype()
    with FakeTensorMode():
        # Parameters built in the compute dtype (fake tensors cannot be swapped by .to()).
        torch.set_default_dtype(dtype)
        try:
            model = model_cls(copy.deepcopy(model_args))
        finally:
            torch.set_default_dtype(previous)
        apply_ac(model, ac.mode, ac.selective_ac_option)
        sharded_grads = []

        def shard_grad(p: torch.Tensor) -> None:
            p.grad = None
            sharded_grads.append(torch.empty(_shard_numel(p, shards), dtype=torch.float32))

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(shard_grad)
        tokens = torch.randint(0, model_args.vocab_size, (t.local_batch_size, t.seq_len + 1))
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        tracker = LiveBytes()
        tracker.ignore([*model.parameters(), *model.buffers(), tokens])
        with tracker:
            loss = cross_entropy_sum(model(inputs), labels)
            loss.backward()
        return tracker.peak


def estimate_memory(config: JobConfig, world_size: int) -> MemoryEstimate:
    """Bytes per rank for training `config` on `world_size` ranks (FSDP / HSDP / DDP layouts)."""
    from titan.data import build_tokenizer
    from titan.models import get_model_spec, model_args_from_config

    par = config.parallelism
    dims = ParallelDims(
        dp_replicate=par.data_parallel_replicate_degree, dp_shard=par.data_parallel_shard_degree,
        cp=1, tp=1, pp=1, world_size=world_size,
    )
    spec = get_model_spec(config.model.name)
    args = model_args_from_config(spec, config.model)
    try:  # the trainer sizes the vocabulary from the tokenizer
        args.vocab_size = build_tokenizer(config.model.tokenizer_path).vocab_size
    except (TitanError, OSError):  # tokenizer file not on this machine: the flavor's vocabulary
        pass
    args.max_seq_len = config.training.seq_len
    args.attn_type = config.model.attn_type
    with torch.device("meta"):
        model = spec.model_cls(args)

    shards = dims.dp_shard if dims.fsdp_enabled else 1
    local = sum(_shard_numel(p, shards) for p in model.parameters())
    param_dtype = DTYPES[config.training.mixed_precision_param]
    elt = torch.finfo(param_dtype).bits // 8
    gathered = 0.0
    if dims.fsdp_enabled:
        root = sum(_module_numel(m) for n, m in model.named_modules() if not n.startswith("layers"))
        block = max(sum(p.numel() for p in b.parameters()) for b in model.layers.values())
        gathered = float((root + min(2, len(model.layers)) * block) * elt)
    # Activations in the compute dtype (FSDP's param_dtype; autocast without FSDP is approximated
    # by running the whole model in that dtype).
    activations = _fake_peak_bytes(spec.model_cls, args, config, param_dtype, shards)
    return MemoryEstimate(
        world_size=world_size,
        dp_shard=shards,
        params=local,
        param_bytes=float(local * _FP32),
        grad_bytes=float(local * _FP32),
        optimizer_bytes=float(local * _FP32 * _ADAM_STATES),
        gathered_param_bytes=gathered,
        activation_bytes=float(activations),
    )
