"""Context parallel for the MoE families (deepseek_v3, qwen3's MoE flavors, llama4 without iRoPE).

On CPU (gloo, CP 2): the flex forward of each family against the unsharded model (logits, loss, and
every MoE layer's routing counts summed over the CP ranks), in fp32 and bf16 parameters; the
sequence-wise balance loss of a split sequence against the whole one (value and gradient), and an
MoE layer's gradients with it summed over the CP ranks against the unsharded layer's. The attention
kernels' backward needs CUDA under CP (see titan/parallel/dims.py check_layout):
tests/cuda/test_moe_cp_gpu.py trains there. The layouts CP does not allow are refused in one line.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from tests.helpers.distributed import run_distributed
from tests.helpers.moe_cp import CP_MOE, DS, SEQ, VOCAB
from titan.errors import TitanError
from titan.launch.entry import main
from titan.models.deepseek_v3.model import DeepSeekV3Transformer
from titan.models.llama.parallelize import apply_llama_cp, cp_buffers
from titan.models.llama4.args import Llama4ModelArgs
from titan.models.llama4.model import Llama4Transformer
from titan.models.moe import MoE, MoEArgs, moe_layers, sequence_balance_loss
from titan.models.moe.parallelize import apply_moe_cp
from titan.models.qwen3.args import Qwen3ModelArgs
from titan.models.qwen3.model import Qwen3Transformer
from titan.parallel.cp import cp_shard_batch, cp_sum, cp_unshard
from titan.training.loss import cross_entropy_sum

QWEN3CP_MOE = Qwen3ModelArgs(
    vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=64, max_seq_len=SEQ,
    attn_type="flex", moe_enabled=True,
    moe_args=MoEArgs(**CP_MOE, hidden_dim=32, route_norm=True, score_before_experts=False),
)  # fmt: skip
LLAMA4 = Llama4ModelArgs(
    vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ, attn_type="flex",
    interleave_moe_layer_step=1, moe_args=MoEArgs(**CP_MOE, num_shared_experts=1, score_before_experts=True),
)  # fmt: skip
MODELS = {
    "deepseek_v3": (DeepSeekV3Transformer, DS),
    "qwen3": (Qwen3Transformer, QWEN3CP_MOE),
    "llama4": (Llama4Transformer, LLAMA4),
}


def _routing_counts(model: torch.nn.Module) -> torch.Tensor:
    return torch.stack([m.tokens_per_expert.clone() for _, m in moe_layers([model])])


def _forward_parity(model_cls, args, mesh, dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    model = model_cls(args)
    model.init_weights()
    if dtype != torch.float32:
        model.to(dtype)
        model.init_buffers()  # the RoPE table stays complex64
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        ref_logits = model(inputs).float()
        ref_loss = cross_entropy_sum(ref_logits, labels)
    ref_counts = _routing_counts(model)
    for _, m in moe_layers([model]):
        m.reset_counters()
    apply_moe_cp(model, mesh, "flex", apply_llama_cp)
    with torch.no_grad(), cp_shard_batch(mesh, inputs, labels, cp_buffers(model)) as (x, y):
        assert model.freqs_cis.shape[0] == SEQ // mesh.size()  # the RoPE rows follow the sequence
        logits = model(x).float()
        loss = cross_entropy_sum(logits, y)
    dist.all_reduce(loss)
    counts = _routing_counts(model)
    dist.all_reduce(counts)
    return {
        "logits": (cp_unshard(mesh, logits) - ref_logits).abs().max().item(),
        "loss": (loss - ref_loss).abs().item() / ref_loss.item(),
        "counts_equal": torch.equal(counts, ref_counts),
        "routed": int(ref_counts.sum()),
    }


def _balance_loss_parity(rank: int, world: int, mesh) -> dict:
    """The sequence-wise balance loss of a head-tail split sequence against the whole one."""
    bs, e, k = 3, 8, 3
    g = torch.Generator().manual_seed(5)
    scores = torch.rand(bs, SEQ, e, generator=g).sigmoid()
    experts = torch.topk(scores, k, dim=-1).indices
    full = scores.clone().requires_grad_()
    want = sequence_balance_loss(full.view(-1, e), experts.view(-1, k), bs, e)
    want.backward()
    chunk = SEQ // (2 * world)
    rows = torch.cat([torch.arange(r * chunk, (r + 1) * chunk) for r in (rank, 2 * world - 1 - rank)])
    local = scores[:, rows].clone().requires_grad_()
    got = sequence_balance_loss(local.reshape(-1, e), experts[:, rows].reshape(-1, k), bs, e, cp_sum(mesh), world)
    got.backward()
    total = got.detach().clone()
    dist.all_reduce(total)
    assert local.grad is not None and full.grad is not None
    return {
        "loss": (total - want).abs().item() / want.item(),
        "grad": (local.grad - full.grad[:, rows]).abs().max().item(),
        "grad_scale": full.grad.abs().max().item(),
    }


def _moe_layer_grad_parity(rank: int, world: int, mesh) -> float:
    """An MoE layer with the balance loss on (its default scale: the mean over whole sequences), fed
    this rank's head-tail rows: its gradients summed over the CP ranks are the unsharded layer's."""
    torch.manual_seed(3)
    moe = MoE(replace(DS.moe_args, aux_loss_coeff=0.5), dim=32, hidden_dim=16)
    moe.init_weights(0.02)
    x, g = torch.randn(2, SEQ, 32), torch.randn(2, SEQ, 32)
    (moe(x) * g).sum().backward()
    want = {n: p.grad.clone() for n, p in moe.named_parameters() if p.grad is not None}
    moe.zero_grad()
    holder = nn.ModuleDict({"moe": moe})
    apply_moe_cp(holder, mesh, "flex", lambda *_: None)  # no attention here: only the MoE side
    chunk = SEQ // (2 * world)
    rows = torch.cat([torch.arange(r * chunk, (r + 1) * chunk) for r in (rank, 2 * world - 1 - rank)])
    (moe(x[:, rows]) * g[:, rows]).sum().backward()
    worst = 0.0
    for name, p in moe.named_parameters():
        if p.grad is None:
            continue
        grad = p.grad.clone()
        dist.all_reduce(grad)
        worst = max(worst, ((grad - want[name]).abs().max() / want[name].abs().max()).item())
    return worst


def _on_two_ranks(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    out: dict = {"balance": _balance_loss_parity(rank, world, mesh)}
    out["moe_layer"] = _moe_layer_grad_parity(rank, world, mesh)
    for name, (cls, args) in MODELS.items():
        out[name] = _forward_parity(cls, replace(args), mesh, torch.float32)
    out["deepseek_v3_bf16"] = _forward_parity(DeepSeekV3Transformer, replace(DS), mesh, torch.bfloat16)
    return out


@pytest.mark.slow
def test_moe_families_cp_forward_and_balance_loss_match_unsharded():
    """CP 2 (flex, gloo): each MoE family's logits and loss equal the unsharded model's, its routing
    counts summed over the CP ranks equal the unsharded counts; the split balance loss is the whole one."""
    for per_rank in run_distributed(_on_two_ranks, 2):
        bal = per_rank["balance"]
        # fp32 sums of ~SEQ terms in another grouping: a few ulps of the result.
        assert bal["loss"] < 1e-5 and bal["grad"] < 1e-6 * bal["grad_scale"], bal
        # Each gradient sums SEQ tokens' terms in two halves: fp32 rounding, relative to the largest entry.
        assert per_rank["moe_layer"] < 1e-5, per_rank["moe_layer"]
        for name in MODELS:
            r = per_rank[name]
            # The flex kernel sees the same rows and keys in both layouts (the CP mask only drops
            # the fully masked blocks): differences are fp32 rounding of the softmax's block order.
            assert r["logits"] < 1e-5 and r["loss"] < 1e-6, (name, r)
            args = MODELS[name][1]
            moe_blocks = sum(args.is_moe_layer(i) for i in range(args.n_layers))
            assert r["counts_equal"] and r["routed"] == moe_blocks * 2 * SEQ * args.moe_args.top_k, (name, r)
        bf16 = per_rank["deepseek_v3_bf16"]
        # bf16 parameters and activations: the same arithmetic up to bf16's rounding of block-ordered sums.
        assert bf16["loss"] < 2e-2, bf16


def test_cp_refusals_are_one_line(tmp_path, capsys: pytest.CaptureFixture):
    """The attention layouts CP cannot split are refused by the family's args (the run plan's check,
    before any process group, also in the dry run): llama4's iRoPE flavors and gpt-oss's sinks."""
    for name, flavor, why in (("llama4", "debugmodel_irope", "iRoPE blocks"), ("gpt_oss", "debugmodel", "sinks")):
        flags = ["--model.name", name, "--model.flavor", flavor, "--training.seq_len", "512"]
        flags += ["--job.dump_folder", str(tmp_path), "--parallelism.context_parallel_degree", "2"]
        assert main([*flags, "--job.dry_run", "--job.dry_run_world_size", "2"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert "context_parallel_degree = 2 is not supported" in err[-1] and why in err[-1], err[-1:]
    temperature = replace(LLAMA4, nope_layers=[0], chunked_layers=[], attn_temperature_tuning=True)
    with pytest.raises(TitanError, match="context_parallel_degree = 2 is not supported for this llama4 flavor"):
        temperature.check_parallelism(1, 2)
    LLAMA4.check_parallelism(1, 2)  # no iRoPE: allowed
    assert not hasattr(DS, "check_parallelism")  # DeepSeek-V3 refuses no layout
