"""Qwen3 (torchtitan's qwen3 family, Hugging Face's Qwen3 and Qwen3-MoE): per-head q/k RMSNorm,
its own head width and titan's MoE layer on Llama 3's skeleton."""

from titan.models.qwen3.args import Qwen3ModelArgs, get_nparams_and_flops, qwen3_configs
from titan.models.qwen3.model import Qwen3Attention, Qwen3Block, Qwen3Transformer

__all__ = [
    "Qwen3Attention",
    "Qwen3Block",
    "Qwen3ModelArgs",
    "Qwen3Transformer",
    "get_nparams_and_flops",
    "qwen3_configs",
]
