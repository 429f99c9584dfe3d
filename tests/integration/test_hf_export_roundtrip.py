"""torchtitan's model-only HF round trip through train.py: the first run saves its last step with
last_save_in_hf, the second (same dump folder, its own checkpoint folder) starts from
<dump>/<folder>/step-N with initial_load_in_hf."""

import pytest

from tests.helpers.runs import train_subprocess

pytestmark = pytest.mark.slow


def test_last_save_in_hf_then_initial_load_in_hf(tmp_path):
    code, out, losses = train_subprocess(
        tmp_path,
        "--training.steps",
        "3",
        "--checkpoint.folder",
        "hf_checkpoint",
        "--checkpoint.last_save_model_only",
        "--checkpoint.last_save_in_hf",
    )
    assert code == 0, out
    step = tmp_path / "hf_checkpoint" / "step-3"
    assert (step / "config.json").is_file() and (step / "model.safetensors.index.json").is_file()

    code, out2, losses2 = train_subprocess(
        tmp_path,
        "--training.steps",
        "2",
        "--checkpoint.initial_load_path",
        str(step),
        "--checkpoint.initial_load_model_only",
        "--checkpoint.initial_load_in_hf",
    )
    assert code == 0, out2
    assert f"loaded Hugging Face weights from checkpoint.initial_load_path {step}" in out2
    # it starts from the trained weights: its first loss is below the first run's first loss
    assert float(losses2[1]) < float(losses[1])


def test_llama4_continued_pretraining_from_a_released_style_hf_folder(tmp_path):
    """Meta's Llama 4 features (QK norm, NoPE temperature tuning, chunked attention, MoE every second
    block) in a transformers-written folder: the run starts at transformers' loss on the first
    batch, resumes exactly from its DCP checkpoint, and exports HF that transformers loads with the
    trained weights."""
    import shutil

    import torch
    import torch.nn.functional as F
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    from tests.helpers.runs import trainer
    from titan.checkpointing.model_dcp import read_model_tensors
    from titan.models.llama4.state_dict_adapter import from_hf, hf_config_to_args

    config = Llama4TextConfig(
        vocab_size=2048, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_hidden_layers=4, intermediate_size=32, intermediate_size_mlp=48, num_local_experts=4, moe_layers=[1, 3],
        no_rope_layer_interval=2, attention_chunk_size=8, floor_scale=8, attn_scale=0.5, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, pad_token_id=None, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    Llama4ForCausalLM(config).save_pretrained(tmp_path / "hf")
    run = [
        "--model.name", "llama4", "--model.flavor", "debugmodel", "--checkpoint.initial_load_path",
        str(tmp_path / "hf"), "--checkpoint.initial_load_in_hf", "--checkpoint.config_mismatch", "use_checkpoint",
        "--training.steps", "3", "--checkpoint.interval", "1",
    ]  # fmt: skip
    code, out, losses = train_subprocess(tmp_path / "run", *run)
    assert code == 0, out
    # transformers' loss on the run's first batch (the data does not depend on the model)
    inputs, labels = trainer(tmp_path / "probe", "--model.name", "llama4").next_microbatches()[0]
    ref = Llama4ForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        ref_loss = F.cross_entropy(ref(inputs).logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    assert abs(float(losses[1]) - ref_loss.item()) <= 1e-4, (losses[1], ref_loss.item())
    # resume from step 2 (step 3 set aside): the same step-3 loss, saved as HF this time
    ckpt = tmp_path / "run/checkpoint"
    shutil.move(ckpt / "step-3", tmp_path / "step-3-dcp")
    hf_flags = ("--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only")
    code, out, _ = train_subprocess(tmp_path / "refused", *run, *hf_flags)  # it trains a bias HF cannot hold
    assert code == 2 and "checkpoint.hf_drop_routing_bias = true" in out.strip().splitlines()[-1], out
    code, out, again = train_subprocess(tmp_path / "run", *run, *hf_flags, "--checkpoint.hf_drop_routing_bias")
    assert code == 0, out
    assert again[3] == losses[3]
    trained = read_model_tensors(tmp_path / "step-3-dcp")
    hf = Llama4ForCausalLM.from_pretrained(str(ckpt / "step-3"), dtype=torch.float32)
    args = hf_config_to_args(hf.config.to_dict())
    assert args.use_qk_norm and args.attn_temperature_tuning and args.nope_layers == [1, 3]
    loaded = from_hf(hf.state_dict(), args)
    initial = from_hf(ref.state_dict(), args)
    for key, value in trained.items():
        if not key.endswith("expert_bias"):  # HF Llama 4 has no routing bias (dropped, as told)
            assert torch.equal(loaded[key], value), key
    assert not torch.equal(loaded["layers.0.attention.wq.weight"], initial["layers.0.attention.wq.weight"])
    # to_hf of the run's DCP step exports the folder's model as the in-training export did, once
    # told to drop the trained bias (refused before, nothing written)
    import json

    from scripts.convert_hf import main

    assert main(["to_hf", str(ckpt / "step-2"), str(tmp_path / "step-2-hf")]) == 1
    assert not (tmp_path / "step-2-hf").exists()
    assert main(["to_hf", str(ckpt / "step-2"), str(tmp_path / "step-2-hf"), "--drop_routing_bias"]) == 0
    exported = json.loads((ckpt / "step-3/config.json").read_text())
    assert json.loads((tmp_path / "step-2-hf/config.json").read_text()) == exported
    assert exported["max_position_embeddings"] == 64 and exported["use_qk_norm"]
