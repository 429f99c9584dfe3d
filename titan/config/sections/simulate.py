"""[simulate]: the scale simulator (scripts/simulate.py): one CPU process plays one rank of an N-rank job."""

from __future__ import annotations

from dataclasses import dataclass

from titan.errors import require


@dataclass
class Simulate:
    rank: int = 0
    """The global rank the simulator plays (0 .. world size - 1). Pipeline ranks hold different
    stages, and with expert parallelism or uneven splits ranks differ: simulate the one you ask about."""
    device_memory_gib: float = 80.0
    """Memory of one accelerator in GiB: a rank whose simulated peak is above it is reported in one
    line naming the largest category, and the simulator exits with status 1."""
    moe_imbalance: float = 1.0
    """Expert parallelism: the tokens this rank's experts receive, as a multiple of the balanced
    share (1: every expert gets the same number of tokens; 1.5: this rank's experts get 50% more).
    Fake tensors carry no routing, so the all-to-all split sizes are this assumption."""
    max_layers: int = 8
    """Most transformer blocks the simulated rank runs at full depth. A rank holding more runs two
    short depths of the same layer pattern and extrapolates every number linearly to its full depth
    (said in the output). 0: always the full depth (slower: minutes per hundred layers)."""

    def validate(self) -> None:
        require(self.rank >= 0, "simulate.rank", self.rank, "an integer >= 0 (and below the world size)")
        require(self.device_memory_gib > 0, "simulate.device_memory_gib", self.device_memory_gib, "a number of GiB > 0")
        require(
            self.moe_imbalance >= 1.0,
            "simulate.moe_imbalance",
            self.moe_imbalance,
            "a factor >= 1 (1: balanced routing; 1.5: this rank's experts get 50% more tokens than the mean)",
        )
        require(self.max_layers >= 0, "simulate.max_layers", self.max_layers, "an integer >= 0 (0: full depth)")
