"""The decoder block and model of the MoE families: llama's pre-norm block whose feed-forward is
titan's MoE on the layers the family's args name (a dense SwiGLU elsewhere), and llama's
Transformer whose blocks keep routing counters and initialise themselves. llama4, qwen3 and
deepseek_v3 differ only in their attention module, the widths and a hook or two."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from titan.models.kv_cache import KVCache
from titan.models.llama.model import Attention, FeedForward, RMSNorm, Transformer
from titan.models.moe.moe import MoE
from titan.models.mtp import MultiTokenPrediction, mtp_depth


class MoEBlock(nn.Module):
    """``args`` gives ``dim``, ``norm_eps``, ``n_layers``, ``depth_init``, ``moe_args`` and
    ``is_moe_layer(layer_id)``; the parallel plans and balancing read ``moe_enabled`` and ``moe``
    (or ``feed_forward``), ``attention``, ``attention_norm`` and ``ffn_norm``."""

    attention: Attention

    def __init__(
        self, layer_id: int, args: Any, attention: Attention, moe_hidden_dim: int | None, ffn_hidden_dim: int
    ) -> None:
        super().__init__()
        # Kept so depth-scaled init stays right after pipeline splitting removes earlier layers.
        self.layer_id = layer_id
        self.n_layers = args.n_layers
        self.depth_init = args.depth_init
        self.attention = attention
        self.moe_enabled = args.is_moe_layer(layer_id)
        if self.moe_enabled:
            self.moe = MoE(args.moe_args, args.dim, moe_hidden_dim)
        else:
            self.feed_forward = FeedForward(args.dim, ffn_hidden_dim)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def block_mask(self, attn_mask: Any) -> Any:
        """This block's mask out of what the model built for all blocks (llama4 picks one of two)."""
        return attn_mask

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, attn_mask: Any = None, kv_cache: KVCache | None = None
    ) -> torch.Tensor:
        mask = self.block_mask(attn_mask)
        h = x + self.attention(self.attention_norm(x), freqs_cis, attn_mask=mask, kv_cache=kv_cache)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + ffn(self.ffn_norm(h))

    def init_attention(self, out_std: float) -> None:
        """llama's: the input projections at 0.02, the output projection at the depth-scaled std."""
        for lin in (self.attention.wq, self.attention.wk, self.attention.wv):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.attention.wo.weight, mean=0.0, std=out_std)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        # As llama's blocks: writes into the residual stream at 0.02 / sqrt(2 depth); the MoE's
        # experts and router too.
        depth = self.layer_id + 1 if self.depth_init else self.n_layers
        out_std = 0.02 / math.sqrt(2 * depth)
        self.init_attention(out_std)
        if self.moe_enabled:
            self.moe.init_weights(out_std, buffer_device)
        else:
            nn.init.trunc_normal_(self.feed_forward.w1.weight, mean=0.0, std=0.02)
            for lin in (self.feed_forward.w2, self.feed_forward.w3):
                nn.init.trunc_normal_(lin.weight, mean=0.0, std=out_std)
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()


class MoETransformer(Transformer):
    """llama's Transformer over blocks with a ``moe_enabled`` flag (MoEBlock or a family's own):
    the routing counters are buffers, reset with the RoPE table; each block initialises its own
    weights after the embedding, final norm and output. With ``mtp_depth`` in its args the
    multi-token-prediction parts (titan.models.mtp) come last, in forward and in init, so the main
    model's weights are those of the same seed without them."""

    norm_cls: type[nn.Module] = RMSNorm
    """The family's RMSNorm (the MTP modules' norms are of the final norm's kind)."""

    def __init__(self, model_args: Any) -> None:
        super().__init__(model_args)
        depth = mtp_depth(model_args)
        self.mtp = MultiTokenPrediction(depth, model_args.dim, model_args.norm_eps, self.norm_cls) if depth else None

    def moe_family_blocks(self) -> list[Any]:
        return [m for m in self.layers.modules() if hasattr(m, "moe_enabled")]  # also inside AC wrappers

    def init_buffers(self, device: torch.device | None = None) -> None:
        super().init_buffers(device)
        for block in self.moe_family_blocks():
            if block.moe_enabled:
                block.moe.reset_counters(self.freqs_cis.device)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        super().init_weights(buffer_device)  # embedding, final norm, output, RoPE table
        for block in self.moe_family_blocks():
            block.init_weights(self.freqs_cis.device)
        if self.mtp is not None:
            self.mtp.init_weights()
