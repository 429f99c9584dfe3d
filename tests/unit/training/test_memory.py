"""Memory estimator: exact static arithmetic, AC ordering, and fake-tensor peak == real-tensor peak."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.runs import script_module
from tests.helpers.tiny import TINY, build, patch_flavors
from titan.config import load_config
from titan.errors import TitanError
from titan.models.llama import get_model_args
from titan.parallel.ac import apply_ac
from titan.training.loss import cross_entropy_sum
from titan.training.memory import LiveBytes, estimate_memory

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def tiny_flavor(monkeypatch):
    from dataclasses import replace

    args = replace(TINY, vocab_size=2048)  # the shipped tokenizer's vocabulary
    patch_flavors(monkeypatch, tiny=args)
    return args


def _cfg(*extra: str):
    return load_config(
        [
            "--model.flavor",
            "tiny",
            "--training.seq_len",
            "32",
            "--training.local_batch_size",
            "4",
            "--training.mixed_precision_param",
            "float32",
            *extra,
        ]
    )


def test_live_bytes_tracks_current_and_peak():
    with LiveBytes() as tracker:
        a = torch.empty(1000)
        b = a * 2
        view = b[:10]
        del b
        assert tracker.current == 8000  # the view keeps b's storage alive
        del view
        assert tracker.current == 4000
        c = torch.cat([a, a])
    assert (tracker.current, tracker.peak) == (12000, 12000)
    del a, c


def test_static_state_is_split_over_fsdp_shards(tiny_flavor):
    model = build(tiny_flavor)
    n = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())  # RoPE's table: parameters' category
    one = estimate_memory(_cfg(), 1)
    assert (one.params, one.categories["parameters"], one.categories["optimizer_state"]) == (n, 4 * n + buffers, 8 * n)
    assert one.categories["communication"] == 0
    three = estimate_memory(_cfg(), 3)
    # FSDP2 pads dim 0 to a multiple of the shard count: ceil(rows / 3) rows per rank.
    expected = sum(math.ceil(p.shape[0] / 3) * (p.numel() // p.shape[0]) for p in build(tiny_flavor).parameters())
    assert three.params == expected and n / 3 <= expected < n / 3 + 2000
    assert three.categories["communication"] > 0
    ddp = estimate_memory(
        _cfg("--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"), 2
    )
    assert ddp.params == n and ddp.categories["communication"] == 0


def test_activation_checkpointing_lowers_the_estimate_in_order(tiny_flavor):
    act = {
        m: estimate_memory(_cfg(*a), 1).activation_bytes
        for m, a in {
            "none": (),
            "full": ("--activation_checkpoint.mode", "full"),
            "op": ("--activation_checkpoint.mode", "selective"),
        }.items()
    }
    assert act["full"] < act["op"] < act["none"], act


@pytest.mark.parametrize("mode", ["none", "full"])
def test_fake_peak_equals_real_peak(tiny_flavor, mode):
    """The estimator's fake run allocates exactly what the real forward/backward does."""
    est = estimate_memory(_cfg("--activation_checkpoint.mode", mode), 1).activation_bytes
    model = build(tiny_flavor)
    apply_ac(model, mode)
    tokens = torch.randint(0, tiny_flavor.vocab_size, (4, 33))
    tracker = LiveBytes()
    tracker.ignore([*model.parameters(), *model.buffers(), tokens])
    with tracker:
        cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    assert all(p.grad is not None for p in model.parameters())  # kept, as the trainer keeps them
    # Within 0.1%: the checkpoint's recompute allocates a few small bookkeeping tensors differently.
    assert est == pytest.approx(tracker.peak, rel=1e-3)


def test_views_of_parameters_are_not_allocations():
    """F.linear views the weight (weight.t()); counting that view once counted every weight."""
    lin = torch.nn.Linear(256, 256, bias=False)
    x = torch.randn(2, 256)
    tracker = LiveBytes()
    tracker.ignore([*lin.parameters(), x])
    with tracker:
        lin(x)
    assert tracker.peak == 2 * 256 * 4  # the output only, not the 256 KiB weight


