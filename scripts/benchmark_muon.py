"""Muon's optimizer step on 2 ranks against 1 rank, same matrices, one thread per process.

    python scripts/benchmark_muon.py [--dim 512] [--layers 2] [--steps 3]

The matrices are a llama3-style stack of ``--layers`` blocks of width ``--dim`` (wq, wo: dim x dim;
wk, wv: dim/4 x dim; w1, w3: 3 dim x dim; w2: dim x 3 dim). One rank steps them as plain tensors;
two ranks (gloo, CPU) hold them as FSDP does (rows sharded over a mesh of 2) and orthogonalise
each matrix whole on its owner, half the Newton-Schulz work each. The step time is the median over
``--steps`` steps after one warm-up (the slowest rank's, for 2 ranks). Prints one JSON line:
``one_rank_s``, ``two_rank_s``, ``ratio`` (target: at most 0.65), and the setup.
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


def _shapes(dim: int, layers: int) -> list[tuple[int, int]]:
    block = [(dim, dim), (dim // 4, dim), (dim // 4, dim), (dim, dim), (3 * dim, dim), (dim, 3 * dim), (3 * dim, dim)]
    return block * layers


def _run(rank: int, world: int, store: str, dim: int, layers: int, steps: int, out: str) -> None:
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from titan.training.muon import Muon

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(0)
    fulls = [(torch.randn(s, generator=gen), torch.randn(s, generator=gen)) for s in _shapes(dim, layers)]
    if world == 1:
        params = [torch.nn.Parameter(w) for w, _ in fulls]
        grads = [g for _, g in fulls]
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        params = [torch.nn.Parameter(distribute_tensor(w, mesh, (Shard(0),))) for w, _ in fulls]
        grads = [distribute_tensor(g, mesh, (Shard(0),)) for _, g in fulls]
    opt = Muon(params, lr=1e-3, weight_decay=0.1)
    times = []
    for _ in range(steps + 1):
        for p, g in zip(params, grads):
            p.grad = g
        dist.barrier()
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    slowest = torch.tensor([statistics.median(times[1:])], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(out).write_text(str(slowest.item()))
    dist.destroy_process_group()


def _time(world: int, args: argparse.Namespace) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "seconds")
        env = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        os.environ.update(env)
        mp.start_processes(
            _run,
            args=(world, os.path.join(tmp, "store"), args.dim, args.layers, args.steps, out),
            nprocs=world,
            start_method="spawn",
        )
        return float(Path(out).read_text())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    one, two = _time(1, args), _time(2, args)
    print(
        json.dumps(
            {
                "one_rank_s": round(one, 3),
                "two_rank_s": round(two, 3),
                "ratio": round(two / one, 3),
                "target_ratio": 0.65,
                "matrices": len(_shapes(args.dim, args.layers)),
                "dim": args.dim,
                "layers": args.layers,
                "steps": args.steps,
                "threads_per_process": 1,
                "torch": torch.__version__,
                "load_average": os.getloadavg()[0],
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
