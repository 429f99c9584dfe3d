"""[activation_checkpoint]: the ActivationCheckpoint section of the config tree (assembled in titan/config/job_config.py)."""

from __future__ import annotations

from dataclasses import dataclass

from titan.config.choices import ACMode


@dataclass
class ActivationCheckpoint:
    mode: ACMode = "none"
    """Recompute activations in backward instead of keeping them: none, full (every
    TransformerBlock keeps only its input) or selective (see selective_ac_option)."""
    selective_ac_option: int | str = "op"
    """With mode = selective: "op" keeps the outputs of every other matmul (and attention) per block
    and recomputes the rest; an integer N fully checkpoints every N-th block (layers 0, N, 2N...)."""