def test_a_weight_gradient_is_labelled_a_gradient_when_backward_makes_it():
    """A routed experts' weight gradient (every expert of the whole model in the profile) is a
    rank's own slice on the rank: labelled ``grads`` from the op that makes it, through the
    transposed view the forward used, and autograd's copy of it, not the block's work."""
    from titan.training.memory.tracker import Tracker

    w = torch.nn.Parameter(torch.randn(4, 256, 32))  # 4 "experts" [hidden, dim]
    x = torch.randn(4, 2, 32, requires_grad=True)
    tracker = Tracker()
    tracker.ignore([w, x])
    tracker.label_gradients([w], "grads")
    tracker.base("block")
    with tracker:
        tracker.open()
        torch.bmm(x, w.transpose(-2, -1)).sum().backward()
        window = tracker.close()
    weight = w.numel() * 4
    # bmm's gradient of the transposed weight, and autograd's copy of it in the weight's layout
    assert window.peak["grads"] == 2 * weight, window.peak
    assert window.peak["block"] < weight, window.peak  # the activations' gradient (x's), not w's


def test_script_prints_a_table(tiny_flavor):
    script = script_module("estimate_memory")
    from contextlib import redirect_stdout
    from io import StringIO

    out = StringIO()
    with redirect_stdout(out):
        script.main(
            [
                "--world_size",
                "2",
                "--model.flavor",
                "tiny",
                "--training.seq_len",
                "32",
                "--activation_checkpoint.mode",
                "full",
            ]
        )
    text = out.getvalue()
    assert "world size 2 (dp_shard 2), rank 0" in text and "| total" in text and "activation checkpointing full" in text


def _debug(mode: str, *extra: str):
    return load_config(
        [
            "--job.config_file",
            str(REPO / "train_configs/debug_model.toml"),
            "--training.seq_len",
            "128",
            "--training.local_batch_size",
            "4",
            "--metrics.enable_tensorboard",
            "false",
            "--activation_checkpoint.mode",
            mode,
            *extra,
        ]
    )


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_estimate_matches_a_real_cpu_training_run(tmp_path, mode):
    """The debug model trained for 2 steps on CPU as one rank, bf16 autocast over fp32 parameters
    (as on one GPU): the estimate is the measured peak (parameters, AdamW states created at the
    first step, autocast copies, activations, gradients, foreach temporaries) within 5%."""
    from titan.training.memory import measure_peak
    from titan.training.trainer import Trainer

    config = _debug(
        mode,
        "--training.mixed_precision_param",
        "bfloat16",
        "--job.dump_folder",
        str(tmp_path),
        "--optimizer.implementation",
        "foreach",
    )
    est = estimate_memory(config, 1)
    measured, _ = measure_peak(Trainer(config), 2)
    assert est.total_bytes == pytest.approx(measured, rel=0.05), (est.rows(), measured)
    # Without AC the activations set the peak; with AC the foreach optimizer step does.
    assert est.peak_phase == ("forward/backward" if mode == "none" else "optimizer step")


def test_optimizer_implementation_sets_the_step_temporaries():
    foreach, fused, loop = (
        estimate_memory(_debug("full", "--optimizer.implementation", impl), 1)
        for impl in ("foreach", "fused", "for-loop")
    )
    step = [e.phase_peaks["optimizer step"] for e in (foreach, fused, loop)]
    assert step[0] - step[1] == foreach.categories["optimizer_state"] // 2  # sqrt of the one param group
    assert step[1] < step[2] < step[0]
    assert fused.total_bytes < foreach.total_bytes


@pytest.mark.parametrize("flag", ["training.enable_cpu_offload", "optimizer.early_step_in_backward"])
def test_offload_and_step_in_backward_are_refused_by_name(flag):
    config = load_config(["--" + flag, "--training.seq_len", "32"])
    with pytest.raises(TitanError, match=f"not {flag}; set it to false"):
        estimate_memory(config, 2)


