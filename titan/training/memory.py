"""Per-rank training memory estimate, without materializing the model.

Static state is counted from the meta model's shapes: fp32 parameters, gradients and AdamW's two
moments, each split over the FSDP shard group (dim-0 sharding, padded like FSDP2). The dynamic
part is measured: one forward + loss + backward of the real model code (activation checkpointing
applied as configured; the loss as configured: the full logits, or the output projection + cross
entropy by training.loss_chunk_tokens chunks; the vocabulary rows of model.vocab_size, else the
tokenizer's) runs on fake tensors at the per-rank micro-batch, in the trainer's
precision (FSDP: parameters in its param dtype; one rank / DDP: fp32 parameters under autocast,
whose bf16 weight copies and fp32 residual stream are then part of the measurement), and a
dispatch mode tracks the bytes of every live tensor storage. Each parameter gradient is swapped
for one of its sharded size as soon as it is accumulated, as FSDP2 keeps only the
reduce-scattered shard, so the peak covers activations plus the gradients that exist at that
moment (zero_grad frees them before each forward). With FSDP the gathered (unsharded)
parameters in use are added: the root module (kept gathered through forward and backward by
default) plus two blocks (the current one and the prefetched next one).

The optimizer step is the other candidate for the peak: all gradients and states plus the
step's temporaries (foreach AdamW's sqrt of a whole param group). The total is parameters and
states plus the larger of the two phases.

Layouts: FSDP / HSDP / DDP; tensor, pipeline and context parallel layouts are refused (the dry
run gives their exact per-rank parameter memory). Not modelled: allocator caching and
fragmentation (compare with max_memory_allocated, not reserved), communication buffers, CUDA
context and kernel workspaces, compile (which usually lowers activation memory), float8 casts.
activation_checkpoint.mode = memory_budget is counted between the full and the uncheckpointed peaks.
"""

from __future__ import annotations

import copy
import math
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from titan.checkpointing.snapshot_budget import snapshot_host_bytes
from titan.config.job_config import JobConfig
from titan.errors import TitanError
from titan.parallel.ac import apply_ac
from titan.parallel.dims import ParallelDims
from titan.parallel.fsdp import DTYPES

__all__ = ["MemoryEstimate", "LiveBytes", "estimate_memory", "measure_peak"]

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

    def ignore(self, tensors: Iterable[torch.Tensor]) -> None:
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

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
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
    optimizer_step_bytes: float = 0.0
    """Temporaries of the optimizer step (beside gradients and states)."""
    optimizer_states: str = "AdamW, 2 x fp32"
    """What optimizer_bytes holds, for the table."""

    @property
    def forward_backward_bytes(self) -> float:
        """Above parameters and states during forward/backward: gathered params + activations."""
        return self.gathered_param_bytes + self.activation_bytes

    @property
    def step_bytes(self) -> float:
        """Above parameters and states during the optimizer step: gradients + its temporaries."""
        return self.grad_bytes + self.optimizer_step_bytes

    @property
    def step_extra_bytes(self) -> float:
        """What the optimizer step adds when its peak is above forward/backward's (else 0)."""
        return max(0.0, self.step_bytes - self.forward_backward_bytes)

    @property
    def total_bytes(self) -> float:
        """Peak: parameters and states always; the larger of the two phases on top."""
        return self.param_bytes + self.optimizer_bytes + self.forward_backward_bytes + self.step_extra_bytes

    @property
    def peak_phase(self) -> str:
        return "optimizer step" if self.step_extra_bytes > 0 else "forward/backward"

    def rows(self) -> list[tuple[str, float | None]]:
        return [
            ("parameters (fp32, sharded)", self.param_bytes),
            (f"optimizer states ({self.optimizer_states})", self.optimizer_bytes),
            ("gathered parameters (FSDP)", self.gathered_param_bytes),
            ("activations + gradients so far (peak)", self.activation_bytes),
            ("  of which gradients after backward (fp32, sharded)", self.grad_bytes),
            ("optimizer step temporaries", self.optimizer_step_bytes),
            ("optimizer step above the forward/backward peak", self.step_extra_bytes),
            (f"total (peak in {self.peak_phase})", self.total_bytes),
            ("host, not in total: memory snapshots", snapshot_host_bytes(self.param_bytes + self.optimizer_bytes)),
        ]


def _shard_numel(p: torch.Tensor, shards: int) -> int:
    if p.dim() == 0 or shards == 1:
        return p.numel()
    rows = math.ceil(p.shape[0] / shards)
    return rows * (p.numel() // p.shape[0])


def _module_numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters(recurse=False))


