"""Training metrics: one console line per log step, plus TensorBoard scalars.

Usage in the loop::

    metrics = MetricsProcessor(config.metrics, dump_folder=config.job.dump_folder, rank=rank, device=device,
                               num_flops_per_token=flops)
    metrics.reset(step)                      # after checkpoint load, right before the loop
    ...  metrics.add_data_time(dt); metrics.count_tokens(batch.numel())   # per micro-batch
    if metrics.should_log(step):
        metrics.log(step, loss=loss, grad_norm=norm, lr=lr)
    metrics.close()

Where scalars go: the console line (the logging rank(s), ``metrics.log_rank``), TensorBoard, a
JSONL file (one object per logged step, ``{"step": .., "loss_metrics/global_avg_loss": ..}``) and
Weights & Biases, each when enabled. ``extra`` scalars also go on the console line;
``extra_scalars`` only to the files.

Throughput (tps) is tokens per second per device: the tokens this rank counted, divided by the
wall time since the last log and by ``non_data_parallel_size`` (TP/CP/PP ranks work on the same
tokens, so the devices sharing them split the credit). Time spent in checkpointing and validation
is left out of that wall time (so out of tps and MFU); checkpoint time is logged on its own as
``time_metrics/checkpoint(s)`` (and on the console line of a window with a save).
"""

from __future__ import annotations

import json
import os
import re
import resource
import time
from datetime import datetime
from typing import Any

import torch

from titan.config.sections.metrics import Metrics
from titan.errors import TitanError
from titan.log import color_enabled, logger
from titan.training.flops import get_float8_peak_flops, get_peak_flops, mfu

__all__ = ["MetricsProcessor", "Color", "strip_color"]

_GIB = 1024**3
FILES_ONLY_PREFIXES = ("moe_layers/", "attention_layers/")
"""``extra`` keys with one of these prefixes (per-layer MoE and attention statistics) are written to
the files only."""


class Color:
    """ANSI escape codes for the console line."""

    red = "\033[31m"
    green = "\033[32m"
    yellow = "\033[33m"
    blue = "\033[34m"
    magenta = "\033[35m"
    cyan = "\033[36m"
    white = "\033[37m"
    reset = "\033[39m"


class _NoColor:
    red = green = yellow = blue = magenta = cyan = white = reset = ""


_ANSI = re.compile(r"\033\[[0-9;]*m")


def strip_color(text: str) -> str:
    return _ANSI.sub("", text)


def _cpu_memory() -> tuple[float, float]:
    """(resident bytes of this process, total physical RAM bytes; 0 when unknown)."""
    page = os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[1]) * page
    except (OSError, ValueError, IndexError):
        # No procfs (macOS): peak RSS instead of current; KiB on Linux, bytes on macOS.
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        used = maxrss if os.uname().sysname == "Darwin" else maxrss * 1024
    try:
        total = page * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        total = 0
    return float(used), float(total)


