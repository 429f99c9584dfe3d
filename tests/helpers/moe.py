"""The tiny llama4 flavors the MoE layout tests share (expert parallel, Muon), registered for a test."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

from tests.helpers.parity import VOCAB
from titan.models import get_model_spec, register_flavor, register_model_spec
from titan.models.llama4.args import Llama4ModelArgs
from titan.models.moe import MoEArgs

# 4 layers, MoE in layers 1 and 3; 4 experts (EP 1, 2 or 4), top 2, a shared expert, bias balancing on.
EPTEST = Llama4ModelArgs(
    dim=64,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=VOCAB,
    multiple_of=32,
    moe_args=MoEArgs(num_experts=4, top_k=2, num_shared_experts=1, load_balance_coeff=1e-2),
)
# The same with the router's scores applied to the experts' outputs (Qwen3's and DeepSeek-V3's way).
EPTEST_SAE = dataclasses.replace(EPTEST, moe_args=dataclasses.replace(EPTEST.moe_args, score_before_experts=False))
LLAMA4 = ("--model.name", "llama4", "--model.flavor", "eptest")
SAE = ("--model.flavor", "eptest_sae")


@contextlib.contextmanager
def eptest_flavor() -> Iterator[None]:
    saved = get_model_spec("llama4")
    try:
        register_flavor("llama4", "eptest", EPTEST, replace=True)
        register_flavor("llama4", "eptest_sae", EPTEST_SAE, replace=True)
        yield
    finally:
        register_model_spec(saved, replace=True)
