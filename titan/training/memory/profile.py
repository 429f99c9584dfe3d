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
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils._pytree import tree_flatten

from titan.config.job_config import JobConfig
from titan.parallel.ac import apply_ac
from titan.parallel.fake_world import fake_world
from titan.parallel.float8 import convert_to_float8
from titan.parallel.fsdp import DTYPES
from titan.parallel.utils import blocks_of
from titan.training.memory.attention import cuda_attention
from titan.training.memory.tracker import LABELS, Tracker, Window

__all__ = ["LABELS", "Profile", "Weights", "Window", "profile_step"]

Weights = Callable[[int | None], dict[str, float]]
"""A window's label weights by its block (None: embedding, head, tail; titan/training/memory/labels.py)."""

_BY_NAME = {
    "attention_norm": "gathered",
    "ffn_norm": "gathered",
    "router": "router",
    "experts": "experts",
    "wo": "rowwise",
    "w2": "rowwise",
}


@dataclass
class Profile:
    tokens: int  # tokens of the micro-batch measured
    embed: Window
    forward: dict[int, Window]  # layer id -> its block's forward
    head: Window
    backward: dict[int, Window]  # layer id -> its block's backward
    tail: Window


def _label_modules(model: nn.Module, tracker: Tracker, whole: set[str]) -> None:
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

    def gathered(m: nn.Module, args: Any, out: Any) -> None:
        """A sub-layer's normed input, and the gradient backward hands it (under TP, before that
        gradient's reduce-scatter: a partial sum over the whole sequence)."""
        relabel("gathered")(m, args, out)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g: tracker.relabel(g, "gathered"))

    def reads_gathered(linear: nn.Module) -> None:
        """Under TP a column-wise layer reads the gathered input: float8's casts of it are whole."""
        forward = linear.forward

        def run(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            saved = tracker.set_whole([x] if tracker.label_of(x) == "gathered" else [])
            try:
                return forward(x, *args, **kwargs)
            finally:
                tracker.whole = saved

        linear.forward = run  # pyright: ignore[reportAttributeAccessIssue]

    def whole_gradient(linear: nn.Module) -> None:
        """Under TP a row-wise layer's output gradient comes all-gathered over the sequence (the
        backward of its reduce-scatter): float8's casts of it in its backward are whole."""

        def pre(m: nn.Module, grad_out: Any) -> None:
            g = grad_out[0]
            tracker.set_whole([g] if isinstance(g, torch.Tensor) else [])

        def post(m: nn.Module, grad_in: Any, grad_out: Any) -> None:
            tracker.set_whole([])

        linear.register_full_backward_pre_hook(pre)
        linear.register_full_backward_hook(post)

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
                    whole_gradient(module)
            elif isinstance(module, nn.Linear):
                reads_gathered(module)
            elif label is not None or leaf in ("moe", "shared_experts"):
                labelled(module, label or ("moe" if leaf == "moe" else "block"))
            if label == "experts":
                module.register_forward_hook(relabel("routed_out"))
        labelled(block, "block")
    norm = getattr(model, "norm", None)
    if norm is not None:  # the output projection's input (its gradient is the loss region's)
        norm.register_forward_hook(relabel("gathered"))


class _Windows:
    """Opens and closes the windows with hooks on the blocks, the head and the embedding output."""

    def __init__(self, model: nn.Module, tracker: Tracker, weights: Weights) -> None:
        self.tracker, self.weights = tracker, weights
        self.forward: dict[int, Window] = {}
        self.backward: dict[int, Window] = {}
        self.embed = self.head = self.tail = Window()
        self.pending: dict[int, list[torch.Tensor]] = defaultdict(list)  # gradients to drop at a window's end
        ids = [int(i) for i in blocks_of(model).keys()]
        self.first, self.last = ids[0], ids[-1]
        self._next = dict(zip(ids, ids[1:]))
        self._previous = dict(zip(ids[1:], ids))
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
            if self.tracker.labels[0] == "loss":  # the output projection's, made in the loss region
                self.tracker.add(p.grad, "loss")
            else:
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
            self.tracker.open(self.weights(i))
            x = args[0]
            x.register_hook(self._backward_end(i))

        return hook

    def _post(self, i: int) -> Callable:
        def hook(module: nn.Module, args: tuple, out: Any) -> None:
            self.forward[i] = self.tracker.close()
            self.tracker.open(self.weights(self._next.get(i)))  # the next block's forward, or the head
            if i == self.last:  # the gradient reaching the last block's output ends the head
                first = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)][0]
                first.register_hook(self._head_end)

        return hook

    def _head_end(self, grad: torch.Tensor) -> None:
        self.head = self.tracker.close()
        self.tracker.open(self.weights(self.last))
        self.tracker.base("block")

    def _backward_end(self, i: int) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            # The block's own gradients go when its FSDP unit reduce-scatters them (after this hook,
            # which sees the gradient its backward hands on, so at the window's end).
            self._drop(i)
            self.backward[i] = self.tracker.close()
            self.tracker.open(self.weights(self._previous.get(i)))  # the previous block's backward, or the tail
            if i == self.first:  # the embedding's backward: its weight's gradient
                self.tracker.base("root_grads")

        return hook

    def finish(self) -> None:
        self._drop(-1)
        self.tail = self.tracker.close()


