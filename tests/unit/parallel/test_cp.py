"""Context parallel on CPU: what runs here is the flex forward (training needs CUDA, checked)."""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tests.helpers.distributed import run_distributed
from tests.helpers.tiny import TINY
from titan.errors import TitanError
from titan.models.llama.model import Transformer
from titan.models.llama.parallelize import apply_llama_cp, cp_buffers
from titan.parallel.cp import check_cp_seq_len, cp_shard_batch, cp_unshard
from titan.training.loss import cross_entropy_sum

SEQ, VOCAB = 512, 256  # flex CP needs seq_len % (2 x cp x 128) == 0


def _flex_forward_parity(rank: int, world: int):
    torch.manual_seed(0)
    args = replace(TINY, vocab_size=VOCAB, max_seq_len=SEQ, attn_type="flex")
    model = Transformer(args)
    model.init_weights()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        ref_logits = model(inputs)
        ref_loss = cross_entropy_sum(ref_logits, labels)

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    apply_llama_cp(model, mesh, "flex")
    chunk = SEQ // (2 * world)
    with torch.no_grad(), cp_shard_batch(mesh, inputs, labels, cp_buffers(model)) as (x, y):
        # Head-tail: rank r holds chunks r and 2cp-1-r of the sequence (inputs, labels, RoPE rows).
        head = slice(rank * chunk, (rank + 1) * chunk)
        tail = slice((2 * world - 1 - rank) * chunk, (2 * world - rank) * chunk)
        assert torch.equal(x, torch.cat([inputs[:, head], inputs[:, tail]], 1))
        assert torch.equal(y, torch.cat([labels[:, head], labels[:, tail]], 1))
        assert model.freqs_cis.shape[0] == SEQ // world
        logits = model(x)
        loss = cross_entropy_sum(logits, y)
    assert model.freqs_cis.shape[0] == SEQ  # restored after the block
    dist.all_reduce(loss)
    full = cp_unshard(mesh, logits)
    return (full - ref_logits).abs().max().item(), (loss - ref_loss).abs().item() / ref_loss.item()


@pytest.mark.slow
def test_flex_cp_forward_matches_unsharded():
    """world size 2: CP forward (flex) reproduces the unsharded logits and loss."""
    for logit_diff, rel_loss_diff in run_distributed(_flex_forward_parity, 2):
        assert logit_diff < 1e-5 and rel_loss_diff < 1e-6, (logit_diff, rel_loss_diff)


def test_cp_seq_len_checks():
    check_cp_seq_len(64, 2, "sdpa")
    check_cp_seq_len(512, 2, "flex")
    with pytest.raises(TitanError, match="divisible by 4"):
        check_cp_seq_len(66, 2, "sdpa")
    with pytest.raises(TitanError, match="divisible by 512"):
        check_cp_seq_len(256, 2, "flex")
