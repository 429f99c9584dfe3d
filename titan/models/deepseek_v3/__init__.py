"""DeepSeek-V3 (torchtitan's deepseek_v3 family): multi-head latent attention and fine-grained MoE
with shared experts and group-limited routing, on llama3's skeleton and titan's MoE layer."""

from titan.models.deepseek_v3.args import DeepSeekV3ModelArgs, deepseek_v3_configs, get_nparams_and_flops

__all__ = ["DeepSeekV3ModelArgs", "deepseek_v3_configs", "get_nparams_and_flops"]
