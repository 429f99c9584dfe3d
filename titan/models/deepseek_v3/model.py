"""DeepSeek-V3 decoder (torchtitan's deepseek_v3 family) on Llama 3's skeleton.

The embedding, final norm, output projection, masks and the forward tail (the chunked loss's
hand-over) are llama3's Transformer; the blocks differ. Attention is multi-head latent attention
(MLA): queries come from ``wq`` or a low-rank ``wq_a -> q_norm -> wq_b``; keys and values from one
compressed latent ``wkv_a -> kv_norm -> wkv_b`` plus a rotary key part shared by all heads. Each
head's query/key is ``qk_nope_head_dim`` features without RoPE followed by ``qk_rope_head_dim``
with it (Meta's interleaved pairs, YaRN-scaled); values are ``v_head_dim`` wide. The first
``n_dense_layers`` blocks have a dense SwiGLU, the others titan's MoE layer.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from titan.models.deepseek_v3.args import DeepSeekV3ModelArgs
from titan.models.llama.flex import FlexKernel
from titan.models.llama.kernels import attention_kernel
from titan.models.llama.model import Attention, RMSNorm, apply_rotary_emb
from titan.models.max_logits import RowScale
from titan.models.moe.block import MoEBlock, MoETransformer
from titan.models.rope import default_inv_freq, yarn_inv_freq


def precompute_freqs_cis(args: DeepSeekV3ModelArgs, device: torch.device | str | None = None) -> torch.Tensor:
    """Rotations [max_seq_len, qk_rope_head_dim // 2] complex64 (YaRN's frequencies and, with its
    ``rope_attention_factor``, magnitude when it is on)."""
    yarn = args.yarn()
    dim = args.qk_rope_head_dim
    if yarn is None:
        inv_freq, magnitude = default_inv_freq(dim, args.rope_theta, device), 1.0
    else:
        inv_freq, magnitude = yarn_inv_freq(dim, args.rope_theta, yarn, device), yarn.cos_sin_scale()
    angles = torch.outer(torch.arange(args.max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return torch.polar(torch.full_like(angles, magnitude), angles)


class MLAttention(Attention):
    """Multi-head latent attention through llama's four steps (project, position, attend, wo).
    Keys are expanded to every head before the kernel (training attends over full keys)."""

    def __init__(self, args: DeepSeekV3ModelArgs, flex_kernel: FlexKernel | None = None, layer_id: int = 0) -> None:
        nn.Module.__init__(self)  # not llama's projections: MLA has its own
        self.layer_id = layer_id
        self.use_rope = True
        self.n_heads = self.n_kv_heads = args.n_heads
        self.attn_type = args.attn_type
        self.q_lora_rank = args.q_lora_rank
        self.kv_lora_rank = args.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_head_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.head_dim = args.qk_head_dim
        latent_eps = args.latent_norm_eps if args.latent_norm_eps is not None else args.norm_eps
        if self.q_lora_rank == 0:
            self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, self.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(self.q_lora_rank, eps=latent_eps)
            self.wq_b = nn.Linear(self.q_lora_rank, args.n_heads * self.head_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_lora_rank, eps=latent_eps)
        self.wkv_b = nn.Linear(self.kv_lora_rank, args.n_heads * (self.nope_dim + self.v_head_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * self.v_head_dim, args.dim, bias=False)
        # The rotary key every head shares passes here: an identity, where tensor parallelism (whose
        # ranks each expand it to their own heads only) sums its gradient over the ranks.
        self.shared_rope_key = nn.Identity()
        # The kernels scale q.k by head_dim ** -0.5; YaRN's softmax scale differs from it, so the
        # queries carry the ratio (1 without YaRN: nothing is multiplied).
        self.q_scale = args.softmax_scale * math.sqrt(self.head_dim)
        self.inner_attention = attention_kernel(args.attn_type, flex_kernel)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bs, seqlen, _ = x.shape
        q = self.wq(x) if self.q_lora_rank == 0 else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(bs, seqlen, -1, self.head_dim)  # -1: TP hands this rank a shard of the heads
        latent, k_rope = torch.split(self.wkv_a(x), [self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(bs, seqlen, -1, self.nope_dim + self.v_head_dim)
        k_nope, v = torch.split(kv, [self.nope_dim, self.v_head_dim], dim=-1)
        k_rope = self.shared_rope_key(k_rope).unsqueeze(2).expand(-1, -1, k_nope.shape[2], -1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        return q, k, v

    def position(
        self, xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on the last ``qk_rope_head_dim`` features of every head; the queries scaled."""
        n = self.nope_dim
        q_rope, k_rope = apply_rotary_emb(xq[..., n:], xk[..., n:], freqs_cis)
        q = torch.cat([xq[..., :n], q_rope], dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        return q, torch.cat([xk[..., :n], k_rope], dim=-1)

    def qk_clip_scales(self, gamma: torch.Tensor) -> list[RowScale]:
        """QK-clip as Kimi K2 applies it to MLA: head h's logit q_nope . k_nope + q_rope . k_rope
        scales by ``gamma[h]`` when its query's nope rows and key's nope rows (in wkv_b) take
        sqrt(gamma) and its query's rope rows take gamma; the rotary key every head shares
        (wkv_a's last rows) and the values stay. The query rows are wq's, or wq_b's with low-rank
        queries (wq_a and q_norm are shared by all heads)."""
        root = gamma.sqrt()[:, None]
        q_rows = torch.cat([root.expand(-1, self.nope_dim), gamma[:, None].expand(-1, self.rope_dim)], 1)
        kv_rows = torch.cat([root.expand(-1, self.nope_dim), torch.ones_like(root).expand(-1, self.v_head_dim)], 1)
        wq = self.wq if self.q_lora_rank == 0 else self.wq_b
        return [RowScale(wq.weight, q_rows.flatten()), RowScale(self.wkv_b.weight, kv_rows.flatten())]

    def init_weights(self, out_std: float) -> None:
        for name in ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b"):
            lin = getattr(self, name, None)
            if lin is not None:
                nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=out_std)
        self.kv_norm.reset_parameters()
        if self.q_lora_rank:
            self.q_norm.reset_parameters()


class DeepSeekV3Block(MoEBlock):
    attention: MLAttention

    def __init__(self, layer_id: int, args: DeepSeekV3ModelArgs, flex_kernel: FlexKernel | None = None) -> None:
        attention = MLAttention(args, flex_kernel, layer_id)
        super().__init__(layer_id, args, attention, args.moe_inter_dim, args.inter_dim)

    def init_attention(self, out_std: float) -> None:
        self.attention.init_weights(out_std)  # latent attention's own projections


class DeepSeekV3Transformer(MoETransformer):
    model_args: DeepSeekV3ModelArgs

    def __init__(self, model_args: DeepSeekV3ModelArgs) -> None:
        model_args.validate()
        if model_args.use_yarn is None:
            # torchtitan's rule reads max_seq_len (a run sets it to its seq_len), which an export
            # replaces by the context length: the model keeps the choice it was built with.
            model_args = dataclasses.replace(model_args, use_yarn=model_args.yarn_enabled)
        super().__init__(model_args)

    def rope_table(self, device: torch.device | str | None) -> torch.Tensor:
        return precompute_freqs_cis(self.model_args, device=device)  # YaRN on the rotary dims only

    def make_block(self, layer_id: int, flex_kernel: FlexKernel | None) -> nn.Module:
        return DeepSeekV3Block(layer_id, self.model_args, flex_kernel)
