"""Multi-rank tests say where they run: gloo ranks on the CPU with the GPUs hidden (on a one-GPU
machine rank 1 would otherwise ask for cuda:1), nccl only with a GPU per rank, else skipped."""

import os
import re
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import cpu_env, run_distributed
from titan.errors import TitanError
from titan.parallel.utils import pick_device

TESTS = Path(__file__).resolve().parents[1]


def _where(rank: int, world: int) -> tuple:
    import torch.distributed as dist

    return os.environ["CUDA_VISIBLE_DEVICES"], torch.cuda.is_available(), pick_device(rank).type, dist.get_backend()


@pytest.mark.slow
def test_gloo_ranks_run_on_cpu_with_gpus_hidden(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # run_distributed alone must hide them
    assert run_distributed(_where, 2) == [("", False, "cpu", "gloo")] * 2


def test_nccl_skips_with_a_reason_when_there_are_fewer_gpus_than_ranks():
    with pytest.raises(pytest.skip.Exception, match=r"nccl with 2 ranks needs 2 GPUs, this machine has \d"):
        run_distributed(_where, 2, backend="nccl")
    with pytest.raises(ValueError, match="backend"):
        run_distributed(_where, 2, backend="mpi")


def test_cpu_tests_see_no_gpu_and_subprocesses_inherit_that():
    # tests/conftest.py: tests without the cuda marker are CPU tests on any machine.
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and not torch.cuda.is_available()
    assert pick_device(1) == torch.device("cpu")
    assert cpu_env(FOO="1")["CUDA_VISIBLE_DEVICES"] == "" and cpu_env(FOO="1")["FOO"] == "1"


def test_every_torchrun_test_passes_the_cpu_environment():
    """A torchrun child picks its device itself: each file launching one must hand it cpu_env()."""
    offenders = []
    for path in TESTS.rglob("*.py"):
        if "cuda" in path.relative_to(TESTS).parts:
            continue
        text = path.read_text()
        launches_torchrun = re.search(r"[\"']torch\.distributed\.run[\"']", text)  # run as a module, not patched
        if launches_torchrun and "cpu_env(" not in text:
            offenders.append(str(path.relative_to(TESTS)))
        # Process groups in tests go through run_distributed (explicit backend), not by hand.
        if path.relative_to(TESTS).as_posix() != "helpers/distributed.py" and re.search(r"init_process_group\(", text):
            offenders.append(f"{path.relative_to(TESTS)}: init_process_group outside tests/helpers/distributed.py")
    assert not offenders, offenders


def test_more_ranks_than_gpus_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(TitanError, match=r"local rank 1 needs GPU cuda:1 but 1 GPU\(s\) are visible.*CUDA_VISIBLE"):
        pick_device(1)


def test_shared_helpers_live_in_tests_helpers():
    """Tests import shared code from tests/helpers (or fixtures), never from another test module."""
    offenders = [
        f"{path.relative_to(TESTS)}: {m[0]}"
        for path in TESTS.rglob("test_*.py")
        for m in re.finditer(r"from tests\.(?:unit|integration)\.\S+ import", path.read_text())
    ]
    assert not offenders, offenders
