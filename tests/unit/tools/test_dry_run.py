"""Dry run: the real build path for N ranks on one CPU process, checked against the model size."""

from pathlib import Path

import pytest
import torch.distributed as dist

from titan.config import load_config
from titan.errors import TitanError
from titan.tools.dry_run import DryRunReport, format_report, run_dry_run
from titan.training.plan import plan_run

REPO = Path(__file__).resolve().parents[3]


def _config(toml: str, world: int, *extra: str):
    return load_config(
        [
            "--job.config_file",
            str(REPO / "train_configs" / toml),
            "--job.dry_run",
            "--job.dry_run_world_size",
            str(world),
            *extra,
        ]
    )


@pytest.mark.slow
def test_405b_on_512_ranks_plan_adds_up_to_the_model():
    config = _config("llama3_405b.toml", 512)  # as shipped: TP 8 inside nodes, FSDP 64 across
    report = run_dry_run(config)
    assert not dist.is_initialized()  # the fake group is gone again
    assert report.model_params == 405_853_388_800
    assert report.degrees == {"pp": 1, "dp_replicate": 1, "dp_shard": 64, "cp": 1, "tp": 8}
    assert len(report.per_rank_params) == 512 and min(report.per_rank_params) > 0
    # Each shard once: the model. TP replicates the norm weights over its 8 ranks, so the plain
    # sum over ranks exceeds the model by 7 copies of them (per FSDP shard).
    assert report.distinct_shard_params == report.model_params
    norms = 126 * 2 * 16384 + 16384
    assert sum(report.per_rank_params) == report.model_params + 7 * norms
    text = format_report(report, config)
    assert "mesh: DeviceMesh((dp_shard=64, tp=8)" in text
    assert "stage 0: layers 0-125 (126) + tok_embeddings, norm, output" in text
    assert "        0-503      792,755,456" in text
    assert "model transforms: activation checkpointing full, torch.compile (model, loss)" in text  # as configured
    assert "matches the model's 405,853,388,800" in text
    # fp32 params + grads + two AdamW states: 16 bytes per local parameter.
    assert abs(sum(report.memory[0].values()) - 792_755_456 * 16 / 1024**3) < 1e-6

    # Pure FSDP over all 512 ranks: no copies at all, the per-rank counts sum to the model.
    fsdp = run_dry_run(_config("llama3_405b.toml", 512, "--parallelism.tensor_parallel_degree", "1"))
    assert sum(fsdp.per_rank_params) == fsdp.distinct_shard_params == fsdp.model_params
    assert fsdp.per_rank_params[0] > fsdp.per_rank_params[-1]  # uneven dim-0 chunks at the end


def test_looped_pipeline_counts_embedding_and_output_as_stages():
    """6 layers + embedding + output make 8 stages for 4 ranks x 2 (loop placement: r, r + 4)."""
    for schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        report = run_dry_run(
            _config(
                "debug_model.toml",
                4,
                "--parallelism.pipeline_parallel_degree",
                "4",
                "--parallelism.pipeline_parallel_schedule",
                schedule,
            )
        )
        assert report.ok and report.stages == [
            "no layers + tok_embeddings; layer 3 (1)",
            "layer 0 (1); layer 4 (1)",
            "layer 1 (1); layer 5 (1)",
            "layer 2 (1); no layers + norm, output",
        ]
    two = run_dry_run(
        _config(
            "debug_model.toml",
            2,
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_layers_per_stage",
            "4",
        )
    )
    assert two.stages == ["layers 0-2 (3) + tok_embeddings", "layers 3-5 (3) + norm, output"]


def test_schedule_csv_is_loaded_against_the_stages(tmp_path):
    """PipelineScheduleMulti runs a CSV order (4 stages, 8 micro-batches); one that does not fit is one line."""
    rows = [
        ",".join(
            [f"{s}F{m}" for s in (r, r + 2) for m in range(8)] + [f"{s}B{m}" for s in (r + 2, r) for m in range(8)]
        )
        for r in range(2)
    ]
    good, bad = tmp_path / "good.csv", tmp_path / "bad.csv"
    good.write_text("\n".join(rows) + "\n")
    bad.write_text(rows[0].replace("2F7", "5F7") + "\n" + rows[1] + "\n")
    flags = (
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        "PipelineScheduleMulti",
        "--training.local_batch_size",
        "8",
        "--parallelism.pipeline_parallel_schedule_csv",
    )
    assert run_dry_run(_config("debug_model.toml", 2, *flags, str(good))).ok
    with pytest.raises(TitanError, match=r"which does not fit 4 stages x 8 micro-batches: it names stage 5,"):
        run_dry_run(_config("debug_model.toml", 2, *flags, str(bad)))


