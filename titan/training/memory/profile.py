"""One micro-batch through the model, whole (no parallelism), on fake tensors: what each piece of the
step keeps and adds, by where it was made.

The model is built with one block of each kind the rank holds (``keep``), in the trainer's
precision and with its activation checkpointing, loss and float8 conversion, and runs one forward,
loss and backward on fake tensors (shapes, no values, no memory) at the rank's tokens per
micro-batch. A dispatch mode follows every storage an op creates until torch frees it and labels
it by the module that made it (``LABELS``). The step is cut into windows, each opened and closed by
hooks: the embedding; each block's forward (its pre-forward hook to its forward hook); the head
(final norm, output projection and loss, forward and backward, until the gradient reaches the last
block's output); each block's backward (the gradient reaching its output to the gradient reaching
its input, the recompute of a checkpointed block included); the tail (the embedding's backward).
For each window the profile keeps what it leaves live at its end and its highest moment, both as
bytes by label above what was live when it opened. Windows add up: the rank's step is the same
windows in the rank's block order (titan/training/memory/timeline.py).

A parameter's gradient lives until its block's backward window ends (FSDP then reduce-scatters it
and frees the unsharded gradient); the embedding's, final norm's and output's until the backward
ends (the root unit's reduce-scatter comes last).
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from titan.config.job_config import JobConfig
from titan.parallel.ac import apply_ac
from titan.parallel.fake_world import fake_world
from titan.parallel.float8 import convert_to_float8
from titan.parallel.fsdp import DTYPES
from titan.parallel.utils import blocks_of

__all__ = ["LABELS", "Profile", "Window", "profile_step"]

LABELS = (
    *("block", "gathered", "rowwise", "whole", "router", "moe", "experts", "routed_out"),
    *("grads", "root_grads", "embed", "loss"),
)
"""Where a storage was made: ``block`` (a block's own work: attention, dense FFN, shared expert,
residuals), ``gathered`` (a sub-layer's normed input: the tensor tensor parallelism all-gathers
over the sequence), ``rowwise`` (what the output projections of attention and feed-forward make:
under TP a partial sum over the whole sequence, reduce-scattered after), ``whole`` (modules TP
runs whole on every rank, ``whole`` of profile_step), ``router`` / ``moe`` /
``experts`` (an MoE layer's router, its routing glue and its routed experts), ``routed_out`` (the
routed experts' output: under EP what the combining all-to-all returns), ``grads`` /
``root_grads`` (unsharded gradients of a block's parameters, and of the embedding, final norm and
output), ``embed`` (the embedding's output and backward), ``loss`` (output projection and loss)."""

_BY_NAME = {
    "attention_norm": "gathered",
    "ffn_norm": "gathered",
    "router": "router",
    "experts": "experts",
    "wo": "rowwise",
    "w2": "rowwise",
}


def _zero() -> dict[str, int]:
    return dict.fromkeys(LABELS, 0)


@dataclass
class Window:
    """A piece of the step: ``kept`` (bytes by label it leaves live at its end, above what was live
    when it opened; negative where it frees what earlier windows made) and ``peak`` (the same at its
    highest moment)."""

    kept: dict[str, int] = field(default_factory=_zero)
    peak: dict[str, int] = field(default_factory=_zero)


@dataclass
class Profile:
    tokens: int  # tokens of the micro-batch measured
    embed: Window
    forward: dict[int, Window]  # layer id -> its block's forward
    head: Window
    backward: dict[int, Window]  # layer id -> its block's backward
    tail: Window
    grad_bytes: dict[int, int]  # layer id -> bytes of its parameters' gradients (unsharded, as measured)
    root_grad_bytes: int


class _Tracker(TorchDispatchMode):
    """Live bytes by label, and the open window's highest moment."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = _zero()
        self.labels: list[str] = ["embed"]
        self._entries: dict[int, list] = {}
        self._start: dict[str, int] = _zero()
        self._peak_total = -1
        self._peak: dict[str, int] = _zero()

    # ------------------------------------------------------------ windows
    def open(self) -> None:
        self._start = dict(self.bytes)
        self._peak_total, self._peak = 0, _zero()

    def close(self) -> Window:
        kept = {k: self.bytes[k] - self._start[k] for k in LABELS}
        return Window(kept, dict(self._peak))

    def _update(self) -> None:
        delta = {k: self.bytes[k] - self._start[k] for k in LABELS}
        total = sum(delta.values())
        if total > self._peak_total:
            self._peak_total, self._peak = total, delta

    # ------------------------------------------------------------ storages
    def add(self, t: torch.Tensor, label: str) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._entries:
            return
        nbytes = storage.nbytes()
        self._entries[key] = [nbytes, label]
        self.bytes[label] += nbytes
        weakref.finalize(storage, self._free, key)
        self._update()

    def _free(self, key: int) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.bytes[entry[1]] -= entry[0]

    def relabel(self, t: torch.Tensor, label: str) -> None:
        entry = self._entries.get(id(t.untyped_storage()))
        if entry is not None and entry[1] != label:
            self.bytes[entry[1]] -= entry[0]
            self.bytes[label] += entry[0]
            entry[1] = label

    def base(self, label: str) -> None:
        """The label of storages made outside every labelled module from now on."""
        self.labels[0] = label

    def ignore(self, tensors: Sequence[torch.Tensor]) -> None:
        """Storages that exist before the step (parameters, inputs): views of them allocate nothing."""
        for t in tensors:
            self._entries[id(t.untyped_storage())] = [0, "embed"]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor turns it into ops on local tensors, which come back here
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.add(t, self.labels[-1])
        return out


def _label_modules(model: nn.Module, tracker: _Tracker, whole: set[str]) -> None:
    """Storages made inside a module get its label; a sub-layer's norm output is ``gathered``. The
    label is pushed and popped around the module's forward itself, not by hooks: a checkpointed
    block's recompute stops early (an exception out of the forward) once it has what backward needs."""

    def labelled(module: nn.Module, label: str) -> None:
        forward = module.forward

        def run(*args: Any, **kwargs: Any) -> Any:
            tracker.labels.append(label)
            try:
                return forward(*args, **kwargs)
            finally:
                tracker.labels.pop()

        module.forward = run  # pyright: ignore[reportAttributeAccessIssue]

    def relabel(label: str) -> Callable:
        def hook(m: nn.Module, args: Any, out: Any) -> None:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    tracker.relabel(t, label)

        return hook

    gathered = relabel("gathered")

    for block in blocks_of(model).values():
        for name, module in block.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            label = _BY_NAME.get(leaf)
            if label is None and name.replace("_checkpoint_wrapped_module.", "") in whole:
                label = "whole"
            if label == "gathered":
                module.register_forward_hook(gathered)
            elif label == "rowwise":  # its output only: what it makes inside is sharded like its weight
                if isinstance(module, nn.Linear):
                    module.register_forward_hook(relabel("rowwise"))
            elif label is not None or leaf in ("moe", "shared_experts"):
                labelled(module, label or ("moe" if leaf == "moe" else "block"))
            if label == "experts":
                module.register_forward_hook(relabel("routed_out"))
        labelled(block, "block")
    norm = getattr(model, "norm", None)
    if norm is not None:
        norm.register_forward_hook(gathered)


class _Windows:
    """Opens and closes the windows with hooks on the blocks, the head and the embedding output."""

    def __init__(self, model: nn.Module, tracker: _Tracker) -> None:
        self.tracker = tracker
        self.forward: dict[int, Window] = {}
        self.backward: dict[int, Window] = {}
        self.embed = self.head = self.tail = Window()
        self.pending: dict[int, list[torch.Tensor]] = defaultdict(list)  # gradients to drop at a window's end
        self._block: int | None = None
        ids = [int(i) for i in blocks_of(model).keys()]
        self.first, self.last = ids[0], ids[-1]
        for i, block in zip(ids, blocks_of(model).values()):
            block.register_forward_pre_hook(self._pre(i))
            block.register_forward_hook(self._post(i))
            for p in block.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._grad(i))
        for p in model.parameters():
            if p.requires_grad and not hasattr(p, "_titan_block_grad"):
                p.register_post_accumulate_grad_hook(self._grad(-1))

    def _grad(self, i: int) -> Callable:
        label = "root_grads" if i == -1 else "grads"

        def hook(p: torch.Tensor) -> None:
            assert p.grad is not None
            self.tracker.add(p.grad, label)
            self.tracker.relabel(p.grad, label)
            self.pending[i].append(p)

        return hook

    def _drop(self, i: int) -> None:
        for p in self.pending.pop(i, []):
            p.grad = None

    def _pre(self, i: int) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            if i == self.first:
                self.embed = self.tracker.close()
                self.tracker.base("block")
            self.tracker.open()
            x = args[0]
            x.register_hook(self._backward_end(i))

        return hook

    def _post(self, i: int) -> Callable:
        def hook(module: nn.Module, args: tuple, out: Any) -> None:
            self.forward[i] = self.tracker.close()
            self.tracker.open()  # the next block's forward, or the head
            if i == self.last:  # the gradient reaching the last block's output ends the head
                first = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)][0]
                first.register_hook(self._head_end)

        return hook

    def _head_end(self, grad: torch.Tensor) -> None:
        self.head = self.tracker.close()
        self.tracker.open()
        self.tracker.base("block")

    def _backward_end(self, i: int) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            # The block's own gradients go when its FSDP unit reduce-scatters them (after this hook,
            # which sees the gradient its backward hands on, so at the window's end).
            self._drop(i)
            self.backward[i] = self.tracker.close()
            self.tracker.open()  # the previous block's backward, or the tail
            if i == self.first:
                self.tracker.base("embed")

        return hook

    def finish(self) -> None:
        self._drop(-1)
        self.tail = self.tracker.close()


