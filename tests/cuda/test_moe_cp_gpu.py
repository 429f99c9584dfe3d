"""Context parallel for the MoE families on 2 GPUs (NCCL; skipped with the reason on fewer): SDPA's
ring attention with DeepSeek-V3's latent attention (values narrower than queries/keys) and the
balance loss on. The model's gradients summed over the CP ranks equal the unsharded model's, and
the trainer's CP 2 curve equals FSDP 2's (fp32 within 1e-5 per step, bf16 within its rounding)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tests.helpers.deepseek import BF16, BF16_TOL, SHARD, dstest_flavor, layouts
from tests.helpers.distributed import run_distributed
from tests.helpers.moe_cp import DS, SEQ, VOCAB
from tests.helpers.parity import close
from titan.models.deepseek_v3.model import DeepSeekV3Transformer
from titan.models.llama.parallelize import apply_llama_cp, cp_buffers
from titan.models.moe.parallelize import apply_moe_cp
from titan.parallel.cp import cp_shard_batch
from titan.training.loss import cross_entropy_sum

pytestmark = pytest.mark.cuda

CP2 = ("--parallelism.context_parallel_degree", "2")
AUX = ("--model.moe_aux_loss_coeff", "0.01")


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _grad_parity(rank: int, world: int) -> dict[str, float]:
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("cp",))
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        args = replace(DS, attn_type="sdpa", moe_args=replace(DS.moe_args, aux_loss_coeff=0.1))
        model = DeepSeekV3Transformer(args).to(dev)
        model.init_weights()
        if dtype != torch.float32:
            model.to(dtype)
            model.init_buffers()  # the RoPE table stays complex64
        tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(1)).to(dev)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        cross_entropy_sum(model(inputs).float(), labels).backward()
        want = _grads(model)
        model.zero_grad()
        apply_moe_cp(model, mesh, "sdpa", apply_llama_cp)
        with cp_shard_batch(mesh, inputs, labels, cp_buffers(model)) as (x, y):
            assert x is not None and y is not None
            cross_entropy_sum(model(x).float(), y).backward()  # inside: ring attention's backward too
        worst = 0.0
        for name, grad in _grads(model).items():
            dist.all_reduce(grad)
            worst = max(
                worst, ((grad.float() - want[name].float()).abs().max() / want[name].float().abs().max()).item()
            )
        out[str(dtype)] = worst
    return out


def test_cp2_gradients_equal_the_unsharded_model_with_latent_attention():
    for per_rank in run_distributed(_grad_parity, 2, backend="nccl", timeout=600):
        # fp32: the ring merges two softmax blocks per query row (log-sum-exp rescaling), a few ulps.
        assert per_rank["torch.float32"] < 1e-4, per_rank
        assert per_rank["torch.bfloat16"] < 5e-2, per_rank


def _curves_on_two_gpus(rank: int, world: int, dump: str) -> dict:
    with dstest_flavor():
        return layouts(
            dump,
            {
                "fsdp2": (2, (SHARD, "2", *AUX)),
                "cp2": (1, (SHARD, "1", *CP2, *AUX)),
                "fsdp2_bf16": (2, (SHARD, "2", *AUX, *BF16)),
                "cp2_bf16": (1, (SHARD, "1", *CP2, *AUX, *BF16)),
            },
        )


def test_cp2_trains_like_fsdp2(tmp_path):
    """The trainer at CP 2 (SDPA ring attention, the balance loss on) against FSDP 2: the same
    global batch, the tokens split along the sequence instead of across sequences."""
    for per_rank in run_distributed(_curves_on_two_gpus, 2, str(tmp_path), backend="nccl", timeout=900):
        close(per_rank["cp2"], per_rank["fsdp2"], "cp2")
        close(per_rank["cp2_bf16"], per_rank["fsdp2_bf16"], "cp2 bf16", BF16_TOL, relative=True)
