"""Which Gated DeltaNet path runs: the exact torch path (titan.models.linear_attention.delta_rule)
on every device, or flash-linear-attention's fused kernels (fla-core; Triton, CUDA only) with its
causal convolution (causal-conv1d's CUDA kernel when that package is installed, else fla's Triton
one). ``model.linear_attn_backend`` chooses: auto (fla where the tensors are on CUDA and fla is
installed, torch elsewhere), torch, or fla (refused before any process group where it cannot run).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from titan.config.choices import LinearAttnBackend, choices
from titan.errors import TitanError

BACKENDS = choices(LinearAttnBackend)
INSTALL = "pip install 'titan[linear_attention]' (fla-core, causal-conv1d)"


def fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None


def resolve_backend(choice: str, device_type: str) -> tuple[str, str]:
    """(the path a model on ``device_type`` runs, why) for the configured ``choice``."""
    if choice == "torch":
        return "torch", "model.linear_attn_backend = torch"
    if device_type != "cuda":
        return "torch", f"fla's kernels need CUDA, this run is on {device_type}"
    if not fla_installed():
        return "torch", f"fla-core is not installed ({INSTALL})"
    return "fla", "CUDA with fla-core installed" if choice == "auto" else "model.linear_attn_backend = fla"


def check_backend(choice: str, device_type: str) -> None:
    """Refuse, in one line, a choice this device cannot run (the run plan's check)."""
    if choice not in BACKENDS:
        raise TitanError(f"config key 'model.linear_attn_backend' got {choice!r}; valid: {', '.join(BACKENDS)}")
    if choice == "fla" and (device_type != "cuda" or not fla_installed()):
        why = f"this run is on {device_type}" if device_type != "cuda" else f"fla-core is not installed: {INSTALL}"
        raise TitanError(
            f"config key 'model.linear_attn_backend' got 'fla', which needs CUDA and fla-core ({why}); valid here:"
            " auto or torch"
        )


def uses_fla(choice: str, x: torch.Tensor) -> bool:
    """Whether a forward on ``x`` takes the fla path: "fla" as resolved by the parallelize step
    (resolve_backend), or "auto" in a model used as it is built (generation, tests)."""
    if choice == "fla":
        return True
    return choice == "auto" and x.device.type == "cuda" and fla_installed()


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1, -1, *t.shape[2:])


def fla_conv(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """fla's causal_conv1d + SiLU, x [B, S, C], weight [C, W]; with ``cu_seqlens`` the flattened
    batch restarts at every document."""
    from fla.modules.convolution import causal_conv1d  # pyright: ignore[reportMissingImports]

    backend = "cuda" if importlib.util.find_spec("causal_conv1d") is not None else "triton"
    b = x.shape[0]
    inp = _flat(x) if cu_seqlens is not None else x
    out: Any = causal_conv1d(x=inp, weight=weight, activation="silu", backend=backend, cu_seqlens=cu_seqlens)
    out = out[0] if isinstance(out, tuple) else out
    return out.reshape(b, -1, *out.shape[2:]) if cu_seqlens is not None else out


def fla_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
) -> torch.Tensor:
    """fla's chunk_gated_delta_rule with the torch path's conventions (q/k L2-normalised in the
    kernel, scale Dk^-0.5, grouped value heads by repeating q/k); documents by ``cu_seqlens``."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # pyright: ignore[reportMissingImports]

    hk, hv = q.shape[2], v.shape[2]
    if hk != hv:  # every fla version takes equal head counts; newer ones also grouped ones
        q, k = (t.repeat_interleave(hv // hk, dim=2) for t in (q, k))
    b = q.shape[0]
    if cu_seqlens is not None:
        q, k, v, g, beta = (_flat(t) for t in (q, k, v, g, beta))
    out, _ = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
    return out.reshape(b, -1, *out.shape[2:]) if cu_seqlens is not None else out
