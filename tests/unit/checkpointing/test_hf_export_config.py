"""One HF export, one config: a run's weights exported during training (last_save_in_hf) and by
scripts/convert_hf.py to_hf --flavor from its DCP checkpoint give the same config.json, whose
max_position_embeddings is the model's context length (the flavor's), not the training window."""

from __future__ import annotations

import importlib.util
import json

from tests.helpers.runs import REPO, trainer
from titan.checkpointing.hf import export_args
from titan.models import get_flavor, get_model_spec


def test_in_training_export_and_to_hf_write_the_same_config(tmp_path):
    t = trainer(
        tmp_path,
        "--training.steps",
        "2",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "1",
        "--checkpoint.last_save_model_only",
        "--checkpoint.last_save_in_hf",
    )
    assert t.config.training.seq_len == 32  # the run's window; its RoPE table has 32 rows
    t.train()
    ckpt = tmp_path / "checkpoint"
    in_training = json.loads((ckpt / "step-2" / "config.json").read_text())
    spec = importlib.util.spec_from_file_location("convert_hf", REPO / "scripts/convert_hf.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "to_hf"
    assert script.main(["to_hf", str(ckpt / "step-1"), str(out), "--flavor", "debugmodel"]) == 0
    converted = json.loads((out / "config.json").read_text())
    assert converted == in_training
    assert in_training["max_position_embeddings"] == get_flavor(get_model_spec("llama3"), "debugmodel").max_seq_len


def test_a_run_longer_than_its_flavor_states_its_own_length():
    flavor = get_flavor(get_model_spec("llama3"), "debugmodel")
    record = {"model": {"name": "llama3", "flavor": "debugmodel"}, "training": {"seq_len": 4096}}
    assert export_args(flavor, record).max_seq_len == 4096  # trained on 4096 positions: at least that
    record["training"]["seq_len"] = 256
    assert export_args(flavor, record).max_seq_len == flavor.max_seq_len == 2048
    assert export_args(flavor, {"model": {"name": "nope", "flavor": "x"}}) is flavor  # unknown: as trained
    assert export_args(flavor, record, flavor_max=512).max_seq_len == 512
