"""[training]: the Training section of the config tree (assembled in titan/config/job_config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from titan.config.choices import BadLines, MixedPrecisionDType, MixtureExhausted, NonFinite, TxtSplit
from titan.errors import require


@dataclass
class MixtureSource:
    """One source of a data mixture: a ``[[training.mixture]]`` (or ``[[validation.mixture]]``) table."""

    path: str = ""
    """A token store folder (scripts/tokenize_dataset.py) or a local text file/folder."""
    dataset: str = ""
    """A registry name (pydoc, c4, ...) instead of `path`; with `path` too, `path` is its local copy."""
    weight: float = 1.0
    """Share of the windows drawn from this source, relative to the other weights (> 0)."""

    def validate(self, key: str = "training.mixture[0]") -> None:
        """``key``: where the table sits, e.g. validation.mixture[2]."""
        require(self.weight > 0, f"{key}.weight", self.weight, "a number > 0")
        require(bool(self.path or self.dataset), key, self, "a table with path or dataset set")


@dataclass
class Training:
    dataset: str = "pydoc"
    """Dataset name from the registry (pydoc: the embedded offline corpus, c4, c4_validation), a
    Hugging Face hub dataset id (owner/name, e.g. HuggingFaceFW/fineweb-edu: streamed), or a local
    path."""
    dataset_path: str = ""
    """Local file or folder (jsonl/json/parquet/arrow/txt) to read instead of the hub source; for
    c4, a mirror in allenai/c4's layout (en/c4-train.*.json.gz); for a hub dataset, its mirror
    (`hf download ID --repo-type dataset --local-dir DIR`, card README.md included)."""
    dataset_config: str = ""
    """Hub datasets: the config (subset) name from the dataset's card, e.g. sample-10BT. Empty: the
    dataset's default config."""
    dataset_split: str = "train"
    """Hub datasets: the split to read (as the card's configs name them)."""
    dataset_text_field: str = "text"
    """Column that holds the document text in local / hub datasets."""
    dataset_txt_split: TxtSplit = "paragraph"
    """How .txt files are cut into documents: paragraph (at blank lines), line, or document
    (one document per file)."""
    local_batch_size: int = 8
    """Sequences per micro-batch on each data-parallel rank."""
    global_batch_size: int = -1
    """Sequences per optimizer step over all data-parallel ranks. -1: local_batch_size x dp.
    A larger multiple means gradient accumulation."""
    seq_len: int = 2048
    """Tokens per sequence."""
    steps: int = 10000
    """Optimizer steps to train for."""
    max_norm: float = 1.0
    """Gradient-norm clipping threshold (total L2 norm over all parameters). <= 0 disables it."""
    seed: int | None = None
    """Seed for weight init and RNG. None: a fixed default of 0 is used so runs are repeatable."""
    deterministic: bool = False
    """Bitwise-repeatable runs (slower): deterministic algorithms, fixed cuBLAS workspace, no cuDNN
    attention, Inductor without numerics-changing autotuning; see docs/stability.md."""
    mixed_precision_param: MixedPrecisionDType = "bfloat16"
    """FSDP parameter dtype in forward/backward: bfloat16 or float32 (on CPU bfloat16 matmuls are
    very slow; use float32 there)."""
    mixed_precision_reduce: MixedPrecisionDType = "float32"
    """FSDP gradient reduce dtype: float32 or bfloat16."""
    enable_cpu_offload: bool = False
    """FSDP2 CPU offload: sharded parameters, gradients and optimizer states live in host memory
    and the optimizer steps on the CPU; each block's parameters are copied to the device for its
    forward and backward only. Needs FSDP (data_parallel_shard_degree x context_parallel_degree >
    1); not with float8's FSDP all-gather."""
    dataset_infinite: bool = True
    """Re-loop over the dataset when it ends (logged, with an epoch counter). False: training
    stops cleanly when the data runs out."""
    dataset_bad_lines: BadLines = "fail"
    """A .jsonl line that is not a JSON object or not UTF-8: "fail" (stop naming file:line) or
    "skip" (drop it, log a count and the first few file:line)."""
    dataset_shuffle_seed: int | None = None
    """Token stores: read the windows of each epoch in a shuffled order drawn from this seed
    (reproducible, resumable, O(1) memory). None: in order. Text sources and validation data are
    always read in order."""
    mixture: list[MixtureSource] = field(default_factory=list)
    """Train on several sources by weight instead of `dataset`: [[training.mixture]] tables with
    `path` or `dataset`, and `weight` (docs/datasets.md). CLI: --training.mixture
    '[{path = "/data/web", weight = 0.7}, {dataset = "pydoc", weight = 0.3}]'."""
    mixture_exhausted: MixtureExhausted = "restart"
    """What a mixture source that runs out does: restart (read it again, next epoch) or stop
    (training stops cleanly; also what dataset_infinite = false means for a mixture)."""
    dataloader_num_workers: int = 0
    """Worker processes that prefetch batches (0: load in the training process)."""
    dataloader_pin_memory: bool = False
    """Hand batches over in pinned (page-locked) host memory, for faster copies to the GPU
    (no effect without an accelerator)."""
    dataloader_prefetch_factor: int | None = None
    """Batches each worker loads ahead (needs dataloader_num_workers > 0). None: torch's default, 2."""
    loss_chunk_tokens: int = 0
    """Tokens per chunk of the fused output projection + cross entropy. 0: the model computes the
    whole logits [local_batch_size x seq_len, vocab] and the loss takes them at once. C > 0: the
    loss applies the output projection C tokens at a time (forward and backward per chunk), so the
    logits never exist whole: loss memory ~ C x vocab x (logit bytes + 8) instead of
    local_batch_size x seq_len x vocab x the same (docs/performance.md has measurements)."""
    mtp_loss_weight: float = 0.3
    """Weight of the multi-token-prediction loss (model.mtp_depth > 0): the objective is the
    next-token loss + mtp_loss_weight x the mean over the depths of each depth's cross entropy, all
    normalised by the next-token loss's token count (torchtitan's MTPLoss and its default 0.3;
    DeepSeek-V3 trained with 0.3, then 0.1). The loss logged as ``loss`` stays the next-token one;
    ``mtp_loss`` is the unweighted mean over the depths. No effect with model.mtp_depth = 0."""
    gc_freq: int = 50
    """Run Python's garbage collector every N steps (automatic gc is disabled to avoid stalls)."""
    nonfinite: NonFinite = "stop"
    """What a NaN/inf loss or grad norm does (checked every step, before the optimizer step):
    stop (raise and exit non-zero naming the step and metric, saving nothing) or skip_step (no
    optimizer update for that step; the step counter, data and LR schedule still advance)."""
    nonfinite_max_consecutive_skips: int = 10
    """With nonfinite = skip_step: stop once this many steps in a row were skipped."""

    def validate(self) -> None:
        require(self.steps >= 1, "training.steps", self.steps, "an integer >= 1")
        require(self.local_batch_size >= 1, "training.local_batch_size", self.local_batch_size, "an integer >= 1")
        require(
            self.global_batch_size == -1 or self.global_batch_size >= 1,
            "training.global_batch_size",
            self.global_batch_size,
            "-1 (local_batch_size x dp) or an integer >= 1",
        )
        require(self.seq_len >= 2, "training.seq_len", self.seq_len, "an integer >= 2")
        require(
            self.dataloader_num_workers >= 0,
            "training.dataloader_num_workers",
            self.dataloader_num_workers,
            "an integer >= 0",
        )
        prefetch = self.dataloader_prefetch_factor
        require(
            prefetch is None or (prefetch >= 1 and self.dataloader_num_workers > 0),
            "training.dataloader_prefetch_factor",
            prefetch,
            "unset, or an integer >= 1 together with training.dataloader_num_workers > 0",
        )
        require(
            self.loss_chunk_tokens >= 0,
            "training.loss_chunk_tokens",
            self.loss_chunk_tokens,
            "an integer >= 0 (0: the full logits)",
        )
        require(self.mtp_loss_weight >= 0, "training.mtp_loss_weight", self.mtp_loss_weight, "a number >= 0")
        require(self.gc_freq >= 1, "training.gc_freq", self.gc_freq, "an integer >= 1")
        require(
            self.nonfinite_max_consecutive_skips >= 0,
            "training.nonfinite_max_consecutive_skips",
            self.nonfinite_max_consecutive_skips,
            "an integer >= 0",
        )
        for i, source in enumerate(self.mixture):
            source.validate(f"training.mixture[{i}]")
