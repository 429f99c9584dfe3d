"""Weights brought in (an HF folder, a converted DCP folder) whose model differs from the run's:
refused with one line naming each difference, or followed with checkpoint.config_mismatch."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.runs import TINY_RUN
from tests.helpers.tiny import random_model
from titan.checkpointing.hf import import_hf_to_dcp, save_hf
from titan.config import load_config
from titan.data import build_tokenizer
from titan.errors import TitanError
from titan.models import get_model_spec, model_args_from_config
from titan.models.llama import Transformer
from titan.training.plan import run_model_args
from titan.training.trainer import Trainer

RUN = [*TINY_RUN, "--training.steps", "1", "--checkpoint.enable"]


def _run_args():
    config = load_config(RUN)
    args = model_args_from_config(get_model_spec(config.model.name), config.model)
    return run_model_args(config, args, build_tokenizer("").vocab_size)


def _hf_folder(tmp_path: Path, **changes) -> tuple[Path, Transformer]:
    args = replace(_run_args(), **changes)
    model = random_model(args, seed=5)
    save_hf(model.state_dict(), args, tmp_path / "hf")
    return tmp_path / "hf", model


def _trainer(tmp_path: Path, hf: Path, *extra: str) -> Trainer:
    return Trainer(
        load_config(
            [
                *RUN,
                "--job.dump_folder",
                str(tmp_path / "dump"),
                "--checkpoint.initial_load_path",
                str(hf),
                "--checkpoint.initial_load_in_hf",
                *extra,
            ]
        )
    )


def test_other_rope_theta_and_norm_eps_are_refused_by_default(tmp_path: Path) -> None:
    hf, _ = _hf_folder(tmp_path, rope_theta=1e4, norm_eps=1e-6)
    with pytest.raises(TitanError) as e:
        _trainer(tmp_path, hf)
    assert str(e.value) == (
        f"checkpoint.initial_load_path {hf}: the Hugging Face folder's model differs from this run's: norm_eps = 1e-06"
        " there, 1e-05 in this run, rope_theta = 10000.0 there, 500000.0 in this run; train with its values with"
        " --checkpoint.config_mismatch use_checkpoint, keep this run's with use_new, or change the model settings"
    )


@pytest.mark.slow
def test_use_checkpoint_trains_with_the_folders_values(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf, _ = _hf_folder(tmp_path, rope_theta=1e4, norm_eps=1e-6)
    trainer = _trainer(tmp_path, hf, "--checkpoint.config_mismatch", "use_checkpoint")
    args = trainer.model_parts[0].model_args
    assert (args.rope_theta, args.norm_eps) == (1e4, 1e-6)
    microbatches = trainer.next_microbatches()
    ((inputs, labels),) = microbatches
    ref = transformers.LlamaForCausalLM.from_pretrained(str(hf), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        expected = F.cross_entropy(ref(inputs).logits.flatten(0, 1).float(), labels.flatten()).item()
        # The flavor's values (what titan trained with before) give a visibly different first loss.
        flavor_model = Transformer(_run_args()).eval()
        flavor_model.load_state_dict(trainer.model_parts[0].state_dict())
        flavor_loss = F.cross_entropy(flavor_model(inputs).flatten(0, 1).float(), labels.flatten()).item()
    loss, _ = trainer.train_step(microbatches)
    assert abs(loss.item() - expected) < 1e-4, (loss.item(), expected)
    assert abs(flavor_loss - expected) > 1e-3, (flavor_loss, expected)


def test_use_new_keeps_the_runs_values_but_not_other_shapes(tmp_path: Path) -> None:
    hf, _ = _hf_folder(tmp_path, rope_theta=1e4)
    trainer = _trainer(tmp_path, hf, "--checkpoint.config_mismatch", "use_new")
    assert trainer.model_parts[0].model_args.rope_theta == 500000.0
    other, _ = _hf_folder(tmp_path / "b", n_kv_heads=16)
    with pytest.raises(
        TitanError,
        match=r"use_new cannot load weights of another shape \(n_kv_heads = 16 there, 8 in"
        r" this run\)",
    ):
        _trainer(tmp_path / "b", other, "--checkpoint.config_mismatch", "use_new")


def test_converted_dcp_folder_is_checked_too(tmp_path: Path) -> None:
    hf, _ = _hf_folder(tmp_path, rope_theta=1e4)
    import_hf_to_dcp(hf, tmp_path / "dcp")
    with pytest.raises(TitanError) as e:
        Trainer(
            load_config(
                [
                    *RUN,
                    "--job.dump_folder",
                    str(tmp_path / "dump"),
                    "--checkpoint.initial_load_path",
                    str(tmp_path / "dcp"),
                ]
            )
        )
    assert "the checkpoint's model differs from this run's: rope_theta = 10000.0 there, 500000.0 in this run" in str(
        e.value
    )


def test_matching_folder_loads_without_a_word(tmp_path: Path) -> None:
    hf, model = _hf_folder(tmp_path)
    trainer = _trainer(tmp_path, hf)
    for name, p in trainer.model_parts[0].named_parameters():
        assert torch.equal(p, model.state_dict()[name]), name
