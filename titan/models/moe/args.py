"""Hyper-parameters of a mixture-of-experts feed-forward layer (any family can embed one)."""

from __future__ import annotations

from dataclasses import dataclass, field

from titan.errors import TitanError

SCORE_FUNCS = ("sigmoid", "softmax")


@dataclass
class MoEArgs:
    """The layer's shape and routing. How it trains (grouped GEMMs, balancing, the debug routing)
    is left out of equality: weights trained with one setting load under another."""

    num_experts: int = 8
    num_shared_experts: int = 1
    """Dense experts every token goes through, as one FeedForward num_shared_experts times wider."""
    shared_hidden_dim: int | None = None
    """The shared experts' FeedForward width; None: hidden_dim x num_shared_experts."""
    shared_expert_gate: bool = False
    """Scale the shared experts' output per token by sigmoid(a linear map of the token to one
    value) (Qwen3-Next / Qwen3.5: ``shared_expert_gate``). Under TP the gate runs whole on every
    rank, its gradient summed over TP (titan.models.moe.parallelize)."""
    top_k: int = 1
    score_func: str = "sigmoid"
    """Router score per expert: sigmoid (independent) or softmax (over the experts), in fp32."""
    route_norm: bool = False
    """Divide each token's top-k scores by their sum (they then add up to 1, times route_scale)."""
    route_scale: float = 1.0
    gate_bias: bool = False
    score_before_experts: bool = True
    """Scale the expert's input by its score (True) or the expert's output (False)."""
    use_grouped_mm: bool = field(default=True, compare=False)
    """Run the routed experts as torch._grouped_mm where device and dtype allow it, else as a
    per-expert loop with the same numbers (the loop reads the token counts on the host)."""
    load_balance_coeff: float | None = field(default=1e-3, compare=False)
    """Auxiliary-loss-free balancing: after each optimizer step every expert's routing bias moves by
    this much towards balance (sign of mean load - its load, re-centred). None: no bias."""
    aux_loss_coeff: float = field(default=0.0, compare=False)
    """Weight of the sequence-wise balance loss added to the backward pass (0: off)."""
    hidden_dim: int | None = None
    """Hidden width of each routed expert; None: the embedding family decides (llama4 derives it)."""
    experts_bias: bool = False
    """Each routed expert's three projections carry a bias, added per token by its expert (gpt-oss)."""
    swiglu_limit: float | None = None
    """None: the experts' SwiGLU is silu(gate) * up. A number: gpt-oss's clamped variant, gate clamped
    above and up on both sides at this limit, then gate * sigmoid(swiglu_alpha * gate) * (up + 1)."""
    swiglu_alpha: float = 1.702
    """The sigmoid gain of the clamped SwiGLU (used only with swiglu_limit)."""
    num_expert_groups: int | None = None
    """Group-limited routing (DeepSeek's node-limited routing): the experts form this many equal
    groups, and a token picks its top_k only among the ``num_limited_groups`` groups whose two best
    (bias-shifted) scores add up highest. None: every expert is a candidate."""
    num_limited_groups: int | None = None
    force_load_balance: bool = field(default=False, compare=False)
    """Debugging/benchmarks: route token t's k-th choice to expert (t * top_k + k) % num_experts,
    ignoring the router's choice (the scores used are still the router's for those experts)."""

    def validate(self, prefix: str = "model.moe_args") -> None:
        def bad(field: str, value: object, valid: str) -> TitanError:
            return TitanError(f"{prefix}.{field} got {value!r}; valid: {valid}")

        if not isinstance(self.num_experts, int) or self.num_experts <= 0:
            raise bad("num_experts", self.num_experts, "a positive integer")
        if not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.num_experts:
            raise bad("top_k", self.top_k, f"an integer from 1 to num_experts ({self.num_experts})")
        if not isinstance(self.num_shared_experts, int) or self.num_shared_experts < 0:
            raise bad("num_shared_experts", self.num_shared_experts, "an integer >= 0")
        if self.score_func not in SCORE_FUNCS:
            raise bad("score_func", self.score_func, ", ".join(SCORE_FUNCS))
        if self.route_scale <= 0:
            raise bad("route_scale", self.route_scale, "a number > 0")
        if self.load_balance_coeff is not None and self.load_balance_coeff <= 0:
            raise bad("load_balance_coeff", self.load_balance_coeff, "a number > 0, or None to turn it off")
        if self.aux_loss_coeff < 0:
            raise bad("aux_loss_coeff", self.aux_loss_coeff, "a number >= 0 (0 turns it off)")
        if self.swiglu_limit is not None and not self.swiglu_limit > 0:
            raise bad("swiglu_limit", self.swiglu_limit, "a number > 0, or None for the plain SwiGLU")
        self._validate_groups(bad)
        for name in ("hidden_dim", "shared_hidden_dim"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise bad(name, value, "a positive integer or None")
        if self.shared_expert_gate and not self.num_shared_experts:
            raise bad("shared_expert_gate", True, "false when num_shared_experts is 0 (there is nothing to gate)")

    def _validate_groups(self, bad) -> None:
        groups, limited = self.num_expert_groups, self.num_limited_groups
        if groups is None:
            if limited is not None:
                raise bad("num_limited_groups", limited, "None when num_expert_groups is None")
            return
        if not isinstance(groups, int) or groups <= 0 or self.num_experts % groups or self.num_experts // groups < 2:
            valid = f"a divisor of num_experts ({self.num_experts}) leaving >= 2 per group"
            raise bad("num_expert_groups", groups, valid)
        per_group = self.num_experts // groups
        if not isinstance(limited, int) or not 1 <= limited <= groups or limited * per_group < self.top_k:
            raise bad(
                "num_limited_groups",
                limited,
                f"an integer from 1 to num_expert_groups ({groups}) whose groups hold >= top_k ({self.top_k}) experts",
            )
