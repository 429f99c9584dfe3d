"""Muon's optimizer step on 2 ranks against 1 rank, same matrices, one thread per process.

    python scripts/benchmark_muon.py [--dim 512] [--layers 2] [--steps 3] [--repeats 3]

The matrices are a llama3-style stack of ``--layers`` blocks of width ``--dim`` (wq, wo: dim x dim;
wk, wv: dim/4 x dim; w1, w3: 3 dim x dim; w2: dim x 3 dim). One pair of gloo processes times both:
rank 0 steps them as plain tensors (one rank; rank 1 waits in a barrier, idle), then both ranks
step them held as FSDP holds them (rows sharded over a mesh of 2), each matrix orthogonalised whole
on its owner, half the Newton-Schulz work each. The two alternate ``--repeats`` times, ``--steps``
steps each after one warm-up of both, so that a change in the machine's load falls on both alike.
A 2-rank step's time is its slower rank's. Prints one JSON line: the medians ``one_rank_s``,
``two_rank_s`` and their ``ratio`` (target: at most 0.65), the same on the fastest step of each
(``min_ratio``: the least disturbed by other processes on a shared machine), the CPU seconds per
step of a rank (all its threads: Newton-Schulz, packing, gloo's), the load average before and
after, and the setup.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

WORLD = 2


def _shapes(dim: int, layers: int) -> list[tuple[int, int]]:
    block = [(dim, dim), (dim // 4, dim), (dim // 4, dim), (dim, dim), (3 * dim, dim), (dim, 3 * dim), (3 * dim, dim)]
    return block * layers


def _timed(opt: torch.optim.Optimizer, params: list, grads: list) -> tuple[float, float]:
    """(wall, CPU) seconds of one step from a common start."""
    for p, g in zip(params, grads):
        p.grad = g
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    opt.step()
    return time.perf_counter() - wall, time.process_time() - cpu


def _run(rank: int, store: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from titan.training.muon import Muon

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp_shard",))
    gen = torch.Generator().manual_seed(0)
    fulls = [(torch.randn(s, generator=gen), torch.randn(s, generator=gen)) for s in _shapes(args.dim, args.layers)]
    sharded = [torch.nn.Parameter(distribute_tensor(w, mesh, (Shard(0),))) for w, _ in fulls]
    sharded_grads = [distribute_tensor(g, mesh, (Shard(0),)) for _, g in fulls]
    two = Muon(sharded, lr=1e-3, weight_decay=0.1)
    whole = [torch.nn.Parameter(w) for w, _ in fulls] if rank == 0 else []
    whole_grads = [g for _, g in fulls] if rank == 0 else []
    one = Muon(whole, lr=1e-3, weight_decay=0.1) if rank == 0 else None
    del fulls
    times: dict[str, list[tuple[float, float]]] = {"one": [], "two": []}
    for repeat in range(args.repeats + 1):  # the first: warm-up, not recorded
        for _ in range(1 if repeat == 0 else args.steps):
            if one is not None:
                sample = _timed(one, whole, whole_grads)
            else:
                dist.barrier()  # rank 1 idles while rank 0 steps alone
                sample = (0.0, 0.0)
            if repeat:
                times["one"].append(sample)
        for _ in range(1 if repeat == 0 else args.steps):
            sample = _timed(two, sharded, sharded_grads)
            if repeat:
                times["two"].append(sample)
    # the slower rank of each 2-rank step
    walls = torch.tensor([w for w, _ in times["two"]], dtype=torch.float64)
    dist.all_reduce(walls, op=dist.ReduceOp.MAX)
    cpus = torch.tensor([c for _, c in times["two"]], dtype=torch.float64)
    dist.all_reduce(cpus, op=dist.ReduceOp.MAX)
    if rank == 0:
        result = {
            "one_wall": [w for w, _ in times["one"]],
            "one_cpu": [c for _, c in times["one"]],
            "two_wall": walls.tolist(),
            "two_cpu": cpus.tolist(),
        }
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "seconds.json")
        os.environ.update({"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
        mp.start_processes(_run, args=(os.path.join(tmp, "store"), args, out), nprocs=WORLD, start_method="spawn")
        t = json.loads(Path(out).read_text())
    med = {k: statistics.median(v) for k, v in t.items()}
    print(
        json.dumps(
            {
                "one_rank_s": round(med["one_wall"], 3),
                "two_rank_s": round(med["two_wall"], 3),
                "ratio": round(med["two_wall"] / med["one_wall"], 3),
                "min_ratio": round(min(t["two_wall"]) / min(t["one_wall"]), 3),
                "one_rank_cpu_s": round(med["one_cpu"], 3),
                "two_rank_cpu_s": round(med["two_cpu"], 3),
                "target_ratio": 0.65,
                "matrices": len(_shapes(args.dim, args.layers)),
                "dim": args.dim,
                "layers": args.layers,
                "steps": args.steps,
                "repeats": args.repeats,
                "threads_per_process": 1,
                "torch": torch.__version__,
                "load_average_before": load_before,
                "load_average_after": os.getloadavg()[0],
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
