"""Every parallel layout reproduces the 1-process losses and grad norms (fp32, same global batch).

10 steps: step 1 checks the forward and the gradient (via the grad
norm), later steps that the optimizer updates computed from sharded gradients keep matching.
Layouts that need different meshes share one spawned process group: each builds its Trainer in turn.
"""

from pathlib import Path

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.parity import FLAVORS, GLOBAL_BATCH, check, config, layouts_on_ranks, run
from tests.helpers.tiny import extra_flavors, patch_flavors
from titan.training.trainer import Trainer


@pytest.fixture(autouse=True)
def _flavors(monkeypatch):
    patch_flavors(monkeypatch, **FLAVORS)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    with extra_flavors(**FLAVORS):  # module scope: monkeypatch is per test
        folder = str(tmp_path_factory.mktemp("ref"))
        return run(Trainer(config(folder, "--training.local_batch_size", str(GLOBAL_BATCH))))


def _shard(n: int) -> tuple[str, ...]:
    return ("--parallelism.data_parallel_shard_degree", str(n))


def _pp(schedule: str, *more: str) -> tuple[str, ...]:
    return ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", schedule, *more)


TP2 = ("--parallelism.tensor_parallel_degree", "2")
TWO_RANK_LAYOUTS = {
    "fsdp2": _shard(2),
    "ddp2": ("--parallelism.data_parallel_replicate_degree", "2", *_shard(1)),
    "tp2": (*TP2, *_shard(1)),
    "tp2_no_loss_parallel": (*TP2, *_shard(1), "--parallelism.disable_loss_parallel", "true"),
    "pp2_gpipe": (*_pp("GPipe"), *_shard(1)),
    "pp2_1f1b": (*_pp("1F1B"), *_shard(1)),
    "pp2_1f1b_accum2": (*_pp("1F1B"), *_shard(1)),
    "pp2_interleaved1f1b": (*_pp("Interleaved1F1B"), *_shard(1)),
    "pp2_loopedbfs": (*_pp("LoopedBFS"), *_shard(1)),
    "pp2_interleavedzb": (*_pp("InterleavedZeroBubble"), *_shard(1)),
    "pp2_zbv": (*_pp("ZBVZeroBubble"), *_shard(1)),
    "pp2_dualpipev": (*_pp("DualPipeV"), *_shard(1)),
}
FOUR_RANK_LAYOUTS = {
    "hsdp2x2": ("--parallelism.data_parallel_replicate_degree", "2", *_shard(2)),
    "fsdp2_tp2": (*TP2, *_shard(2)),
    "pp2_fsdp2": (*_pp("1F1B"), *_shard(2)),
    "pp2_tp2": (*_pp("Interleaved1F1B"), *TP2, *_shard(1)),
}


def _looped_bfs_csv(path: Path) -> str:
    """A hand-written compute-only schedule: 4 stages looped over 2 ranks, all forwards first."""
    rows = []
    for rank in range(2):
        stages = (rank, rank + 2)
        fwd = [f"{s}F{m}" for s in stages for m in range(4)]
        bwd = [f"{s}B{m}" for s in reversed(stages) for m in range(4)]
        rows.append(",".join(fwd + bwd))
    path.write_text("\n".join(rows) + "\n")
    return str(path)


@pytest.mark.slow
def test_two_rank_layouts_match_one_process(tmp_path, reference):
    """world size 2: FSDP, DDP, TP (+/- loss parallel), PP with every torch schedule and a CSV one."""
    csv = _looped_bfs_csv(tmp_path / "schedule.csv")
    multi = _pp("PipelineScheduleMulti", "--parallelism.pipeline_parallel_schedule_csv", csv)
    layouts = {**TWO_RANK_LAYOUTS, "pp2_csv": (*multi, *_shard(1))}
    check(run_distributed(layouts_on_ranks, 2, str(tmp_path), layouts), reference)


@pytest.mark.slow
def test_four_rank_layouts_match_one_process(tmp_path, reference):
    """world size 4: HSDP 2x2, FSDP+TP 2x2, PP+FSDP 2x2, PP+TP 2x2."""
    check(run_distributed(layouts_on_ranks, 4, str(tmp_path), FOUR_RANK_LAYOUTS), reference)


def _split_backward_csv(path: Path) -> str:
    """Like _looped_bfs_csv, with each backward split into its input (I) and weight (W) halves."""
    rows = []
    for rank in range(2):
        stages = (rank, rank + 2)
        fwd = [f"{s}F{m}" for s in stages for m in range(4)]
        bwd = [f"{s}{op}{m}" for s in reversed(stages) for m in range(4) for op in "IW"]
        rows.append(",".join(fwd + bwd))
    path.write_text("\n".join(rows) + "\n")
    return str(path)


SIX = ("--model.flavor", "partest6")


@pytest.mark.slow
def test_six_layer_splits_match_one_process(tmp_path):
    """6 layers, the embedding and the output counted as a layer each (8 units): 8 virtual stages on
    4 ranks for the looped schedules, 2 stages of 4 units at layers_per_stage 4, an explicit module
    list, and PipelineScheduleMulti running CSV orders (4 stages on 2 ranks)."""
    reference = run(Trainer(config(str(tmp_path / "ref"), "--training.local_batch_size", str(GLOBAL_BATCH), *SIX)))
    fqns = (
        '[["tok_embeddings", "layers.0"],'
        ' ["layers.1", "layers.2", "layers.3", "layers.4", "layers.5", "norm", "output"]]'
    )
    two = {
        "pp2_layers_per_stage4": (*_pp("1F1B", "--parallelism.pipeline_parallel_layers_per_stage", "4"), *_shard(1)),
        "pp2_module_fqns": (*_pp("GPipe", "--parallelism.module_fqns_per_model_part", fqns), *_shard(1)),
        "pp2_multi_csv_split_backward": (
            *_pp(
                "PipelineScheduleMulti",
                "--parallelism.pipeline_parallel_schedule_csv",
                _split_backward_csv(tmp_path / "zb.csv"),
            ),
            *_shard(1),
        ),
    }
    four = {
        f"pp4_{schedule}": (
            "--parallelism.pipeline_parallel_degree",
            "4",
            "--parallelism.pipeline_parallel_schedule",
            schedule,
            *_shard(1),
        )
        for schedule in ("Interleaved1F1B", "InterleavedZeroBubble")
    }
    for world, layouts in ((2, two), (4, four)):
        layouts = {name: (*flags, *SIX) for name, flags in layouts.items()}
        check(run_distributed(layouts_on_ranks, world, str(tmp_path), layouts, timeout=900), reference)


UNEVEN_LAYOUTS = {
    "pp2_1f1b_uneven": (*_pp("1F1B"), *_shard(1)),  # stages of 3 and 2 layers
    "pp2_interleaved1f1b_uneven": (*_pp("Interleaved1F1B"), *_shard(1)),  # 4 stages: 1, 2, 2, 0 layers
}


@pytest.mark.slow
def test_uneven_pipeline_split_matches_one_process(tmp_path):
    """5 layers over 2 and 4 pipeline stages: the uneven split trains as the unsplit model does."""
    five = ("--model.flavor", "partest5")
    reference = run(Trainer(config(str(tmp_path / "ref"), "--training.local_batch_size", str(GLOBAL_BATCH), *five)))
    layouts = {name: (*flags, *five) for name, flags in UNEVEN_LAYOUTS.items()}
    check(run_distributed(layouts_on_ranks, 2, str(tmp_path), layouts), reference)
