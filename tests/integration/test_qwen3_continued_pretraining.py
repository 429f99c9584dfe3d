"""Continued pretraining from a Hugging Face Qwen3 folder: ./run_train.sh with the folder as
checkpoint.initial_load_path (initial_load_in_hf) builds the folder's model (its config.json) and
its first step's loss is transformers' loss on the same batch."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

from tests.helpers.runs import REPO, run_env
from titan.config import load_config
from titan.training.trainer import Trainer

pytestmark = pytest.mark.slow

LOSS = re.compile(r"step:\s*1\s+loss:\s*([0-9.]+)")


def test_first_loss_from_an_hf_folder_is_transformers_loss(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=2048, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, max_position_embeddings=256, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )  # fmt: skip
    hf = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():  # norms away from one; logits of O(1)
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * 0.05)
    hf.save_pretrained(tmp_path / "hf")
    flags = [
        "--model.name", "qwen3", "--model.flavor", "debugmodel",
        "--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", "1",
        "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--metrics.disable_color_printing",
        "--checkpoint.enable", "--checkpoint.initial_load_path", str(tmp_path / "hf"),
        "--checkpoint.initial_load_in_hf", "--checkpoint.config_mismatch", "use_checkpoint",
    ]  # fmt: skip
    out = subprocess.run(
        ["./run_train.sh", *flags, "--job.dump_folder", str(tmp_path / "run")],
        cwd=REPO,
        env=run_env(NGPU="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "loaded Hugging Face weights" in text, text[-3000:]
    first = LOSS.search(text)
    assert first is not None, text[-3000:]
    # The same first batch from the same data pipeline (a trainer that only reads it).
    trainer = Trainer(load_config([*flags, "--job.dump_folder", str(tmp_path / "batch")]))
    batch = trainer.next_microbatches()
    assert batch is not None
    inputs, labels = batch[0]
    with torch.no_grad():
        logits = hf(inputs).logits
    ref = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100).item()
    assert abs(float(first[1]) - ref) < 1e-4, (first[1], ref)  # the log prints 4 decimals
