"""Meta's release format (params.json + 2 model-parallel shards) -> DCP -> the Trainer trains on it."""

import json
from pathlib import Path

import pytest
import torch

from titan.checkpointing.model_dcp import load_model_from_dcp, read_model_args, read_model_tensors
from titan.config import load_config
from titan.errors import TitanError
from titan.models.llama.args import TransformerModelArgs, get_model_args
from titan.models.llama.meta_checkpoint import _merge
from titan.models.llama.model import Transformer
from titan.training.loss import cross_entropy_sum
from titan.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[3]
SEQ = 32
# Meta's fairscale layout: column-parallel weights split the output dim (0), row-parallel the
# input dim (1); Llama 3's VocabParallelEmbedding splits the vocab (0); norms are replicated.
_SPLIT_DIM = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "output": 0, "tok_embeddings": 0, "wo": 1, "w2": 1}
PARAMS = {
    "dim": 256,
    "n_layers": 6,
    "n_heads": 16,
    "n_kv_heads": 8,
    "vocab_size": 2048,
    "multiple_of": 256,
    "ffn_dim_multiplier": None,
    "norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "use_scaled_rope": False,
}


def write_fake_meta(folder: Path, truth: dict[str, torch.Tensor], n_shards: int = 2) -> None:
    folder.mkdir(parents=True)
    (folder / "params.json").write_text(json.dumps(PARAMS))
    shards: list[dict] = [{} for _ in range(n_shards)]
    for key, t in truth.items():
        kind = key.split(".")[-2]
        for i in range(n_shards):
            part = t.chunk(n_shards, dim=_SPLIT_DIM[kind])[i] if kind in _SPLIT_DIM else t
            shards[i][key] = part.to(torch.bfloat16).clone()
        shards[0]["rope.freqs"] = torch.zeros(8)  # Llama 2 leftovers are skipped
    for i, shard in enumerate(shards):
        torch.save(shard, folder / f"consolidated.{i:02d}.pth")


def _args(dump: str) -> list[str]:
    return [
        "--job.config_file",
        str(REPO / "train_configs/debug_model.toml"),
        "--job.dump_folder",
        dump,
        "--training.seq_len",
        str(SEQ),
        "--training.local_batch_size",
        "2",
        "--metrics.enable_tensorboard",
        "false",
    ]


def _trainer_from(dump: str, dcp_dir: Path) -> Trainer:
    """Through [checkpoint] initial_load_path, as a user starts from a converted checkpoint."""
    return Trainer(
        load_config([*_args(dump), "--checkpoint.enable", "true", "--checkpoint.initial_load_path", str(dcp_dir)])
    )


@pytest.mark.slow
def test_two_shard_meta_checkpoint_converts_and_trains(tmp_path, capsys):
    from scripts.convert_llama_to_dcp import main

    with torch.device("meta"):
        shapes = Transformer(
            get_model_args("debugmodel", vocab_size=PARAMS["vocab_size"], max_seq_len=SEQ)
        ).state_dict()
    torch.manual_seed(7)
    # Meta releases are bf16: make the truth bf16-representable so the fp32 model gets it exactly.
    truth = {k: torch.randn(v.shape).mul(0.05).bfloat16().float() for k, v in shapes.items()}
    write_fake_meta(tmp_path / "meta", truth)

    assert main([str(tmp_path / "meta"), str(tmp_path / "dcp")]) == 0
    assert "wrote" in capsys.readouterr().out
    converted = read_model_tensors(tmp_path / "dcp")
    assert set(converted) == set(truth) and all(converted[k].dtype == torch.bfloat16 for k in converted)
    for k in truth:
        assert torch.equal(converted[k].float(), truth[k]), k
    assert read_model_args(tmp_path / "dcp", TransformerModelArgs).n_kv_heads == 8

    trainer = _trainer_from(str(tmp_path / "dump"), tmp_path / "dcp")  # bf16 on disk -> the fp32 model
    model = trainer.model_parts[0]
    for k, v in model.state_dict().items():
        assert torch.equal(v, truth[k]), k
    tokens = torch.randint(0, PARAMS["vocab_size"], (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        expected = (cross_entropy_sum(model(inputs), labels) / labels.numel()).item()
    loss, grad_norm = trainer.train_step([(inputs, labels)])
    assert abs(loss.item() - expected) < 1e-5 and torch.isfinite(grad_norm)
    assert not torch.equal(model.state_dict()["norm.weight"], truth["norm.weight"])  # it stepped

    # A checkpoint of another shape is refused by name before anything is loaded.
    other = Transformer(TransformerModelArgs(dim=64, n_layers=6, n_heads=4, vocab_size=2048, max_seq_len=SEQ))
    with pytest.raises(TitanError, match="tok_embeddings.weight' has shape"):
        load_model_from_dcp(other, tmp_path / "dcp")


def test_merge_finds_the_split_dim_of_either_embedding_layout():
    full = torch.arange(24.0).view(4, 6)
    assert torch.equal(_merge("tok_embeddings.weight", list(full.chunk(2, 0)), (4, 6)), full)  # Llama 3
    assert torch.equal(_merge("tok_embeddings.weight", list(full.chunk(2, 1)), (4, 6)), full)  # Llama 2
    with pytest.raises(TitanError, match="do not concatenate to"):
        _merge("x", [full[:1], full[:2]], (4, 6))


def test_wrong_or_missing_files_give_clear_errors(tmp_path, capsys):
    from scripts.convert_llama_to_dcp import main

    def error(folder: Path) -> str:
        assert main([str(folder), str(tmp_path / "out")]) == 1
        return capsys.readouterr().err

    assert "does not exist" in error(tmp_path / "nope")
    meta = tmp_path / "meta"
    meta.mkdir()
    assert "params.json is missing" in error(meta)
    (meta / "params.json").write_text(json.dumps(PARAMS | {"dim": 64, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2}))
    assert "no consolidated.*.pth" in error(meta)
    (meta / "consolidated.01.pth").write_bytes(b"")
    assert "must be consolidated.00.pth .. consolidated.00.pth" in error(meta)
    (meta / "consolidated.01.pth").unlink()
    (meta / "consolidated.00.pth").write_bytes(b"not a checkpoint")
    assert "not a readable torch.save checkpoint" in error(meta)
    # Shapes that params.json does not predict (a 128-wide model under a 64-wide params.json).
    shard = {k: torch.zeros(128) for k in ("norm.weight",)}
    torch.save(shard, meta / "consolidated.00.pth")
    assert "does not match params.json" in error(meta)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    with pytest.raises(TitanError, match="not a DCP checkpoint"):
        read_model_tensors(meta)
