"""The data loader alone (read + tokenize + pack), no model: throughput, resume time, bytes read.

    python scripts/benchmark_loader.py [--dataset pydoc | c4 | NAME] [--dataset_path DIR | STORE]
        [--mixture '[{path = "STORE", weight = 0.7}, {dataset = "pydoc", weight = 0.3}]']
        [--shuffle_seed S] [--dp 1] [--workers 0] [--resume_at N1,N2,...] [--seq_len 2048] [--batch_size 8]
        [--max_docs 0] [--tokenizer ""]

Every dp rank (simulated one after the other in this process) reads one epoch of its share
(or --max_docs units); the ranks' throughput is averaged. The unit is what the loader counts for
the source: documents for text, windows (seq_len + 1 tokens) for a token store
(scripts/tokenize_dataset.py) and for a mixture (--mixture: training.mixture's CLI form; it reads
until a source runs out). --resume_at: positions in units read per rank; the state of dp rank 0
is saved when it first reaches each, and ``resume_s`` is the time from building a fresh loader
with that state to its first batch. The last line is JSON:

    {"unit": "documents" | "windows", "docs_per_s": ... (units per second), "tokens_per_s": ...,
     "resume_s": {"N1": s1, ...}, "bytes_read_per_rank": [...], "bytes_total": ...}

bytes_read_per_rank: on-disk bytes of the shard files each rank opened (a pass over the whole
stream counts every file). A test C4 mirror: scripts/make_c4_mirror.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from titan.config import load_config  # noqa: E402
from titan.data import build_dataloader, build_tokenizer  # noqa: E402
from titan.errors import TitanError  # noqa: E402
from titan.log import init_logger  # noqa: E402


def _docs(loader) -> int:
    """Units read: documents (text) or windows (store), summed over the streams; a mixture's draws."""
    state = loader.state_dict()
    return state["t"] if state.get("kind") == "mixture" else sum(st["docs"] for st in state["streams"])


def _unit(loader) -> str:
    return "documents" if getattr(loader, "layout", "mixture") in ("shards", "documents") else "windows"


def _bar(total: int | None, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="shard", disable=not sys.stderr.isatty(), leave=False)


def run_rank(make, rank: int, resume_at: list[int], max_docs: int) -> dict:
    """One rank's pass; states saved at the resume positions (rank 0)."""
    loader = make(rank, infinite=False)
    own = [j for j in range(getattr(loader, "num_shards", 0)) if j % loader.dp_world_size == rank]
    bar = _bar(len(own) if getattr(loader, "layout", "") == "shards" else None, f"dp rank {rank}")
    states, tokens, todo = {}, 0, sorted(resume_at) if rank == 0 else []
    start = time.perf_counter()
    for inputs, _ in loader:
        tokens += inputs.numel()
        docs = _docs(loader)
        while todo and docs >= todo[0]:
            states[todo.pop(0)] = loader.state_dict()
        bar.update(len(set(loader.read_stats()["opened"])) - bar.n)
        if max_docs and docs >= max_docs:
            break
    elapsed = time.perf_counter() - start
    bar.close()
    if todo:
        raise TitanError(
            f"--resume_at {todo[0]} is past the {_docs(loader)} {_unit(loader)} dp rank 0 reads; "
            "use smaller positions or --max_docs 0"
        )
    stats = loader.read_stats()
    return {
        "docs": _docs(loader),
        "unit": _unit(loader),
        "tokens": tokens,
        "s": elapsed,
        "states": states,
        "bytes_read": stats["bytes_read"],
        "bytes_total": stats["bytes_total"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="pydoc")
    p.add_argument("--dataset_path", default="")
    p.add_argument("--mixture", default="", help="training.mixture's CLI form (replaces --dataset)")
    p.add_argument("--shuffle_seed", type=int, default=None, help="token stores: shuffle windows with this seed")
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks to simulate")
    p.add_argument("--workers", type=int, default=0, help="loader workers per rank")
    p.add_argument("--resume_at", default="", help="comma-separated documents seen per rank")
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--max_docs", type=int, default=0, help="stop each rank after this many units (0: epoch)")
    p.add_argument("--tokenizer", default="", help="tokenizer path; empty: the shipped tokenizer")
    args = p.parse_args(argv)
    try:
        resume_at = [int(x) for x in args.resume_at.split(",") if x.strip()]
    except ValueError:
        print(f"benchmark_loader: error: --resume_at {args.resume_at!r} is not a list of integers", file=sys.stderr)
        return 2
    init_logger()  # the layout choice and resume lines go to stderr
    tokenizer = build_tokenizer(args.tokenizer)

    def make(rank: int, infinite: bool = True):
        return build_dataloader(
            dataset=args.dataset,
            dataset_path=args.dataset_path,
            text_field="text",
            tokenizer=tokenizer,
            seq_len=args.seq_len,
            local_batch_size=args.batch_size,
            dp_rank=rank,
            dp_world_size=args.dp,
            num_workers=args.workers,
            infinite=infinite,
            mixture=mixture,
            mixture_exhausted="restart" if infinite else "stop",
            shuffle_seed=args.shuffle_seed,
        )

    try:
        mixture = load_config(["--training.mixture", args.mixture]).training.mixture if args.mixture else None
        ranks = [run_rank(make, r, resume_at, args.max_docs) for r in range(args.dp)]
        resume_s = {}
        for n in resume_at:
            start = time.perf_counter()
            loader = make(0)
            loader.load_state_dict(ranks[0]["states"][n])
            next(iter(loader))
            resume_s[str(n)] = round(time.perf_counter() - start, 3)
    except TitanError as e:
        print(f"titan: error: {e}", file=sys.stderr)
        return 2
    seconds = sum(r["s"] for r in ranks)
    for r, res in enumerate(ranks):
        print(
            f"dp rank {r}: {res['docs']:,} {res['unit']}, {res['tokens']:,} tokens in {res['s']:.1f} s, "
            f"read {res['bytes_read']} of {res['bytes_total']} bytes",
            file=sys.stderr,
        )
    print(
        json.dumps(
            {
                "unit": ranks[0]["unit"],
                "docs_per_s": round(sum(r["docs"] for r in ranks) / seconds, 1),
                "tokens_per_s": round(sum(r["tokens"] for r in ranks) / seconds, 1),
                "resume_s": resume_s,
                "bytes_read_per_rank": [r["bytes_read"] for r in ranks],
                "bytes_total": ranks[0]["bytes_total"],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
