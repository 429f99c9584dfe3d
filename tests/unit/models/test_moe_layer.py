"""The MoE layer against a per-token reference, its two expert paths, routing, balancing and the
sequence-wise balance loss (fp32, tiny shapes)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from titan.errors import TitanError
from titan.models.moe import (
    MoE,
    MoEArgs,
    aux_loss_scale,
    bias_delta,
    run_grouped,
    run_loop,
    sequence_balance_loss,
    update_expert_bias,
)

DIM, HIDDEN = 16, 32


def _moe(seed: int = 0, **kw) -> MoE:
    torch.manual_seed(seed)
    m = MoE(MoEArgs(**{"num_experts": 4, "top_k": 2, **kw}), dim=DIM, hidden_dim=HIDDEN)
    m.init_weights(0.05)
    with torch.no_grad():  # larger weights than the init, so every term matters in the comparison
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m


def _expert(m: MoE, e: int, x: torch.Tensor) -> torch.Tensor:
    w1, w2, w3 = m.experts.w1[e], m.experts.w2[e], m.experts.w3[e]
    return w2 @ (F.silu(w1 @ x) * (w3 @ x))


def _reference(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: score, choose with the bias, weigh, run the chosen experts one at a time."""
    out = []
    for t in x.reshape(-1, DIM):
        logits = m.router.gate(t)
        s = torch.sigmoid(logits) if m.router.score_func == "sigmoid" else torch.softmax(logits, -1)
        choice = s if m.expert_bias is None else s + m.expert_bias
        chosen = torch.topk(choice, m.top_k).indices.tolist()
        w = s[chosen]
        if m.router.route_norm:
            w = w / w.sum()
        w = w * m.router.route_scale
        y = m.shared_experts(t) if m.shared_experts is not None else torch.zeros(DIM)
        for wk, e in zip(w, chosen):
            y = y + (_expert(m, e, wk * t) if m.score_before_experts else wk * _expert(m, e, t))
        out.append(y)
    return torch.stack(out).view(x.shape)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"score_func": "softmax", "route_norm": True, "route_scale": 2.5},
        {"score_before_experts": False, "num_shared_experts": 0, "top_k": 1},
        {"use_grouped_mm": False, "score_func": "softmax", "load_balance_coeff": None},
    ],
)
def test_moe_equals_per_token_loop_values_and_grads(kw):
    m = _moe(**kw)
    if m.expert_bias is not None:
        m.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
    ref = copy.deepcopy(m)
    x = torch.randn(2, 6, DIM)
    g = torch.randn(2, 6, DIM)
    (m(x) * g).sum().backward()
    (_reference(ref, x) * g).sum().backward()
    torch.testing.assert_close(m(x), _reference(ref, x), atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("align", [1, 16])
def test_grouped_mm_path_equals_loop_path(align):
    torch.manual_seed(1)
    w1, w3 = torch.randn(4, HIDDEN, DIM, requires_grad=True), torch.randn(4, HIDDEN, DIM, requires_grad=True)
    w2 = torch.randn(4, DIM, HIDDEN, requires_grad=True)
    x = torch.randn(13, DIM, requires_grad=True)
    counts = torch.tensor([5.0, 0.0, 7.0, 1.0])  # an expert without tokens too
    g = torch.randn(13, DIM)
    grads = []
    for fn in (lambda *a: run_grouped(*a, align=align), run_loop):
        out = fn(w1, w2, w3, x, counts)
        grads.append((out.detach(), *torch.autograd.grad((out * g).sum(), (x, w1, w2, w3))))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_router_bias_selects_but_does_not_weigh_and_force_balance_is_round_robin():
    m = _moe(top_k=1, route_scale=1.0)
    x = torch.randn(8, DIM)
    scores = m.router.scores(x)
    m.expert_bias.copy_(torch.tensor([10.0, 0.0, 0.0, 0.0]))  # expert 0 wins every token
    top, experts, counts, _ = m.router(x, m.expert_bias)
    assert experts.flatten().tolist() == [0] * 8 and counts.tolist() == [8, 0, 0, 0]
    # Integers: a mixed-precision policy casts the experts' floating-point inputs, never these.
    assert counts.dtype == torch.int64
    torch.testing.assert_close(top[:, 0], scores[:, 0])  # weighed by the unbiased score
    m.router.force_load_balance, m.router.top_k = True, 2
    top, experts, counts, _ = m.router(x, m.expert_bias)
    assert experts.tolist() == [[0, 1], [2, 3]] * 4 and counts.tolist() == [4.0] * 4
    torch.testing.assert_close(top, scores.gather(1, experts))


def test_route_norm_makes_weights_sum_to_route_scale():
    m = _moe(score_func="sigmoid", route_norm=True, route_scale=3.0, top_k=3)
    top, *_ = m.router(torch.randn(5, DIM))
    torch.testing.assert_close(top.sum(-1), torch.full((5,), 3.0))


def test_bias_update_follows_the_rule_with_counts_summed_by_reduce_fn():
    m = _moe(load_balance_coeff=0.01)
    m.tokens_per_expert.copy_(torch.tensor([6, 1, 3, 2]))  # mean 3: two over, one at, one under
    update_expert_bias([m], reduce_fn=lambda c: c * 2)  # a second rank with the same counts
    # sign(mean - load) = [-1, 1, 0, 1], re-centred by its mean 0.25.
    torch.testing.assert_close(m.expert_bias, 0.01 * torch.tensor([-1.25, 0.75, -0.25, 0.75]))
    assert m.tokens_since_log.tolist() == [12, 2, 6, 4]
    assert m.tokens_per_expert.abs().sum() == 0
    torch.testing.assert_close(bias_delta(torch.ones(4), 0.5), torch.zeros(4))
    # Balancing lowers the overloaded expert's chance: its biased score drops relative to the others.
    assert m.expert_bias[0] < m.expert_bias[2] < m.expert_bias[1]


def test_sequence_balance_loss_matches_its_definition():
    torch.manual_seed(2)
    bs, slen, e, k = 3, 5, 4, 2
    scores = torch.rand(bs * slen, e)
    experts = torch.topk(scores, k).indices
    want = 0.0
    for b in range(bs):
        s = scores[b * slen : (b + 1) * slen]
        p = (s / s.sum(-1, keepdim=True)).mean(0)
        f = torch.zeros(e)
        for row in experts[b * slen : (b + 1) * slen]:
            for i in row:
                f[i] += e / (k * slen)
        want += slen * float((f * p).sum())
    torch.testing.assert_close(sequence_balance_loss(scores, experts, bs, e), torch.tensor(want))


@pytest.mark.parametrize("scale", [None, 0.125])
def test_aux_loss_gradient_equals_gradient_of_the_explicit_loss(scale):
    m = _moe(aux_loss_coeff=0.7, score_func="softmax")
    plain = copy.deepcopy(m)
    plain.aux_loss_coeff = 0.0
    x, g = torch.randn(2, 6, DIM), torch.randn(2, 6, DIM)
    if scale is None:
        (m(x) * g).sum().backward()
    else:
        with aux_loss_scale(scale):
            (m(x) * g).sum().backward()
    flat = x.reshape(-1, DIM)
    _, experts, _, scores = plain.router(flat, plain.expert_bias)
    factor = scale if scale is not None else 1 / 12
    explicit = (plain(x) * g).sum() + factor * 0.7 * sequence_balance_loss(scores, experts, 2, 4)
    explicit.backward()
    assert m.router.gate.weight.grad is not None
    # The two backwards sum the same terms in another order (the aux loss's gradient flows in
    # through another graph): float32 sums of N terms of magnitude M may differ by ~N * eps * M.
    # Each router-logit gradient is a DIM-long dot product (upstream gradient . expert output),
    # then the gate weight's gradient sums it over the 12 tokens: the errors of chained sums add,
    # N = 12 + DIM; M = the parameter's largest gradient entry (~13 for the gate weight: an entry
    # near 0 is a cancellation of terms that large, hence an absolute, not relative, tolerance).
    n_terms = x.shape[0] * x.shape[1] + DIM
    for (name, p), q in zip(m.named_parameters(), plain.parameters()):
        atol = n_terms * torch.finfo(torch.float32).eps * float(q.grad.abs().max())
        torch.testing.assert_close(p.grad, q.grad, atol=atol, rtol=1e-5, msg=name)


def test_activation_checkpoint_recompute_does_not_count_tokens_twice():
    m = _moe()
    x = torch.randn(2, 6, DIM, requires_grad=True)
    checkpoint(m, x, use_reentrant=False).sum().backward()
    assert m.tokens_per_expert.sum().item() == 2 * 6 * 2


def test_evaluation_counts_no_tokens():
    """Validation's forwards (eval mode) leave the counts that the next step's bias update reads."""
    m = _moe().eval()
    with torch.no_grad():
        m(torch.randn(2, 6, DIM))
    assert m.tokens_per_expert.sum().item() == 0 and m.padded_since_log.item() == 0


def test_bad_args_name_the_field():
    with pytest.raises(TitanError, match=r"model.moe_args.top_k got 5; valid: an integer from 1 to num_experts \(4\)"):
        MoEArgs(num_experts=4, top_k=5).validate()
    with pytest.raises(TitanError, match="score_func got 'relu'; valid: sigmoid, softmax"):
        MoEArgs(score_func="relu").validate()


def test_autocast_runs_the_experts_in_the_autocast_dtype_on_both_paths():
    """fp32 parameters under bf16 autocast (one rank / DDP): the grouped GEMM gets bf16 operands, as
    a matmul would, and matches the loop."""
    grouped = _moe(seed=3)
    loop = copy.deepcopy(grouped)
    loop.experts.use_grouped_mm = False
    x = torch.randn(2, 6, DIM)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert grouped.experts.uses_grouped_mm(x) and not loop.experts.uses_grouped_mm(x)
        a, b = grouped(x), loop(x)
    assert a.dtype == b.dtype == torch.bfloat16
    torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
