"""profiling.enable_memory_snapshot: a real CUDA out-of-memory error writes the allocator snapshot."""

import pickle

import pytest
import torch

from titan.config import load_config
from titan.training.profiling import Profiler

pytestmark = pytest.mark.cuda


def test_out_of_memory_writes_a_snapshot(tmp_path):
    config = load_config(["--job.dump_folder", str(tmp_path), "--profiling.enable_memory_snapshot"])
    prof = Profiler(config.profiling, dump_folder=config.job.dump_folder, rank=0, device=torch.device("cuda", 0))
    try:
        keep = torch.ones(1024, 1024, device="cuda")  # something for the snapshot to show
        too_big = 2 * torch.cuda.get_device_properties(0).total_memory
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(too_big, dtype=torch.uint8, device="cuda")
    finally:
        prof.close()
    path = tmp_path / "memory_snapshot" / "oom" / "rank0_memory_snapshot.pickle"
    assert path.is_file()
    snapshot = pickle.loads(path.read_bytes())
    assert snapshot["segments"], "the snapshot lists no allocator segments"
    traces = [e for trace in snapshot["device_traces"] for e in trace]
    assert any(e["action"] == "alloc" and e["size"] >= keep.numel() * 4 for e in traces)
    assert any(e["action"] == "oom" for e in traces)