def _fake_forward_backward_peak(model_cls: type, model_args, config: JobConfig, shards: int, fsdp: bool) -> int:
    """Peak live bytes of forward + loss + backward on fake tensors, as the trainer runs them.

    With FSDP the model computes in FSDP's param dtype (the gathered copies; gradients are
    reduce-scattered to fp32 shards). Without FSDP the parameters stay fp32 and the trainer runs
    the forward under autocast: the bf16 copies of the weights, the fp32 residual stream and norm
    outputs, and the casts saved for backward all exist there too, so the fake run does the same.
    """
    from titan.models.mtp import mtp_labels
    from titan.training.build import hand_over_hidden
    from titan.training.loss import IGNORE_INDEX, token_loss

    t = config.training
    ac = config.activation_checkpoint
    compute = DTYPES[t.mixed_precision_param]
    build_dtype = compute if fsdp else torch.float32
    autocast = not fsdp and compute != torch.float32
    previous = torch.get_default_dtype()
    with FakeTensorMode():
        # Parameters built in their dtype (fake tensors cannot be swapped by .to()).
        torch.set_default_dtype(build_dtype)
        try:
            model = model_cls(copy.deepcopy(model_args))
        finally:
            torch.set_default_dtype(previous)
        # The trainer's loss: the full logits, or the output projection + loss by chunks.
        hand_over_hidden(model, t.loss_chunk_tokens > 0, getattr(config.model, "name", ""))
        loss_fn = token_loss(config, model_args)  # with the MTP depths' rows, as the trainer's
        loss_fn.bind([model])
        # Activation checkpointing as the trainer applies it (each mode's recomputation is measured).
        apply_ac(model, ac.mode, ac.selective_ac_option)
        sharded_grads = []

        def shard_grad(p: torch.Tensor) -> None:
            p.grad = None
            sharded_grads.append(torch.empty(_shard_numel(p, shards), dtype=torch.float32))

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(shard_grad)
        tokens = torch.randint(0, model_args.vocab_size, (t.local_batch_size, t.seq_len + 1))
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        # block_causal: one document per row (the trainer's document ids are as large whatever they hold)
        docs = (
            {"doc_ids": torch.zeros_like(inputs, dtype=torch.int32)}
            if getattr(model_args, "attn_mask_type", "causal") == "block_causal"
            else {}
        )
        if loss_fn.mtp_depth:
            labels = mtp_labels(labels, loss_fn.mtp_depth, IGNORE_INDEX, docs.get("doc_ids"))
        tracker = LiveBytes()
        tracker.ignore([*model.parameters(), *model.buffers(), tokens, labels, *docs.values()])
        with tracker:
            # The trainer's order (titan.training.forward): forward and loss under autocast (the
            # chunked loss runs each chunk's backward in it), the model's backward after.
            with torch.autocast("cpu", dtype=compute, enabled=autocast):
                loss = loss_fn(model(inputs, **docs), labels, torch.ones(()))
            loss.backward()
        return tracker.peak


def _optimizer_step_bytes(model: nn.Module, shards: int, config: JobConfig) -> int:
    """Temporaries of one optimizer step on top of parameters, gradients and states (fp32 shards).

    AdamW, foreach: torch._foreach_sqrt(exp_avg_sqs) makes one fp32 copy of a whole param group
    (groups step one after another); for-loop: exp_avg_sq.sqrt() / bias_correction holds two
    copies of the largest parameter at once; fused: none (one kernel updates in place). Muon: its
    step's buffers as titan.training.muon.muon_memory plans them (the pieces sent, the matrices
    owned, stacks and Newton-Schulz buffers, bounded by the shard); its AdamW part steps after it.
    """
    from titan.training.muon import muon_memory, split_muon_params
    from titan.training.optim import param_groups, resolve_implementation

    params = [p for p in model.parameters() if p.requires_grad]
    muon = 0
    if config.optimizer.name.lower() == "muon":
        muon = muon_memory(model, shards, config.optimizer.ns_steps, config.optimizer.muon_router_gate)["optimizer_aux"]
        params = split_muon_params(model, config.optimizer.muon_router_gate)[1]
    if not params:
        return muon
    impl = resolve_implementation(config.optimizer)
    if impl == "fused":
        return muon
    if impl == "for-loop":
        return max(muon, 2 * _FP32 * max(_shard_numel(p, shards) for p in params))
    groups = param_groups(model, config.optimizer.weight_decay_exclude, params)
    return max(muon, _FP32 * max(sum(_shard_numel(p, shards) for p in g["params"]) for g in groups))


def _optimizer_states(model: nn.Module, shards: int, config: JobConfig) -> tuple[int, str]:
    """(state bytes per rank, description): AdamW / Adam keep two fp32 moments per element; Muon one
    momentum buffer per matrix element and AdamW's two for the rest (titan.training.muon.muon_memory)."""
    from titan.training.muon import muon_memory

    if config.optimizer.name.lower() != "muon":
        local = sum(_shard_numel(p, shards) for p in model.parameters())
        return local * _FP32 * _ADAM_STATES, "AdamW, 2 x fp32"
    state = muon_memory(model, shards, config.optimizer.ns_steps, config.optimizer.muon_router_gate)["optimizer_state"]
    return state, "Muon 1 x fp32 on matrices, AdamW 2 x fp32 on the rest"


