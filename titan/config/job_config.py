"""The configuration tree: one dataclass per TOML section, each in its own module of
titan/config/sections/.

Every field has a type (fixed string choices are the Literal types of choices.py), a default and
a docstring (the string literal right under it). CLI flags, ``--help`` and docs/config_reference.md
are generated from these classes, so they are the only list of options. Adding a section: a module
in sections/ and one field here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType

from titan.config.sections.activation_checkpoint import ActivationCheckpoint
from titan.config.sections.checkpoint import Checkpoint
from titan.config.sections.comm import Comm
from titan.config.sections.compile import Compile
from titan.config.sections.debug import Debug
from titan.config.sections.fault_tolerance import FaultTolerance
from titan.config.sections.float8 import Float8
from titan.config.sections.job import Job
from titan.config.sections.lr_scheduler import LRScheduler
from titan.config.sections.metrics import Metrics
from titan.config.sections.model import Model
from titan.config.sections.optimizer import Optimizer
from titan.config.sections.parallelism import Parallelism
from titan.config.sections.profiling import Profiling
from titan.config.sections.simulate import Simulate
from titan.config.sections.stability import Stability
from titan.config.sections.training import Training
from titan.config.sections.validation import Validation
from titan.errors import require

__all__ = [
    "Job",
    "Model",
    "Optimizer",
    "LRScheduler",
    "Training",
    "Parallelism",
    "Metrics",
    "Checkpoint",
    "Stability",
    "Validation",
    "Profiling",
    "Comm",
    "ActivationCheckpoint",
    "Compile",
    "Float8",
    "Debug",
    "FaultTolerance",
    "Simulate",
    "JobConfig",
]


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    metrics: Metrics = field(default_factory=Metrics)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    stability: Stability = field(default_factory=Stability)
    validation: Validation = field(default_factory=Validation)
    profiling: Profiling = field(default_factory=Profiling)
    comm: Comm = field(default_factory=Comm)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    debug: Debug = field(default_factory=Debug)
    # Where each option was set ('section.key' -> "file:line", "command line", "environment"; an
    # option not in it has its default), filled by load_config. Not annotated: not an option.
    sources = MappingProxyType({})
    # One line per torchtitan key or value the loader translated, logged once logging is set up
    # (titan.config.dialects.log_translations). Not annotated: not an option.
    translations = tuple[str, ...]()
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    simulate: Simulate = field(default_factory=Simulate)

    def validate(self) -> None:
        """Every section's own checks, then the rules between sections. Checks that need runtime
        knowledge (the model registry, torch's optimizers and schedules, torchao) are
        titan.training.checks.validate_job; those that need the world size or device, the run plan's."""
        for section in dataclasses.fields(self):
            getattr(self, section.name).validate()
        cp = self.parallelism.context_parallel_degree
        require(
            self.model.attn_mask_type != "block_causal" or cp == 1,
            "model.attn_mask_type",
            rule=f'= "block_causal" does not combine with parallelism.context_parallel_degree {cp}: titan\'s CP'
            " paths (SDPA ring attention, flex with the causal mask over the head-tail rearranged rows)"
            ' know no document boundaries; use attn_mask_type "causal" with CP',
        )
        require(
            not self.checkpoint.last_save_in_hf or self.parallelism.pipeline_parallel_degree == 1,
            "checkpoint.last_save_in_hf",
            rule="is not supported with pipeline parallelism (no rank holds the"
            " whole model); export a DCP checkpoint with scripts/convert_hf.py",
        )
        require(
            self.activation_checkpoint.mode != "memory_budget"
            or (self.compile.enable and "model" in self.compile.components),
            "activation_checkpoint.mode",
            rule='= "memory_budget" needs compile: the budget is applied by compile\'s partitioner; set'
            ' compile.enable = true with "model" in compile.components, or use mode full or selective',
        )
        local, mbs = self.training.local_batch_size, self.parallelism.pipeline_parallel_microbatch_size
        require(
            self.parallelism.pipeline_parallel_degree == 1 or local % mbs == 0,
            "training.local_batch_size",
            rule=f"({local}) must be a multiple of parallelism.pipeline_parallel_microbatch_size ({mbs})",
        )
