"""[metrics]: the Metrics section of the config tree (assembled in titan/config/job_config.py)."""

from __future__ import annotations

from dataclasses import dataclass

from titan.errors import require


@dataclass
class Metrics:
    log_freq: int = 10
    """Log one console line (and TensorBoard scalars) every N steps."""
    param_norm_freq: int = 10
    """Add param_norm (total L2 norm of the weights entering the step) to the log of step 1 and of
    every log step that is a multiple of N. It reads every weight once, so log_freq = 1 runs pay for
    it only every N steps. 0: never."""
    max_logit_freq: int = 10
    """Add max_logit (the largest pre-softmax attention logit of the step, over layers and heads;
    each layer's to the files) to the log of step 1 and of every log step that is a multiple of N.
    Measuring it costs one more q.k^T per layer on that step with sdpa/varlen attention (nothing with
    flex on CUDA or gpt-oss), so log_freq = 1 runs pay for it only every N steps. 0: never. With
    optimizer.qk_clip_threshold it is measured every step and logged on every log step."""
    enable_tensorboard: bool = False
    """Write TensorBoard event files."""
    save_tb_folder: str = "tb"
    """TensorBoard folder, relative to job.dump_folder."""
    disable_color_printing: bool = False
    """Plain console output without ANSI colors. Colors are used only when the output is a
    terminal and NO_COLOR is not set, so logs written to a file or pipe are plain anyway."""
    log_rank: int = 0
    """Rank that prints the metrics line and writes TensorBoard / JSONL / W&B. -1: every rank
    (files get a rank suffix)."""
    startup_memory_estimate: bool = True
    """Estimate the per-rank memory for the start-up table (titan/training/memory.py: a fake
    forward and backward of a few blocks, about a second on the debug model, longer on wide
    models). One-process runs only: the estimate plays a rank in a fake world of its own, which a
    rank of a multi-rank run, inside the real one, cannot start; its row says so. false: the row
    says it is off. --job.dry_run and scripts/estimate_memory.py estimate any layout."""
    enable_jsonl: bool = True
    """Append every logged step's scalars as one JSON line to <dump_folder>/<save_jsonl_folder>/
    <run stamp>.jsonl (plot with scripts/plot_metrics.py)."""
    save_jsonl_folder: str = "metrics"
    """JSONL metrics folder, relative to job.dump_folder."""
    enable_wandb: bool = False
    """Log to Weights & Biases (pip install 'titan[wandb]'); WANDB_MODE=offline works without
    network. Files go under <dump_folder>/wandb."""
    wandb_project: str = ""
    """W&B project. Empty: $WANDB_PROJECT, else "titan"."""
    wandb_run_name: str = ""
    """W&B run name. Empty: $WANDB_NAME, else W&B's generated name."""

    def validate(self) -> None:
        require(self.log_freq >= 1, "metrics.log_freq", self.log_freq, "an integer >= 1")
        require(
            self.param_norm_freq >= 0, "metrics.param_norm_freq", self.param_norm_freq, "an integer >= 0 (0: never)"
        )
        require(self.max_logit_freq >= 0, "metrics.max_logit_freq", self.max_logit_freq, "an integer >= 0 (0: never)")
