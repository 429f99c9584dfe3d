"""Profile a few training steps of one benchmark config and print torch.profiler's own table.

    python scripts/profile_step.py --preset llama3_8b_8layers --row compile            # one GPU
    python scripts/profile_step.py --row eager --warmup 2 --steps 2 --model.n_layers 2   # CPU, debug model

The config is scripts/benchmark.py's: its preset's overrides, then the named row's (``--row``, a
config of its GPU set: eager, compile, float8-tensorwise, ...), then any further ``--section.key
value`` overrides. After ``--warmup`` steps (compilation, allocator warm-up) ``--steps`` steps are
recorded; printed: the top ``--top`` ops by device time (CPU time without a GPU), and per step the
wall time, the device's busy time (the sum of its kernels' times from the same table) and the host
gap between them (the time the device waits for the host).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from benchmark import FLOAT8, GPU_CONFIGS, PRESETS, _float8_needs_emulation  # noqa: E402


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None)
    rows = [name for name, _ in GPU_CONFIGS]
    parser.add_argument("--row", choices=rows, default="compile", help="the benchmark config to profile")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=15)
    args, overrides = parser.parse_known_args(argv)
    for flag in ("warmup", "steps", "top"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1; got {getattr(args, flag)}")

    import torch
    from torch.profiler import ProfilerActivity, profile

    from titan.training.checks import load_job
    from titan.training.trainer import Trainer

    row = dict(GPU_CONFIGS)[args.row]
    if FLOAT8 in row and _float8_needs_emulation():
        row += " --float8.emulate"  # no float8 tensor cores: emulated, as the benchmark does
    preset = PRESETS[args.preset]["args"] if args.preset else []
    config_args = list(preset) + shlex.split(row) + overrides
    if not any(a.startswith(("--job.config_file", "--config_file")) for a in config_args):
        config_args = ["--job.config_file", str(REPO / "train_configs/debug_model.toml"), *config_args]
    config = load_job(config_args)
    if not any(a.startswith("--job.dump_folder") for a in config_args):
        config.job.dump_folder = tempfile.mkdtemp(prefix="profile_step_")  # nothing of it is kept
    config.training.steps = args.warmup + args.steps
    config.checkpoint.enable = False
    config.metrics.enable_tensorboard = config.metrics.enable_wandb = False
    trainer = Trainer(config)
    cuda = trainer.device.type == "cuda"

    def one_step() -> None:
        microbatches = trainer.next_microbatches()
        if microbatches is None:
            raise SystemExit("profile_step: the dataset ran out")
        trainer.train_state.step += 1
        result = trainer.train_step(microbatches)
        # The trainer's one host read of a logged step: the step ends when the device is done.
        trainer.stability.read(trainer.step, result.loss, result.grad_norm, result.extra)

    for _ in range(args.warmup):
        one_step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            one_step()
        if cuda:
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / args.steps
    events = prof.key_averages()
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    print(f"profile: {args.row} ({shlex.join(config_args)}); {args.warmup} warm-up + {args.steps} recorded steps")
    print(events.table(sort_by=sort, row_limit=args.top))
    line = f"per step: wall {1000 * wall:.1f} ms"
    if cuda:
        busy = sum(e.self_device_time_total for e in events) / 1000 / args.steps  # us -> ms
        line += f", device busy {busy:.1f} ms (sum of kernel times), host gap {1000 * wall - busy:.1f} ms"
    print(line)


if __name__ == "__main__":
    main(sys.argv[1:])
