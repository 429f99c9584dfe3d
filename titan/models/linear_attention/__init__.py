"""Linear-attention token mixers any family can pick per layer: the Gated DeltaNet (a recurrent
state with the gated delta rule, a short causal convolution, a gated RMSNorm), with one exact torch
path on every device and flash-linear-attention's kernels on CUDA."""

from titan.models.linear_attention.delta_rule import causal_conv1d, chunk_gated_delta_rule
from titan.models.linear_attention.gated_deltanet import DocumentSpans, GatedDeltaNet
from titan.models.linear_attention.kernels import BACKENDS, check_backend, resolve_backend

__all__ = [
    "BACKENDS",
    "DocumentSpans",
    "GatedDeltaNet",
    "causal_conv1d",
    "check_backend",
    "chunk_gated_delta_rule",
    "resolve_backend",
]
