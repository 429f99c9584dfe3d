"""[debug]: switches that change what training computes, for benchmarking and debugging only."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Debug:
    moe_force_load_balance: bool = False
    """MoE models: ignore the router's choice and send each token's k-th choice to expert
    (token * top_k + k) % num_experts (round robin, every expert gets the same load), weighted by
    the router's scores for those experts. For benchmarks of the expert computation and
    communication free of routing imbalance; the model does not learn to route."""

    def validate(self) -> None:
        pass
