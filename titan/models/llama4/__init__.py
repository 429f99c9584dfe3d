"""Llama 4 (torchtitan's llama4 family): MoE feed-forward blocks and iRoPE on Llama 3's skeleton."""

from titan.models.llama4.args import Llama4ModelArgs, get_nparams_and_flops, llama4_configs
from titan.models.llama4.model import Llama4Block, Llama4Transformer

__all__ = ["Llama4Block", "Llama4ModelArgs", "Llama4Transformer", "get_nparams_and_flops", "llama4_configs"]
