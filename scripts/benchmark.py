"""Benchmark training throughput of a config across switches (compile, AC, float8, ...).

    python scripts/benchmark.py --job.config_file train_configs/debug_model.toml
    python scripts/benchmark.py --steps 20 --warmup 5 --nproc 8 --job.config_file train_configs/llama3_8b.toml \\
        --variant "eager=" --variant "compile=--compile.enable" \\
        --variant "compile+fp8=--compile.enable --float8.enable_float8_linear"

Each variant runs in a fresh process (torchrun when --nproc > 1) with the shared overrides plus
its own: `warmup` steps untimed (compilation, allocator warm-up), then `steps` timed steps, each
ended by a host sync on the loss. Reported: median step time, tokens/s per device (local
micro-batch tokens x accumulation / median step time), peak memory (CUDA max allocated, or peak
RSS on CPU) and the last loss, so runs of the same config stay comparable. Without --variant the
standard set runs: eager, compile, AC full, AC selective op, AC every 2nd block, float8 (emulated
where float8 hardware is missing).
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

STANDARD = [
    ("eager", ""),
    ("compile", "--compile.enable"),
    ("AC full", "--activation_checkpoint.mode full"),
    ("AC selective op", "--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op"),
    ("AC every 2nd block", "--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option 2"),
    ("float8", "--float8.enable_float8_linear"),
]


def _float8_needs_emulation() -> bool:
    import torch

    return not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9)


def run_single(argv: list[str], warmup: int, steps: int, out_path: str) -> None:
    """Inside one variant's process: build the trainer, time the steps, write JSON (rank 0)."""
    import resource

    import torch

    from titan.config import load_config
    from titan.trainer import Trainer

    config = load_config(argv)
    config.training.steps = warmup + steps
    config.metrics.enable_tensorboard = False
    trainer = Trainer(config)
    cuda = trainer.device.type == "cuda"
    times, loss = [], float("nan")
    for i in range(warmup + steps):
        batches = trainer.next_microbatches()
        if batches is None:
            raise SystemExit("benchmark: the dataset ran out; use a larger dataset or fewer steps")
        if i == warmup and cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        trainer.step += 1
        loss_t, _ = trainer.train_step(batches)
        loss = loss_t.item()  # host sync: the step is done
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    t = config.training
    step_s = statistics.median(times)
    tokens = t.local_batch_size * t.seq_len * trainer.grad_accum_steps
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if trainer.rank == 0:
        Path(out_path).write_text(json.dumps({
            "step_s": step_s, "tokens_per_s": tokens / step_s, "peak_bytes": peak, "loss": loss,
            "step_s_min": min(times), "step_s_max": max(times),
            "device": torch.cuda.get_device_name() if cuda else "cpu",
        }))


def run_variant(base: list[str], extra: str, warmup: int, steps: int, nproc: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        script = [str(Path(__file__).resolve()), "--_single", out, "--warmup", str(warmup), "--steps", str(steps)]
        launcher = [sys.executable]
        if nproc > 1:
            launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
        cmd = launcher + script + base + shlex.split(extra)
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(out):
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
            return {"error": f"exit {proc.returncode}: {tail}"}
        return json.loads(Path(out).read_text())


def _pop(argv: list[str], flag: str, default: str | None, repeat: bool = False):  # noqa: ANN202
    values = []
    while flag in argv:
        i = argv.index(flag)
        values.append(argv[i + 1])
        del argv[i : i + 2]
    if repeat:
        return values
    return values[-1] if values else default


def main(argv: list[str]) -> None:
    argv = list(argv)
    single = _pop(argv, "--_single", None)
    warmup = int(_pop(argv, "--warmup", "3"))
    steps = int(_pop(argv, "--steps", "10"))
    nproc = int(_pop(argv, "--nproc", "1"))
    variants = [v.split("=", 1) for v in _pop(argv, "--variant", None, repeat=True)]
    if single is not None:
        run_single(argv, warmup, steps, single)
        return
    if not variants:
        variants = [list(v) for v in STANDARD]
        if _float8_needs_emulation():
            variants[-1] = ["float8 (emulated)", STANDARD[-1][1] + " --float8.emulate"]
    if not any(a in ("--job.config_file", "--config_file") or a.startswith("--job.config_file=") for a in argv):
        argv = ["--job.config_file", str(REPO / "train_configs/debug_model.toml")] + argv

    from tabulate import tabulate

    rows, base_tps, device = [], None, "?"
    for name, extra in variants:
        print(f"running {name} ({extra or 'no overrides'}) ...", file=sys.stderr, flush=True)
        r = run_variant(argv, extra, warmup, steps, nproc)
        if "error" in r:
            rows.append([name, "failed", "", "", "", "", ""])
            print(f"{name} failed: {r['error']}", file=sys.stderr)
            continue
        device = r["device"]
        base_tps = base_tps or r["tokens_per_s"]
        rows.append([
            name, f"{1000 * r['step_s']:.1f}", f"{1000 * r['step_s_min']:.0f}-{1000 * r['step_s_max']:.0f}",
            f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_s'] / base_tps:.2f}x",
            f"{r['peak_bytes'] / 2**20:,.0f}", f"{r['loss']:.4f}",
        ])
    memory = "CUDA max allocated" if device != "cpu" else "the process's peak RSS, imports and data included"
    print(f"device: {device}; {nproc} process(es); {warmup} warm-up + {steps} timed steps; peak mem: {memory};"
          f" overrides: {' '.join(argv)}")
    headers = ["variant", "median step (ms)", "min-max (ms)", "tokens/s/device", "vs first", "peak mem (MiB)", "last loss"]
    print(tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True))


if __name__ == "__main__":
    main(sys.argv[1:])
