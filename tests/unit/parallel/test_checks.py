"""Bad layouts fail with one clear line before any process group exists (so no rank can hang)."""

import re
from dataclasses import replace

import pytest
import torch.distributed as dist

from tests.helpers.tiny import TINY
from titan.config import load_config
from titan.errors import TitanError
from titan.models.llama.pipeline import split_stage
from titan.parallel.dims import ParallelDims, check_layout
from titan.parallel.pp_layout import SCHEDULES, describe_split, num_stages, spread_modules, stage_ids_this_rank
from titan.training.checks import load_job
from titan.training.trainer import Trainer

ARGS = replace(TINY, n_layers=4, vocab_size=256, max_seq_len=2048)


def _par(*flags: str):
    return load_config(["--training.seq_len", "32", *flags]).parallelism


def _dims(world: int, **degrees) -> ParallelDims:
    d = dict(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1) | degrees
    return ParallelDims(world_size=world, **d)


def test_degrees_must_multiply_to_world_size():
    with pytest.raises(TitanError, match="= 4, but the world size is 2"):
        _dims(2, tp=2, pp=2)
    with pytest.raises(TitanError, match="do not divide the world size 6"):
        _dims(6, dp_shard=-1, tp=4)
    assert _dims(8, dp_shard=-1, tp=2, pp=2).dp_shard == 2


@pytest.mark.parametrize(
    ("degrees", "flags", "device", "message"),
    [
        ({"tp": 4}, (), "cpu", "tensor_parallel_degree 4 must divide model n_kv_heads"),
        ({"tp": 2, "dp_replicate": 2}, (), "cpu", "DDP .* does not compose with tensor parallel"),
        ({"tp": 2}, ("--parallelism.enable_async_tensor_parallel", "true"), "cpu", "needs CUDA"),
        # 4 layers + the embedding and the output counted as one layer each: 6 units to split.
        ({"pp": 7}, (), "cpu", "cannot be split into 7 pipeline stages"),
        (
            {"pp": 4},
            ("--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"),
            "cpu",
            "cannot be split into 8 pipeline stages",
        ),
        ({"pp": 3}, ("--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"), "cpu", None),  # 6 stages of 1
        ({"pp": 5}, (), "cpu", None),  # embedding + layer 0, layers 1, 2, 3, norm + output
        ({"pp": 3}, (), "cpu", None),
        ({"pp": 2}, ("--parallelism.pipeline_parallel_layers_per_stage", "4"), "cpu", None),  # ceil(6 / 4) = 2
        (
            {"pp": 2},
            (
                "--parallelism.pipeline_parallel_schedule",
                "Interleaved1F1B",
                "--parallelism.pipeline_parallel_layers_per_stage",
                "3",
            ),
            "cpu",
            "1 per rank, but schedule Interleaved1F1B runs at least 2",
        ),
        (
            {"pp": 2},
            ("--parallelism.pipeline_parallel_layers_per_stage", "1"),
            "cpu",
            "make 6 pipeline stages, 3 per rank, but schedule 1F1B runs one stage per rank",
        ),
        (
            {"pp": 2},
            (
                "--parallelism.pipeline_parallel_schedule",
                "ZBVZeroBubble",
                "--parallelism.pipeline_parallel_layers_per_stage",
                "1",
            ),
            "cpu",
            "6 pipeline stages, 3 per rank, but the V-shaped schedule ZBVZeroBubble runs exactly 2 per rank",
        ),
        (
            {"pp": 4},
            ("--parallelism.pipeline_parallel_layers_per_stage", "4"),
            "cpu",
            "2 pipeline stages, not a multiple of pipeline_parallel_degree 4",
        ),
        (
            {"pp": 4},
            ("--parallelism.pipeline_parallel_first_stage_less_layers", "2"),
            "cpu",
            "cannot be split into 4 pipeline stages: with the embedding counted as 2",
        ),
        (
            {"pp": 2},
            (
                "--parallelism.module_fqns_per_model_part",
                '[["tok_embeddings", "layers.0"], ["layers.2", "layers.3", "norm", "output"]]',
            ),
            "cpu",
            "module_fqns_per_model_part' got .* once each, in that order",
        ),
        (
            {"pp": 2},
            ("--parallelism.module_fqns_per_model_part", '[["tok_embeddings"], ["layers.0"], ["layers.1"]]'),
            "cpu",
            "has 3 pipeline stages, not a multiple of pipeline_parallel_degree 2",
        ),
        ({"cp": 2}, (), "cpu", "trains only on CUDA: on CPU, SDPA has no"),
        ({"cp": 2}, (), "cuda", None),
        ({"tp": 2}, ("--parallelism.enable_async_tensor_parallel", "true"), "cuda", "also set compile.enable"),
    ],
)
def test_layout_checks(degrees, flags, device, message):
    world = 1
    for d in degrees.values():
        world *= d
    dims = _dims(world, **degrees)
    if message is None:
        check_layout(dims, _par(*flags), ARGS, 32, device)
        return
    with pytest.raises(TitanError, match=message):
        check_layout(dims, _par(*flags), ARGS, 32, device)


