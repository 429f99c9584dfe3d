"""[optimizer]: the Optimizer section of the config tree (assembled in titan/config/job_config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from titan.config.choices import OptimizerImplementation, WeightDecayExclude


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
