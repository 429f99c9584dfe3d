"""The llama4 family: torchtitan's flavors, active-parameter FLOPs, reuse of llama3's pieces, iRoPE
masks (fp32, tiny shapes; the big flavors only on the meta device)."""

from __future__ import annotations

import copy

import pytest
import torch

from titan.errors import TitanError
from titan.models import get_model_spec, spec_for_args
from titan.models.llama.args import TransformerModelArgs
from titan.models.llama.model import Transformer
from titan.models.llama4 import Llama4ModelArgs, Llama4Transformer, get_nparams_and_flops, llama4_configs
from titan.models.llama4.model import IRopeMasks, chunked_causal_dense
from titan.models.moe import MoEArgs

TINY = Llama4ModelArgs(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=32,
    moe_args=MoEArgs(num_experts=4, top_k=2),
)  # fmt: skip


def _build(args: Llama4ModelArgs, seed: int = 0) -> Llama4Transformer:
    torch.manual_seed(seed)
    model = Llama4Transformer(copy.deepcopy(args))
    model.init_weights()
    return model


def test_flavors_are_torchtitans_by_name_and_shape():
    spec = get_model_spec("llama4")
    assert list(spec.flavors) == [
        "debugmodel", "17bx16e", "17bx128e", "debugmodel_irope", "17bx16e_irope", "17bx128e_irope",
    ]  # fmt: skip
    scout, maverick = spec.flavors["17bx16e"], spec.flavors["17bx128e"]
    assert (scout.dim, scout.n_layers, scout.n_heads, scout.kv_heads, scout.moe_hidden_dim) == (5120, 48, 40, 8, 8192)
    assert scout.interleave_moe_layer_step == 1 and maverick.interleave_moe_layer_step == 2
    assert spec.flavors["17bx16e_irope"].every_n_layers_nope == 4
    assert spec_for_args(scout) is spec and spec_for_args(TransformerModelArgs()).name == "llama3"
    # Scout's text model: every expert stored, 17B active (the name); FLOPs count the active ones.
    with torch.device("meta"):
        model = Llama4Transformer(copy.deepcopy(scout))
    total, flops = get_nparams_and_flops(model, 8192)
    attention, expert, norms = 2 * 5120 * 5120 + 2 * 5120 * 1024, 3 * 5120 * 8192, 2 * 5120
    per_layer = attention + 16 * expert + expert + 5120 * 16 + norms  # routed, shared, router
    assert total == 48 * per_layer + 2 * 202048 * 5120 + 5120
    active = (flops - 12 * 48 * 40 * 128 * 8192) / 6 + 202048 * 5120  # + the embedding lookup
    assert active == 48 * (per_layer - 15 * expert) + 2 * 202048 * 5120 + 5120
    assert 16.5e9 < active < 17.5e9


