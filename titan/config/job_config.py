"""The configuration tree: one dataclass per TOML section, each in its own module of
titan/config/sections/.

Every field has a type (fixed string choices are the Literal types of choices.py), a default and
a docstring (the string literal right under it). CLI flags, ``--help`` and docs/config_reference.md
are generated from these classes, so they are the only list of options. Adding a section: a module
in sections/ and one field here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from titan.config.sections.job import Job
from titan.config.sections.model import Model
from titan.config.sections.optimizer import Optimizer
from titan.config.sections.lr_scheduler import LRScheduler
from titan.config.sections.training import Training
from titan.config.sections.parallelism import Parallelism
from titan.config.sections.metrics import Metrics
from titan.config.sections.checkpoint import Checkpoint
from titan.config.sections.stability import Stability
from titan.config.sections.validation import Validation
from titan.config.sections.profiling import Profiling
from titan.config.sections.comm import Comm
from titan.config.sections.activation_checkpoint import ActivationCheckpoint
from titan.config.sections.compile import Compile
from titan.config.sections.float8 import Float8

__all__ = ["Job", "Model", "Optimizer", "LRScheduler", "Training", "Parallelism", "Metrics", "Checkpoint", "Stability", "Validation", "Profiling", "Comm", "ActivationCheckpoint", "Compile", "Float8", "JobConfig"]


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