def test_trainer_rejects_bad_layout_before_any_process_group(tmp_path, monkeypatch):
    """world size 16 (claimed by the env, no process started): TP 16 does not divide the debug
    model's 8 kv heads."""
    monkeypatch.setenv("WORLD_SIZE", "16")
    config = load_config(
        ["--job.dump_folder", str(tmp_path), "--training.seq_len", "32", "--parallelism.tensor_parallel_degree", "16"]
    )
    with pytest.raises(TitanError, match="must divide model n_kv_heads"):
        Trainer(config)
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--parallelism.pipeline_parallel_schedule", "Zigzag"), "valid: GPipe, 1F1B"),
        (("--parallelism.pipeline_parallel_schedule_csv", "/nonexistent.csv"), "no such file"),
        (
            ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "3"),
            "multiple of parallelism.pipeline_parallel_microbatch_size",
        ),
        (
            ("--parallelism.pipeline_parallel_schedule", "PipelineScheduleMulti"),
            "runs the order of a CSV file: set parallelism.pipeline_parallel_schedule_csv",
        ),
        (
            (
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_schedule",
                "DualPipeV",
                "--validation.enable",
            ),
            "V-shaped schedules fail in eval",
        ),  # fmt: skip
        (("--parallelism.pipeline_parallel_layers_per_stage", "0"), r"-1 \(automatic\) or an integer >= 1"),
        (("--parallelism.pipeline_parallel_last_stage_less_layers", "-1"), "an integer >= 0"),
        (("--parallelism.context_parallel_rotate_method", "ring"), "allgather, alltoall"),
        (("--parallelism.tensor_parallel_degree", "0"), "an integer >= 1"),
    ],
)
def test_config_checks(flags, message):
    with pytest.raises(TitanError, match=message):
        load_job(["--training.local_batch_size", "8", *flags])


def test_stage_layout():
    par = _par("--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble")
    assert num_stages(4, 2, par) == 4
    assert stage_ids_this_rank(0, 2, 4, v_style=True) == [0, 3]
    assert stage_ids_this_rank(1, 2, 4, v_style=False) == [1, 3]
    # The embedding and norm + output count as one layer each; the remainder goes to the first stages.
    counts = {
        (n, s): [sum(m.startswith("layers.") for m in part) for part in spread_modules(n, s)]
        for n, s in ((6, 4), (5, 4), (7, 4), (5, 2), (6, 8), (126, 8))
    }
    assert counts == {
        (6, 4): [1, 2, 2, 1],
        (5, 4): [1, 2, 2, 0],
        (7, 4): [2, 2, 2, 1],
        (5, 2): [3, 2],
        (6, 8): [0, 1, 1, 1, 1, 1, 1, 0],
        (126, 8): [15, 16, 16, 16, 16, 16, 16, 15],
    }
    assert spread_modules(6, 8)[0] == ["tok_embeddings"] and spread_modules(6, 8)[-1] == ["norm", "output"]
    # torchtitan's first/last_stage_less_layers: 0 counts the ends as nothing, 2 as two layers.
    assert spread_modules(4, 2, 0, 0) == [
        ["tok_embeddings", "layers.0", "layers.1"],
        ["layers.2", "layers.3", "norm", "output"],
    ]
    assert [len(p) for p in spread_modules(6, 2, 2, 0)] == [3, 6]
    assert num_stages(6, 2, _par("--parallelism.pipeline_parallel_schedule", "Interleaved1F1B")) == 4
    assert num_stages(6, 4, _par("--parallelism.pipeline_parallel_schedule", "InterleavedZeroBubble")) == 8
    assert (
        num_stages(
            6,
            4,
            _par(
                "--parallelism.pipeline_parallel_schedule",
                "Interleaved1F1B",
                "--parallelism.pipeline_parallel_layers_per_stage",
                "1",
            ),
        )
        == 8
    )
    assert num_stages(6, 2, _par("--parallelism.pipeline_parallel_layers_per_stage", "4")) == 2
    assert describe_split(6, spread_modules(6, 4)) == (
        "pipeline split of 6 layers into 4 stages: stage 0: layer 0 + embedding;"
        " stage 1: layers 1-2; stage 2: layers 3-4; stage 3: layer 5 + output+loss"
    )
    import torch

    with torch.device("meta"):
        from titan.models.llama.model import Transformer

        model = Transformer(ARGS)
    first, last = (split_stage(model, names) for names in spread_modules(4, 2))
    assert list(first.layers.keys()) == ["0", "1"] and first.output is None and first.norm is None
    assert list(last.layers.keys()) == ["2", "3"] and last.tok_embeddings is None and last.output is not None
    ends = split_stage(model, ["norm", "output"])
    assert not list(ends.layers.keys()) and ends.tok_embeddings is None and ends.norm is not None


def test_the_schedule_table_is_torchs():
    """The pre-check knows the schedules by name (SCHEDULES); the runtime gets torch's classes by the
    same names: each must run the stages per rank the table says, and torch must have no other."""
    from torch.distributed.pipelining import schedules as torch_schedules

    from titan.parallel.pp import schedule_class

    for name, kind in SCHEDULES.items():
        cls = schedule_class(name.upper())  # any case, as torch's lookup
        multi = issubclass(cls, torch_schedules.PipelineScheduleMulti)
        assert issubclass(cls, torch_schedules.PipelineScheduleSingle) != multi, name
        v = cls in (torch_schedules.ScheduleZBVZeroBubble, torch_schedules.ScheduleDualPipeV)
        assert kind == ("v" if v else "multi" if multi else "single"), name
    with pytest.raises(ValueError) as missing:
        torch_schedules.get_schedule_class("no such schedule")
    assert set(SCHEDULES) == set(re.findall(r"'(\w+)'", str(missing.value))), missing.value