def test_flops_count_top_k_of_the_routed_experts():
    model = _build(TINY)
    total, flops = get_nparams_and_flops(model, 32)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".moe.experts." in n)
    embedding = model.tok_embeddings.weight.numel()
    assert total == sum(p.numel() for p in model.parameters())
    attention = 12 * 2 * 4 * 16 * 32
    assert flops == 6 * (total - embedding - experts + experts * 2 // 4) + attention


def test_without_moe_layers_it_is_llama3():
    """No block reaches the interleave step: the blocks, norm, output and RoPE (scaled) are llama3's."""
    args = Llama4ModelArgs(**{**TINY.__dict__, "interleave_moe_layer_step": 10, "use_rope_scaling": True})
    l4 = _build(args)
    l3 = Transformer(
        TransformerModelArgs(
            **{k: v for k, v in args.__dict__.items() if k in TransformerModelArgs.__dataclass_fields__}
        )
    )
    l3.load_state_dict(l4.state_dict())
    tokens = torch.randint(0, 128, (2, 32))
    torch.testing.assert_close(l4(tokens), l3(tokens), rtol=0, atol=0)


def test_moe_blocks_follow_the_interleave_step_and_nope_every_n():
    args = Llama4ModelArgs(**{**TINY.__dict__, "n_layers": 4, "every_n_layers_nope": 2})
    model = _build(args)
    blocks = list(model.layers.values())
    assert [b.moe_enabled for b in blocks] == [False, True, False, True]
    assert [b.attention.use_rope for b in blocks] == [False, True, False, True]
    assert (
        "layers.1.moe.expert_bias" in model.state_dict() and "layers.1.moe.tokens_per_expert" not in model.state_dict()
    )


def test_irope_rope_blocks_attend_within_fixed_blocks_and_nope_blocks_over_the_window():
    args = Llama4ModelArgs(**{**TINY.__dict__, "every_n_layers_nope": 2, "fixed_attn_block_size": 8})
    model = _build(args)
    masks = model.attention_mask(32, torch.device("cpu"), None, None)
    assert isinstance(masks, IRopeMasks) and masks.nope is None
    pos = torch.arange(32)
    want = (pos[:, None] >= pos[None, :]) & (pos[:, None] // 8 == pos[None, :] // 8)
    assert torch.equal(masks.rope[0, 0], want)
    docs = torch.tensor([[0] * 12 + [1] * 20])
    assert torch.equal(
        chunked_causal_dense(32, 8, torch.device("cpu"), docs)[0, 0], want & (docs[0, :, None] == docs[0])
    )
    freqs = model.freqs_cis
    x = torch.randn(1, 32, 64)
    x2 = x.clone()
    x2[0, 3] += 1.0  # a token in the first block of 8
    for layer, crosses in (("0", True), ("1", False)):  # 0: NoPE (whole window), 1: RoPE (own block)
        block = model.layers[layer]
        y, y2 = block(x, freqs, masks), block(x2, freqs, masks)
        assert torch.equal(y[0, 8:], y2[0, 8:]) != crosses, layer


def test_bad_llama4_args_name_the_key():
    with pytest.raises(TitanError, match="every_n_layers_nope must be an integer > 1"):
        Llama4ModelArgs(every_n_layers_nope=1).validate()
    with pytest.raises(TitanError, match=r"moe_args.top_k got 9"):
        Llama4ModelArgs(moe_args=MoEArgs(num_experts=8, top_k=9)).validate()
    assert set(llama4_configs) >= {"debugmodel", "debugmodel_irope"}


def test_moe_balancing_keys_reach_the_moe_args_and_are_refused_on_dense_models():
    from titan.config import load_config
    from titan.models import model_args_from_config
    from titan.training.plan import run_model_args

    def moe_args(*flags: str):
        config = load_config(["--model.name", "llama4", *flags])
        return run_model_args(config, model_args_from_config(get_model_spec("llama4"), config.model), None).moe_args

    assert (moe_args().load_balance_coeff, moe_args().aux_loss_coeff) == (1e-3, 0.0)  # the flavor's
    tuned = moe_args("--model.moe_load_balance_coeff", "0.01", "--model.moe_aux_loss_coeff", "0.001")
    assert (tuned.load_balance_coeff, tuned.aux_loss_coeff) == (0.01, 0.001)
    assert moe_args("--model.moe_load_balance_coeff", "0").load_balance_coeff is None  # no biases
    with pytest.raises(TitanError, match="model.moe_load_balance_coeff.*valid: a number >= 0"):
        load_config(["--model.name", "llama4", "--model.moe_load_balance_coeff", "-1"])
    dense = load_config(["--model.moe_aux_loss_coeff", "0.001"])
    with pytest.raises(TitanError, match=r"'model.moe_aux_loss_coeff' got 0.001; valid: unset \(model llama3"):
        run_model_args(dense, model_args_from_config(get_model_spec("llama3"), dense.model), None)


def test_debug_moe_force_load_balance_reaches_the_routers():
    from titan.config import load_config
    from titan.models import model_args_from_config
    from titan.training.plan import run_model_args

    config = load_config(["--model.name", "llama4", "--debug.moe_force_load_balance"])
    args = run_model_args(config, model_args_from_config(get_model_spec("llama4"), config.model), None)
    assert args.moe_args.force_load_balance
    args.dim, args.n_layers, args.n_heads, args.max_seq_len = 64, 2, 4, 16
    model = _build(args)
    _, experts, counts, _ = model.layers["1"].moe.router(torch.randn(16, 64))
    assert experts.flatten().tolist() == [i % 8 for i in range(16)] and counts.tolist() == [2.0] * 8
