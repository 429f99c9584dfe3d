"""[activation_checkpoint]: the ActivationCheckpoint section of the config tree (assembled in
titan/config/job_config.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from titan.config.choices import ACMode, DeterminismCheck
from titan.errors import require


@dataclass
class ActivationCheckpoint:
    mode: ACMode = "none"
    """Recompute activations in backward instead of keeping them: none, full (every
    TransformerBlock keeps only its input), selective (see selective_ac_option) or memory_budget
    (compile's min-cut partitioner decides what to keep, within memory_budget; needs compile.enable
    with "model" in compile.components)."""
    selective_ac_option: int | str = "op"
    """With mode = selective: "op" keeps the outputs of every other matmul (and attention) per block
    and recomputes the rest; an integer N fully checkpoints every N-th block (layers 0, N, 2N...)."""
    per_op_sac_force_recompute_mm_shapes_by_fqns: list[str] = field(default_factory=lambda: ["moe.router.gate"])
    """With selective_ac_option = "op": matmuls with the weight shape of any nn.Linear whose name
    contains one of these strings are always recomputed and not counted in "every other matmul"
    (e.g. a MoE router's small gate). Any matmul of that shape in the block is recomputed."""
    memory_budget: float = 0.5
    """With mode = memory_budget, in [0, 1]: the activation memory each compiled block may keep, as a
    fraction between recomputing everything the block computes (0.0, like full checkpointing) and
    compile's default, runtime-optimal choice (1.0). The partitioner picks the cheapest recomputation
    that fits."""
    visualize_memory_budget_pareto: bool = False
    """With mode = memory_budget: write the partitioner's runtime-vs-memory Pareto curve of each
    compiled graph as SVG files to <job.dump_folder>/memory_budget_pareto (needs matplotlib)."""
    preserve_rng_state: bool = False
    """Restore the RNG state when a checkpointed block is recomputed, so random ops (dropout) repeat
    their forward values. Off: titan's blocks have no random ops, and saving the CUDA RNG state
    costs a device sync per block."""
    early_stop: bool = True
    """Stop a block's recomputation as soon as every saved activation it needs has been recomputed
    (eager runs; under compile the partitioner decides the recomputation)."""
    determinism_check: DeterminismCheck = "default"
    """Compare the recomputed activations' shapes, dtypes and devices with the forward's and fail
    on a mismatch ("default"), or not ("none"). Eager runs only."""
    debug: bool = False
    """On a determinism-check failure, also print the ops the forward and the recomputation ran
    (slower). Eager runs only."""

    def validate(self) -> None:
        if self.mode == "selective":
            parse_selective_option(self.selective_ac_option)
        budget = self.memory_budget
        require(
            isinstance(budget, (int, float))
            and not isinstance(budget, bool)
            and math.isfinite(budget)
            and 0.0 <= budget <= 1.0,
            "activation_checkpoint.memory_budget",
            budget,
            "a number from 0.0 (recompute everything) to 1.0 (compile's default choice)",
        )
        fqns = self.per_op_sac_force_recompute_mm_shapes_by_fqns
        require(
            all(isinstance(f, str) and f.strip() for f in fqns),
            "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns",
            fqns,
            'a list of non-empty module names, e.g. ["moe.router.gate"]',
        )


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