class MetricsProcessor:
    def __init__(
        self,
        cfg: Metrics,
        *,
        dump_folder: str,
        rank: int,
        device: torch.device,
        num_flops_per_token: int,
        float8: bool = False,
        log_this_rank: bool | None = None,
        non_data_parallel_size: int = 1,
        run_config: dict[str, Any] | None = None,
    ) -> None:
        """``cfg``: the [metrics] section; files go under ``dump_folder`` (job.dump_folder);
        ``run_config``: the whole config as a dict, recorded with a W&B run."""
        self.cfg = cfg
        self.rank = rank
        self.device = torch.device(device)
        self.num_flops_per_token = num_flops_per_token
        self.non_data_parallel_size = max(1, non_data_parallel_size)
        world = int(os.environ.get("WORLD_SIZE", 1))
        if not -1 <= self.cfg.log_rank < world:
            raise TitanError(
                f"config key 'metrics.log_rank' got {self.cfg.log_rank}; valid: -1 (all ranks) or a rank"
                f" below the world size {world}"
            )
        if log_this_rank is None:
            log_this_rank = self.cfg.log_rank in (-1, rank)
        self.log_this_rank = log_this_rank
        self.color = Color() if color_enabled(self.cfg.disable_color_printing) else _NoColor()
        # With every rank logging, each writes its own files.
        suffix = f"-rank{rank}" if self.cfg.log_rank == -1 else ""
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S") + suffix

        self.device_name = "cpu"
        # mfu is always against the bf16 peak (torchtitan's convention: float8 and bf16 runs compare
        # directly); float8 runs also get mfu_float8 against the float8 tensor-core peak.
        self.peak_flops: float | None = None
        self.peak_flops_float8: float | None = None
        if self.device.type == "cuda":
            self.device_name = torch.cuda.get_device_name(self.device)
            self.peak_flops = get_peak_flops(self.device_name)
            self.peak_flops_float8 = get_float8_peak_flops(self.device_name) if float8 else None
            if self.peak_flops is None:
                logger.warning(f"peak FLOPs of {self.device_name!r} unknown; MFU shows n/a")
            else:
                logger.info(
                    f"mfu is against the bf16 peak of {self.device_name}, {self.peak_flops / 1e12:,.0f} TFLOP/s"
                    + (
                        f"; mfu_float8 against its float8 peak, {self.peak_flops_float8 / 1e12:,.0f} TFLOP/s"
                        if self.peak_flops_float8
                        else ""
                    )
                )
            torch.cuda.reset_peak_memory_stats(self.device)

        self.writer: Any = None
        self.tb_log_dir: str | None = None
        if self.cfg.enable_tensorboard and self.log_this_rank:
            from torch.utils.tensorboard import SummaryWriter

            self.tb_log_dir = os.path.join(dump_folder, self.cfg.save_tb_folder, stamp)
            self.writer = SummaryWriter(log_dir=self.tb_log_dir)
            logger.info(f"TensorBoard logs in {self.tb_log_dir}")

        self.jsonl: Any = None
        self.jsonl_path: str | None = None
        if self.cfg.enable_jsonl and self.log_this_rank:
            folder = os.path.join(dump_folder, self.cfg.save_jsonl_folder)
            os.makedirs(folder, exist_ok=True)
            self.jsonl_path = os.path.join(folder, f"{stamp}.jsonl")
            self.jsonl = open(self.jsonl_path, "a", buffering=1)  # line-buffered: readable while running
            logger.info(f"metrics JSONL in {self.jsonl_path}")

        self.wandb: Any = None
        if self.cfg.enable_wandb and self.log_this_rank:
            self.wandb = _init_wandb(cfg, dump_folder, run_config or {}, suffix)

        self.reset(0)

    # -- accumulation between logs ---------------------------------------------------------

    def reset(self, step: int = 0) -> None:
        """Start a fresh measurement window ending the previous one at ``step`` (call once the
        setup, e.g. checkpoint loading, is done so it does not count as training time)."""
        self._last_step = step
        self._last_time = time.perf_counter()
        self._tokens = 0
        self._data_time = 0.0
        self._checkpoint_time = 0.0

    def count_tokens(self, n: int) -> None:
        self._tokens += int(n)

    def add_data_time(self, seconds: float) -> None:
        self._data_time += float(seconds)

    def exclude_time(self, seconds: float) -> None:
        """Leave ``seconds`` (validation, checkpointing) out of the current window's throughput."""
        self._last_time += float(seconds)

    def add_checkpoint_time(self, seconds: float) -> None:
        """Checkpoint hooks' wall time: out of tokens/s and MFU, logged as its own column."""
        self._checkpoint_time += float(seconds)
        self.exclude_time(seconds)

    def should_log(self, step: int) -> bool:
        return step == 1 or step % self.cfg.log_freq == 0

    # -- reporting ---------------------------------------------------------------------------

    def _memory(self) -> tuple[float, float, dict[str, float]]:
        """(GiB, % of device total, extra TensorBoard scalars)."""
        if self.device.type == "cuda":
            stats = torch.cuda.memory_stats(self.device)
            total = torch.cuda.get_device_properties(self.device).total_memory
            reserved = torch.cuda.max_memory_reserved(self.device)
            active = stats.get("active_bytes.all.peak", 0)
            gib, pct = reserved / _GIB, 100.0 * reserved / total
            extra = {
                "memory/max_reserved(GiB)": gib,
                "memory/max_reserved(%)": pct,
                "memory/max_active(GiB)": active / _GIB,
                "memory/max_active(%)": 100.0 * active / total,
                "memory/num_alloc_retries": float(stats.get("num_alloc_retries", 0)),
                "memory/num_ooms": float(stats.get("num_ooms", 0)),
            }
            torch.cuda.reset_peak_memory_stats(self.device)
            return gib, pct, extra
        used, total = _cpu_memory()
        gib, pct = used / _GIB, (100.0 * used / total if total else 0.0)
        return gib, pct, {"memory/rss(GiB)": gib, "memory/rss(%)": pct}

    def log(
        self,
        step: int,
        *,
        loss: float | torch.Tensor,
        grad_norm: float | torch.Tensor,
        lr: float,
        extra: dict[str, Any] | None = None,
        extra_scalars: dict[str, Any] | None = None,
    ) -> dict[str, float]:
        """Print the console line (on log ranks), write TensorBoard scalars (rank 0) and start a
        new window. Returns the scalars that were logged."""
        now = time.perf_counter()
        elapsed = max(now - self._last_time, 1e-9)
        steps = max(step - self._last_step, 1)
        tps = self._tokens / (elapsed * self.non_data_parallel_size)
        tflops = self.num_flops_per_token * tps / 1e12
        mfu_pct = mfu(tps, self.num_flops_per_token, self.peak_flops) if self.peak_flops else None
        mem_gib, mem_pct, mem_extra = self._memory()
        loss_f, grad_norm_f = float(loss), float(grad_norm)

        scalars: dict[str, float] = {
            "loss_metrics/global_avg_loss": loss_f,
            "grad_norm": grad_norm_f,
            "lr": float(lr),
            "throughput(tps)": tps,
            "tflops": tflops,
            **mem_extra,
            "time_metrics/end_to_end(s)": elapsed / steps,
            "time_metrics/data_loading(s)": self._data_time / steps,
            "time_metrics/data_loading(%)": 100.0 * self._data_time / elapsed,
            "time_metrics/checkpoint(s)": self._checkpoint_time,
        }
        if mfu_pct is not None:
            scalars["mfu(%)"] = mfu_pct
        if self.peak_flops_float8:
            scalars["mfu_float8(%)"] = mfu(tps, self.num_flops_per_token, self.peak_flops_float8)
        for key, value in {**(extra or {}), **(extra_scalars or {})}.items():
            scalars[key] = float(value)

        if self.log_this_rank:
            c = self.color
            mfu_text = f"{mfu_pct:.2f}%" if mfu_pct is not None else "n/a"
            line = (
                f"{c.red}step: {step:2}  "
                f"{c.green}loss: {loss_f:7.4f}  "
                f"{c.yellow}grad_norm: {grad_norm_f:7.4f}  "
                f"{c.cyan}memory: {mem_gib:5.2f}GiB({mem_pct:5.2f}%)  "
                f"{c.blue}tps: {round(tps):,}  "
                f"{c.magenta}tflops: {tflops:,.2f}  "
                f"{c.magenta}mfu: {mfu_text}"
            )
            if "mfu_float8(%)" in scalars:
                line += f"  {c.magenta}mfu_float8: {scalars['mfu_float8(%)']:.2f}%"
            if self._checkpoint_time >= 0.005:  # a save happened in this window (not the per-step polls)
                line += f"  {c.white}checkpoint: {self._checkpoint_time:.2f}s (not in tps)"
            for key, value in (extra or {}).items():
                if not key.startswith(FILES_ONLY_PREFIXES):  # per-layer detail: files only
                    line += f"  {c.white}{key}: {float(value):.4g}"
            logger.info(line + c.reset)

        self.write(step, scalars)

        self.reset(step)
        # The time spent logging belongs to the next window, not to nobody.
        self._last_time = now
        return scalars

    def write(self, step: int, scalars: dict[str, float]) -> None:
        """Send scalars to TensorBoard, the JSONL file and W&B (whichever are enabled here)."""
        if self.writer is not None:
            for key, value in scalars.items():
                self.writer.add_scalar(key, value, step)
            self.writer.flush()  # a run stopped by an error keeps every logged step
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, **scalars}, allow_nan=True) + "\n")
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def log_validation(self, step: int, *, loss: float, perplexity: float, tokens: int, seconds: float) -> None:
        if self.log_this_rank:
            c = self.color
            logger.info(
                f"{c.red}validation step: {step:2}  {c.green}loss: {loss:7.4f}  "
                f"{c.yellow}perplexity: {perplexity:.4g}  {c.blue}tokens: {tokens:,}  "
                f"{c.cyan}time: {seconds:.2f}s{c.reset}"
            )
        self.write(step, {"validation/loss": loss, "validation/perplexity": perplexity})

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def _init_wandb(cfg: Metrics, dump_folder: str, run_config: dict[str, Any], suffix: str) -> Any:
    try:
        import wandb
    except ImportError:
        raise TitanError(
            "metrics.enable_wandb needs the wandb package: pip install 'titan[wandb]'"
            " (or pip install wandb), or set metrics.enable_wandb = false"
        ) from None
    project = cfg.wandb_project or os.environ.get("WANDB_PROJECT") or "titan"
    name = cfg.wandb_run_name or os.environ.get("WANDB_NAME") or None
    os.makedirs(dump_folder, exist_ok=True)
    run = wandb.init(
        project=project,
        name=f"{name}{suffix}" if name else None,
        group=name if suffix else None,
        dir=dump_folder,  # W&B adds its own wandb/ folder under it
        config=run_config,
    )
    logger.info(f"W&B run {run.name!r} in project {project!r} (mode {os.environ.get('WANDB_MODE', 'online')})")
    return run
