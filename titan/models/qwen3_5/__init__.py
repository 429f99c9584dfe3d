"""Qwen3.5 (torchtitan's qwen3_5 family; Hugging Face's Qwen3.5, Qwen3.5-MoE and Qwen3-Next text
decoders): Gated DeltaNet and gated full-attention layers, dense or MoE with a gated shared expert."""

from titan.models.qwen3_5.args import Qwen35ModelArgs, get_nparams_and_flops, qwen3_5_configs
from titan.models.qwen3_5.model import Qwen35Attention, Qwen35Block, Qwen35Transformer

__all__ = [
    "Qwen35Attention",
    "Qwen35Block",
    "Qwen35ModelArgs",
    "Qwen35Transformer",
    "get_nparams_and_flops",
    "qwen3_5_configs",
]
