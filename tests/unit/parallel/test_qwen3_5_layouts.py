"""qwen3_5's layouts on two gloo ranks: every layout's (loss, grad norm) per step against the same
data-parallel layout without it or the one-process run, within 1e-5 for 4 steps in fp32 (1e-4 against
the one-process run where the data-parallel reduction reorders sums) and within bf16's tolerance with
bf16 parameters. HSDP, FSDP x TP and EP x ETP are family-independent compositions: the dense and
MoE layout tests cover them. The tiny hybrid has three Gated DeltaNet blocks and one gated attention
block (2 key / 4 value DeltaNet heads: TP 2 splits both); the MoE one routes in every block with the
gated shared expert (TP: the router and the shared expert's gate whole on every rank). Compile with the
memory-budget AC runs in one process against eager (one block of each kind, 3 steps). Context
parallelism is refused in one line. The MoE model with one multi-token-prediction depth under TP 2
and PP 2 gives the one-process (loss, grad norm, MTP loss) for 3 steps (1e-5 relative)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.mtp import run_mtp
from tests.helpers.parity import GLOBAL_BATCH, VOCAB, close, config, run
from titan.errors import TitanError
from titan.models import get_model_spec, register_flavor, register_model_spec
from titan.models.moe import MoEArgs
from titan.models.qwen3_5 import Qwen35ModelArgs
from titan.training.trainer import Trainer

pytestmark = pytest.mark.slow

TOL = 1e-5
STEPS = 4  # the layouts part from the first step; a few steps show the optimizer state agrees too
PP_RTOL = 1e-5  # pipeline micro-batches sum in another order: a few ulps of the loss, so relative
BF16_TOL = 2e-2  # bf16 parameters: 8 mantissa bits, about 4e-3 per rounding; two layouts round apart
SHAPE = dict(
    dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=VOCAB, hidden_dim=96, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, max_seq_len=64,
)  # fmt: skip
MOE = MoEArgs(
    num_experts=4, top_k=2, num_shared_experts=1, shared_hidden_dim=32, shared_expert_gate=True, score_func="softmax",
    route_norm=True, score_before_experts=False, hidden_dim=48, load_balance_coeff=1e-2,
)  # fmt: skip
FLAVORS = {
    "q35test": Qwen35ModelArgs(**SHAPE),
    # One block of each kind: what compile sees (each kind compiles once, whatever the depth).
    "q35short": Qwen35ModelArgs(**{**SHAPE, "n_layers": 2}, layer_types=["linear_attention", "full_attention"]),
    "q35moetest": Qwen35ModelArgs(**SHAPE, moe_enabled=True, moe_args=MOE),
}
SHARD = "--parallelism.data_parallel_shard_degree"
BF16 = ("--training.mixed_precision_param", "bfloat16")
MTP = ("--model.mtp_depth", "1", "--metrics.log_freq", "1")


@contextlib.contextmanager
def qwen3_5_flavors() -> Iterator[None]:
    saved = get_model_spec("qwen3_5")
    try:
        for name, args in FLAVORS.items():
            register_flavor("qwen3_5", name, args, replace=True)
        yield
    finally:
        register_model_spec(saved, replace=True)


def _trainer(dump: str, flavor: str, dp: int, *flags: str) -> Trainer:
    batch = ("--training.local_batch_size", str(GLOBAL_BATCH // dp), "--training.global_batch_size", str(GLOBAL_BATCH))
    model = ("--model.name", "qwen3_5", "--model.flavor", flavor)
    return Trainer(config(dump, *model, *batch, "--metrics.log_freq", "5", "--optimizer.lr", "1e-3", *flags))


def _layouts(dump: str, layouts: dict[str, tuple[str, int, tuple[str, ...]]]) -> dict:
    with qwen3_5_flavors():
        return {name: run(_trainer(dump, flavor, dp, *flags), STEPS) for name, (flavor, dp, flags) in layouts.items()}


def on_two_ranks(rank: int, world: int, dump: str) -> dict:
    tp2 = ("--parallelism.tensor_parallel_degree", "2", SHARD, "1")
    ep2 = (SHARD, "2", "--parallelism.expert_parallel_degree", "2")
    pp2 = ("--parallelism.pipeline_parallel_degree", "2", SHARD, "1")
    with qwen3_5_flavors():  # multi-token prediction (one full-attention MoE block): (loss, grad norm, MTP loss)
        mtp = {f"moe_mtp_{name}": run_mtp(_trainer(dump, "q35moetest", 1, *MTP, *flags)) for name, flags in (
            ("tp2", tp2), ("pp2", pp2))}  # fmt: skip
    return mtp | _layouts(
        dump,
        {
            "fsdp2": ("q35test", 2, (SHARD, "2")),
            "fsdp2_ac_op": ("q35test", 2, (SHARD, "2", "--activation_checkpoint.mode", "selective")),
            "tp2": ("q35test", 1, tp2),
            "pp2": ("q35test", 1, pp2),
            "moe_ep2": ("q35moetest", 2, ep2),
            "moe_tp2": ("q35moetest", 1, tp2),
            "moe_ep2_bf16": ("q35moetest", 2, (*ep2, *BF16)),
        },
    )  # fmt: skip


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict:
    """The one-process runs."""
    dump = str(tmp_path_factory.mktemp("q35ref"))
    with qwen3_5_flavors():
        out = {f: run(_trainer(dump, f, GLOBAL_BATCH), steps=3 if f == "q35short" else STEPS) for f in FLAVORS}
        return out | {"mtp": run_mtp(_trainer(dump, "q35moetest", GLOBAL_BATCH, *MTP))}


def test_layouts_match_their_data_parallel_layout(tmp_path: Path, references: dict) -> None:
    results = run_distributed(on_two_ranks, 2, str(tmp_path), timeout=900)
    dense, moe = references["q35test"], references["q35moetest"]
    for r in results:
        close(r["fsdp2"], dense, "fsdp2 vs 1 process", 1e-4)
        close(r["fsdp2_ac_op"], r["fsdp2"], "fsdp2_ac_op", TOL)
        close(r["tp2"], dense, "tp2 (DeltaNet heads split)", TOL)
        close(r["pp2"], dense, "pp2", PP_RTOL, relative=True)
        close(r["moe_ep2"], moe, "moe ep2 vs 1 process", 1e-4)
        close(r["moe_tp2"], moe, "moe tp2 (router and shared gate whole, gradients summed)", TOL)
        close(r["moe_ep2_bf16"], r["moe_ep2"], "ep2 bf16 vs fp32", BF16_TOL, relative=True)
        for name in ("moe_mtp_tp2", "moe_mtp_pp2"):
            close(r[name], references["mtp"], name, PP_RTOL, relative=True)
            assert max(abs(a[2] - b[2]) / b[2] for a, b in zip(r[name], references["mtp"])) < PP_RTOL, name


def test_compile_with_memory_budget_ac_matches_eager(tmp_path: Path, references: dict) -> None:
    flags = ("--compile.enable", "--activation_checkpoint.mode", "memory_budget")
    with qwen3_5_flavors():  # 3 steps: the compile is the cost, and the subject
        compiled = run(_trainer(str(tmp_path), "q35short", GLOBAL_BATCH, *flags), steps=3)
    close(compiled, references["q35short"], "compile + memory-budget AC", TOL)


def test_context_parallel_is_refused_in_one_line() -> None:
    with pytest.raises(TitanError, match="context_parallel_degree = 2 is not supported for qwen3_5") as e:
        FLAVORS["q35test"].check_parallelism(1, 2)
    assert "\n" not in str(e.value)
    with pytest.raises(TitanError, match="tensor_parallel_degree 4 must divide model.linear_num_key_heads"):
        FLAVORS["q35test"].check_parallelism(4, 1)
