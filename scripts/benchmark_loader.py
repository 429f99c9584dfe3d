"""Tokens/s of the data loader alone (read + tokenize + pack + collate), no model.

    python scripts/benchmark_loader.py [--path my_corpus.txt]
        [--seq_len 2048] [--batch_size 8] [--num_workers 0] [--batches 200] [--tokenizer ""]

Runs on the embedded pydoc corpus, and first on --path (a local text / JSONL file or folder) if given.
Compare with the trainer's tokens/s: the loader should be >= 20x faster than the model consumes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from titan.data import build_dataloader, build_tokenizer  # noqa: E402


def bench(name: str, dataset: str, path: str, tokenizer, args) -> float:
    loader = build_dataloader(dataset=dataset, dataset_path=path, text_field="text", tokenizer=tokenizer,
                              seq_len=args.seq_len, local_batch_size=args.batch_size, dp_rank=0,
                              dp_world_size=1, num_workers=args.num_workers)
    it = iter(loader)
    next(it)  # start-up (workers, first pass) is not throughput
    start, tokens = time.perf_counter(), 0
    for _ in range(args.batches):
        inputs, _ = next(it)
        tokens += inputs.numel()
    elapsed = time.perf_counter() - start
    tps = tokens / elapsed
    print(f"{name:>16}: {tps:>12,.0f} tokens/s  ({args.batches} batches of {args.batch_size}x{args.seq_len}, "
          f"{elapsed:.2f} s, workers={args.num_workers}, epoch {loader.state_dict()['streams'][0]['epoch']})")
    return tps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", default="", help="also benchmark this local file or folder (.txt, .jsonl, ...)")
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--num_workers", type=int, default=0)
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--tokenizer", default="", help="tokenizer path; empty: the shipped tokenizer")
    args = p.parse_args()
    tokenizer = build_tokenizer(args.tokenizer)
    if args.path:
        bench(Path(args.path).name, "local", args.path, tokenizer, args)
    bench("pydoc", "pydoc", "", tokenizer, args)


if __name__ == "__main__":
    main()
