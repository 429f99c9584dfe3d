"""Read Meta's original Llama 3 release format: params.json + consolidated.NN.pth.

Large models ship as model-parallel shards (one file per fairscale rank). Which dim a tensor is
split on depends on its layer type (column-parallel q/k/v/w1/w3/output on dim 0, row-parallel
wo/w2 on dim 1, the embedding on dim 0 for Llama 3's VocabParallelEmbedding but dim 1 for
Llama 2's ParallelEmbedding; norms replicated). Rather than hard-coding one release's layout,
the split dim is found by comparing each shard's shape with the full shape that params.json
implies, so either layout merges correctly and anything else is reported, not guessed.
titan's parameter names and RoPE layout are Meta's, so no renaming or permutation is needed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from titan.errors import TitanError, read_user_json
from titan.models.llama.args import TransformerModelArgs
from titan.models.llama.model import ffn_hidden_dim
from titan.progress import progress

# Meta's 3.1 reference code hard-codes these; params.json only says use_scaled_rope.
_META_ROPE_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    dict(rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_position_embeddings=8192)
)
_SKIP_KEYS = ("rope.freqs",)  # Llama 2 stored its RoPE table; titan recomputes it


def args_from_params(
    params: dict, vocab_size: int | None = None, rope_scale_factor: float | None = None, max_seq_len: int | None = None
) -> TransformerModelArgs:
    """params.json -> TransformerModelArgs. vocab_size fills in Llama 2's -1."""
    for key in ("dim", "n_layers", "n_heads"):
        if key not in params:
            raise TitanError(f"params.json has no {key!r}; expected Meta's Llama params (dim, n_layers, n_heads, ...)")
    vocab = params.get("vocab_size", -1)
    if vocab is None or vocab <= 0:
        vocab = vocab_size
    if vocab is None:
        raise TitanError("params.json vocab_size is missing or -1 and the checkpoint has no output.weight to infer it")
    scaled = bool(params.get("use_scaled_rope", False))
    args = TransformerModelArgs(
        dim=params["dim"],
        n_layers=params["n_layers"],
        n_heads=params["n_heads"],
        n_kv_heads=params.get("n_kv_heads"),
        vocab_size=vocab,
        multiple_of=params.get("multiple_of", 256),
        ffn_dim_multiplier=params.get("ffn_dim_multiplier"),
        norm_eps=params.get("norm_eps", 1e-5),
        rope_theta=float(params.get("rope_theta", 10000.0)),
        use_rope_scaling=scaled,
        rope_scale_factor=float(rope_scale_factor or params.get("rope_scaling_factor") or 8.0),
        max_seq_len=max_seq_len or params.get("max_seq_len", 131072 if scaled else 8192),
        **_META_ROPE_DEFAULTS,
    )
    args.validate()
    return args


def full_shapes(args: TransformerModelArgs) -> dict[str, tuple[int, ...]]:
    """Every parameter of the titan model with its unsharded shape."""
    dim, hd, hidden = args.dim, args.head_dim, ffn_hidden_dim(args)
    shapes: dict[str, tuple[int, ...]] = {
        "tok_embeddings.weight": (args.vocab_size, dim),
        "norm.weight": (dim,),
        "output.weight": (args.vocab_size, dim),
    }
    for i in range(args.n_layers):
        p = f"layers.{i}."
        shapes |= {
            p + "attention.wq.weight": (args.n_heads * hd, dim),
            p + "attention.wk.weight": (args.kv_heads * hd, dim),
            p + "attention.wv.weight": (args.kv_heads * hd, dim),
            p + "attention.wo.weight": (dim, args.n_heads * hd),
            p + "feed_forward.w1.weight": (hidden, dim),
            p + "feed_forward.w3.weight": (hidden, dim),
            p + "feed_forward.w2.weight": (dim, hidden),
            p + "attention_norm.weight": (dim,),
            p + "ffn_norm.weight": (dim,),
        }
    return shapes


def _merge(key: str, parts: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(parts[0].shape) == shape:
        # Replicated (norms; every tensor of a 1-shard checkpoint): all shards hold the same.
        return parts[0]
    for dim in range(len(shape)):
        others_match = all(p.shape[:dim] + p.shape[dim + 1 :] == shape[:dim] + shape[dim + 1 :] for p in parts)
        if others_match and sum(p.shape[dim] for p in parts) == shape[dim]:
            return torch.cat(parts, dim=dim)
    got = [tuple(p.shape) for p in parts]
    raise TitanError(
        f"Meta checkpoint tensor {key!r}: shard shapes {got} do not concatenate to {shape} (from params.json)"
    )


def shard_files(ckpt_dir: Path) -> list[Path]:
    files = sorted(ckpt_dir.glob("consolidated.*.pth"))
    if not files:
        raise TitanError(
            f"{ckpt_dir}: no consolidated.*.pth files"
            " (Meta's checkpoint layout is params.json + consolidated.00.pth ...)"
        )
    numbers = [re.fullmatch(r"consolidated\.(\d+)\.pth", f.name) for f in files]
    if [int(m.group(1)) if m is not None else -1 for m in numbers] != list(range(len(files))):
        raise TitanError(
            f"{ckpt_dir}: shard files must be consolidated.00.pth .."
            f" consolidated.{len(files) - 1:02d}.pth, got {[f.name for f in files]}"
        )
    return files


def load_meta_checkpoint(
    ckpt_dir: str | Path, rope_scale_factor: float | None = None, max_seq_len: int | None = None
) -> tuple[dict[str, torch.Tensor], TransformerModelArgs]:
    """Merge all shards into one titan model state dict (tensors keep the checkpoint's dtype)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise TitanError(f"Meta checkpoint folder {ckpt_dir} does not exist")
    params_file = ckpt_dir / "params.json"
    params = read_user_json(
        params_file, f"{params_file} is missing; Meta checkpoints ship params.json next to consolidated.*.pth"
    )
    if not isinstance(params, dict):
        raise TitanError(f"{params_file} holds a JSON {type(params).__name__}; Meta's params.json is an object")
    files = shard_files(ckpt_dir)
    shards = []
    for f in files:
        try:
            shards.append(torch.load(f, map_location="cpu", weights_only=True, mmap=True))
        except Exception as e:  # any unpickling failure means a bad file
            raise TitanError(f"{f} is not a readable torch.save checkpoint: {type(e).__name__}: {e}") from None
    keys = [set(s) - set(_SKIP_KEYS) for s in shards]
    if any(k != keys[0] for k in keys):
        raise TitanError(
            f"{ckpt_dir}: shards hold different tensor names; is one of {len(files)} files from another model?"
        )
    vocab = None
    if "output.weight" in keys[0]:
        vocab = sum(s["output.weight"].shape[0] for s in shards)  # column-parallel: vocab on dim 0
    args = args_from_params(params, vocab, rope_scale_factor, max_seq_len)
    if "output.weight" not in keys[0]:
        args.tie_embeddings = True  # Llama 3.2 1B/3B style: the embedding is the output projection
    shapes = full_shapes(args)
    if args.tie_embeddings:
        del shapes["output.weight"]
    missing, unexpected = sorted(set(shapes) - keys[0]), sorted(keys[0] - set(shapes))
    if missing or unexpected:
        raise TitanError(
            f"{ckpt_dir}: checkpoint does not match params.json (n_layers {args.n_layers}); "
            f"missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    merging = progress(shapes.items(), desc=f"merging {len(shards)} shard(s)", total=len(shapes), unit="tensor")
    state = {key: _merge(key, [s[key] for s in shards], shape) for key, shape in merging}
    if args.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    return state, args
