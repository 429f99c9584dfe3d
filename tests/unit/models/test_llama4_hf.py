"""titan llama4 <-> transformers' Llama4ForCausalLM: the same logits (within 1e-5, fp32) from
converted weights on random small configs, lossless weights both ways, and the HF folder path
(sharded safetensors, config.json) that convert_hf.py and initial_load_in_hf use."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import Llama4ForCausalLM, Llama4TextConfig

from titan.checkpointing.hf import load_hf, read_hf_config, save_hf
from titan.errors import TitanError
from titan.models.llama4 import Llama4ModelArgs, Llama4Transformer
from titan.models.llama4.state_dict_adapter import args_to_hf_config, from_hf, hf_config_to_args, to_hf
from titan.models.moe import MoEArgs

REPO = Path(__file__).resolve().parents[3]
BASE = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=16, max_seq_len=32)
CONFIGS = {
    # MoE every block, top 2, llama3-scaled RoPE whose bands occur at head_dim 16
    "scaled_top2": Llama4ModelArgs(
        **BASE,
        interleave_moe_layer_step=1,
        moe_args=MoEArgs(num_experts=4, top_k=2),
        use_rope_scaling=True,
        rope_scale_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_position_embeddings=64,
        rope_theta=10000.0,
    ),
    # MoE every second block, iRoPE: NoPE blocks 0 and 2, the others attend within blocks of 8
    "irope_tied": Llama4ModelArgs(
        **BASE, moe_args=MoEArgs(num_experts=3, top_k=1), every_n_layers_nope=2, fixed_attn_block_size=8,
        tie_embeddings=True,
    ),
}  # fmt: skip


def _titan(args: Llama4ModelArgs) -> Llama4Transformer:
    torch.manual_seed(0)
    model = Llama4Transformer(copy.deepcopy(args))
    model.init_weights()
    with torch.no_grad():  # norms and router away from their init, so every tensor matters
        for name, p in model.named_parameters():
            if "norm" in name or "router" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.3)
    return model


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers_and_weights_round_trip(name):
    args = CONFIGS[name]
    model = _titan(args)
    hf_config = Llama4TextConfig(**{k: v for k, v in args_to_hf_config(args).items() if k != "architectures"})
    hf = Llama4ForCausalLM(hf_config).eval()
    result = hf.load_state_dict(to_hf(model.state_dict(), args), strict=False)
    # tied: HF's lm_head is its embedding (one tensor), which the export writes once
    assert result.unexpected_keys == [] and result.missing_keys == (["lm_head.weight"] if args.tie_embeddings else [])
    assert not args.tie_embeddings or hf.lm_head.weight is hf.model.embed_tokens.weight
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, atol=1e-5, rtol=1e-5)
    back = from_hf(hf.state_dict(), args)
    state = model.state_dict()
    assert set(back) == set(state)
    for key, value in state.items():
        assert torch.equal(back[key], value), key
    # config.json -> the same args (the training settings aside, which HF does not record)
    assert hf_config_to_args(hf_config.to_dict()) == args


def test_hf_folder_round_trip_with_module_whole_shards(tmp_path):
    args = CONFIGS["scaled_top2"]
    model = _titan(args)
    with torch.no_grad():
        model.layers["1"].moe.expert_bias.fill_(0.0)
    save_hf(model.state_dict(), args, tmp_path / "hf", max_shard_bytes=40_000)  # many files
    index = json.loads((tmp_path / "hf/model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    assert json.loads((tmp_path / "hf/config.json").read_text())["model_type"] == "llama4_text"
    assert read_hf_config(tmp_path / "hf") == args
    state, loaded_args = load_hf(tmp_path / "hf")
    assert isinstance(loaded_args, Llama4ModelArgs)
    for key, value in model.state_dict().items():
        assert torch.equal(state[key], value), key
    # scripts/convert_hf.py: HF -> model-only DCP folder (model_args.json) -> HF again
    spec = importlib.util.spec_from_file_location("convert_hf", REPO / "scripts/convert_hf.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["from_hf", str(tmp_path / "hf"), str(tmp_path / "dcp")]) == 0
    assert script.main(["to_hf", str(tmp_path / "dcp"), str(tmp_path / "hf2")]) == 0  # family from the folder
    again, again_args = load_hf(tmp_path / "hf2")
    assert again_args == args and all(torch.equal(again[k], v) for k, v in state.items())


def test_unsupported_hf_variants_are_refused_in_one_line():
    config = args_to_hf_config(CONFIGS["scaled_top2"])
    with pytest.raises(TitanError, match="attention_bias = True is not supported by titan's llama4: only False"):
        hf_config_to_args({**config, "attention_bias": True})
    with pytest.raises(TitanError, match="no_rope_layers must be a list with one entry per layer"):
        hf_config_to_args({**config, "no_rope_layers": [1, 1, 0]})