def test_hsdp_and_ddp_layouts_count_replicas_once():
    hsdp = run_dry_run(_config("debug_model.toml", 8, "--parallelism.data_parallel_replicate_degree", "2"))
    assert hsdp.degrees["dp_replicate"] == 2 and hsdp.degrees["dp_shard"] == 4
    assert hsdp.ok and sum(hsdp.per_rank_params) == 2 * hsdp.model_params
    # FSDP layouts get the estimator's categories at its peak.
    assert set(hsdp.memory[0]) == {"params", "grads", "optim", "comm", "act"}
    assert hsdp.memory[0]["act"] > 0 and "activation checkpointing none" in hsdp.memory_note
    # The row total is the estimator's peak (its sharding arithmetic = the real shards).
    from titan.training.memory import estimate_memory

    est = estimate_memory(_config("debug_model.toml", 8, "--parallelism.data_parallel_replicate_degree", "2"), 8)
    assert est.params == hsdp.per_rank_params[0]
    assert sum(hsdp.memory[0].values()) == pytest.approx(est.total_bytes / 1024**3, rel=1e-9)
    ddp = run_dry_run(
        _config(
            "debug_model.toml",
            4,
            "--parallelism.data_parallel_replicate_degree",
            "4",
            "--parallelism.data_parallel_shard_degree",
            "1",
        )
    )
    assert ddp.ok and ddp.per_rank_params == [ddp.model_params] * 4


def test_tp_pp_hsdp_layout_splits_stages_and_counts_tp_replicas_once():
    config = _config(
        "debug_model.toml",
        16,
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.data_parallel_replicate_degree",
        "2",
    )
    report = run_dry_run(config)
    assert report.degrees == {"pp": 2, "dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 2}
    assert report.stages == ["layers 0-2 (3) + tok_embeddings", "layers 3-5 (3) + norm, output"]
    assert report.ok
    # Norm weights are replicated over TP and everything over dp_replicate: more than 2x the model.
    assert sum(report.per_rank_params) > 2 * report.model_params
    text = format_report(report, config)
    assert "pp rank 1: layers 3-5 (3) + norm, output" in text and "replicated copies included" in text
    assert "gradient accumulation: 1 micro-batch(es) per step" in text


def test_bad_layout_fails_like_the_real_launch():
    with pytest.raises(TitanError, match="world size is 8"):
        run_dry_run(_config("debug_model.toml", 8, "--parallelism.data_parallel_shard_degree", "3"))
    assert not dist.is_initialized()


def test_dry_run_refuses_to_run_under_a_launcher(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(TitanError, match="plain process, not under torchrun"):
        run_dry_run(_config("debug_model.toml", 8))


def test_mismatch_is_reported_not_hidden():
    plan = plan_run(load_config([]), 2, "cuda", data_here=False)
    report = DryRunReport(
        plan,
        2,
        "m",
        {"pp": 1},
        ["stage"],
        model_params=10,
        per_rank_params=[4, 5],
        distinct_shard_params=9,
        memory=[{"params": 0.0}] * 2,
    )
    assert not report.ok
    assert "DOES NOT MATCH the model's 10" in format_report(report, load_config([]))


def test_settings_the_estimator_does_not_model_leave_the_plan_valid():
    report = run_dry_run(
        _config(
            "debug_model.toml",
            2,
            "--optimizer.bf16_stochastic_round",
            "true",
            "--training.mixed_precision_param",
            "bfloat16",
        )
    )
    assert report.ok and set(report.memory[0]) == {"params", "grads", "optim"}
    assert "not optimizer.bf16_stochastic_round" in report.memory_note


def test_validation_with_context_parallel_plans():
    # each cp rank evaluates its sequence shard: the layout is valid with validation on
    report = run_dry_run(
        _config("debug_model.toml", 2, "--parallelism.context_parallel_degree", "2", "--validation.enable", "true")
    )
    assert report.degrees["cp"] == 2
    assert not dist.is_initialized()
    # document-masked attention does not combine with CP: refused before any group exists
    with pytest.raises(TitanError, match='block_causal" does not combine with parallelism.context_parallel_degree'):
        run_dry_run(
            _config(
                "debug_model.toml",
                2,
                "--parallelism.context_parallel_degree",
                "2",
                "--model.attn_mask_type",
                "block_causal",
            )
        )
    assert not dist.is_initialized()


def test_dry_run_logs_each_torchtitan_translation_once(caplog, capsys):
    from titan.tools.dry_run import main

    config = _config("debug_model.toml", 2, "--training.compile", "false", "--training.dataset", "c4_test")
    with caplog.at_level("INFO", logger="titan"):
        assert main(config) == 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("torchtitan key")]
    assert lines == [
        "torchtitan key 'training.compile' = 'false' -> titan key compile.enable = 'false'",
        "torchtitan key 'training.dataset' = 'c4_test' -> titan key training.dataset = 'pydoc'",
    ]
    assert "dry run: llama3 debugmodel on 2 ranks" in capsys.readouterr().out
