"""Sampling from a checkpoint: greedy / temperature / top-k, KV cache, optional tensor parallel.

The model comes from its family's spec (model class, args, TP plan) and decodes with its own
attention: the KV cache (titan.models.kv_cache) is an argument of the model's forward.

Tensor parallel uses the family's training TP plan (sequence parallel included), which shards
activations along the sequence: every chunk fed to the model is right-padded to a multiple of
the TP degree. Right padding is exact for a causal model (no real position attends to a later
one) and the padded cache slots are overwritten by the next chunk.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from titan.checkpointing import hf as hf_io
from titan.checkpointing import model_dcp as dcp_io
from titan.errors import TitanError
from titan.models import ModelSpec, spec_for_args
from titan.models.kv_cache import KVCache


def checkpoint_args(path: str | Path, flavor: str | None = None, model: str | None = None) -> tuple[str, Any]:
    """("hf" or "dcp", model args) of a checkpoint folder. A DCP folder says its family and shape
    as scripts/convert_hf.py to_hf reads them (hf.dcp_model_args: model_args.json or the run's saved
    config); ``model`` / ``flavor`` only where it records none. An HF folder says it in config.json."""
    path = Path(path)
    # A training step folder holds DCP's .metadata and the run's config.json: DCP decides.
    if (path / ".metadata").is_file():
        return "dcp", hf_io.dcp_model_args(path, model, flavor)
    if (path / "config.json").is_file():
        return "hf", hf_io.read_hf_config(path)
    raise TitanError(f"{path} is neither a Hugging Face folder (config.json) nor a DCP checkpoint (.metadata)")


def _cast_floats(model: nn.Module, dtype: torch.dtype) -> None:
    """Parameters and real buffers to `dtype`; complex buffers (RoPE tables) keep their precision,
    which Module.to(dtype) would discard."""
    model._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)


def load_model(
    path: str | Path,
    *,
    max_seq_len: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    flavor: str | None = None,
    tp_mesh: DeviceMesh | None = None,
    model: str | None = None,
) -> nn.Module:
    kind, args = checkpoint_args(path, flavor, model)
    spec: ModelSpec = spec_for_args(args)
    # The RoPE table only needs the positions we will generate; 3.1 configs say 131072.
    args = dataclasses.replace(args, max_seq_len=max_seq_len)
    with torch.device("meta"):
        net = spec.model_cls(args)
    if tp_mesh is not None:
        if spec.tensor_parallel_fn is None:
            raise TitanError(f"model {spec.name} has no tensor-parallel plan; run generation on one rank")
        spec.tensor_parallel_fn(net, tp_mesh, loss_parallel=False)
    net.to_empty(device=device)
    net.init_buffers(device)  # derived buffers (RoPE); the weights are loaded next
    if kind == "dcp":
        dcp_io.load_model_from_dcp(net, path)
    else:
        hf_io.load_hf_into_model([net], path)
    _cast_floats(net, dtype)
    return net.eval()


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
def generate(
    model: nn.Module,
    prompt: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
    stop_ids: AbstractSet[int] = frozenset(),
    use_cache: bool = True,
    pad_multiple: int = 1,
) -> tuple[list[int], float]:
    """New token ids after `prompt`, and tokens/s of the decode loop. Under TP every rank calls it."""
    if not prompt:
        raise TitanError("the prompt is empty; give at least one token")
    if temperature < 0 or (top_k is not None and top_k < 1):
        raise TitanError(f"--temperature must be >= 0 and --top_k >= 1, got {temperature} and {top_k}")
    device = next(model.parameters()).device
    model_args: Any = model.model_args  # every spec's model class keeps its args (ModelSpec.model_cls)
    table: int = model_args.max_seq_len
    if len(prompt) + max_new_tokens + pad_multiple > table:
        raise TitanError(f"prompt {len(prompt)} + {max_new_tokens} new tokens exceeds the context {table}")
    generator = torch.Generator(device=device).manual_seed(seed)
    tokens = torch.tensor([prompt], dtype=torch.long, device=device)
    cache = KVCache(table) if use_cache else None
    new: list[int] = []

    def run(chunk: torch.Tensor) -> torch.Tensor:
        n = chunk.shape[1]
        pad = -n % pad_multiple
        if pad:
            chunk = F.pad(chunk, (0, pad), value=0)
        return model(chunk, kv_cache=cache)[:, n - 1].float()

    t0 = time.perf_counter()
    chunk = tokens
    for _ in range(max_new_tokens):
        logits = run(chunk)
        nxt = sample(logits, temperature, top_k, generator)
        if dist.is_initialized():
            dist.broadcast(nxt, src=0)  # one sampled token for all TP ranks
        if cache is not None:
            cache.advance(chunk.shape[1])
            chunk = nxt[:, None]
        else:
            chunk = tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        new.append(int(nxt.item()))
        if new[-1] in stop_ids:
            break
    elapsed = time.perf_counter() - t0
    return new, len(new) / max(elapsed, 1e-9)
