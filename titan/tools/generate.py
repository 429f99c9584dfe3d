"""Sampling from a checkpoint: greedy / temperature / top-k, KV cache, optional tensor parallel.

Tensor parallel uses the training TP plan (apply_tp, sequence parallel included), which shards
activations along the sequence: every chunk fed to the model is right-padded to a multiple of
the TP degree. Right padding is exact for a causal model (no real position attends to a later
one) and the padded cache slots are overwritten by the next chunk.

The KV cache replaces each Attention module's forward while generating (module hooks such as
TP's input redistribution still run); the model file itself stays cache-free.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from titan.errors import TitanError
from titan.checkpointing import model_dcp as dcp_io
from titan.checkpointing import hf as hf_io
from titan.models import get_flavor, get_model_spec
from titan.models.llama.args import TransformerModelArgs
from titan.models.llama.model import Attention, Transformer, apply_rotary_emb, precompute_freqs_cis, repeat_kv


def checkpoint_args(path: str | Path, flavor: str | None = None) -> tuple[str, TransformerModelArgs]:
    """("hf" or "dcp", model args) of a checkpoint folder."""
    path = Path(path)
    if (path / "config.json").is_file():
        return "hf", hf_io.read_hf_config(path)
    if not (path / ".metadata").is_file():
        raise TitanError(f"{path} is neither a Hugging Face folder (config.json) nor a DCP checkpoint (.metadata)")
    args = dcp_io.read_model_args(path)
    if args is None:
        if flavor is None:
            raise TitanError(f"{path} has no {dcp_io.MODEL_ARGS_FILE}; pass --flavor (e.g. debugmodel, 8B)")
        args = dcp_io.infer_model_args(path, get_flavor(get_model_spec("llama3"), flavor))
    return "dcp", args


def load_model(path: str | Path, *, max_seq_len: int, device: torch.device, dtype: torch.dtype = torch.float32,
               flavor: str | None = None, tp_mesh: DeviceMesh | None = None) -> Transformer:
    kind, args = checkpoint_args(path, flavor)
    # The RoPE table only needs the positions we will generate; 3.1 configs say 131072.
    args = dataclasses.replace(args, max_seq_len=max_seq_len)
    with torch.device("meta"):
        model = Transformer(args)
    if tp_mesh is not None:
        from titan.models.llama.parallelize import apply_tp

        apply_tp(model, tp_mesh, loss_parallel=False)
    model.to_empty(device=device)
    if kind == "dcp":
        dcp_io.load_model_from_dcp(model, path)
    else:
        hf_io.load_hf_into_model([model], path)
    # Module.to(dtype) would also cast the complex RoPE table to a real dtype: drop it, rebuild.
    model.freqs_cis = None
    model.to(dtype)
    model.freqs_cis = precompute_freqs_cis(args, device=device)
    return model.eval()


@dataclasses.dataclass
class _Cache:
    pos: int = 0  # tokens already in the cache (excluding padding)
    max_len: int = 0


def _cached_forward(attn: Attention, cache: _Cache, store: dict):  # noqa: ANN202
    def forward(x: torch.Tensor, freqs_cis: torch.Tensor, block_mask=None) -> torch.Tensor:  # noqa: ANN001, ARG001
        bs, seqlen, _ = x.shape
        xq = attn.wq(x).view(bs, seqlen, -1, attn.head_dim)
        xk = attn.wk(x).view(bs, seqlen, -1, attn.head_dim)
        xv = attn.wv(x).view(bs, seqlen, -1, attn.head_dim)
        start, end = cache.pos, cache.pos + seqlen
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis[start:end])
        if "k" not in store:  # local kv heads under TP, so sized from the first projection
            shape = (bs, cache.max_len, xk.shape[2], attn.head_dim)
            store["k"], store["v"] = xk.new_zeros(shape), xv.new_zeros(shape)
        store["k"][:, start:end], store["v"][:, start:end] = xk, xv
        n_rep = attn.n_heads // attn.n_kv_heads
        k, v = repeat_kv(store["k"][:, :end], n_rep), repeat_kv(store["v"][:, :end], n_rep)
        q, k, v = (t.transpose(1, 2) for t in (xq, k, v))
        # Query i sits at position start + i and may see keys 0 .. start + i.
        mask = torch.arange(end, device=x.device)[None, :] <= torch.arange(start, end, device=x.device)[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return attn.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))

    return forward


@contextlib.contextmanager
def kv_cache(model: Transformer, max_len: int) -> Iterator[_Cache]:
    cache = _Cache(max_len=max_len)
    attns = [layer.attention for layer in model.layers.values()]
    for attn in attns:
        attn.forward = _cached_forward(attn, cache, {})
    try:
        yield cache
    finally:
        for attn in attns:
            del attn.forward  # back to the class's forward


def sample(logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator) -> torch.Tensor:
    """logits [B, V] -> token ids [B]; temperature 0 is greedy."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits.float(), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: Transformer, prompt: list[int], max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, seed: int = 0, stop_ids: set[int] = frozenset(), use_cache: bool = True,
             pad_multiple: int = 1) -> tuple[list[int], float]:
    """New token ids after `prompt`, and tokens/s of the decode loop. Under TP every rank calls it."""
    if not prompt:
        raise TitanError("the prompt is empty; give at least one token")
    if temperature < 0 or (top_k is not None and top_k < 1):
        raise TitanError(f"--temperature must be >= 0 and --top_k >= 1, got {temperature} and {top_k}")
    device = model.freqs_cis.device
    table = model.freqs_cis.shape[0]
    if len(prompt) + max_new_tokens + pad_multiple > table:
        raise TitanError(f"prompt {len(prompt)} + {max_new_tokens} new tokens exceeds the context {table}")
    generator = torch.Generator(device=device).manual_seed(seed)
    tokens = torch.tensor([prompt], dtype=torch.long, device=device)
    new: list[int] = []

    def run(chunk: torch.Tensor) -> torch.Tensor:
        n = chunk.shape[1]
        pad = -n % pad_multiple
        if pad:
            chunk = F.pad(chunk, (0, pad), value=0)
        return model(chunk)[:, n - 1].float()

    ctx = kv_cache(model, table) if use_cache else contextlib.nullcontext()
    with ctx as cache:
        t0 = time.perf_counter()
        chunk = tokens
        for _ in range(max_new_tokens):
            logits = run(chunk)
            nxt = sample(logits, temperature, top_k, generator)
            if dist.is_initialized():
                dist.broadcast(nxt, src=0)  # one sampled token for all TP ranks
            if cache is not None:
                cache.pos += chunk.shape[1]
                chunk = nxt[:, None]
            else:
                chunk = tokens = torch.cat([tokens, nxt[:, None]], dim=1)
            new.append(int(nxt.item()))
            if new[-1] in stop_ids:
                break
        elapsed = time.perf_counter() - t0
    return new, len(new) / max(elapsed, 1e-9)
