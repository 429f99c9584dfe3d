"""Convert Meta's original Llama 3 checkpoint (params.json + consolidated.NN.pth) to a titan DCP folder.

    python scripts/convert_llama_to_dcp.py Meta-Llama-3.1-8B/original/ ckpt/llama3_8b_dcp
    # then train from it:  --checkpoint.initial_load_path ckpt/llama3_8b_dcp

Multi-shard releases (70B, 405B: one consolidated.NN.pth per model-parallel rank) are merged on
the fly. The output holds the model tensors at top-level names ("layers.0.attention.wq.weight")
plus model_args.json; it needs about the model's size in RAM (shards are memory-mapped).
Errors print one line and exit with status 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from titan.checkpointing.model_dcp import save_model_dcp  # noqa: E402
from titan.errors import TitanError  # noqa: E402
from titan.models.llama.meta_checkpoint import load_meta_checkpoint  # noqa: E402
from titan.parallel.fsdp import DTYPES  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("meta_ckpt_dir", help="folder with params.json and consolidated.*.pth")
    p.add_argument("out_dcp_dir", help="new (or empty) output folder")
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="cast the weights (default: keep the checkpoint's dtype, bfloat16 for Meta releases)",
    )
    p.add_argument(
        "--rope_scale_factor",
        type=float,
        default=None,
        help="Llama 3.1 RoPE scale factor when use_scaled_rope is set (default 8; Llama 3.2 1B/3B use 32)",
    )
    p.add_argument("--max_seq_len", type=int, default=None, help="context length recorded in model_args.json")
    args = p.parse_args(argv)
    try:
        t0 = time.perf_counter()
        state, model_args = load_meta_checkpoint(args.meta_ckpt_dir, args.rope_scale_factor, args.max_seq_len)
        if args.dtype:
            state = {k: v.to(DTYPES[args.dtype]) for k, v in state.items()}
            if model_args.tie_embeddings:
                state["output.weight"] = state["tok_embeddings.weight"]
        save_model_dcp(state, model_args, args.out_dcp_dir)
    except TitanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    n = sum(v.numel() for k, v in state.items() if not (model_args.tie_embeddings and k == "output.weight"))
    print(f"wrote {args.out_dcp_dir}: {n:,} parameters, {model_args.n_layers} layers, {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
