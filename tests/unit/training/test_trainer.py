"""Trainer steps on explicit batches: data-parallel layouts and accumulation give the same update."""

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.helpers.distributed import run_distributed
from titan.config import load_config
from titan.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[3]
SEQ, VOCAB = 32, 2048


def _config(dump: str, *extra: str):
    return load_config(
        [
            "--job.config_file",
            str(REPO / "train_configs/debug_model.toml"),
            "--job.dump_folder",
            dump,
            "--training.seq_len",
            str(SEQ),
            "--metrics.enable_tensorboard",
            "false",
            *extra,
        ]
    )


def _global_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _full_params(trainer: Trainer) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in trainer.model_parts[0].named_parameters():
        t = p.detach()
        out[name] = (t.full_tensor() if isinstance(t, DTensor) else t).clone()
    return out


def _two_steps(trainer: Trainer, batches: list[list[tuple[torch.Tensor, torch.Tensor]]]):
    losses = []
    for mbs in batches:
        loss, norm = trainer.train_step(mbs)
        losses.append((loss.item(), norm.item()))
    return losses, _full_params(trainer)


def _rank_step(rank: int, world: int, dump: str, extra: tuple[str, ...]):
    trainer = Trainer(_config(dump, "--training.local_batch_size", "2", *extra))
    inputs, labels = _global_batch(4)
    dp = trainer.parallel_dims.dp_degree
    per = inputs.shape[0] // dp
    r = trainer.dp_rank
    mb = [(inputs[r * per : (r + 1) * per], labels[r * per : (r + 1) * per])]
    return _two_steps(trainer, [mb, mb])


@pytest.fixture(scope="module")
def one_rank_reference(tmp_path_factory):
    dump = str(tmp_path_factory.mktemp("ref"))
    trainer = Trainer(_config(dump, "--training.local_batch_size", "4"))
    inputs, labels = _global_batch(4)
    return _two_steps(trainer, [[(inputs, labels)]] * 2)


def _assert_same(result, reference, tol=1e-5):
    (losses, params), (ref_losses, ref_params) = result, reference
    for (loss, n), (rl, rn) in zip(losses, ref_losses):
        assert abs(loss - rl) < tol and abs(n - rn) < tol * 10, (losses, ref_losses)
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, atol=tol, rtol=tol, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        (),  # FSDP2 over 2 ranks (data_parallel_shard_degree -1)
        ("--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"),
    ],
    ids=["fsdp2", "ddp2"],
)
def test_two_rank_step_equals_one_rank_step(tmp_path, one_rank_reference, layout):
    results = run_distributed(_rank_step, 2, str(tmp_path), layout)
    _assert_same(results[0], one_rank_reference)
    # Every rank ends with the same full weights.
    for name, p in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], p, atol=0, rtol=0)


def test_grad_accumulation_equals_one_big_batch(tmp_path, one_rank_reference):
    trainer = Trainer(_config(str(tmp_path), "--training.local_batch_size", "2", "--training.global_batch_size", "4"))
    assert trainer.grad_accum_steps == 2
    inputs, labels = _global_batch(4)
    mbs = [(inputs[:2], labels[:2]), (inputs[2:], labels[2:])]
    _assert_same(_two_steps(trainer, [mbs, mbs]), one_rank_reference)


def test_same_seed_same_weights_different_seed_differs(tmp_path):
    a = _full_params(Trainer(_config(str(tmp_path), "--training.seed", "7")))
    b = _full_params(Trainer(_config(str(tmp_path), "--training.seed", "7")))
    c = _full_params(Trainer(_config(str(tmp_path), "--training.seed", "8")))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.attention.wq.weight"], c["layers.0.attention.wq.weight"])