def _loss_region(tracker: _Tracker) -> Callable:
    """``loss`` from the output projection's forward until the gradient reaches its input (the
    simulator's loss region, titan/tools/simulate/attach.py)."""

    def end(grad: torch.Tensor) -> None:
        tracker.base("block")

    def start(module: nn.Module, args: tuple) -> None:
        tracker.base("loss")
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.requires_grad:
            x.register_hook(end)

    return start


def _fake_model(model_cls: type, model_args: Any, config: JobConfig, fsdp: bool, keep: Sequence[int]) -> nn.Module:
    """The model with blocks ``keep`` only (layer ids kept), in the dtype the trainer computes in."""
    from titan.training.build import hand_over_hidden

    t = config.training
    previous = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[t.mixed_precision_param] if fsdp else torch.float32)
    try:
        model = model_cls(copy.deepcopy(model_args))
    finally:
        torch.set_default_dtype(previous)
    kept = {str(i) for i in keep}
    blocks = blocks_of(model)
    for name in [n for n in blocks.keys() if n not in kept]:
        del blocks[name]
    hand_over_hidden(model, t.loss_chunk_tokens > 0, config.model.name)
    if config.float8.enable_float8_linear:
        # Weights cast in each forward (FSDP's float8 all-gather, where on, hands them over cast:
        # the layout counts them gathered in fp8, here the casts are a transient of the block).
        off = {"enable_fsdp_float8_all_gather": False, "precompute_float8_dynamic_scale_for_fsdp": False}
        convert_to_float8(model, replace(config.float8, **off), fsdp_enabled=False)
    apply_ac(model, config.activation_checkpoint, compiled=False)
    return model


