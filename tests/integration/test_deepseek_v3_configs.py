"""torchtitan v0.2.2's three deepseek_v3 training configs, as that release ships them
(torchtitan/models/deepseek_v3/train_configs/, copied to tests/fixtures/torchtitan/), through the
dry run at the 8 ranks its run_train.sh starts by default. Only the tokenizer location is missing
here (the dry run then uses the flavor's vocabulary) and the debug model's c4_test is titan's
offline corpus. The 16B file asks for per-op selective activation checkpointing with EP 8, which
titan refuses in one line (as for llama4: torch cannot replay the experts' own FSDP inside a
checkpointed block); with full AC it plans."""

from __future__ import annotations

from pathlib import Path

import pytest

from titan.launch.entry import main

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "torchtitan"
# The release's files, byte for byte (tests/fixtures/torchtitan/, also read by the simulator's tests).
CONFIGS = {
    name: (FIXTURES / file).read_text()
    for name, file in (
        ("debug_model", "deepseek_v3_debug_model.toml"),
        ("deepseek_v3_16b", "deepseek_v3_16b.toml"),
        ("deepseek_v3_671b", "deepseek_v3_671b.toml"),
    )
}


def _dry_run(tmp_path: Path, name: str, *extra: str) -> int:
    path = tmp_path / f"{name}.toml"
    path.write_text(CONFIGS[name])
    flags = ["--job.config_file", str(path), "--job.dump_folder", str(tmp_path / "out"), *extra]
    return main([*flags, "--job.dry_run", "--job.dry_run_world_size", "8"])


@pytest.mark.parametrize(
    # the 16B file: per-op selective AC with EP 8, as shipped
    "name",
    ["debug_model", "deepseek_v3_16b", pytest.param("deepseek_v3_671b", marks=pytest.mark.slow)],
)
def test_deepseek_v3_config_dry_runs_as_it_is(name: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    status = _dry_run(tmp_path, name)
    out = capsys.readouterr()
    assert status == 0, out.err.strip().splitlines()[-1:]
    assert "matches the model's" in out.out + out.err


def test_deepseek_v3_benchmark_presets_are_valid_configs() -> None:
    """scripts/benchmark.py's DeepSeek-V3 rows: each variant loads and plans as the layout it names."""
    from tests.helpers.runs import script_module
    from titan.training.checks import load_job
    from titan.training.plan import plan_run

    benchmark = script_module("benchmark")
    for name, world in (("deepseek_v3_debug_cpu", 2), ("deepseek_v3_16b_4layers", 8)):
        preset = benchmark.PRESETS[name]
        for _, extra in preset["variants"]:
            config = load_job(preset.get("args", []) + extra.format(nproc=world).split())
            plan = plan_run(config, world, "cuda" if world == 8 else "cpu")
            assert config.model.name == "deepseek_v3"
            assert plan.parallel_dims.ep == config.parallelism.expert_parallel_degree


SMALL = ("--model.n_layers", "2", "--training.seq_len", "256", "--activation_checkpoint.mode", "none")


@pytest.mark.parametrize("name", ["debug_model", pytest.param("deepseek_v3_671b", marks=pytest.mark.slow)])
def test_context_parallel_2_plans(name: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """CP 2 x FSDP 4 over the 8 ranks: latent attention's kernels take CP (the plan is checked for GPUs)."""
    status = _dry_run(tmp_path, name, "--parallelism.context_parallel_degree", "2")
    out = capsys.readouterr()
    assert status == 0, out.err.strip().splitlines()[-1:]
    assert "matches the model's" in out.out + out.err


def test_tensor_parallel_plans_with_experts_and_refuses_heads_it_does_not_divide(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    etp = ("--parallelism.expert_parallel_degree", "2", "--parallelism.expert_tensor_parallel_degree", "2")
    status = _dry_run(tmp_path, "debug_model", *SMALL, "--parallelism.tensor_parallel_degree", "2", *etp)
    out = capsys.readouterr()
    assert status == 0, out.err.strip().splitlines()[-1:]
    assert "tp 2" in out.out and "matches the model's" in out.out + out.err
    # EP over the TP ranks' tokens with whole experts (ETP 1): one line, before any process group.
    status = _dry_run(tmp_path, "debug_model", *SMALL, "--parallelism.tensor_parallel_degree", "2", *etp[:2])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and "set expert_tensor_parallel_degree = 2" in err[-1], err[-1:]
    tp8 = ("--model.n_heads", "12", "--parallelism.tensor_parallel_degree", "8")
    status = _dry_run(tmp_path, "debug_model", *SMALL, *tp8)
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and "tensor_parallel_degree 8 must divide model n_heads (12)" in err[-1], err[-1:]


@pytest.mark.slow
def test_671b_plans_at_tp8_with_latent_projections_norms_and_routers_replicated(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    status = _dry_run(tmp_path, "deepseek_v3_671b", "--parallelism.tensor_parallel_degree", "8")
    out = capsys.readouterr().out
    assert status == 0 and "tp 8" in out
    # By hand: what every TP rank holds whole, per block the query and key/value down projections
    # (7168 x 1536, 7168 x 576), their norms (1536, 512) and the two block norms; the router of each
    # of the 58 MoE blocks (256 experts x 7168); the final norm. All else is split 8 ways.
    dim, blocks, moe_blocks = 7168, 61, 58
    replicated = blocks * (dim * 1536 + 1536 + dim * 576 + 512 + 2 * dim) + moe_blocks * 256 * dim + dim
    total = 671_026_404_352
    per_rank = (total - replicated) // 8 + replicated
    assert f"0-7   {per_rank:,}" in out, out
