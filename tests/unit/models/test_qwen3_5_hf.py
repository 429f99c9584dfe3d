"""titan qwen3_5 <-> transformers' Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM and Qwen3NextForCausalLM:
folders written by save_pretrained load with transformers' logits (within 1e-4, fp32) and greedy
generation, export back bitwise (every tensor of the original folder, config read back equal), and
an absent field means transformers' default (every field's values against transformers:
tests/unit/models/test_hf_config_sweep.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from titan.checkpointing.hf import load_hf, read_hf_config, save_hf
from titan.models.qwen3_5 import Qwen35Transformer
from titan.models.qwen3_5.hf_config import DEFAULTS, hf_config_to_args
from titan.models.qwen3_5.state_dict_adapter import from_hf
from titan.tools.generate import generate

# GVA (2 key heads, 4 value heads), value heads narrower than key heads, a head_dim of its own.
SMALL = dict(
    vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=6, linear_num_key_heads=2,
    linear_num_value_heads=4, max_position_embeddings=128,
)  # fmt: skip
MOE = dict(moe_intermediate_size=24, shared_expert_intermediate_size=20, num_experts=4, num_experts_per_tok=2)
CLASSES = {
    "qwen3_5_text": (Qwen3_5TextConfig, Qwen3_5ForCausalLM, SMALL),
    "qwen3_5_moe_text": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, {**SMALL, **MOE}),
    "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM, {**SMALL, **MOE}),
}
TOKENS = torch.randint(0, 64, (2, 80), generator=torch.Generator().manual_seed(0))  # two chunks of 64


def _hf_model(model_type: str, **changes: Any) -> Any:
    config_cls, model_cls, small = CLASSES[model_type]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**small, **changes})).eval()
    with torch.no_grad():  # norms away from their init, so a misplaced one shows
        for name, p in model.named_parameters():
            p.copy_(torch.rand_like(p) * 0.5 if "norm" in name else torch.randn_like(p) * 0.2)
    return model


def _titan(hf_model: Any) -> Qwen35Transformer:
    args = hf_config_to_args(hf_model.config.to_dict())
    model = Qwen35Transformer(args)
    model.load_state_dict(from_hf(hf_model.state_dict(), args), strict=True)
    model.init_buffers()
    return model.eval()


def _folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


@pytest.mark.parametrize(
    "model_type,changes",
    [
        ("qwen3_5_text", dict(tie_word_embeddings=True)),
        ("qwen3_5_moe_text", {}),
        ("qwen3_next", dict(decoder_sparse_step=2, mlp_only_layers=[2], norm_topk_prob=False)),
    ],
)
def test_hf_folder_both_ways(tmp_path: Path, model_type: str, changes: dict) -> None:
    hf = _hf_model(model_type, **changes)
    hf.save_pretrained(tmp_path / "hf")
    state, args = load_hf(tmp_path / "hf")
    model = Qwen35Transformer(args)
    model.load_state_dict(state, strict=True)
    model.init_buffers()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), hf(TOKENS, use_cache=False).logits, atol=1e-4, rtol=0)
    # Back out: every tensor of transformers' own folder, bit for bit, in files of ~20 KB.
    save_hf(model.state_dict(), args, tmp_path / "out", max_shard_bytes=20_000)
    assert read_hf_config(tmp_path / "out") == args
    theirs, ours = _folder_tensors(tmp_path / "hf"), _folder_tensors(tmp_path / "out")
    assert set(ours) == set(theirs) - ({"lm_head.weight"} if args.tie_embeddings else set())
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    back = CLASSES[model_type][1].from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(TOKENS).logits, hf(TOKENS, use_cache=False).logits, atol=0, rtol=0)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_greedy_generation_is_transformers(model_type: str) -> None:
    hf = _hf_model(model_type)
    prompt = TOKENS[0, :70].tolist()  # past one chunk, then one token at a time from the cache
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :].tolist()
    new, _ = generate(_titan(hf), prompt, 8)
    assert new == ref


@pytest.mark.parametrize("model_type", list(CLASSES))
def test_an_absent_field_takes_transformers_default(model_type: str) -> None:
    config_cls = CLASSES[model_type][0]
    declared = {f.name: f.default for f in dataclasses.fields(config_cls)}
    for key, value in DEFAULTS[model_type].items():
        assert declared[key] == value, key
    assert hf_config_to_args({"model_type": model_type}) == hf_config_to_args(config_cls().to_dict())


def test_continued_pretraining_starts_at_transformers_loss(tmp_path: Path) -> None:
    """checkpoint.initial_load_path at a Qwen3.5 folder (initial_load_in_hf): the run builds the
    folder's model and its first step's loss is transformers' loss on the same batch."""
    import torch.nn.functional as F

    from titan.config import load_config
    from titan.training.trainer import Trainer

    hf = _hf_model("qwen3_5_moe_text", vocab_size=2048)
    with torch.no_grad():  # logits of O(1) at this vocabulary
        hf.lm_head.weight.mul_(0.25)
    hf.save_pretrained(tmp_path / "hf")
    trainer = Trainer(
        load_config(
            [
                "--model.name", "qwen3_5", "--model.flavor", "debugmodel_moe", "--training.seq_len", "32",
                "--training.local_batch_size", "2", "--training.steps", "1", "--training.mixed_precision_param",
                "float32", "--metrics.enable_tensorboard", "false", "--checkpoint.enable",
                "--checkpoint.initial_load_path", str(tmp_path / "hf"), "--checkpoint.initial_load_in_hf",
                "--checkpoint.config_mismatch", "use_checkpoint", "--job.dump_folder", str(tmp_path / "run"),
            ]
        )
    )  # fmt: skip
    batch = trainer.next_microbatches()
    assert batch is not None
    inputs, labels = batch[0]
    with torch.no_grad():
        logits = hf(inputs, use_cache=False).logits
    ref = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).item()
    loss, _ = trainer.train_step(batch)
    assert abs(loss.item() - ref) < 1e-4, (loss.item(), ref)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_row_slices_read_as_a_sharded_rank_reads_them(tmp_path: Path, model_type: str) -> None:
    """A rank's FSDP / TP shard of a DeltaNet tensor reads its rows of the fused HF tensor (titan's
    q, k, v sit at offsets in in_proj_qkv / in_proj_qkvz / conv1d)."""
    from titan.checkpointing.hf_folder import HFFolder
    from titan.checkpointing.hf_load import HFPlan

    _hf_model(model_type).save_pretrained(tmp_path / "hf")
    plan = HFPlan(HFFolder(tmp_path / "hf"))
    for name in [n for n in plan.source if ".attention." in n and "layers.0." in n]:
        whole = plan.rows(name, None)
        for a, b in ((0, 1), (1, whole.shape[0] - 1), (whole.shape[0] // 2, whole.shape[0])):
            assert torch.equal(plan.rows(name, (a, b)), whole[a:b]), (name, a, b)


def test_the_mtp_head_is_skipped_with_one_log_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from safetensors.torch import save_file

    hf = _hf_model("qwen3_5_text")
    hf.save_pretrained(tmp_path / "hf")
    tensors = load_file(str(tmp_path / "hf/model.safetensors"))
    mtp = {"mtp.fc.weight": torch.ones(32, 64), "mtp.layers.0.input_layernorm.weight": torch.ones(32)}
    save_file({**tensors, **mtp}, str(tmp_path / "hf/model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level("INFO"):
        state, _ = load_hf(tmp_path / "hf")
    assert not any(k.startswith("mtp") for k in state)
    lines = [r.getMessage() for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert len(lines) == 1 and "2 Hugging Face tensor(s)" in lines[0], lines
