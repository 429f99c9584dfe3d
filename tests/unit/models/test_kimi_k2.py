"""Kimi K2 as released: its config.json (model_type kimi_k2, DeepseekV3ForCausalLM) reads as
deepseek_v3 with its own values, which are the kimi_k2 flavor's; the flavor has Kimi K2's ~1.03T
parameters (32B active) on the meta device; its tokenizer is read from the folder's tiktoken.model
with the split pattern its tokenization_kimi.py states."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import tiktoken
import torch

from tests.helpers.hf_release import KIMI_PATTERN, kimi_tokenizer
from titan.data.tokenizer import build_tokenizer
from titan.errors import TitanError
from titan.models import get_flavor, get_model_spec, spec_for_hf_model_type
from titan.models.deepseek_v3.model import DeepSeekV3Transformer
from titan.models.moe.flops import parameter_counts

# moonshotai/Kimi-K2-Instruct's config.json, less auto_map and the token ids.
KIMI_K2 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "attention_bias": False,
    "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "first_k_dense_replace": 1, "hidden_act": "silu",
    "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 131072, "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 1,
    "n_routed_experts": 384, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 64,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 64, "num_nextn_predict_layers": 0,
    "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 163840,
}  # fmt: skip


def test_kimi_k2_config_reads_as_deepseek_v3_with_its_values_the_flavors() -> None:
    spec = spec_for_hf_model_type("kimi_k2")
    assert spec.name == "deepseek_v3"
    args = spec.state_dict_adapter.hf_config_to_args(KIMI_K2)
    moe = args.moe_args
    assert (moe.num_experts, moe.num_expert_groups, args.n_dense_layers, args.n_heads) == (384, None, 1, 64)
    flavor = get_flavor(spec, "kimi_k2")
    per_run = {"attn_type": flavor.attn_type, "attn_mask_type": flavor.attn_mask_type}
    assert dataclasses.replace(args, **per_run) == flavor


def test_kimi_k2_flavor_counts_its_parameters_on_meta() -> None:
    flavor = get_flavor(get_model_spec("deepseek_v3"), "kimi_k2")
    with torch.device("meta"):
        model = DeepSeekV3Transformer(dataclasses.replace(flavor, max_seq_len=16))
    counts = parameter_counts(model)
    assert sum(counts.values()) == 1_026_408_209_408  # Kimi K2's "1T total" (the MTP layer aside)
    active = counts["dense"] + counts["moe_other"] + counts["experts"] * 8 // 384
    assert 31e9 < active < 33e9  # "32B activated" (embedding aside)


def test_kimi_tokenizer_is_read_from_its_folder(tmp_path: Path) -> None:
    kimi_tokenizer(tmp_path)
    tok = build_tokenizer(tmp_path)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (512, 256, 257)
    reference = tiktoken.Encoding(
        "kimi", pat_str=KIMI_PATTERN, mergeable_ranks={bytes([b]): b for b in range(256)}, special_tokens={}
    )
    for text in ("Hello World's 12345 tokens!", "月之暗面 Kimi K2\n\n  x", "[BOS] stays text"):
        ids = tok.encode(text, bos=True, eos=True)
        assert ids == [256, *reference.encode(text), 257]
        assert tok.decode(ids[1:-1]) == text
    (tmp_path / "tokenization_kimi.py").write_text("class TikTokenTokenizer:\n    pat_str = compute()\n")
    with pytest.raises(TitanError, match="states no literal pat_str"):
        build_tokenizer(tmp_path)