def _check_supported(config: JobConfig) -> None:
    """The formulas cover FSDP / HSDP / DDP with AdamW or Adam in fp32 states: refuse the rest."""
    par = config.parallelism
    for key, value in (
        ("tensor_parallel_degree", par.tensor_parallel_degree),
        ("pipeline_parallel_degree", par.pipeline_parallel_degree),
        ("context_parallel_degree", par.context_parallel_degree),
    ):
        if value != 1:
            raise TitanError(
                f"the memory estimator models FSDP / HSDP / DDP layouts only, not parallelism.{key} {value};"
                " run the dry run (--job.dry_run --job.dry_run_world_size N) for the exact per-rank"
                " parameter and optimizer memory of TP / PP / CP layouts"
            )
    if config.optimizer.bf16_stochastic_round:
        raise TitanError(
            "the memory estimator models fp32 parameters and AdamW states, not"
            " optimizer.bf16_stochastic_round (bf16 parameters); set it to false to estimate"
        )
    for key, on in (
        ("training.enable_cpu_offload", config.training.enable_cpu_offload),
        ("optimizer.early_step_in_backward", config.optimizer.early_step_in_backward),
    ):
        if on:
            raise TitanError(
                f"the memory estimator models device-resident states with a whole-model gradient,"
                f" not {key}; set it to false to estimate"
            )


def estimate_memory(config: JobConfig, world_size: int) -> MemoryEstimate:
    """Bytes per rank for training `config` on `world_size` ranks (FSDP / HSDP / DDP layouts)."""
    from titan.data import build_tokenizer
    from titan.models import get_model_spec, model_args_from_config

    _check_supported(config)
    par = config.parallelism
    dims = ParallelDims(
        dp_replicate=par.data_parallel_replicate_degree,
        dp_shard=par.data_parallel_shard_degree,
        cp=1,
        tp=1,
        pp=1,
        world_size=world_size,
    )
    spec = get_model_spec(config.model.name)
    args = model_args_from_config(spec, config.model)
    if config.model.vocab_size is not None:  # the rows asked for (the trainer checks them against the tokenizer)
        args.vocab_size = config.model.vocab_size
    else:
        try:  # the trainer sizes the vocabulary from the tokenizer
            args.vocab_size = build_tokenizer(config.model.tokenizer_path).vocab_size
        except (TitanError, OSError):  # tokenizer file not on this machine: the flavor's vocabulary
            pass
    args.max_seq_len = config.training.seq_len
    args.attn_type = config.model.attn_type
    args.attn_mask_type = config.model.attn_mask_type
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
    # torch's flex_attention has no CPU backward: its activations are measured with sdpa's, which keep
    # the same per-block tensors (the block mask is built once per batch, outside the blocks).
    fake_args = replace(args, attn_type="sdpa") if args.attn_type == "flex" else args
    ac = config.activation_checkpoint
    if ac.mode == "memory_budget":
        # compile's partitioner keeps memory_budget of the way from recomputing everything (about full
        # checkpointing's peak) to its default choice (at most the uncheckpointed peak): interpolate.
        full, none = (
            _fake_forward_backward_peak(
                spec.model_cls,
                fake_args,
                replace(config, activation_checkpoint=replace(ac, mode=m)),
                shards,
                dims.fsdp_enabled,
            )
            for m in ("full", "none")
        )
        activations = full + ac.memory_budget * (none - full)
    else:
        activations = _fake_forward_backward_peak(spec.model_cls, fake_args, config, shards, dims.fsdp_enabled)
    states, states_label = _optimizer_states(model, shards, config)
    return MemoryEstimate(
        world_size=world_size,
        dp_shard=shards,
        params=local,
        param_bytes=float(local * _FP32),
        grad_bytes=float(local * _FP32),
        optimizer_bytes=float(states),
        optimizer_states=states_label,
        gathered_param_bytes=gathered,
        activation_bytes=float(activations),
        optimizer_step_bytes=float(_optimizer_step_bytes(model, shards, config)),
    )


def measure_peak(trainer, steps: int) -> tuple[float, str]:  # titan.training.trainer.Trainer
    """Peak bytes of `steps` real training steps of `trainer` (one rank) on random tokens, and
    what was measured: on CUDA the allocator's max_memory_allocated (everything the process
    allocated, parameters included); elsewhere the parameters and buffers plus the peak of every
    storage allocated during the steps (LiveBytes), the same quantity without an allocator."""
    t = trainer.config.training
    vocab = trainer.model_parts[0].tok_embeddings.num_embeddings
    parts = trainer.model_parts
    held = [*(p for m in parts for p in m.parameters()), *(b for m in parts for b in m.buffers())]
    gen = torch.Generator().manual_seed(0)

    def run() -> None:
        for _ in range(steps):
            batch = []
            for _ in range(trainer.grad_accum_steps):
                tokens = torch.randint(0, vocab, (t.local_batch_size, t.seq_len + 1), generator=gen).to(trainer.device)
                batch.append((tokens[:, :-1], tokens[:, 1:]))
            trainer.train_step(batch)

    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        return float(torch.cuda.max_memory_allocated()), "CUDA max_memory_allocated"
    tracker = LiveBytes()
    tracker.ignore(held)
    with tracker:
        run()
    base = sum(x.untyped_storage().nbytes() for x in {id(x.untyped_storage()): x for x in held}.values())
    return float(base + tracker.peak), "parameters + peak of the storages allocated in the steps"
