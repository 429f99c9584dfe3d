"""Llama 3 / 3.1 decoder in plain PyTorch.

Parameter names follow Meta's reference checkpoints (tok_embeddings, layers.N.attention.wq, ...,
norm, output) and RoPE uses Meta's interleaved-pair layout, so consolidated.*.pth weights load
without permutation. Parallelism lives elsewhere: this file imports nothing of torch's distributed package
so that the same module runs single-process, under FSDP/TP (DTensor parameters) and as a
pipeline stage.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from titan.errors import TitanError
from titan.models.kv_cache import KVCache
from titan.models.llama.args import TransformerModelArgs
from titan.models.llama.flex import BlockMaskCache, FlexKernel
from titan.models.llama.kernels import attention_kernel
from titan.models.llama.masks import DocumentMasks, VarlenMask
from titan.models.max_logits import RowScale
from titan.models.mtp import mtp_depth, mtp_tail, split_input
from titan.models.sdpa import sdpa

AttnMask = BlockMask | VarlenMask | torch.Tensor | None
"""What the blocks get from Transformer.forward: flex's BlockMask, varlen's document boundaries, a
boolean block-causal mask (sdpa, or varlen on CPU), or None (sdpa's plain causal attention)."""


def _scale_rope_freqs(freqs: torch.Tensor, args: TransformerModelArgs) -> torch.Tensor:
    """Llama 3.1 context extension: keep high frequencies, divide low ones by scale_factor.

    Wavelengths shorter than original_ctx / high_freq_factor are kept (they resolve local
    order and were well trained); wavelengths longer than original_ctx / low_freq_factor are
    stretched by scale_factor so the longer context stays in the trained angle range; in
    between the two are blended linearly in original_ctx / wavelength.
    """
    ctx = args.rope_original_max_position_embeddings
    lo, hi, scale = args.rope_low_freq_factor, args.rope_high_freq_factor, args.rope_scale_factor
    wavelen = 2 * math.pi / freqs
    # Equal factors (Llama 4) make a hard cut at ctx: no band to blend over, so no division by zero.
    smooth = ((ctx / wavelen - lo) / ((hi - lo) or 1.0)).clamp(0.0, 1.0)
    blended = (1 - smooth) * freqs / scale + smooth * freqs
    return torch.where(wavelen < ctx / hi, freqs, torch.where(wavelen > ctx / lo, freqs / scale, blended))


def precompute_freqs_cis(args: TransformerModelArgs, device: torch.device | str | None = None) -> torch.Tensor:
    """Complex rotations e^{i m theta_j}, shape [max_seq_len, head_dim // 2], complex64."""
    dim = args.head_dim
    # fp32 regardless of the default dtype: angles up to ~1e5 rad need the mantissa.
    idx = torch.arange(0, dim, 2, device=device, dtype=torch.float32)[: dim // 2]
    freqs = 1.0 / (args.rope_theta ** (idx / dim))
    if args.use_rope_scaling:
        freqs = _scale_rope_freqs(freqs, args)
    t = torch.arange(args.max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q/k [B, S, H, Dh] by position; adjacent feature pairs (2j, 2j+1) form a complex."""

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        f = freqs_cis.view(1, xc.shape[1], 1, xc.shape[-1])
        return torch.view_as_real(xc * f).flatten(3).type_as(x)

    return rotate(xq), rotate(xk)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused rms_norm: one kernel forward and one backward on CUDA, and the mean square
        # is accumulated in fp32 for bf16 inputs (as the unfused x.float() version did). The fused
        # kernel needs one dtype, so a weight of another dtype (fp32 weight, bf16 activation) is
        # cast to the activation's.
        weight = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    def __init__(
        self,
        args: TransformerModelArgs,
        flex_kernel: FlexKernel | None = None,
        layer_id: int = 0,
        use_rope: bool = True,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id  # its slot in a KV cache
        self.use_rope = use_rope  # False: no positional embedding (NoPE layers of iRoPE models)
        self.n_heads = args.n_heads
        self.n_kv_heads = args.kv_heads
        self.head_dim = args.head_dim
        self.attn_type = args.attn_type
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.inner_attention = attention_kernel(args.attn_type, flex_kernel)

    def forward(
        self,
        x: torch.Tensor,
        freqs_cis: torch.Tensor,
        attn_mask: AttnMask = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        # Four steps a family overrides one at a time (q/k norms, biases, sinks, another kernel)
        # instead of copying the whole forward: project, position, attend, output projection.
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.project(x)
        # Sliced here, not by the caller: under TP/SP the caller only sees its sequence shard,
        # while attention runs on the gathered sequence (under CP both are the local shard).
        start = kv_cache.pos if kv_cache is not None else 0
        xq, xk = self.position(xq, xk, freqs_cis[start : start + seqlen], start)
        if kv_cache is not None:
            out = self._cached_attention(xq, xk, xv, kv_cache)
        else:
            q, k, v = (t.transpose(1, 2) for t in (xq, xk, xv))  # [B, H | KVH, S, Dh]
            out = self.attend(q, k, v, attn_mask)
        out = out.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(out)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, S, dim] -> q, k, v [B, S, heads, head_dim]."""
        bs, seqlen, _ = x.shape
        # Head counts are inferred (-1) so tensor parallelism can hand us a local shard of heads.
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        return xq, xk, xv

    def position(
        self, xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE (``freqs_cis`` already sliced to positions start .. start + S), or nothing on NoPE
        layers. ``start`` is the first position (a KV cache's offset)."""
        if self.use_rope:
            return apply_rotary_emb(xq, xk, freqs_cis)
        return xq, xk

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: AttnMask) -> torch.Tensor:
        """q [B, H, S, Dh], k/v [B, KVH, S, Dh] -> [B, H, S, Dh]: the training/prefill kernel.
        k/v keep their n_kv_heads: the kernel reads kv head h // n_rep for query head h."""
        if self.attn_type == "flex":
            if attn_mask is None:
                raise TitanError("flex attention needs the BlockMask built by Transformer.forward")
            return self.inner_attention(q, k, v, block_mask=attn_mask)
        # Context parallelism hooks the kernel's (q, k, v) call: the mask goes only where there is one.
        return self.inner_attention(q, k, v) if attn_mask is None else self.inner_attention(q, k, v, attn_mask)

    def qk_clip_scales(self, gamma: torch.Tensor) -> list[RowScale]:
        """QK-clip: scale the logits of query head h by at most ``gamma[h]`` (<= 1; [n_heads], every
        head of the layer). Queries and keys each take the square root, by rows of wq and wk (and
        their biases). Grouped-query heads share a key head, so each group takes its smallest
        gamma (its largest logit), as Megatron-LM does: its other heads shrink a little more
        instead of some query weights growing."""
        rep = self.n_heads // self.n_kv_heads
        root = gamma.view(self.n_kv_heads, rep).amin(dim=1).sqrt()
        q_rows, k_rows = root.repeat_interleave(rep * self.head_dim), root.repeat_interleave(self.head_dim)
        pairs = ((self.wq, q_rows), (self.wk, k_rows))
        biases = [RowScale(lin.bias, rows) for lin, rows in pairs if lin.bias is not None]
        return [RowScale(lin.weight, rows) for lin, rows in pairs] + biases

    def _cached_attention(
        self, xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, kv_cache: KVCache
    ) -> torch.Tensor:
        """Decoding: the new queries against every cached key, with SDPA for both attention types
        (a flex BlockMask would have to be rebuilt for every new length). k/v keep their heads."""
        start, seqlen = kv_cache.pos, xq.shape[1]
        xk, xv = kv_cache.update(self.layer_id, xk, xv)
        q, k, v = (t.transpose(1, 2) for t in (xq, xk, xv))
        if seqlen == 1:  # one new token sees every cached key: no mask, so fused kernels apply
            return sdpa(q, k, v)
        if start == 0:  # the prompt: plain causal attention
            return sdpa(q, k, v, is_causal=True)
        # Queries at an offset (is_causal aligns them top-left): query i sits at position
        # start + i and may see keys 0 .. start + i.
        keys = torch.arange(start + seqlen, device=xq.device)
        mask = keys[None, :] <= torch.arange(start, start + seqlen, device=xq.device)[:, None]
        return sdpa(q, k, v, attn_mask=mask)


def ffn_hidden_dim(args: TransformerModelArgs) -> int:
    """SwiGLU width: 2/3 of 4*dim (keeps the 3-matrix FFN at the 2-matrix cost), scaled, rounded."""
    hidden = int(2 * (4 * args.dim) / 3)
    if args.ffn_dim_multiplier is not None:
        hidden = int(args.ffn_dim_multiplier * hidden)
    return args.multiple_of * ((hidden + args.multiple_of - 1) // args.multiple_of)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: TransformerModelArgs, flex_kernel: FlexKernel | None = None) -> None:
        super().__init__()
        # Kept so depth-scaled init stays right after pipeline splitting removes earlier layers.
        self.layer_id = layer_id
        self.n_layers = args.n_layers
        self.depth_init = args.depth_init
        self.attention = Attention(args, flex_kernel, layer_id)
        self.feed_forward = FeedForward(args.dim, ffn_hidden_dim(args))
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        freqs_cis: torch.Tensor,
        attn_mask: AttnMask = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, attn_mask=attn_mask, kv_cache=kv_cache)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        # Output projections (wo, w2, w3) write into the residual stream, whose variance grows
        # with every block. depth_init shrinks them with the block's depth, 0.02/sqrt(2(l+1))
        # (two residual writes per block, as in GPT-2 / OLMo); otherwise all blocks use the
        # whole-network factor 0.02/sqrt(2 * n_layers).
        depth = self.layer_id + 1 if self.depth_init else self.n_layers
        out_std = 0.02 / math.sqrt(2 * depth)
        for lin in (self.attention.wq, self.attention.wk, self.attention.wv, self.feed_forward.w1):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02)
        for lin in (self.attention.wo, self.feed_forward.w2, self.feed_forward.w3):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=out_std)
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()


class Transformer(nn.Module):
    def __init__(self, model_args: TransformerModelArgs) -> None:
        super().__init__()
        self.model_args = model_args
        self.vocab_size = model_args.vocab_size
        self.n_layers = model_args.n_layers
        # Optional: a pipeline stage without the first (or last) modules sets them to None.
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(model_args.vocab_size, model_args.dim)
        # flex: one mask cache and one compiled kernel per model object (never module-global).
        self.block_masks = BlockMaskCache() if model_args.attn_type == "flex" else None
        block_causal = model_args.attn_mask_type == "block_causal"
        self.document_masks = DocumentMasks(model_args.attn_type) if block_causal else None
        flex_kernel = FlexKernel() if model_args.attn_type == "flex" else None
        # Sequence parallelism (set by tensor parallel) hands each block a 1/N sequence shard;
        # attention itself runs on the gathered sequence, N times longer.
        self.seq_shards = 1
        # A ModuleDict keyed "0".."n-1" keeps FQNs stable when pipeline stages delete layers.
        blocks = range(model_args.n_layers + mtp_depth(model_args))  # MTP's blocks after the model's
        self.layers = nn.ModuleDict({str(i): self.make_block(i, flex_kernel) for i in blocks})
        self.norm: RMSNorm | None = RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(model_args.dim, model_args.vocab_size, bias=False)
        # True: forward stops after the norm and the loss applies `output` by chunks (ModelSpec).
        self.loss_owns_output = False
        if model_args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Non-persistent: derived from args, so checkpoints stay free of it; init_weights
        # recomputes it after a meta-device build + to_empty().
        self.register_buffer("freqs_cis", self.rope_table(None), persistent=False)

    def rope_table(self, device: torch.device | str | None) -> torch.Tensor:
        """The RoPE table every block reads (a family with its own rotary scaling overrides it)."""
        return precompute_freqs_cis(self.model_args, device=device)

    def make_block(self, layer_id: int, flex_kernel: FlexKernel | None) -> nn.Module:
        """Block ``layer_id`` (a family reusing this skeleton builds its own blocks here)."""
        return TransformerBlock(layer_id, self.model_args, flex_kernel)

    def _apply(self, fn, recurse: bool = True):
        # nn.Module._apply (to_empty, .to, .cuda) replaces each module's parameter separately,
        # which silently unties shared weights; restore the tie afterwards.
        out = super()._apply(fn, recurse)
        if (
            self.model_args.tie_embeddings
            and self.tok_embeddings is not None
            and self.output is not None
            and self.output.weight is not self.tok_embeddings.weight
        ):
            self.output.weight = self.tok_embeddings.weight
        return out

    def _param_device(self) -> torch.device:
        for p in self.parameters():
            return p.device
        return self.freqs_cis.device

    def init_buffers(self, device: torch.device | None = None) -> None:
        """(Re)compute the derived buffers (the RoPE table) on `device` (default: the parameters').
        Loading weights into a model fresh from to_empty() needs this and not init_weights."""
        self.freqs_cis = self.rope_table(device if device is not None else self._param_device())

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """(Re)initialise buffers and parameters in place; seed with torch.manual_seed first.

        Only nn.init functions on existing parameters are used, so this works on plain tensors
        and on FSDP/TP DTensor parameters alike, and on pipeline stages missing some modules.
        """
        self.init_buffers(buffer_device)
        dim = self.model_args.dim
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=1.0)
        for block in self.layers.modules():
            if isinstance(block, TransformerBlock):  # also when wrapped by activation checkpointing
                block.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            # Logits start at unit scale: the normed hidden state has unit RMS, so std dim**-0.5
            # gives O(1) logits. With tied embeddings this also sets the embedding (a std-1
            # embedding would make the initial logits sqrt(dim) times too large).
            std = dim**-0.5
            nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def attention_mask(
        self, seqlen: int, device: torch.device, doc_ids: torch.Tensor | None, kv_cache: KVCache | None
    ) -> Any:
        """What every block gets as ``attn_mask`` for a window of ``seqlen`` positions."""
        if kv_cache is None and self.document_masks is not None:
            if doc_ids is None:
                raise TitanError(
                    'model.attn_mask_type = "block_causal" needs the batch\'s document ids: call the'
                    " model with doc_ids=titan.models.documents.document_ids(tokens, eos_id)"
                )
            return self.document_masks.build(doc_ids)
        if kv_cache is None and self.block_masks is not None:
            return self.block_masks.get(seqlen, device)
        return None

    def forward(
        self, tokens: torch.Tensor, kv_cache: KVCache | None = None, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens [B, S] int64 -> logits [B, S, vocab] in the parameter dtype (the normed hidden
        states [B, S, dim] with ``loss_owns_output``).

        Pipeline stages: without tok_embeddings the input is already hidden states [B, S, dim];
        without norm/output the hidden states are returned. With a ``kv_cache`` (generation) the
        tokens continue the cached ones at position ``kv_cache.pos``; the caller advances it, and
        the prompt is one document. ``doc_ids`` [B, S] (titan.models.documents.document_ids of the
        whole, unsharded window): the document of each position, needed with attn_mask_type
        block_causal. Multi-token prediction (titan.models.mtp) adds rows and the layers past n_layers.
        """
        h, mtp_embeddings = split_input(self, tokens, doc_ids, kv_cache)
        seqlen = h.shape[1]
        end = seqlen * self.seq_shards + (kv_cache.pos if kv_cache is not None else 0)
        if end > self.freqs_cis.shape[0]:
            raise TitanError(
                f"sequence length {end} exceeds model max_seq_len {self.freqs_cis.shape[0]}; "
                "raise model max_seq_len or lower training.seq_len"
            )
        # The full RoPE table: attention slices it for the length it sees (h may be a TP/SP
        # sequence shard). The attention mask is built here, once per batch (the causal flex mask
        # cached per length), not inside the compiled and checkpointed blocks.
        attn_mask = self.attention_mask(seqlen * self.seq_shards, h.device, doc_ids, kv_cache)
        for key, layer in self.layers.items():
            if int(key) < self.n_layers:  # the layers past them are multi-token prediction's
                h = layer(h, self.freqs_cis, attn_mask, kv_cache=kv_cache)
        return self.forward_tail(h) if mtp_embeddings is None else mtp_tail(self, h, mtp_embeddings, attn_mask)

    def forward_tail(self, h: torch.Tensor) -> torch.Tensor:
        """norm -> output, each where this part has it; the output is left to the loss when
        ``loss_owns_output`` (the chunked loss). Families built on this skeleton reuse it."""
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None and not self.loss_owns_output:
            h = self.output(h)
        return h
