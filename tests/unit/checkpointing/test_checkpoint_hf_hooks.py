"""[checkpoint] last_save_in_hf writes an HF folder at the end; initial_load_in_hf starts from one."""

import json
from pathlib import Path

import pytest
import torch

from titan.config import load_config
from titan.errors import TitanError
from titan.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[3]
TINY = [
    "--job.config_file",
    str(REPO / "train_configs/debug_model.toml"),
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--metrics.enable_tensorboard",
    "false",
    "--training.steps",
    "2",
    "--checkpoint.enable",
]


def test_export_then_start_from_hf(tmp_path):
    first = Trainer(
        load_config(
            [
                *TINY,
                "--job.dump_folder",
                str(tmp_path / "a"),
                "--checkpoint.last_save_in_hf",
                "--checkpoint.last_save_model_only",
            ]
        )
    )
    first.train()
    # at step-N itself, where a torchtitan user loads it back from; no DCP folder beside it
    hf = tmp_path / "a" / "checkpoint" / "step-2"
    assert json.loads((hf / "config.json").read_text())["num_hidden_layers"] == 6
    assert list(hf.glob("*.safetensors")) and not (hf / ".metadata").exists()
    assert sorted(p.name for p in hf.parent.iterdir()) == ["step-2"]

    second = Trainer(
        load_config(
            [
                *TINY,
                "--job.dump_folder",
                str(tmp_path / "b"),
                "--checkpoint.initial_load_path",
                str(hf),
                "--checkpoint.initial_load_in_hf",
            ]
        )
    )
    trained = dict(first.model_parts[0].named_parameters())
    for name, p in second.model_parts[0].named_parameters():
        assert torch.equal(p, trained[name]), name

    with pytest.raises(TitanError, match="not a DCP checkpoint folder but a Hugging Face folder: add --checkpoint"):
        Trainer(
            load_config([*TINY, "--job.dump_folder", str(tmp_path / "c"), "--checkpoint.initial_load_path", str(hf)])
        )

    # the same folder again: auto-resume passes over the export (nothing to resume, a fresh start) ...
    again = Trainer(load_config([*TINY, "--job.dump_folder", str(tmp_path / "a"), "--training.steps", "3"]))
    assert again.step == 0
    # ... and naming its step says what it is and how to start from it
    with pytest.raises(TitanError, match=r"step-2 is a Hugging Face export .*--checkpoint.initial_load_in_hf"):
        Trainer(load_config([*TINY, "--job.dump_folder", str(tmp_path / "a"), "--checkpoint.load_step", "2"]))


def test_hf_options_need_their_companions(tmp_path):
    with pytest.raises(TitanError, match="initial_load_in_hf' needs checkpoint.initial_load_path"):
        load_config([*TINY, "--checkpoint.initial_load_in_hf"])
    with pytest.raises(TitanError, match="last_save_in_hf' is not supported with pipeline parallelism"):
        load_config(
            [
                *TINY,
                "--checkpoint.last_save_in_hf",
                "--checkpoint.last_save_model_only",
                "--parallelism.pipeline_parallel_degree",
                "2",
            ]
        )
    with pytest.raises(TitanError, match="last_save_in_hf' writes the final step-N .*last_save_model_only"):
        load_config([*TINY, "--checkpoint.last_save_in_hf"])
