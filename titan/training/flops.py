"""Peak FLOPs by accelerator name, transformer FLOPs per token and MFU.

Peaks are *dense* (no 2:4 sparsity) tensor-core rates per device as torch sees it, from the
vendors' datasheets: bf16 (fp16 for V100, which has no bf16) and float8 where the hardware has
float8 tensor cores. Unknown devices and CPUs give None so callers print "n/a" instead of a made-up
MFU.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = [
    "PEAK_FLOPS",
    "get_float8_peak_flops",
    "get_peak_flops",
    "mfu",
    "mtp_output_flops_per_token",
    "transformer_flops_per_token",
]

# (pattern matched against the device name, bf16 peak, float8 peak or None).
# Order matters: more specific names first (H100 NVL/PCIe before the plain H100 = SXM;
# GH200 before H200). Patterns use word boundaries so "A10" never matches "A100" or "A10G".
PEAK_FLOPS: tuple[tuple[str, float, float | None], ...] = (
    # NVIDIA Hopper
    (r"\bH100\b.*\bNVL\b", 835e12, 1670e12),
    (r"\bH100\b.*\bPCIe\b", 756e12, 1513e12),
    (r"\bH100\b", 989e12, 1979e12),  # SXM5 ("NVIDIA H100 80GB HBM3")
    (r"\bH800\b.*\bPCIe\b", 756e12, 1513e12),
    (r"\bH800\b", 989e12, 1979e12),
    (r"\bGH200\b", 989e12, 1979e12),
    (r"\bH200\b.*\bNVL\b", 835e12, 1670e12),
    (r"\bH200\b", 989e12, 1979e12),
    (r"\bH20\b", 148e12, 296e12),
    # NVIDIA Blackwell
    (r"\bGB200\b", 2500e12, 5000e12),
    (r"\bB200\b", 2250e12, 4500e12),
    # NVIDIA Ampere / Ada / Volta
    (r"\bA100\b", 312e12, None),
    (r"\bA800\b", 312e12, None),
    (r"\bA40\b", 149.7e12, None),
    (r"\bA10G\b", 125e12, None),  # AWS variant; NVIDIA publishes no datasheet (A10: 125 TF)
    (r"\bA10\b", 125e12, None),
    (r"\bL40S\b", 362e12, 733e12),
    (r"\bL40\b", 181e12, 362e12),
    (r"\bL4\b", 121e12, 242e12),
    (r"\bV100\b.*\bPCIe\b", 112e12, None),  # fp16
    (r"\bV100\b", 125e12, None),  # SXM2, fp16
    # AMD Instinct
    (r"\bMI355X\b", 2516e12, 5033e12),
    (r"\bMI350X\b", 2307e12, 4614e12),
    (r"\bMI325X\b", 1307e12, 2615e12),
    (r"\bMI300X\b", 1307e12, 2615e12),
    (r"\bMI300A\b", 981e12, 1961e12),
    (r"\bMI250X\b", 191.5e12, None),  # per GCD: torch sees each of the two dies as a device
)

_COMPILED = tuple((re.compile(p, re.IGNORECASE), bf16, fp8) for p, bf16, fp8 in PEAK_FLOPS)


def get_peak_flops(device_name: str, float8: bool = False) -> float | None:
    """Dense peak FLOP/s of one device, e.g. "NVIDIA H100 80GB HBM3" -> 989e12; None if unknown.

    ``float8=True`` returns the float8 peak where the device has float8 tensor cores and the bf16
    peak elsewhere (float8 training there runs its matmuls in higher precision anyway).
    """
    for pattern, bf16, fp8 in _COMPILED:
        if pattern.search(device_name):
            return fp8 if (float8 and fp8 is not None) else bf16
    return None


def get_float8_peak_flops(device_name: str) -> float | None:
    """The float8 tensor-core peak, or None where the device has none (or is unknown).

    Reported MFU uses the bf16 peak even for float8 training (as torchtitan does), so runs with and
    without float8 compare on one scale; this peak gives the secondary mfu_float8 figure.
    """
    for pattern, _, fp8 in _COMPILED:
        if pattern.search(device_name):
            return fp8
    return None


def mfu(tokens_per_second_per_device: float, flops_per_token: float, peak: float) -> float:
    """Model FLOPs utilization in percent of ``peak`` (FLOP/s of one device)."""
    if peak <= 0:
        raise ValueError(f"peak must be > 0, got {peak}")
    return 100.0 * tokens_per_second_per_device * flops_per_token / peak


def transformer_flops_per_token(num_params: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int) -> int:
    """Training FLOPs per token of a decoder-only transformer (forward + backward).

    6 * N for the matmuls with the weights (``num_params`` should exclude the input embedding,
    which is a lookup) plus 12 * L * H * Dh * T for the attention score/value matmuls, counting
    the full score matrix despite the causal mask (PaLM appendix B convention, used by most MFU
    reports).
    """
    return 6 * num_params + 12 * n_layers * n_heads * head_dim * seq_len


def mtp_output_flops_per_token(model: Any) -> int:
    """What multi-token prediction (titan.models.mtp) adds beyond its parameters: the output
    projection runs once more per depth, 6 x depth x its weights per token. The depths' blocks and
    fusion parts are parameters of the model, which the family's count already takes (blocks past
    n_layers included)."""
    mtp, output = getattr(model, "mtp", None), getattr(model, "output", None)
    if mtp is None or output is None:
        return 0
    return 6 * len(mtp) * output.weight.numel()
