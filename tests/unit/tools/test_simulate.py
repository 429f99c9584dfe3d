"""scripts/simulate.py: one process plays one rank of an N-rank job (fake process group, fake tensors)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.helpers.runs import script_module
from titan.config import load_config
from titan.tools.simulate.memory import CATEGORIES
from titan.tools.simulate.report import overflow_line, to_json
from titan.tools.simulate.run import simulate

REPO = Path(__file__).resolve().parents[3]
DEBUG = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml")]
SMALL = ["--training.seq_len", "64", "--training.local_batch_size", "2"]


@pytest.fixture(scope="module")
def at_64():
    """The debug model (6 blocks) on 64 ranks, at full depth and from two shorter depths."""
    full = simulate(load_config([*DEBUG, *SMALL, "--simulate.max_layers", "0"]), 64)
    short = simulate(load_config([*DEBUG, *SMALL, "--simulate.max_layers", "2"]), 64)
    return full, short


def test_64_ranks_report_every_category_collective_and_no_host_read(at_64):
    full, _ = at_64
    assert not dist.is_initialized()  # the fake world is gone again
    out = json.loads(to_json(full))
    assert out["world_size"] == 64 and out["rank"] == 0 and out["tensors"] == "fake"
    peak = out["simulated_peak_bytes"]
    assert set(peak) == {*CATEGORIES, "total"} and peak["total"] == sum(peak[k] for k in CATEGORIES)
    assert set(out["estimate_bytes"]) == set(peak)  # FSDP only: the estimate has numbers for it
    # fp32 parameters sharded 64 ways (+ the RoPE buffer), AdamW's two moments: twice that
    assert 5_770_496 * 4 / 64 < peak["parameters"] < 5_770_496 * 4 / 64 * 1.1
    assert abs(peak["optimizer_state"] - 2 * 5_770_496 * 4 / 64) < 64 * 4 * 2 * 40  # shard padding
    assert peak["activations"] > 0 and peak["loss"] > 0 and peak["communication"] > 0
    # FSDP: every block gathered in forward and again in backward, the root once; one reduce-scatter
    # each; all-reduces of the step's token count and the gradient norm; nothing read to the host
    assert out["collectives"]["all_gather"]["count"] == 2 * 6 + 1
    assert out["collectives"]["reduce_scatter"]["count"] == 6 + 1
    assert out["collectives"]["all_reduce"]["count"] == 2
    assert out["collectives_by_group"]["all_gather@dp_shard"]["count"] == 13
    assert out["host_reads"] == 0 and out["layers_run"] == [6] and not out["extrapolated"]
    assert out["checkpoint_plan"]["write_items"] > 0


def test_shorter_depths_extrapolate_to_the_full_run(at_64):
    full, short = at_64
    assert short.extrapolated and short.layers_run == [3, 4] and short.record.layers == 6
    _, a = full.peak
    _, b = short.peak
    for key in (*CATEGORIES, "total"):
        assert abs(a[key] - b[key]) <= 0.01 * a["total"], key
    assert short.record.collectives == full.record.collectives


def test_the_last_line_is_json_and_a_rank_that_does_not_fit_says_why_in_one_line(at_64, capsys, monkeypatch):
    full, _ = at_64
    tight = dataclasses.replace(full, device_memory_bytes=1024)
    line = overflow_line(tight)
    assert line is not None and "does not fit simulate.device_memory_gib" in line and "activations" in line
    run = script_module("simulate")
    monkeypatch.setattr("titan.tools.simulate.run.simulate", lambda config, world: tight)
    assert run.main(["--world_size", "64", *DEBUG]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out.strip().splitlines()[-1])["fits"] is False
    assert err.strip().splitlines()[-1] == f"titan: {line}"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([*DEBUG], "scripts/simulate.py needs --world_size N"),
        (["--world_size", "0", *DEBUG], "--world_size needs the number of ranks"),
        (["--world_size", "8", *DEBUG, "--simulate.rank", "8"], "config key 'simulate.rank' got 8; valid: 0 .. 7"),
        (["--world_size", "8", *DEBUG, "--simulate.moe_imbalance", "0.5"], "simulate.moe_imbalance"),
        (["--world_size", "6", *DEBUG, "--parallelism.tensor_parallel_degree", "4"], "do not divide the world size"),
        (["--world_size", "8", *DEBUG, "--training.enable_cpu_offload"], "training.enable_cpu_offload"),
    ],
)
def test_bad_input_is_one_line_and_status_2(args, says, capsys):
    assert script_module("simulate").main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("titan: error: ") and says in err[0], err


def _measured(rank: int, world: int, argv: list[str]) -> dict[str, int]:
    """One rank of a real 2-rank gloo run of the same step, under the same trackers."""
    from titan.tools.simulate.step import measure_step
    from titan.training.plan import plan_run

    config = load_config(argv)
    plan = plan_run(config, world, "cpu", data_here=False)
    plan.parallel_dims.build_mesh("cpu")
    _, peak = measure_step(config, plan, plan.parallel_dims).peak
    return {**peak.bytes, "total": peak.total}


@pytest.mark.slow
def test_simulated_peak_matches_a_real_two_rank_run():
    """The debug model on 2 gloo ranks, real tensors and real collectives, against the simulation of
    rank 0 of 2: the same step under the same trackers."""
    from tests.helpers.distributed import run_distributed
    from titan.tools.simulate.step import simulate_step
    from titan.training.plan import plan_run

    argv = [*DEBUG, *SMALL, "--model.n_layers", "2"]
    real = run_distributed(_measured, 2, argv)[0]
    config = load_config(argv)
    _, peak = simulate_step(config, plan_run(config, 2, "cuda", data_here=False), 0).peak
    assert abs(peak.total - real["total"]) <= 0.1 * real["total"], (peak, real)  # measured: 1 KiB apart
    # The same storages; at the peak's moment a real reduce-scatter may still hold its input where
    # the fake one has handed over the gradient shard already: those two may trade places.
    for key in ("parameters", "optimizer_state", "activations", "loss"):
        assert abs(peak.bytes[key] - real[key]) <= 0.01 * real["total"], (key, peak.bytes, real)
    moved = peak.bytes["gradients"] + peak.bytes["communication"] - real["gradients"] - real["communication"]
    assert abs(moved) <= 0.1 * real["total"], (peak.bytes, real)


LAYOUTS = {
    "tp": ["--parallelism.tensor_parallel_degree", "2"],
    "hsdp": ["--parallelism.data_parallel_replicate_degree", "2"],
    "ddp": ["--parallelism.data_parallel_replicate_degree", "8", "--parallelism.data_parallel_shard_degree", "1"],
    "pp": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B"],
    "cp": ["--parallelism.context_parallel_degree", "2", "--training.mixed_precision_param", "bfloat16"],
    "ep_etp": [
        "--model.name",
        "deepseek_v3",
        "--model.flavor",
        "debugmodel",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.expert_parallel_degree",
        "2",
        "--parallelism.expert_tensor_parallel_degree",
        "2",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_run_their_collectives(layout):
    config = load_config([*DEBUG, *SMALL, "--model.n_layers", "2", *LAYOUTS[layout]])
    report = simulate(config, 8)
    groups = {group for _, group in report.record.collectives}
    _, peak = report.peak
    assert peak["total"] > 0 and peak["activations"] > 0
    expected = {"tp": "tp", "hsdp": "dp_replicate", "ddp": "dp_replicate", "pp": "pp", "cp": "cp", "ep_etp": "ep"}
    assert expected[layout] in groups, report.record.collectives
    assert report.record.tensors == ("real" if layout == "ddp" else "fake")
    if layout != "ep_etp":
        assert sum(report.record.host_reads.values()) == (1 if layout == "pp" else 0)  # pp: the warm-up vote
    else:  # one read of the all-to-all split sizes per MoE block (the debug model's second block)
        assert sum(report.record.host_reads.values()) == 1
    assert report.estimate is not None and report.estimate["total"] > 0  # the estimate models every layout


def test_a_step_that_fails_at_this_scale_is_one_line_naming_where(capsys, monkeypatch):
    def fails(config, world):
        import torch

        norm = torch._foreach_norm  # pyright: ignore[reportPrivateImportUsage]
        norm([torch.empty(0)], float("inf"))  # what torchao's float8 precompute hits

    monkeypatch.setattr("titan.tools.simulate.run.simulate", fails)
    assert script_module("simulate").main(["--world_size", "4096", *DEBUG, "--simulate.rank", "4095"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("titan: rank 4095 of 4096 fails in its simulated step: RuntimeError: "), err
    assert "test_simulate.py:" in err[-1] and "in fails" in err[-1], err  # the call that failed, not torch's
