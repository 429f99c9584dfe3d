"""[optimizer]: the Optimizer section of the config tree (assembled in titan/config/job_config.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from titan.config.choices import OptimizerImplementation, WeightDecayExclude
from titan.errors import require


@dataclass
class Optimizer:
    name: str = "AdamW"
    """Optimizer: AdamW or Adam."""
    lr: float = 8e-4
    """Peak learning rate (reached at the end of warmup)."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    implementation: OptimizerImplementation = "foreach"
    """Kernel choice: for-loop, foreach or fused (fused needs a device that supports it). Not
    used with bf16_stochastic_round, whose torchao kernel is compiled per parameter."""
    weight_decay_exclude: list[WeightDecayExclude] = field(default_factory=list)
    """Parameter kinds that get no weight decay (a second param group): any of "norms" (weights
    of *Norm modules), "embeddings" (nn.Embedding weights, and a tied output). Empty: decay all."""
    bf16_stochastic_round: bool = False
    """Keep parameters in bfloat16 and update them with torchao's AdamW, which computes in fp32
    and rounds the new weights to bf16 stochastically (unbiased, so small updates are not lost).
    Needs name = AdamW; compute then runs in bf16."""
    early_step_in_backward: bool = False
    """Step each parameter's optimizer inside backward, as soon as its gradient is ready, and free
    that gradient at once (per-parameter optimizers on post-accumulate-grad hooks): gradients of
    the whole model never exist together. Not with grad clipping (training.max_norm > 0), gradient
    accumulation, pipeline parallel, DDP or training.nonfinite = skip_step, which need every
    gradient before the first update."""

    def validate(self) -> None:
        """The ranges; the name is matched against the optimizer table by titan.training.optim."""
        require(math.isfinite(self.lr) and self.lr > 0, "optimizer.lr", self.lr, "a number > 0")
        for key in ("beta1", "beta2"):
            value = getattr(self, key)
            require(0.0 <= value < 1.0, f"optimizer.{key}", value, "a number in [0, 1)")
        require(math.isfinite(self.eps) and self.eps >= 0, "optimizer.eps", self.eps, "a number >= 0")
        require(
            math.isfinite(self.weight_decay) and self.weight_decay >= 0,
            "optimizer.weight_decay",
            self.weight_decay,
            "a number >= 0",
        )
        if self.bf16_stochastic_round:
            require(
                self.name.lower() == "adamw",
                "optimizer.name",
                self.name,
                "AdamW with optimizer.bf16_stochastic_round (torchao's kernel)",
            )
            require(
                self.implementation != "fused",
                "optimizer.implementation",
                self.implementation,
                "foreach or for-loop with optimizer.bf16_stochastic_round (torchao's compiled kernel)",
            )
