"""[float8]: the Float8 section of the config tree (assembled in titan/config/job_config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from titan.config.choices import Float8Recipe
from titan.errors import require


@dataclass
class Float8:
    enable_float8_linear: bool = False
    """Swap nn.Linear layers for torchao Float8Linear (float8 matmuls; needs CUDA SM89+ unless
    emulate)."""
    recipe: Float8Recipe = "tensorwise"
    """torchao scaling recipe: tensorwise (one scale per tensor) or rowwise (one per row)."""
    enable_fsdp_float8_all_gather: bool = False
    """FSDP2 all-gathers weights already cast to float8 (half the bytes of bf16); tensorwise only."""
    precompute_float8_dynamic_scale_for_fsdp: bool = False
    """After each optimizer step, compute all float8 weight scales with one all-reduce instead of
    one per layer in forward. Needs enable_fsdp_float8_all_gather."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Linear layers whose name contains any of these strings stay in high precision. Layers with
    a dimension that is not a multiple of 16 are always skipped (float8 kernel requirement)."""
    enable_float8_grouped_mm: bool = False
    """MoE models: run the routed experts' grouped GEMMs of the modules named in grouped_mm_fqns
    in float8 (torchao's MoE training: dynamic rowwise scales, scaled grouped GEMMs; CUDA SM89+,
    no pipeline or context parallel). torchtitan's converter "quantize.grouped_mm.float8"."""
    grouped_mm_fqns: list[str] = field(default_factory=list)
    """Modules whose name contains any of these strings get float8 grouped GEMMs, e.g.
    ["experts"]."""
    emulate: bool = False
    """Run the float8 matmuls in high precision after the casts (for testing on CPU or GPUs older
    than SM89); numerics match float8, speed does not."""

    def validate(self) -> None:
        """Options that only work together; whether torchao and the GPU can run them is checked at
        build time (titan.parallel.float8)."""
        require(
            not self.enable_float8_grouped_mm or bool(self.grouped_mm_fqns),
            "float8.grouped_mm_fqns",
            self.grouped_mm_fqns,
            'the routed experts\' module names (e.g. ["experts"]) when float8.enable_float8_grouped_mm is on',
        )
        if not self.enable_float8_linear:
            return
        require(
            self.recipe != "rowwise" or not self.enable_fsdp_float8_all_gather,
            "float8.enable_fsdp_float8_all_gather",
            rule="works only with float8.recipe = tensorwise (torchao has no float8 all-gather for rowwise scales)",
        )
        require(
            not self.precompute_float8_dynamic_scale_for_fsdp or self.enable_fsdp_float8_all_gather,
            "float8.precompute_float8_dynamic_scale_for_fsdp",
            rule="needs"
            " float8.enable_fsdp_float8_all_gather = true (the precomputed scales are those of the float8"
            " all-gather)",
        )
