"""[validation]: the Validation section of the config tree (assembled in titan/config/job_config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from titan.config.sections.training import MixtureSource
from titan.errors import require


@dataclass
class Validation:
    enable: bool = False
    """Compute loss and perplexity on held-out data every `freq` steps (and at the last step)."""
    dataset: str = "pydoc_validation"
    """Held-out dataset name from the registry (pydoc_validation: topics that pydoc_train leaves
    out; c4_validation), a hub dataset id (owner/name) or a local path."""
    dataset_path: str = ""
    """Local file or folder to read instead of the registry source; for c4_validation, a mirror in
    allenai/c4's layout (en/c4-validation.*.json.gz); for a hub dataset, its mirror."""
    dataset_config: str = ""
    """Hub datasets: the config (subset) name from the dataset's card. Empty: its default config."""
    dataset_split: str = "validation"
    """Hub datasets: the split to read (as the card's configs name them)."""
    mixture: list[MixtureSource] = field(default_factory=list)
    """Validate on several sources ([[validation.mixture]] tables with `path` or `dataset`): each
    source's loss is logged (validation/loss/NAME) next to the loss over all their tokens; the
    weights are not used. Empty: `dataset` alone."""
    freq: int = 100
    """Validate every N training steps."""
    steps: int = -1
    """Batches per validation (local_batch_size x seq_len each, per dp rank). -1: the whole set."""
    local_batch_size: int = -1
    """Sequences per validation batch per dp rank. -1: training.local_batch_size."""

    def validate(self) -> None:
        for i, source in enumerate(self.mixture):
            source.validate(f"validation.mixture[{i}]")
        if not self.enable:
            return
        require(self.freq >= 1, "validation.freq", self.freq, "an integer >= 1")
        require(
            self.steps == -1 or self.steps >= 1, "validation.steps", self.steps, "-1 (the whole set) or an integer >= 1"
        )
        require(
            self.local_batch_size == -1 or self.local_batch_size >= 1,
            "validation.local_batch_size",
            self.local_batch_size,
            "-1 (training.local_batch_size) or an integer >= 1",
        )
