"""Peak bytes of real tensors: a dispatch mode that follows every storage ops create, and the peak of
real training steps of one rank (on CUDA the allocator's own count), to check the estimate against."""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveBytes", "measure_peak"]


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