def _loss_region(tracker: Tracker) -> Callable:
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
    weights: Weights | None = None,
) -> Profile:
    """Windows of one micro-batch of ``batch`` x ``seq`` tokens through blocks ``keep``;
    ``loss_parallel``: the loss as TP's loss parallel computes it (in a 1-rank fake world);
    ``whole``: names of modules inside a block that TP runs whole (labelled ``whole``)."""
    with fake_world(0, 1) if loss_parallel else contextlib.nullcontext():
        w = weights or (lambda block: dict.fromkeys(LABELS, 1.0))
        return _profile(model_cls, model_args, config, fsdp, keep, batch, seq, loss_parallel, whole or set(), w)


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
    weights: Weights,
) -> Profile:
    from titan.models.mtp import mtp_labels
    from titan.training.loss import IGNORE_INDEX, token_loss

    t = config.training
    compute = DTYPES[t.mixed_precision_param]
    autocast = not fsdp and compute != torch.float32
    # torch's flex_attention has no CPU backward: sdpa keeps the same per-block tensors.
    args = replace(model_args, attn_type="sdpa") if getattr(model_args, "attn_type", "") == "flex" else model_args
    mesh = init_device_mesh("cpu", (1,)) if vocab_sharded else None
    with FakeTensorMode():
        model = _fake_model(model_cls, args, config, fsdp, keep)
        block_params = [p for block in blocks_of(model).values() for p in block.parameters()]
        for p in block_params:
            p._titan_block_grad = True  # pyright: ignore[reportAttributeAccessIssue]
        loss_fn = token_loss(config, model_args)  # with the MTP depths' rows, as the trainer's
        loss_fn.bind([model])
        tokens = torch.randint(0, args.vocab_size, (batch, seq))
        docs = (
            {"doc_ids": torch.zeros_like(tokens, dtype=torch.int32)}
            if getattr(args, "attn_mask_type", "causal") == "block_causal"
            else {}
        )
        labels = tokens
        if loss_fn.mtp_depth:  # the MTP depths' targets, as the trainer builds them
            labels = mtp_labels(tokens, loss_fn.mtp_depth, IGNORE_INDEX, docs.get("doc_ids"))
        tracker = Tracker()
        tracker.ignore([*model.parameters(), *model.buffers(), tokens, labels, *docs.values()])
        tracker.label_gradients(block_params, "grads")
        _label_modules(model, tracker, whole)
        windows = _Windows(model, tracker, weights)
        output = getattr(model, "output", None)
        context: contextlib.AbstractContextManager = contextlib.nullcontext()
        if output is not None:  # the loss label from the output projection on
            output.register_forward_pre_hook(_loss_region(tracker))
            if mesh is not None:
                context = _vocab_sharded(output, mesh)
        with tracker, context, cuda_attention():
            tracker.open(weights(None))
            with torch.autocast("cpu", dtype=compute, enabled=autocast):
                loss = loss_fn(model(tokens, **docs), labels, torch.ones(()))
            loss.backward()
            windows.finish()
    return Profile(batch * seq, windows.embed, windows.forward, windows.head, windows.backward, windows.tail)
