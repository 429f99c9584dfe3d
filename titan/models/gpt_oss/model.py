"""gpt-oss decoder (torchtitan's gpt_oss family) on Llama 3's skeleton.

The embedding, final norm, output projection and forward tail are llama3's Transformer; the blocks
are gpt-oss's: attention with q/k/v/o biases, learned sinks and a sliding window on the layers
``layer_types`` names (titan.models.gpt_oss.attention), RoPE rotating the two halves of each head
(transformers' layout, so q/k weights load without permutation) with YaRN's table scaled by its
attention factor, and an MoE feed-forward (titan.models.moe, experts with biases and the clamped
SwiGLU) in every block.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import nn

from titan.errors import TitanError
from titan.models.gpt_oss.args import GptOssModelArgs
from titan.models.gpt_oss.attention import (
    FlexSinkKernel,
    GptOssMasks,
    SinkAttention,
    block_masks,
    dense_masks,
    sink_attention,
)
from titan.models.kv_cache import KVCache
from titan.models.llama.flex import FlexKernel
from titan.models.llama.model import Attention, RMSNorm
from titan.models.moe import MoE
from titan.models.moe.block import MoETransformer
from titan.models.rope import default_inv_freq, yarn_inv_freq


def rope_table(args: GptOssModelArgs, device: torch.device | str | None = None) -> torch.Tensor:
    """[max_seq_len, head_dim // 2] complex64: scale * e^{i m theta_j}, where scale is YaRN's
    attention factor (transformers multiplies cos and sin by it) or 1 for plain RoPE."""
    yarn = args.yarn()
    if yarn is None:
        inv_freq, scale = default_inv_freq(args.head_dim, args.rope_theta, device), 1.0
    else:
        inv_freq, scale = yarn_inv_freq(args.head_dim, args.rope_theta, yarn, device), yarn.cos_sin_scale()
    angles = torch.outer(torch.arange(args.max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return torch.complex(angles.cos() * scale, angles.sin() * scale)


def rotate_halves(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, Dh]: feature j pairs with j + Dh/2 (transformers' rotate_half), in fp32."""
    cos, sin = table.real[None, :, None, :], table.imag[None, :, None, :]
    first, second = x.float().chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).type_as(x)


class GptOssAttention(Attention):
    def __init__(self, args: GptOssModelArgs, layer_id: int, flex: FlexSinkKernel | None) -> None:
        super().__init__(args, None, layer_id)
        bias = args.attention_bias
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=bias)
        self.sinks = nn.Parameter(torch.empty(args.n_heads))
        # Set by the TP plan, which makes the sinks a DTensor split on heads: the kernels take this
        # rank's shard. A flag, not a type test: compiled code (dynamo) misreads getattr/hasattr on a DTensor.
        self.sinks_sharded = False
        self.sliding = args.is_sliding(layer_id)
        self.window = args.sliding_window_size
        self.scale = self.head_dim**-0.5
        self.inner_attention = SinkAttention(self.scale, flex)

    def position(
        self, xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotate_halves(xq, freqs_cis), rotate_halves(xk, freqs_cis)

    def local_sinks(self) -> torch.Tensor:
        return cast(Any, self.sinks).to_local() if self.sinks_sharded else self.sinks

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any) -> torch.Tensor:
        if not isinstance(attn_mask, GptOssMasks):
            raise TitanError("gpt_oss attention needs the masks built by GptOssTransformer.forward")
        mask = attn_mask.sliding if self.sliding else attn_mask.full
        return self.inner_attention(q, k, v, self.local_sinks(), mask)

    def _cached_attention(
        self, xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, kv_cache: KVCache
    ) -> torch.Tensor:
        """Decoding with sinks: queries at start .. start + S - 1 against every cached key, causal
        and, on sliding layers, within the window."""
        start, seqlen = kv_cache.pos, xq.shape[1]
        xk, xv = kv_cache.update(self.layer_id, xk, xv)
        q, k, v = (t.transpose(1, 2) for t in (xq, xk, xv))
        keys = torch.arange(start + seqlen, device=xq.device)
        queries = torch.arange(start, start + seqlen, device=xq.device)
        mask = keys[None, :] <= queries[:, None]
        if self.sliding and self.window is not None:
            mask = mask & (queries[:, None] - keys[None, :] < self.window)
        return sink_attention(q, k, v, self.local_sinks(), mask[None], self.scale)

    def init_weights(self, init_std: float) -> None:
        # As torchtitan: every projection, bias and the sinks at the block's depth-scaled std.
        nn.init.trunc_normal_(self.sinks, mean=0.0, std=init_std)
        for lin in (self.wq, self.wk, self.wv, self.wo):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=init_std)
            if lin.bias is not None:
                nn.init.trunc_normal_(lin.bias, mean=0.0, std=init_std)


class GptOssBlock(nn.Module):
    def __init__(self, layer_id: int, args: GptOssModelArgs, flex: FlexSinkKernel | None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention = GptOssAttention(args, layer_id, flex)
        self.moe_enabled = True  # every block: the MoE parallel plans and balancing look for it
        self.moe = MoE(args.moe_args, args.dim)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, attn_mask: Any = None, kv_cache: KVCache | None = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, attn_mask=attn_mask, kv_cache=kv_cache)
        return h + self.moe(self.ffn_norm(h))

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        std = 0.02 / math.sqrt(2 * (self.layer_id + 1))  # torchtitan's gpt-oss: depth-scaled, all weights
        self.attention.init_weights(std)
        self.moe.init_weights(std, buffer_device)
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()


class GptOssTransformer(MoETransformer):
    model_args: GptOssModelArgs

    def __init__(self, model_args: GptOssModelArgs) -> None:
        model_args.validate()
        self._flex = FlexSinkKernel() if model_args.attn_type == "flex" else None
        self._create_block_mask: Any = None
        super().__init__(model_args)

    def rope_table(self, device: torch.device | str | None) -> torch.Tensor:
        return rope_table(self.model_args, device)  # YaRN on rotate-half pairs

    def make_block(self, layer_id: int, flex_kernel: FlexKernel | None) -> nn.Module:
        return GptOssBlock(layer_id, self.model_args, self._flex)

    def attention_mask(
        self, seqlen: int, device: torch.device, doc_ids: torch.Tensor | None, kv_cache: KVCache | None
    ) -> Any:
        if kv_cache is not None:
            return None  # the cached path builds its masks from the cache's offset
        block_causal = self.model_args.attn_mask_type == "block_causal"
        if block_causal and doc_ids is None:
            raise TitanError(
                'model.attn_mask_type = "block_causal" needs the batch\'s document ids: call the'
                " model with doc_ids=titan.models.documents.document_ids(tokens, eos_id)"
            )
        docs = doc_ids if block_causal else None
        window = self.model_args.sliding_window_size
        if self._flex is not None and device.type == "cuda":
            if self._create_block_mask is None:  # compiled, it builds block by block instead of S x S
                from torch.nn.attention.flex_attention import create_block_mask

                self._create_block_mask = torch.compile(create_block_mask)
            return block_masks(seqlen, window, device, docs, self._create_block_mask)
        return dense_masks(seqlen, window, device, docs)
