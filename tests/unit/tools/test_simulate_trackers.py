"""The simulator's trackers one by one: memory by category, collectives, host reads, depths."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from titan.tools.dry_run import fake_world
from titan.tools.simulate.collectives import CollectiveTracker, group_labels
from titan.tools.simulate.depth import _period, extrapolate
from titan.tools.simulate.memory import CATEGORIES, MemoryTracker, PhasePeak
from titan.tools.simulate.reads import HostReads
from titan.tools.simulate.step import StepRecord


def test_memory_attributes_each_storage_to_one_category_and_follows_frees_and_resizes():
    tracker = MemoryTracker()
    with tracker:
        params = torch.empty(256)  # 1 KiB, made while the default category is parameters
        tracker.default = "activations"
        tracker.phase("forward_backward")
        x = torch.empty(1024)  # 4 KiB of activations
        view = x[:10]  # a view allocates nothing
        with tracker.region("communication"):
            gathered = torch.empty(512)
        tracker.loss_tail = True
        logits = torch.empty(128)
        tracker.loss_tail = False
        assert tracker.bytes["parameters"] == 1024 and tracker.bytes["activations"] == 4096
        assert tracker.bytes["communication"] == 2048 and tracker.bytes["loss"] == 512
        del x, view
        assert tracker.bytes["activations"] == 0  # freed with its last tensor
        # FSDP frees and re-allocates gathered parameters by resizing their storage in place
        gathered.untyped_storage().resize_(0)
        assert tracker.bytes["communication"] == 0
        gathered.untyped_storage().resize_(4096)
        assert tracker.bytes["communication"] == 4096
        tracker.tag([logits], "gradients")  # a storage whose role became known later moves
        assert tracker.bytes["loss"] == 0 and tracker.bytes["gradients"] == 512
        tracker.phase("optimizer")
        with tracker.region("optimizer_aux"):
            tmp = torch.empty(16)
        del tmp
    peak = tracker.peaks["forward_backward"]
    assert peak.total == 1024 + 4096 + 2048 + 512  # all four alive at once
    assert peak.bytes["activations"] == 4096 and sum(peak.bytes.values()) == peak.total
    assert tracker.peaks["optimizer"].bytes["optimizer_aux"] == 64
    assert set(peak.bytes) == set(CATEGORIES)
    assert params.numel() == 256  # kept alive to the end


def test_memory_counts_a_wrapper_subclass_by_its_inner_storage_and_ignores_dtensor_propagation():
    from torch.distributed.tensor import DTensor, Replicate

    tracker = MemoryTracker()
    with fake_world(0, 2):
        mesh = dist.device_mesh.init_device_mesh("cpu", (2,))
        with FakeTensorMode(), tracker:
            tracker.default = "activations"
            local = torch.empty(64, 64)  # 16 KiB
            d = DTensor.from_local(local, mesh, [Replicate()], run_check=False)
            out = d * 2  # DTensor propagates on global-shape fake tensors: not memory; the local op is
            assert tracker.bytes["activations"] == 2 * 64 * 64 * 4
            assert isinstance(out, DTensor)


def test_collectives_are_counted_per_kind_and_mesh_dim_with_the_bytes_this_rank_sends():
    with fake_world(1, 4):
        world = dist.group.WORLD
        assert world is not None
        tracker = CollectiveTracker(group_labels({"dp_shard": world}))
        with tracker:
            x = torch.empty(1024)  # 4 KiB
            dist.all_reduce(x)  # not counting yet
            tracker.counting = True
            dist.all_gather_into_tensor(torch.empty(4096), x)
            dist.reduce_scatter_tensor(torch.empty(256), x)
            dist.all_reduce(x)
            dist.all_reduce(x)
            out = torch.empty(1024)
            dist.all_to_all_single(out, x)
            dist.send(x, dst=0)
            dist.recv(x, src=0)
        calls = {kind: (n, sent) for (kind, group), (n, sent) in tracker.calls.items() if group == "dp_shard"}
    assert calls["all_gather"] == (1, 3 * 4096)  # its shard to each of the other 3
    assert calls["reduce_scatter"] == (1, 4096 * 3 / 4)
    assert calls["all_reduce"] == (2, 2 * 2 * 4096 * 3 / 4)
    assert calls["all_to_all"] == (1, 4096 * 3 / 4)
    assert calls["send"] == (1, 4096) and calls["recv"] == (1, 0)
    assert tracker.by_kind()["all_reduce"] == {"count": 2, "bytes": 12288}


def test_host_reads_count_device_data_once_per_call_and_answer_fake_tensors():
    reads = HostReads()
    host = torch.tensor([3, 5])  # host data (device-mesh coordinates are such): read as it is, not counted
    with FakeTensorMode(), reads:
        reads.counting = True
        counts = torch.empty(8, dtype=torch.int64)  # device data: its value is unknown here
        assert counts.tolist() == [0] * 8  # one read, answered by the assumption (0)
        flag = torch.empty((), dtype=torch.bool)
        assert bool(flag) is False
        with reads.answering(1):
            assert torch.empty((), dtype=torch.int32).item() == 1
        assert host.tolist() == [3, 5]
    assert reads.reads == {"item/tolist": 3}


def test_host_reads_of_real_cpu_tensors_are_not_device_reads():
    reads = HostReads()
    with reads:
        reads.counting = True
        assert torch.ones(2).sum().item() == 2.0
        torch.zeros(3).cpu()
    assert reads.reads == {}


def test_layer_pattern_prefix_and_period():
    assert _period(["d", "d", "d", "m", "m", "m", "m"]) == (3, 1)  # DeepSeek-V3: dense blocks, then MoE
    assert _period(["a", "b", "a", "b", "a", "b"]) == (0, 2)  # alternating (llama4, gpt-oss)
    assert _period(["x"] * 5) == (0, 1)


def _record(layers: int, act: int, sends: int) -> StepRecord:
    peak = PhasePeak(0, dict.fromkeys(CATEGORIES, 0))
    peak.bytes.update(parameters=10 * layers, activations=act, communication=7)
    peak.total = sum(peak.bytes.values())
    return StepRecord(layers, "fake", {"forward_backward": peak}, {("all_gather", "dp"): [sends, 2.0 * sends]}, {}, 1.0)


def test_extrapolation_is_linear_in_blocks_per_category():
    out = extrapolate(_record(3, 300, 7), _record(4, 400, 9), 126)
    peak = out.peaks["forward_backward"]
    assert peak.bytes["parameters"] == 1260 and peak.bytes["activations"] == 12600
    assert peak.bytes["communication"] == 7  # the same at both depths: the same at any
    assert peak.total == 1260 + 12600 + 7
    assert out.collectives[("all_gather", "dp")] == [2 * 126 + 1, pytest.approx(2.0 * 253)]
    assert out.layers == 126 and out.step_seconds == 2.0


def test_extrapolation_takes_the_moment_of_most_activations_where_it_outgrows_the_short_runs_peak():
    # Short runs peak at the end of backward (gradients, 10 per block, and a fixed 1000), the
    # deep run at the start of backward: 50 saved per block on top of a fixed 500.
    def record(layers: int) -> StepRecord:
        end = PhasePeak(0, dict.fromkeys(CATEGORIES, 0))
        end.bytes.update(gradients=10 * layers, communication=1000)
        start = PhasePeak(0, dict.fromkeys(CATEGORIES, 0))
        start.bytes.update(activations=500 + 50 * layers)
        for p in (end, start):
            p.total = sum(p.bytes.values())
        return StepRecord(layers, "fake", {"forward_backward": end}, {}, {}, 1.0, {}, {"forward_backward": start})

    assert extrapolate(record(3), record(4), 10).peaks["forward_backward"].total == 1100  # the end
    deep = extrapolate(record(3), record(4), 100).peaks["forward_backward"]
    assert deep.total == 500 + 5000 and deep.bytes["activations"] == 5500 and deep.bytes["gradients"] == 0


def test_a_fake_world_leaves_no_mesh_behind_for_the_next_one():
    """Groups are named by creation order in each world, and DTensor caches its sharding decisions
    (meshes included) process-wide: the second world must not be handed the first one's groups."""
    from torch.distributed.tensor import DTensor, Shard

    def gathered_product(groups_before: int) -> tuple[int, ...]:
        with fake_world(0, 4):
            for _ in range(groups_before):
                dist.new_group([0, 1])
            mesh = dist.device_mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
            a = DTensor.from_local(torch.ones(4, 2), mesh, [Shard(1)], run_check=False)
            b = DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)], run_check=False)
            return tuple((a @ b).full_tensor().shape)  # a partial sum: all-reduced over the mesh's group

    assert gathered_product(3) == gathered_product(0) == (4, 4)
