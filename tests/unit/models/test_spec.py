"""The model spec is the one door to a family: complete, read-only, and parallel/ names no model;
generation through the model's own attention + KV cache equals full recompute."""

from __future__ import annotations

import ast
import dataclasses
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import titan.models.llama.args as llama_args
from tests.helpers.tiny import TINY, build, extra_flavors
from titan.errors import TitanError
from titan.models import get_flavor, get_model_spec, spec_for_args, spec_for_hf_model_type
from titan.models.kv_cache import KVCache

REPO = Path(__file__).resolve().parents[3]


def test_llama3_spec_has_everything_the_trainer_and_tools_use():
    spec = get_model_spec("llama3")
    for field in dataclasses.fields(spec):
        assert getattr(spec, field.name) is not None, field.name
    assert spec_for_args(TINY) is not None and spec_for_args(TINY).name == "llama3"
    assert spec_for_hf_model_type("llama").name == "llama3"
    with pytest.raises(TitanError, match="model_type is 'mistral'; supported: 'llama'"):
        spec_for_hf_model_type("mistral")
    with pytest.raises(TitanError, match="model.name"):
        get_model_spec("gpt2")


def test_flavor_tables_are_read_only_and_hand_out_copies():
    spec = get_model_spec("llama3")
    with pytest.raises(TypeError):
        spec.flavors["tiny"] = TINY  # type: ignore[index]
    with pytest.raises(TypeError):
        llama_args.llama3_configs["8B"] = TINY  # type: ignore[index]
    copy = get_flavor(spec, "8B")
    copy.n_layers = 1
    assert spec.flavors["8B"].n_layers == 32 and llama_args.get_model_args("8B").n_layers == 32
    with extra_flavors(tiny=TINY):  # tests add flavors through the registry (register_flavor)
        assert get_model_spec("llama3").flavors["tiny"] == TINY
    assert "tiny" not in get_model_spec("llama3").flavors


def test_parallel_imports_no_model():
    for f in sorted((REPO / "titan/parallel").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.startswith("titan.models") for n in names), f.name


@pytest.mark.parametrize("attn_type", ["sdpa", "flex"])
def test_kv_cache_decoding_matches_full_recompute(attn_type):
    """Prefill 5 tokens, then one token at a time through the cache: the logits of every position
    equal those of one full forward (the model's own attention in both)."""
    model = build(replace(TINY, attn_type=attn_type)).eval()
    tokens = torch.randint(0, TINY.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(TINY.max_seq_len)
        steps = [model(tokens[:, :5], kv_cache=cache)]
        cache.advance(5)
        for i in range(5, tokens.shape[1]):
            steps.append(model(tokens[:, i : i + 1], kv_cache=cache))
            cache.advance(1)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=2e-5, rtol=1e-5)
    assert cache.pos == 12
    with pytest.raises(TitanError, match="exceeds model max_seq_len"):
        model(torch.zeros(1, TINY.max_seq_len, dtype=torch.long), kv_cache=cache)
