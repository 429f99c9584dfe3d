"""Bad layouts fail with one clear line before any process group exists (so no rank can hang)."""

from dataclasses import replace

import pytest
import torch.distributed as dist

from titan.config import load_config
from titan.errors import TitanError
from tests.helpers.tiny import TINY
from titan.models.llama.pipeline import split_stage
from titan.parallel.dims import ParallelDims, check_layout
from titan.parallel.pp import describe_split, layers_of_stage, num_stages, stage_ids_this_rank, stage_layer_counts
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
        ({"pp": 5}, (), "cpu", "cannot be split into 5 pipeline stages .*at least one layer"),
        ({"pp": 3}, ("--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"), "cpu",
         r"cannot be split into 6 pipeline stages \(pipeline_parallel_degree 3 x 2 stages per rank\)"),
        ({"pp": 3}, (), "cpu", None),  # 4 layers over 3 stages: 1, 2, 1
        ({"pp": 2}, ("--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                     "--parallelism.pipeline_parallel_layers_per_stage", "3"), "cpu", "must divide model n_layers"),
        ({"pp": 2}, ("--parallelism.pipeline_parallel_layers_per_stage", "1"), "cpu", "runs one stage per rank"),
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
    config = load_config(["--job.dump_folder", str(tmp_path), "--training.seq_len", "32",
                          "--parallelism.tensor_parallel_degree", "16"])
    with pytest.raises(TitanError, match="must divide model n_kv_heads"):
        Trainer(config)
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--parallelism.pipeline_parallel_schedule", "Zigzag"), "valid: GPipe, 1F1B"),
        (("--parallelism.pipeline_parallel_schedule_csv", "/nonexistent.csv"), "no such file"),
        (("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "3"),
         "multiple of parallelism.pipeline_parallel_microbatch_size"),
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
    assert layers_of_stage(2, 4, 8) == [4, 5]
    # Uneven: the remainder goes to the middle stages (later ones first), then the first; never the last.
    assert [stage_layer_counts(n, s) for n, s in ((6, 4), (5, 4), (7, 4), (5, 2), (126, 8))] == [
        [1, 2, 2, 1], [1, 1, 2, 1], [2, 2, 2, 1], [3, 2], [15, 16, 16, 16, 16, 16, 16, 15]]
    assert [layers_of_stage(s, 4, 6) for s in range(4)] == [[0], [1, 2], [3, 4], [5]]
    assert num_stages(6, 2, _par("--parallelism.pipeline_parallel_schedule", "Interleaved1F1B")) == 4
    assert describe_split(6, 4) == ("pipeline split of 6 layers into 4 stages: stage 0: layers 0 + embedding;"
                                    " stage 1: layers 1-2; stage 2: layers 3-4; stage 3: layers 5 + output+loss")
    import torch

    with torch.device("meta"):
        from titan.models.llama.model import Transformer

        model = Transformer(ARGS)
    first, last = split_stage(model, 0, 2), split_stage(model, 1, 2)
    assert list(first.layers.keys()) == ["0", "1"] and first.output is None and first.norm is None
    assert list(last.layers.keys()) == ["2", "3"] and last.tok_embeddings is None and last.output is not None
