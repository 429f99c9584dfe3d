"""[optimizer]: the Optimizer section of the config tree (assembled in titan/config/job_config.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from titan.config.choices import MuonAdjustLR, OptimizerImplementation, WeightDecayExclude
from titan.errors import require


@dataclass
class Optimizer:
    name: str = "AdamW"
    """Optimizer: AdamW, Adam or Muon (Muon for the hidden matrices, AdamW for embeddings, the
    output projection, norms, biases and router gates; see docs/optimizers.md)."""
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
    implementation: OptimizerImplementation = "auto"
    """Adam/AdamW kernel: auto (fused where torch has a fused kernel for every parameter's device,
    foreach otherwise and with bf16_stochastic_round), for-loop, foreach or fused. With Muon it
    is the kernel of the AdamW part. bf16_stochastic_round takes auto, foreach or for-loop
    (torchao's kernel is compiled per parameter)."""
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
    qk_clip_threshold: float | None = None
    """QK-clip (MuonClip with Muon; the same rescale with any optimizer): after each optimizer step,
    every attention head whose largest pre-softmax logit in the step exceeded this threshold tau
    (Kimi K2: 100) gets its query/key weights scaled so that logit would be tau. Unset: off (the
    largest logit is still logged, measured on log steps only). See docs/optimizers.md."""

    momentum: float = 0.95
    """Muon: momentum of the matrices' updates."""
    nesterov: bool = True
    """Muon: Nesterov momentum (orthogonalise g + momentum * (buffer - g) instead of the buffer)."""
    ns_steps: int = 5
    """Muon: Newton-Schulz iterations per update (torch's quintic coefficients)."""
    adjust_lr_fn: MuonAdjustLR = "match_rms_adamw"
    """Muon: how lr is scaled per matrix of shape A x B. match_rms_adamw (Moonlight):
    0.2 * sqrt(max(A, B)), so the update's RMS matches AdamW's and lr / weight_decay carry over from
    an AdamW config; original (Keller Jordan's): sqrt(max(1, A / B)), for Muon-tuned lrs (~0.02)."""
    adamw_lr: float | None = None
    """Muon: peak lr of the AdamW part (embeddings, output, norms, biases, router gates); unset:
    optimizer.lr. It follows the same schedule."""
    adamw_weight_decay: float | None = None
    """Muon: weight decay of the AdamW part; unset: optimizer.weight_decay. Its betas and eps are
    beta1, beta2 and eps."""
    muon_router_gate: bool = False
    """Muon: orthogonalise the MoE router's gate with Muon (Moonlight's and Kimi K2's choice)
    instead of stepping it with AdamW (docs/optimizers.md compares the two)."""

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
        if self.qk_clip_threshold is not None:
            tau = self.qk_clip_threshold
            require(math.isfinite(tau) and tau > 0, "optimizer.qk_clip_threshold", tau, "a number > 0, or unset")
        if self.adamw_lr is not None or self.adamw_weight_decay is not None:
            key = "optimizer.adamw_lr" if self.adamw_lr is not None else "optimizer.adamw_weight_decay"
            require(self.name.lower() == "muon", "optimizer.name", self.name, f"Muon with {key} (AdamW's own keys)")
        if self.muon_router_gate:
            require(self.name.lower() == "muon", "optimizer.name", self.name, "Muon with optimizer.muon_router_gate")
        if self.adamw_lr is not None:
            ok = math.isfinite(self.adamw_lr) and self.adamw_lr > 0
            require(ok, "optimizer.adamw_lr", self.adamw_lr, "a number > 0")
        if self.adamw_weight_decay is not None:
            require(
                math.isfinite(self.adamw_weight_decay) and self.adamw_weight_decay >= 0,
                "optimizer.adamw_weight_decay",
                self.adamw_weight_decay,
                "a number >= 0",
            )
        if self.name.lower() == "muon":
            require(0.0 <= self.momentum < 1.0, "optimizer.momentum", self.momentum, "a number in [0, 1)")
            require(1 <= self.ns_steps < 100, "optimizer.ns_steps", self.ns_steps, "an integer in [1, 99]")
            require(
                not self.early_step_in_backward,
                "optimizer.early_step_in_backward",
                self.early_step_in_backward,
                "false with Muon (it orthogonalises whole matrices, after every gradient is reduced)",
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
