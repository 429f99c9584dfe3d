import os
import shutil
from pathlib import Path

import pytest
import torch

# Tests never touch the network; torchao's C++ extensions are not needed for its Python paths.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
# No warm standbys in launched jobs with restarts: each imports torch and titan (seconds of CPU)
# while the test's ranks start. The tests of warm restarts ask for them (TITAN_WARM_RESTARTS=1).
os.environ.setdefault("TITAN_WARM_RESTARTS", "0")

REPO_ROOT = Path(__file__).resolve().parents[1]

# Under pytest-xdist each worker has a core: one OpenMP thread per process (this worker's in-process
# tests and every process it starts), so two workers' processes do not oversubscribe the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# Asked once, before any test hides the GPUs (below): this also makes the CUDA runtime read the real
# CUDA_VISIBLE_DEVICES, so hiding it later for CPU tests cannot take the GPUs away from cuda tests.
CUDA_AVAILABLE = torch.cuda.is_available()
GPU_COUNT = torch.cuda.device_count() if CUDA_AVAILABLE else 0
_REAL_CUDA_VISIBLE = os.environ.get("CUDA_VISIBLE_DEVICES")
_REAL_CUDA_IS_AVAILABLE = torch.cuda.is_available
_REAL_ACCELERATOR_IS_AVAILABLE = torch.accelerator.is_available


_SHM = Path("/dev/shm")
_SHM_BEFORE: set[str] = set()


def pytest_sessionstart(session):
    if _SHM.is_dir():
        _SHM_BEFORE.update(p.name for p in _SHM.glob("titan-*"))


def pytest_sessionfinish(session, exitstatus):
    """Runs the tests killed leave their in-memory snapshot folders in /dev/shm (they outlive the
    processes by design, for the restart): the session takes away the ones it made. Only where the
    session ends (not in a pytest-xdist worker, whose peers may still be running)."""
    if hasattr(session.config, "workerinput") or not _SHM.is_dir():
        return
    for p in _SHM.glob("titan-*"):
        if p.name not in _SHM_BEFORE and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if CUDA_AVAILABLE:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False on this machine")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _cpu_tests_see_no_gpu():
    """Tests without the ``cuda`` marker are CPU tests, on a GPU machine too: titan picks CUDA
    whenever torch sees it (titan/parallel/utils.py pick_device), so a 2-rank CPU test would ask
    for cuda:1 on a one-GPU machine and in-process models would land on cuda:0 next to CPU data.
    Hidden for the whole session (module fixtures build trainers before any per-test fixture
    runs); ``cuda`` tests get the GPUs back for their own duration (next fixture). Subprocesses
    (torchrun, train.py) inherit the empty CUDA_VISIBLE_DEVICES."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUDA_VISIBLE_DEVICES", "")
        mp.setattr(torch.cuda, "is_available", lambda: False)
        mp.setattr(torch.accelerator, "is_available", lambda: False)
        yield


@pytest.fixture(autouse=True)
def _cuda_tests_see_the_gpus(request, monkeypatch):
    if request.node.get_closest_marker("cuda") is not None and CUDA_AVAILABLE:
        if _REAL_CUDA_VISIBLE is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", _REAL_CUDA_VISIBLE)
        monkeypatch.setattr(torch.cuda, "is_available", _REAL_CUDA_IS_AVAILABLE)
        monkeypatch.setattr(torch.accelerator, "is_available", _REAL_ACCELERATOR_IS_AVAILABLE)
    yield
