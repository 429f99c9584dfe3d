"""[model]: the Model section of the config tree (assembled in titan/config/job_config.py)."""

from __future__ import annotations

from dataclasses import dataclass

from titan.config.choices import AttnMaskType, AttnType


@dataclass
class Model:
    name: str = "llama3"
    """Model family from the registry in titan/models (currently: llama3)."""
    flavor: str = "debugmodel"
    """Model size: debugmodel, 8B, 70B, 405B."""
    tokenizer_path: str = ""
    """Tokenizer file (tiktoken `tokenizer.model`, sentencepiece `.model` or HF `tokenizer.json`).
    Empty: the small tokenizer shipped in titan/data/assets."""
    attn_type: AttnType = "sdpa"
    """Attention backend: sdpa (torch scaled_dot_product_attention) or flex (flex_attention with a
    causal block mask; CUDA only for training, as torch's flex_attention has no CPU backward) or
    varlen (variable-length attention over the documents of a packed window)."""
    attn_mask_type: AttnMaskType = "causal"
    """causal (every token sees the whole window before it) or block_causal (a token sees only
    earlier tokens of its own document in a packed window)."""
    n_layers: int | None = None
    """Override the flavor's number of transformer blocks (unset: the flavor's value), e.g. the 8B
    shape cut to 8 layers to fit one GPU for benchmarking and debugging."""
    dim: int | None = None
    """Override the flavor's model width (unset: the flavor's value); must be divisible by n_heads."""
    n_heads: int | None = None
    """Override the flavor's number of query heads (unset: the flavor's value)."""
    n_kv_heads: int | None = None
    """Override the flavor's number of key/value heads (unset: the flavor's value); must divide n_heads."""
    depth_init: bool = True
    """Init std of the residual-stream output projections (wo, w2, w3). true: depth-scaled per
    block, 0.02 / sqrt(2 * (layer_id + 1)) (early blocks larger, as in torchtitan); false: one
    factor for all blocks, 0.02 / sqrt(2 * n_layers) (GPT-2 / Megatron style)."""
