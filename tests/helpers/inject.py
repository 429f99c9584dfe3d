"""Fault injection into the trainer's steps: scaled (e.g. NaN) gradients or a NaN model output."""

from __future__ import annotations

from titan.training.trainer import Trainer


class Inject:
    """Wraps Trainer.train_step: at the chosen steps, scale every gradient (a parameter hook) or
    poison the model output (then the loss and the gradients are NaN)."""

    def __init__(
        self, monkeypatch, steps: set[int], *, grad_scale: float | None = None, output_nan: bool = False
    ) -> None:
        self.steps, self.grad_scale, self.output_nan = steps, grad_scale, output_nan
        original = Trainer.train_step
        inject = self

        def train_step(trainer, microbatches):
            if trainer.step not in inject.steps:
                return original(trainer, microbatches)
            model = trainer.model_parts[0]
            if inject.output_nan:
                handles = [model.register_forward_hook(lambda m, i, out: out * float("nan"))]
            else:
                handles = [p.register_hook(lambda g: g * inject.grad_scale) for p in model.parameters()]
            try:
                return original(trainer, microbatches)
            finally:
                for h in handles:
                    h.remove()

        monkeypatch.setattr(Trainer, "train_step", train_step)
