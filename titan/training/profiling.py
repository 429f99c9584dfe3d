"""torch.profiler traces and CUDA memory snapshots, driven by the [profiling] config section.

The trainer calls ``profiler.step(step)`` after every training step and ``profiler.close()`` at
the end. Every ``profile_freq`` steps the last ``active_steps`` of the window are recorded after
``warmup_steps`` warm-up steps, and each rank writes
``<dump_folder>/<save_traces_folder>/iteration_<step>/rank<r>_trace.json`` (chrome://tracing,
perfetto.dev). Memory snapshots (CUDA only) go to
``<dump_folder>/<save_memory_snapshot_folder>/iteration_<step>/rank<r>_memory_snapshot.pickle``
and, on an out-of-memory error, ``.../oom/rank<r>_memory_snapshot.pickle``
(drag into pytorch.org/memory_viz).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from titan.config.sections.profiling import Profiling
from titan.log import logger

__all__ = ["Profiler"]

# Allocator events kept for a snapshot; ~100k covers several steps of a large model.
MEMORY_HISTORY_ENTRIES = 100_000


class Profiler:
    def __init__(self, p: Profiling, *, dump_folder: str, rank: int, device: torch.device, start_step: int = 0) -> None:
        """``p``: the [profiling] section, checked (memory snapshots only on CUDA: titan.training.plan.check_run);
        traces and snapshots go under ``dump_folder`` (job.dump_folder)."""
        self.rank = rank
        self.freq = p.profile_freq
        self.torch_profiler: Any = None
        self.memory_folder: str | None = None
        self.traces: list[str] = []
        if p.enable_memory_snapshot:
            self.memory_folder = os.path.join(dump_folder, p.save_memory_snapshot_folder)
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
            # Bound by CUDA builds only; torch._C's stubs do not declare it.
            torch._C._cuda_attach_out_of_memory_observer(self._on_oom)  # pyright: ignore[reportAttributeAccessIssue]
            logger.info(f"CUDA memory snapshots every {self.freq} steps and on OOM in {self.memory_folder}")
        if p.enable_profiling:
            self.trace_folder = os.path.join(dump_folder, p.save_traces_folder)
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            wait = self.freq - p.warmup_steps - p.active_steps
            self.torch_profiler = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(wait=wait, warmup=p.warmup_steps, active=p.active_steps),
                on_trace_ready=self._save_trace,
                record_shapes=True,
            )
            self.torch_profiler.start()
            # A resumed run keeps the same trace steps as an uninterrupted one.
            self.torch_profiler.step_num = start_step
            logger.info(
                f"profiling every {self.freq} steps ({p.warmup_steps} warm-up, {p.active_steps} active)"
                f" into {self.trace_folder}"
            )

    def _save_trace(self, prof: torch.profiler.profile) -> None:
        folder = os.path.join(self.trace_folder, f"iteration_{prof.step_num}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{self.rank}_trace.json")
        t0 = time.perf_counter()
        prof.export_chrome_trace(path)
        self.traces.append(path)
        logger.info(f"profiler trace written to {path} in {time.perf_counter() - t0:.2f}s")

    def _dump_memory(self, name: str) -> str:
        assert self.memory_folder is not None
        folder = os.path.join(self.memory_folder, name)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{self.rank}_memory_snapshot.pickle")
        torch.cuda.memory._dump_snapshot(path)
        return path

    def _on_oom(self, device: int, alloc: int, device_alloc: int, device_free: int) -> None:
        path = self._dump_memory("oom")
        logger.error(
            f"CUDA out of memory on device {device} (asked {alloc / 2**30:.2f} GiB, free"
            f" {device_free / 2**30:.2f} GiB): memory snapshot written to {path}"
        )

    def step(self, step: int) -> None:
        """Call once after training step ``step`` finished."""
        if self.torch_profiler is not None:
            self.torch_profiler.step()
        if self.memory_folder is not None and step % self.freq == 0:
            path = self._dump_memory(f"iteration_{step}")
            logger.info(f"memory snapshot written to {path}")

    def close(self) -> None:
        if self.torch_profiler is not None:
            self.torch_profiler.stop()
            self.torch_profiler = None
        if self.memory_folder is not None:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.memory_folder = None
