"""HF export writes the model the run trained, checks itself, and leaves nothing behind when it
stops: a training checkpoint of a run with [model] shape overrides exports those shapes (from the
step folder's saved config), the family comes from the folder (no --model), a config.json that
would not read back as the model is refused, and a refused or failed export writes nothing."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from transformers import LlamaForCausalLM

from scripts.convert_hf import main
from tests.helpers.tiny import random_model
from titan.checkpointing import hf as hf_io
from titan.checkpointing.hf import save_hf
from titan.checkpointing.model_dcp import save_model_dcp
from titan.errors import TitanError
from titan.models import get_flavor, get_model_spec
from titan.models.llama4 import Llama4ModelArgs, Llama4Transformer, llama4_configs
from titan.models.moe import MoEArgs

OVERRIDES = {  # flavor debugmodel (dim 256, 16 heads) as runs reshape it
    "n_heads 8": {"n_heads": 8},
    "n_kv_heads 4": {"n_kv_heads": 4},
    "dim 128": {"dim": 128},
}


def _training_checkpoint(folder: Path, overrides: dict) -> torch.nn.Module:
    """A step folder as a run with ``--model.<key> <value>`` writes it: the model nested beside
    other state, and the run's config.json; no model_args.json."""
    args = replace(get_flavor(get_model_spec("llama3"), "debugmodel"), n_layers=2, max_seq_len=64, **overrides)
    model = random_model(args, seed=1).eval()
    dcp.save({"model": model.state_dict(), "step": torch.tensor(2)}, checkpoint_id=str(folder))
    record = {"model": {"name": "llama3", "flavor": "debugmodel", **overrides}, "training": {"seq_len": 64}}
    (folder / "config.json").write_text(json.dumps(record))
    return model


@pytest.mark.parametrize("name", list(OVERRIDES))
def test_to_hf_writes_the_shape_the_run_trained(tmp_path, name):
    model = _training_checkpoint(tmp_path / "step-2", OVERRIDES[name])
    assert main(["to_hf", str(tmp_path / "step-2"), str(tmp_path / "hf")]) == 0  # no --model, no --flavor
    config = json.loads((tmp_path / "hf/config.json").read_text())
    args = model.model_args
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["hidden_size"]) == (
        args.n_heads,
        args.kv_heads,
        args.dim,
    )
    ref = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    tokens = torch.randint(0, args.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ref(tokens).logits, model(tokens), atol=1e-4, rtol=0)


def test_the_folder_names_its_family_and_a_wrong_flag_is_refused(tmp_path, capsys):
    _training_checkpoint(tmp_path / "step-2", OVERRIDES["n_heads 8"])
    assert main(["to_hf", str(tmp_path / "step-2"), str(tmp_path / "a"), "--model", "llama4"]) == 1
    assert "--model llama4 disagrees with" in capsys.readouterr().err
    assert main(["to_hf", str(tmp_path / "step-2"), str(tmp_path / "a"), "--flavor", "8B"]) == 1
    assert "--flavor 8B disagrees with" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()
    # without the run's config, a flavor whose shapes differ from the tensors is refused
    _training_checkpoint(tmp_path / "kv", OVERRIDES["n_kv_heads 4"])
    (tmp_path / "kv/config.json").unlink()
    assert (
        main(["to_hf", str(tmp_path / "kv"), str(tmp_path / "a"), "--model", "llama3", "--flavor", "debugmodel"]) == 1
    )
    assert "layers.0.attention.wk.weight has shape (64, 256), the model args give (128, 256)" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()
    # a llama4 model-only folder: found from model_args.json's fields, no --model
    args = replace(llama4_configs["debugmodel"], n_layers=2, vocab_size=64, max_seq_len=32)
    torch.manual_seed(0)
    model = Llama4Transformer(args)
    model.init_weights()
    save_model_dcp(model.state_dict(), args, tmp_path / "dcp4")
    assert main(["to_hf", str(tmp_path / "dcp4"), str(tmp_path / "hf4")]) == 0
    assert json.loads((tmp_path / "hf4/config.json").read_text())["model_type"] == "llama4_text"


def _left(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir())


def test_a_refused_or_failed_export_leaves_nothing_behind(tmp_path, monkeypatch):
    args = Llama4ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, multiple_of=16, max_seq_len=16)
    torch.manual_seed(0)
    model = Llama4Transformer(args)
    model.init_weights()
    state = model.state_dict()
    before = _left(tmp_path)
    for moe in (MoEArgs(num_shared_experts=0), MoEArgs(score_func="softmax"), MoEArgs(route_norm=True)):
        with pytest.raises(TitanError, match="Hugging Face Llama 4 routes with sigmoid"):
            save_hf(state, replace(args, moe_args=moe), tmp_path / "hf")
        assert _left(tmp_path) == before
    # failing halfway through the shards: the partial folder goes too
    calls = []

    def failing_save(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        Path(path).write_bytes(b"x")

    monkeypatch.setattr(hf_io, "save_file", failing_save)
    with pytest.raises(OSError, match="disk full"):
        save_hf(state, args, tmp_path / "hf", max_shard_bytes=10_000)
    assert len(calls) == 2 and _left(tmp_path) == before
    monkeypatch.undo()
    # an existing folder with content is refused and kept as it was
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken/notes.txt").write_text("mine")
    with pytest.raises(TitanError, match="already exists and is not empty"):
        save_hf(state, args, tmp_path / "taken")
    assert _left(tmp_path / "taken") == ["notes.txt"]
    save_hf(state, args, tmp_path / "hf")
    assert {"config.json", "model.safetensors.index.json"} <= set(_left(tmp_path / "hf"))


def test_an_export_whose_config_reads_back_otherwise_stops(tmp_path, monkeypatch):
    args = Llama4ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, multiple_of=16, max_seq_len=16)
    model = Llama4Transformer(args)
    model.init_weights()
    adapter = get_model_spec("llama4").state_dict_adapter
    real = adapter.args_to_hf_config

    def forgetful(a, dtype=torch.float32):  # a writer that leaves a field to transformers' default
        config = real(a, dtype)
        del config["use_qk_norm"]
        return config

    monkeypatch.setattr(adapter, "args_to_hf_config", staticmethod(forgetful))
    with pytest.raises(TitanError, match="reads back with model.use_qk_norm = True, the model has False"):
        save_hf(model.state_dict(), args, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_every_registered_flavor_passes_the_export_self_check():
    from titan.models import _REGISTRY

    for spec in _REGISTRY.specs().values():
        adapter = spec.state_dict_adapter
        if adapter is None:
            continue
        for args in spec.flavors.values():
            try:
                config = adapter.args_to_hf_config(args)
            except TitanError:  # a flavor HF cannot express is refused before the check
                continue
            hf_io.check_export_config(adapter, args, config)
