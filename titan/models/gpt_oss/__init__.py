"""gpt-oss (torchtitan's gpt_oss family): attention sinks, alternating sliding-window attention,
YaRN RoPE and MoE experts with biases and a clamped SwiGLU, on Llama 3's skeleton."""

from titan.models.gpt_oss.args import GptOssModelArgs, get_nparams_and_flops, gpt_oss_configs
from titan.models.gpt_oss.model import GptOssBlock, GptOssTransformer

__all__ = ["GptOssBlock", "GptOssModelArgs", "GptOssTransformer", "get_nparams_and_flops", "gpt_oss_configs"]
