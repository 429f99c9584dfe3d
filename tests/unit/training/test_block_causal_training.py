"""Training with block-causal attention: the trainer builds the batch's document ids once and the
model its mask; TP 2 (heads sharded, masks independent of heads) and PP 2 (the ids split into
micro-batches with the inputs) give the 1-process losses and grad norms (fp32, gloo ranks)."""

from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.tiny import extra_flavors, patch_flavors
from titan.config import load_config
from titan.data import build_tokenizer
from titan.models.llama.args import TransformerModelArgs
from titan.training.trainer import Trainer

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[3]
SEQ, STEPS, BATCH, TOL = 32, 3, 4, 1e-4
FLAVOR = {"bctest": TransformerModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=2048, multiple_of=32)}
LAYOUTS = {
    "tp2": ("--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"),
    "pp2": (
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        "1F1B",
        "--parallelism.data_parallel_shard_degree",
        "1",
    ),
}


def _config(dump: str, *extra: str):
    return load_config(
        [
            "--job.config_file",
            str(REPO / "train_configs/debug_model.toml"),
            "--job.dump_folder",
            dump,
            "--model.flavor",
            "bctest",
            "--training.seq_len",
            str(SEQ),
            "--training.local_batch_size",
            str(BATCH),
            "--metrics.enable_tensorboard",
            "false",
            "--lr_scheduler.warmup_steps",
            "1",
            *extra,
        ]
    )


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random tokens with an EOS every few positions: several documents per window."""
    eos = build_tokenizer("").eos_id
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 1700, (STEPS, BATCH, SEQ + 1), generator=g)
    tokens[torch.rand(tokens.shape, generator=g) < 0.15] = eos
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _run(trainer: Trainer) -> list[tuple[float, float]]:
    out = []
    for inputs, labels in _batches():
        loss, norm = trainer.train_step([(inputs, labels)])
        out.append((loss.item(), norm.item()))
    return out


def _layouts(rank: int, world: int, dump: str) -> dict[str, list[tuple[float, float]]]:
    with extra_flavors(**FLAVOR):
        return {
            name: _run(Trainer(_config(f"{dump}/{name}", "--model.attn_mask_type", "block_causal", *flags)))
            for name, flags in LAYOUTS.items()
        }


def test_block_causal_layouts_match_one_process(tmp_path, monkeypatch):
    patch_flavors(monkeypatch, **FLAVOR)
    reference = _run(Trainer(_config(str(tmp_path / "ref"), "--model.attn_mask_type", "block_causal")))
    varlen = _run(
        Trainer(
            _config(str(tmp_path / "varlen"), "--model.attn_type", "varlen", "--model.attn_mask_type", "block_causal")
        )
    )
    causal = _run(Trainer(_config(str(tmp_path / "causal"))))
    print("causal:", causal, "block_causal:", reference, "varlen:", varlen)
    # the document mask changes the loss and gradients by far more than the tolerance
    assert max(abs(c[0] - r[0]) for c, r in zip(causal, reference)) > 10 * TOL
    for (loss, norm), (ref_loss, ref_norm) in zip(varlen, reference):
        assert abs(loss - ref_loss) < TOL and abs(norm - ref_norm) < 10 * TOL
    for per_rank in run_distributed(_layouts, 2, str(tmp_path), timeout=600):
        for name, losses in per_rank.items():
            for (loss, norm), (ref_loss, ref_norm) in zip(losses, reference):
                assert abs(loss - ref_loss) < TOL and abs(norm - ref_norm) < 10 * TOL, (name, losses, reference)