def _vocab_sharded(output: nn.Module, mesh: DeviceMesh) -> contextlib.AbstractContextManager:
    """The logits as a vocabulary-sharded DTensor on a 1-rank mesh, the loss under loss_parallel:
    the allocations of TP's loss parallel at the whole vocabulary (the layout divides them by TP)."""

    def hook(m: nn.Module, args: Any, out: torch.Tensor) -> DTensor:
        return DTensor.from_local(out, mesh, [Shard(out.ndim - 1)], run_check=False)

    output.register_forward_hook(hook)
    return loss_parallel()


def profile_step(
    model_cls: type,
    model_args: Any,
    config: JobConfig,
    *,
    fsdp: bool,
    keep: Sequence[int],
    batch: int,
    seq: int,
    loss_parallel: bool = False,
    whole: set[str] | None = None,
) -> Profile:
    """Windows of one micro-batch of ``batch`` x ``seq`` tokens through blocks ``keep``;
    ``loss_parallel``: the loss as TP's loss parallel computes it (in a 1-rank fake world);
    ``whole``: names of modules inside a block that TP runs whole (labelled ``whole``)."""
    with fake_world(0, 1) if loss_parallel else contextlib.nullcontext():
        return _profile(model_cls, model_args, config, fsdp, keep, batch, seq, loss_parallel, whole or set())


def _profile(  # noqa: PLR0913 - profile_step's arguments
    model_cls: type,
    model_args: Any,
    config: JobConfig,
    fsdp: bool,
    keep: Sequence[int],
    batch: int,
    seq: int,
    vocab_sharded: bool,
    whole: set[str],
) -> Profile:
    from titan.training.loss import TokenLoss

    t = config.training
    compute = DTYPES[t.mixed_precision_param]
    autocast = not fsdp and compute != torch.float32
    # torch's flex_attention has no CPU backward: sdpa keeps the same per-block tensors.
    args = replace(model_args, attn_type="sdpa") if getattr(model_args, "attn_type", "") == "flex" else model_args
    mesh = init_device_mesh("cpu", (1,)) if vocab_sharded else None
    with FakeTensorMode():
        model = _fake_model(model_cls, args, config, fsdp, keep)
        for block in blocks_of(model).values():
            for p in block.parameters():
                p._titan_block_grad = True  # pyright: ignore[reportAttributeAccessIssue]
        loss_fn = TokenLoss(t.loss_chunk_tokens)
        loss_fn.bind([model])
        tokens = torch.randint(0, args.vocab_size, (batch, seq))
        docs = (
            {"doc_ids": torch.zeros_like(tokens, dtype=torch.int32)}
            if getattr(args, "attn_mask_type", "causal") == "block_causal"
            else {}
        )
        tracker = _Tracker()
        tracker.ignore([*model.parameters(), *model.buffers(), tokens, *docs.values()])
        _label_modules(model, tracker, whole)
        windows = _Windows(model, tracker)
        output = getattr(model, "output", None)
        context: contextlib.AbstractContextManager = contextlib.nullcontext()
        if output is not None:  # the loss label from the output projection on
            output.register_forward_pre_hook(_loss_region(tracker))
            if mesh is not None:
                context = _vocab_sharded(output, mesh)
        with tracker, context:
            tracker.open()
            with torch.autocast("cpu", dtype=compute, enabled=autocast):
                loss = loss_fn(model(tokens, **docs), tokens, torch.ones(()))
            loss.backward()
            windows.finish()
    grads = {
        int(i): sum(p.numel() * p.element_size() for p in b.parameters() if p.requires_grad)
        for i, b in blocks_of(model).items()
    }
    root = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) - sum(grads.values())
    return Profile(
        batch * seq, windows.embed, windows.forward, windows.head, windows.backward, windows.tail, grads, root
    )
