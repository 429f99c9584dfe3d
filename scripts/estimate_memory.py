"""Estimate per-rank training memory for a config and world size, without building the model.

    python scripts/estimate_memory.py --world_size 8 --job.config_file train_configs/llama3_8b.toml
    python scripts/estimate_memory.py --measure_steps 5 --job.config_file train_configs/debug_model.toml

Any config override works (e.g. --activation_checkpoint.mode full, --training.local_batch_size 2).
--measure_steps N also trains the config for N steps on random tokens in this process (one rank,
CPU or one GPU) and prints the measured peak next to the estimate: on CUDA the allocator's
max_memory_allocated, elsewhere the parameters plus the peak of every tensor storage allocated
during the steps (titan.training.memory.measure_peak). Every layout is estimated (FSDP, HSDP, DDP,
TP, PP, CP, EP and their combinations); --simulate.rank picks the rank (default 0).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

from tabulate import tabulate  # noqa: E402

from titan.errors import TitanError  # noqa: E402
from titan.training.checks import load_job  # noqa: E402
from titan.training.memory import estimate_memory, measure_peak  # noqa: E402

_MIB = 1024**2


def _pop_int(argv: list[str], flag: str, default: int) -> int:
    for i, arg in enumerate(argv):
        if arg == flag or arg.startswith(flag + "="):
            value = arg.split("=", 1)[1] if "=" in arg else argv[i + 1]
            del argv[i : i + (1 if "=" in arg else 2)]
            try:
                return int(value)
            except ValueError:
                raise TitanError(f"{flag} got {value!r}; expected an integer") from None
    return default


def measure(config, steps: int) -> tuple[float, str]:
    """Train `steps` steps on random tokens in this process; (peak bytes, what was measured)."""
    from titan.training.trainer import Trainer

    config.metrics.enable_tensorboard = False
    return measure_peak(Trainer(config), steps)


def main(argv: list[str]) -> None:
    argv = list(argv)
    world_size = _pop_int(argv, "--world_size", 1)
    measure_steps = _pop_int(argv, "--measure_steps", 0)
    config = load_job(argv)
    est = estimate_memory(config, world_size)
    t = config.training
    print(
        f"{config.model.name} {config.model.flavor}: world size {world_size} ({est.layout}), rank {est.rank},"
        f" local batch {t.local_batch_size} x seq {t.seq_len}, activation checkpointing"
        f" {config.activation_checkpoint.mode}, compute dtype {t.mixed_precision_param};"
        f" {est.params:,} parameters on this rank"
    )
    rows = [(name, f"{b / _MIB:,.1f}") for name, b in est.rows()]
    print(
        tabulate(
            rows, headers=["per rank", "MiB"], tablefmt="github", colalign=("left", "right"), disable_numparse=True
        )
    )
    if config.compile.enable:
        print("note: torch.compile not modelled (eager activations counted; compile usually needs less)")
    if measure_steps:
        if world_size != 1:
            raise TitanError("--measure_steps runs one process; use --world_size 1")
        measured, what = measure(config, measure_steps)
        err = 100.0 * (est.total_bytes - measured) / measured
        print(
            f"measured ({what}, {measure_steps} steps): {measured / _MIB:,.1f} MiB;"
            f" estimate {est.total_bytes / _MIB:,.1f} MiB ({err:+.1f}%)"
        )


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except TitanError as e:
        print(f"titan: error: {e}", file=sys.stderr)
        sys.exit(2)
