"""qwen3_5's flavors and model: every flavor's parameter count equals transformers' model built on
the meta device from the release's config.json values (text decoder) and the size its name
publishes (the releases also carry a vision encoder and an MTP head: within 7%); a packed window
gives each document the logits it gets alone (block_causal), through attention and DeltaNet blocks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

from titan.models import get_model_spec
from titan.models.documents import document_ids
from titan.models.qwen3_5 import Qwen35Transformer, qwen3_5_configs

# The releases' config.json text_config values: (hidden, layers, heads, kv heads, intermediate or
# (moe, shared, experts, top k), linear value heads, tied, published size in billions).
RELEASES = {
    "0.8B": (1024, 24, 8, 2, 3584, 16, True, 0.8),
    "2B": (2048, 24, 8, 2, 6144, 16, True, 2),
    "4B": (2560, 32, 16, 4, 9216, 32, True, 4),
    "9B": (4096, 32, 16, 4, 12288, 32, False, 9),
    "27B": (5120, 64, 24, 4, 17408, 48, False, 27),
    "35B-A3B": (2048, 40, 16, 2, (512, 512, 256, 8), 32, False, 35),
    "122B-A10B": (3072, 48, 32, 2, (1024, 1024, 256, 8), 64, False, 122),
    "397B-A17B": (4096, 60, 32, 2, (1024, 1024, 512, 10), 64, False, 397),
}


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("flavor", list(RELEASES))
def test_flavor_parameter_count_is_the_release(flavor: str) -> None:
    dim, layers, heads, kv, ffn, v_heads, tied, published = RELEASES[flavor]
    common = dict(
        vocab_size=248320, hidden_size=dim, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=v_heads,
        linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=tied,
    )  # fmt: skip
    with torch.device("meta"):
        if isinstance(ffn, tuple):
            moe = dict(moe_intermediate_size=ffn[0], shared_expert_intermediate_size=ffn[1], num_experts=ffn[2])
            hf = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**common, **moe, num_experts_per_tok=ffn[3]))
        else:
            hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**common, intermediate_size=ffn))
        ours = Qwen35Transformer(replace(qwen3_5_configs[flavor], max_seq_len=1))
    assert _count(ours) == _count(hf)
    assert abs(_count(ours) / (published * 1e9) - 1) < 0.07


def test_the_debug_flavors_are_torchtitans() -> None:
    spec = get_model_spec("qwen3_5")
    dense, moe = spec.flavors["debugmodel"], spec.flavors["debugmodel_moe"]
    assert (dense.dim, dense.n_layers, dense.n_heads, dense.kv_heads, dense.head_dim, dense.hidden_dim) == (
        256, 8, 4, 2, 64, 512
    )  # fmt: skip
    assert [dense.layer_type(i) for i in range(4)] == ["linear_attention"] * 3 + ["full_attention"]
    assert (moe.n_layers, moe.moe_args.num_experts, moe.moe_args.top_k, moe.moe_args.shared_hidden_dim) == (
        4,
        8,
        2,
        256,
    )


def test_packed_window_equals_each_document_alone() -> None:
    args = replace(
        qwen3_5_configs["debugmodel"], vocab_size=64, n_layers=4, max_seq_len=80, linear_attn_backend="torch"
    )
    torch.manual_seed(0)
    alone_model = Qwen35Transformer(args)
    alone_model.init_weights()
    model = Qwen35Transformer(replace(args, attn_mask_type="block_causal"))
    model.load_state_dict(alone_model.state_dict())
    model.init_buffers()
    eos, g = 2, torch.Generator().manual_seed(1)
    tokens = torch.randint(3, 64, (2, 80), generator=g)
    tokens[0, [20, 69]] = eos  # row 0: 21, 49 and 10 tokens; row 1: one document
    with torch.no_grad():
        packed = model(tokens, doc_ids=document_ids(tokens, eos))
        for row, start, end in ((0, 0, 21), (0, 21, 70), (0, 70, 80), (1, 0, 80)):
            alone = alone_model(tokens[row : row + 1, start:end])
            torch.testing.assert_close(packed[row : row + 1, start:end], alone, atol=2e-5, rtol=0)