@pytest.mark.slow
def test_script_refuses_offload_in_one_line():
    import subprocess

    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts/estimate_memory.py"),
            "--world_size",
            "64",
            "--job.config_file",
            str(REPO / "train_configs/llama3_70b.toml"),
            "--training.enable_cpu_offload",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2 and out.stdout == "", out
    assert out.stderr.startswith("titan: error: ") and out.stderr.count("\n") == 1, out.stderr
    assert "not training.enable_cpu_offload" in out.stderr


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_estimate_matches_cuda_peak(tmp_path, monkeypatch, mode):
    """The Llama 3 8B shape cut to 4 layers, seq 8192, one GPU, bf16 autocast, AdamW: the estimate
    is within 10% of torch.cuda.max_memory_allocated, and not above what the allocator reserved."""

    from titan.training.memory import measure_peak
    from titan.training.trainer import Trainer

    patch_flavors(monkeypatch, **{"8B_4layers": get_model_args("8B", n_layers=4)})
    config = load_config(
        [
            "--job.config_file",
            str(REPO / "train_configs/debug_model.toml"),
            "--job.dump_folder",
            str(tmp_path),
            "--model.flavor",
            "8B_4layers",
            "--training.seq_len",
            "8192",
            "--training.local_batch_size",
            "1",
            "--training.mixed_precision_param",
            "bfloat16",
            "--metrics.enable_tensorboard",
            "false",
            "--activation_checkpoint.mode",
            mode,
        ]
    )
    est = estimate_memory(config, 1)
    if est.total_bytes > 0.8 * torch.cuda.get_device_properties(0).total_memory:
        pytest.skip(f"needs a GPU with more than {est.total_bytes / 0.8 / 2**30:.0f} GiB")
    torch.cuda.empty_cache()
    measured, _ = measure_peak(Trainer(config), 2)
    reserved = torch.cuda.max_memory_reserved()
    print(
        f"AC {mode}: estimate {est.total_bytes / 2**30:.2f} GiB, allocated {measured / 2**30:.2f} GiB,"
        f" reserved {reserved / 2**30:.2f} GiB"
    )
    assert est.total_bytes == pytest.approx(measured, rel=0.10), (est.rows(), measured)
    assert est.total_bytes <= reserved * 1.10


@pytest.mark.parametrize(
    "layout",
    [
        ("--parallelism.tensor_parallel_degree", "2"),
        ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"),
        ("--parallelism.context_parallel_degree", "2"),
    ],
    ids=["tp", "pp interleaved", "cp"],
)
def test_every_layout_is_estimated_in_the_categories(layout):
    """TP, PP (a schedule with two stages per rank) and CP layouts walk the rank's step: the peak is
    a forward/backward moment holding activations, and each rank holds its shard of the model."""
    one = estimate_memory(_debug("none", "--training.seq_len", "64"), 1)
    est = estimate_memory(_debug("none", "--training.seq_len", "64", *layout), 4)
    assert est.peak_phase == "forward/backward" and est.categories["activations"] > 0
    assert all(v >= 0 for v in est.categories.values())
    assert est.categories["optimizer_state"] < one.categories["optimizer_state"] / 1.5
    if "--parallelism.pipeline_parallel_degree" in layout:
        # Under PP no block is resharded after forward, and a stage's blocks stay gathered while the
        # rank runs its other stage: stage 2's first block (3; rank 0 runs stages 0 and 2, one
        # block of the debug model's 4 in stage 0) holds stage 0's block 0 too (blocks alike).
        comm: dict[str, float] = {}
        for m in est.moments:
            comm.setdefault(m.name, m.bytes["communication"])
        block = comm["forward 0"] - comm["embedding"]
        assert block > 0 and comm["forward 3"] - comm["embedding"] == 2 * block, comm
