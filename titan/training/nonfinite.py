"""Dropping one optimizer update on the device (``training.nonfinite = skip_step``), with no host read.

The decision to apply a step is a 0-dim bool tensor on the device (see
``titan.training.stability.StabilityMonitor.check``); the host queues the optimizer step either way
and the device keeps or drops its result:

- torch's fused Adam / AdamW (``optimizer.implementation = fused``): the kernel's own ``found_inf``
  input skips the update of the weights, both moments and the step counter. No extra memory or work.
- every other optimizer (foreach, for-loop, torchao's bf16 stochastic-rounding AdamW): the weights and
  every optimizer state tensor of the parameters that have a gradient are copied before the step and
  put back with ``torch.where`` after it when the step is dropped: exact (bit-identical weights,
  moments and step counters), at the cost of one extra copy of the weights and optimizer state in
  memory while the step runs and about two more passes over them. Step counters must live on the
  device for this: on CUDA torch's non-fused Adam / AdamW run ``capturable`` (their bias correction is
  then computed on the device, in float32) and other optimizers' 0-dim CPU step counters are moved to
  the device.

With ``training.nonfinite = stop`` nothing is masked (the run stops at the next log step or save,
before anything is written), so the default policy costs nothing here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch.distributed.tensor import DTensor

__all__ = ["UpdateMask"]

_FOUND_INF = "found_inf"  # the optimizer attribute torch's Adam/AdamW pass to their fused kernel


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor the kernels write (a DTensor's shard), sharing storage with ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t.detach()


def _torch_adam(opt: torch.optim.Optimizer) -> bool:
    return isinstance(opt, (torch.optim.Adam, torch.optim.AdamW))


class UpdateMask:
    """``with mask(apply): optimizers.step()`` keeps the step's update where ``apply`` (a 0-dim bool
    tensor on the device) is true and leaves weights and optimizer state exactly as they were where it
    is false. ``enabled = False`` (the ``stop`` policy) makes it a no-op.

    The masking runs in each optimizer's own step hooks, so whatever runs after the step (the
    container's post-step hooks, e.g. float8's scale precompute) sees the kept or restored weights.
    Optimizer steps outside the ``with`` (a checkpoint load initialising the state) are not touched."""

    def __init__(self, optimizers: Iterable[torch.optim.Optimizer], device: torch.device, enabled: bool) -> None:
        self.optimizers = list(optimizers)
        self.enabled = enabled
        self._apply: torch.Tensor | None = None
        self._saved: dict[int, list] = {}
        if not enabled:
            return
        for opt in self.optimizers:
            opt.register_step_pre_hook(self._before_step)
            opt.register_step_post_hook(self._after_step)
            if device.type == "cuda" and _torch_adam(opt):
                for group in opt.param_groups:
                    # Before the first step and any checkpoint load: step counters are then created
                    # (or loaded) on the device, so restoring them needs no host decision.
                    if not group.get("fused"):
                        group["capturable"] = True

    @contextlib.contextmanager
    def __call__(self, apply: torch.Tensor) -> Iterator[None]:
        self._apply = apply if self.enabled else None
        try:
            yield
        finally:
            self._apply = None
            self._saved.clear()
            for opt in self.optimizers:  # a step that raised leaves no found_inf behind
                if hasattr(opt, _FOUND_INF):
                    delattr(opt, _FOUND_INF)

    @staticmethod
    def _fused(opt: torch.optim.Optimizer) -> bool:
        return _torch_adam(opt) and bool(opt.param_groups[0].get("fused"))

    def _before_step(self, opt: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        if self._apply is None:
            return
        if self._fused(opt):
            # Read by torch's fused Adam/AdamW (which also undo their step-counter increment).
            setattr(opt, _FOUND_INF, (~self._apply).float())
        else:
            self._saved[id(opt)] = self._snapshot(opt)

    def _after_step(self, opt: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        if self._apply is None:
            return
        if self._fused(opt):
            delattr(opt, _FOUND_INF)
        else:
            self._restore(opt, self._saved.pop(id(opt)), self._apply)

    @staticmethod
    def _params(opt: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
        return [p for group in opt.param_groups for p in group["params"] if p.grad is not None]

    def _to_param_device(self, opt: torch.optim.Optimizer, p: torch.nn.Parameter) -> None:
        """A 0-dim step counter kept on the CPU for device weights goes to the device (non-blocking)."""
        state = opt.state.get(p)
        if not state:
            return
        device = _local(p).device
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() == 0 and value.device != device:
                state[key] = value.to(device, non_blocking=True)

    @torch.no_grad()
    def _snapshot(self, opt: torch.optim.Optimizer) -> list[tuple[torch.nn.Parameter, dict[str, torch.Tensor]]]:
        out = []
        for p in self._params(opt):
            self._to_param_device(opt, p)
            copies = {"": _local(p).clone()}
            for key, value in opt.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    copies[key] = _local(value).clone()
            out.append((p, copies))
        return out

    @torch.no_grad()
    def _restore(self, opt: torch.optim.Optimizer, snapshot: list, apply: torch.Tensor) -> None:
        flags: dict[torch.device, torch.Tensor] = {apply.device: apply}
        for p, copies in snapshot:
            self._to_param_device(opt, p)
            live = {"": p, **{k: v for k, v in opt.state.get(p, {}).items() if isinstance(v, torch.Tensor)}}
            for key, value in live.items():
                t = _local(value)
                # Weights offloaded to the CPU step there: the flag follows them (that step waits for
                # the device anyway).
                flag = flags.get(t.device)
                if flag is None:
                    flag = flags[t.device] = apply.to(t.device)
                # State created by this step (the first one) had been zeros: a fresh optimizer's.
                old = copies.get(key)
                torch.where(flag, t, old if old is not None else torch.zeros((), dtype=t.dtype, device=t.device), out=t)
