"""Estimate per-rank training memory for a config and world size, without building the model.

    python scripts/estimate_memory.py --world_size 8 --job.config_file train_configs/llama3_8b.toml
    python scripts/estimate_memory.py --measure_steps 5 --job.config_file train_configs/debug_model.toml

Any config override works (e.g. --activation_checkpoint.mode full, --training.local_batch_size 2).
--measure_steps N also trains the config for N steps in this process (one rank, CPU or one GPU)
and prints the measured peak next to the estimate: on CUDA the allocator's peak allocated bytes,
on CPU the growth of the process's peak resident memory (RSS) over the RSS of the initialised
trainer, plus the parameters that the trainer already held then (the tokenizer and data pipeline
are not part of the estimate); glibc's mmap threshold is fixed so that RSS follows allocations.
"""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

from tabulate import tabulate  # noqa: E402

from titan.config import load_config  # noqa: E402
from titan.errors import TitanError  # noqa: E402
from titan.tools.memory import estimate_memory  # noqa: E402

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


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def measure(config, steps: int) -> tuple[float, str]:
    """Train `steps` steps in this process; (peak bytes of the training state, what was measured)."""
    import torch

    from titan.trainer import Trainer

    config.training.steps = steps
    config.metrics.enable_tensorboard = False
    config.metrics.log_freq = steps
    trainer = Trainer(config)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        trainer.train()
        return float(torch.cuda.max_memory_allocated()), "CUDA max_memory_allocated"
    # The estimate covers the training state, not the tokenizer and data pipeline that Trainer
    # builds too: take the RSS after init as the baseline and add back the parameters it holds.
    params = sum(p.numel() * p.element_size() for m in trainer.model_parts for p in m.parameters())
    before = _rss_bytes()
    trainer.train()
    return float(_peak_rss_bytes() - before + params), "peak RSS growth over the initialised trainer + parameters"


def main(argv: list[str]) -> None:
    argv = list(argv)
    world_size = _pop_int(argv, "--world_size", 1)
    measure_steps = _pop_int(argv, "--measure_steps", 0)
    if measure_steps and os.environ.get("MALLOC_MMAP_THRESHOLD_") is None and sys.platform == "linux":
        # glibc raises its mmap threshold after large frees and then keeps freed tensors in its
        # heap, so RSS stops following what is allocated; a fixed threshold returns every large
        # tensor to the OS on free (read at process start, hence the re-exec).
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    config = load_config(argv)
    est = estimate_memory(config, world_size)
    t = config.training
    print(
        f"{config.model.name} {config.model.flavor}: world size {world_size}, FSDP shard {est.dp_shard},"
        f" local batch {t.local_batch_size} x seq {t.seq_len}, activation checkpointing"
        f" {config.activation_checkpoint.mode}, compute dtype {t.mixed_precision_param};"
        f" {est.params:,} parameters on this rank"
    )
    rows = [(name, f"{b / _MIB:,.1f}") for name, b in est.rows()]
    print(tabulate(rows, headers=["per rank", "MiB"], tablefmt="github", colalign=("left", "right"), disable_numparse=True))
    if measure_steps:
        if world_size != 1:
            raise TitanError("--measure_steps runs one process; use --world_size 1")
        measured, what = measure(config, measure_steps)
        err = 100.0 * (est.total_bytes - measured) / measured
        print(f"measured ({what}, {measure_steps} steps): {measured / _MIB:,.1f} MiB;"
              f" estimate {est.total_bytes / _MIB:,.1f} MiB ({err:+.1f}%)")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except TitanError as e:
        sys.exit(f"error: {e}")
