"""training.deterministic: bitwise-repeatable runs on one device type (CPU or CUDA).

What it switches, and why each is needed on CUDA:
- torch.use_deterministic_algorithms(True) (not warn_only): ops with a deterministic variant use
  it (embedding backward sorts instead of atomics; flash-attention's backward runs FA2's
  deterministic dQ accumulation; memory-efficient attention uses one key split), and an op with
  none stops the run with an error instead of silently drifting.
- CUBLAS_WORKSPACE_CONFIG=:4096:8: cuBLAS picks reduction strategies by available workspace;
  a fixed configuration makes its GEMMs repeatable. cuBLAS reads it when its first handle is
  created, so it is exported before the device is touched (Trainer calls this first thing).
- cudnn.deterministic / benchmark off: no timing-based algorithm choice.
- SDPA backends: flash, memory-efficient and math only. cuDNN attention is excluded: its
  backward is not covered by the deterministic switch above.
- Inductor's deterministic mode: no on-device benchmarking that changes numerics (reduction
  configs, padded matmuls); flex attention uses its Triton backend, whose backward has no atomics.
Everything is restored by ``restore()`` so in-process runs (tests) do not leak the settings.
"""

from __future__ import annotations

import contextlib
import os

import torch

from titan.models.sdpa import sdpa_backends

CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")  # the two values NVIDIA documents as reproducible


def deterministic_sdpa_backends() -> list:
    backends = sdpa_backends("cuda", deterministic=True)
    assert backends is not None  # CUDA always has an explicit list
    return backends


class DeterministicMode:
    """Applies the settings on ``apply()`` (a no-op when disabled) and puts back what was there."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._stack: contextlib.ExitStack | None = None

    def apply(self) -> DeterministicMode:
        if not self.enabled or self._stack is not None:
            return self
        import torch._inductor.config as inductor_config

        stack = contextlib.ExitStack()
        env = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        if env not in CUBLAS_DETERMINISTIC:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC[0]
            stack.callback(_restore_env, "CUBLAS_WORKSPACE_CONFIG", env)
        algos = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
        torch.use_deterministic_algorithms(True, warn_only=False)
        stack.callback(lambda: torch.use_deterministic_algorithms(algos[0], warn_only=algos[1]))
        cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        stack.callback(_restore_cudnn, cudnn)
        inductor = inductor_config.deterministic
        inductor_config.deterministic = True
        stack.callback(setattr, inductor_config, "deterministic", inductor)
        from torch.nn.attention import sdpa_kernel

        stack.enter_context(sdpa_kernel(deterministic_sdpa_backends()))
        self._stack = stack
        return self

    def restore(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None


def _restore_env(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


def _restore_cudnn(values: tuple[bool, bool]) -> None:
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = values
