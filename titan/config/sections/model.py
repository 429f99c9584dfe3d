"""[model]: the Model section of the config tree (assembled in titan/config/job_config.py)."""

from __future__ import annotations

from dataclasses import dataclass

from titan.config.choices import AttnMaskType, AttnType, LinearAttnBackend
from titan.errors import require

# Model-shape keys that override the flavor's value when set.
SHAPE_OVERRIDES = ("n_layers", "dim", "n_heads", "n_kv_heads")


@dataclass
class Model:
    name: str = "llama3"
    """Model family from the registry in titan/models (currently: llama3, llama4, qwen3, qwen3_5, deepseek_v3,
    gpt_oss)."""
    flavor: str = "debugmodel"
    """Model size: llama3 debugmodel, 8B, 70B, 405B; llama4 debugmodel, 17bx16e, 17bx128e and their
    _irope variants; qwen3 debugmodel, 0.6B, 1.7B, 4B, 8B, 14B, 32B, debugmodel_moe, 30B-A3B, 235B-A22B;
    qwen3_5 debugmodel, debugmodel_moe, 0.8B, 2B, 4B, 9B, 27B, 35B-A3B, 122B-A10B, 397B-A17B;
    deepseek_v3 debugmodel, debugmodel_flex_attn, 16B, 236B, 671B; gpt_oss debugmodel, 20b, 120b."""
    tokenizer_path: str = ""
    """Tokenizer file (tiktoken `tokenizer.model`, sentencepiece `.model` or HF `tokenizer.json`).
    Empty: the small tokenizer shipped in titan/data/assets."""
    attn_type: AttnType = "sdpa"
    """Attention backend: sdpa (torch scaled_dot_product_attention), flex (flex_attention with a
    block mask; CUDA only for training, as torch's flex_attention has no CPU backward) or varlen
    (per-document attention with torch's flash varlen kernel on CUDA, SDPA with the block-causal
    mask on CPU; needs attn_mask_type block_causal)."""
    attn_mask_type: AttnMaskType = "causal"
    """causal: every token attends to all earlier tokens of its packed window. block_causal: only to
    the earlier tokens of its own document (documents end at the tokenizer's EOS token), as if each
    document were run alone. Not with context parallelism."""
    linear_attn_backend: LinearAttnBackend = "auto"
    """Models with linear-attention layers (qwen3_5's Gated DeltaNet): torch (the exact chunked
    path, every device), fla (flash-linear-attention's kernels: CUDA with the linear_attention
    extra installed) or auto (fla where it can run, torch elsewhere; the choice is logged)."""
    n_layers: int | None = None
    """Override the flavor's number of transformer blocks (unset: the flavor's value), e.g. the 8B
    shape cut to 8 layers to fit one GPU for benchmarking and debugging."""
    dim: int | None = None
    """Override the flavor's model width (unset: the flavor's value); must be divisible by n_heads."""
    n_heads: int | None = None
    """Override the flavor's number of query heads (unset: the flavor's value)."""
    n_kv_heads: int | None = None
    """Override the flavor's number of key/value heads (unset: the flavor's value); must divide n_heads."""
    vocab_size: int | None = None
    """Rows of the embedding and output projection (unset: the tokenizer's vocabulary size). At
    least the tokenizer's size; larger pads the vocabulary, e.g. 128256 (Llama 3's rows) or a
    multiple of 64 for tensor-core friendly shapes. Weights brought in keep the rows they were saved with."""
    depth_init: bool = True
    """Init std of the residual-stream output projections (wo, w2, w3). true: depth-scaled per
    block, 0.02 / sqrt(2 * (layer_id + 1)) (early blocks larger, as in torchtitan); false: one
    factor for all blocks, 0.02 / sqrt(2 * n_layers) (GPT-2 / Megatron style)."""
    moe_load_balance_coeff: float | None = None
    """MoE models: auxiliary-loss-free balancing, the step by which every expert's routing bias
    moves towards balance after each optimizer step (overloaded experts down, starved ones up).
    Unset: the flavor's value (llama4: 1e-3); 0 turns the biases off (routing by score alone)."""
    moe_aux_loss_coeff: float | None = None
    """MoE models: weight of the sequence-wise balance loss (DeepSeek-V3's) added to the backward
    pass. Unset: the flavor's value (llama4: 0, off)."""

    mtp_depth: int = 0
    """Multi-token prediction (DeepSeek-V3's MTP): the number of extra depths, each predicting one
    token further ahead (depth k: token t + k + 1) from the previous depth's hidden state and the
    embedding of token t + k, through one block of the model's own kind and the shared output
    head; their loss is added with training.mtp_loss_weight. 0: off. Families with MTP modules:
    deepseek_v3 (Hugging Face layer num_hidden_layers, ``num_nextn_predict_layers``) and qwen3_5
    (``mtp.*``, one depth). Not with context parallelism. docs/deepseek_v3.md has the details."""

    def validate(self) -> None:
        for key in SHAPE_OVERRIDES:
            value = getattr(self, key)
            require(
                value is None or value >= 1, f"model.{key}", value, "an integer >= 1, or unset for the flavor's value"
            )
        require(
            self.vocab_size is None or self.vocab_size >= 1,
            "model.vocab_size",
            self.vocab_size,
            "an integer >= the tokenizer's vocabulary size, or unset for the tokenizer's size",
        )
        require(self.mtp_depth >= 0, "model.mtp_depth", self.mtp_depth, "an integer >= 0 (0: off)")
        for key in ("moe_load_balance_coeff", "moe_aux_loss_coeff"):
            value = getattr(self, key)
            require(
                value is None or value >= 0,
                f"model.{key}",
                value,
                "a number >= 0 (0: off), or unset for the flavor's value",
            )
        require(
            self.attn_type != "varlen" or self.attn_mask_type == "block_causal",
            "model.attn_type",
            rule='= "varlen" attends within each document: it needs model.attn_mask_type = "block_causal"'
            " (for causal attention over the whole window use sdpa or flex)",
        )
