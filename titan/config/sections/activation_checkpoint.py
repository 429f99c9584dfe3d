"""[activation_checkpoint]: the ActivationCheckpoint section of the config tree (assembled in
titan/config/job_config.py)."""

from __future__ import annotations

from dataclasses import dataclass

from titan.config.choices import ACMode
from titan.errors import require


@dataclass
class ActivationCheckpoint:
    mode: ACMode = "none"
    """Recompute activations in backward instead of keeping them: none, full (every
    TransformerBlock keeps only its input) or selective (see selective_ac_option)."""
    selective_ac_option: int | str = "op"
    """With mode = selective: "op" keeps the outputs of every other matmul (and attention) per block
    and recomputes the rest; an integer N fully checkpoints every N-th block (layers 0, N, 2N...)."""

    def validate(self) -> None:
        if self.mode == "selective":
            parse_selective_option(self.selective_ac_option)


def parse_selective_option(option: int | str) -> int | str:
    """ "op" or a positive integer N (also given as a string, e.g. from a TOML "2")."""
    if isinstance(option, str) and option.strip().isdigit():
        option = int(option.strip())
    require(
        option == "op" or (isinstance(option, int) and not isinstance(option, bool) and option >= 1),
        "activation_checkpoint.selective_ac_option",
        option,
        '"op" or an integer >= 1',
    )
    return option
