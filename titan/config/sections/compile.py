"""[compile]: the Compile section of the config tree (assembled in titan/config/job_config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from titan.config.choices import CompileComponent


@dataclass
class Compile:
    enable: bool = False
    """torch.compile the parts named in `components` (inductor)."""
    components: list[CompileComponent] = field(default_factory=lambda: ["model", "loss"])
    """What to compile: model (each TransformerBlock, fullgraph) and/or loss (the cross entropy)."""

    def validate(self) -> None:
        """Nothing to check beyond what the loader does: enable is a bool and every component a Literal
        choice; whether compile runs on this device is found when it compiles."""
