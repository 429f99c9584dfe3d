"""titan/tools/generate.py on the GPU: the same greedy tokens as on the CPU, cache == recompute."""

import pytest
import torch

from tests.helpers.tiny import random_model, small_args
from titan.checkpointing.hf import save_hf
from titan.tools.generate import generate, load_model

pytestmark = pytest.mark.cuda

PROMPT = [5, 17, 99, 3, 64, 21, 8]


def test_gpu_greedy_matches_cpu_and_the_cache(tmp_path):
    save_hf(random_model(small_args(), seed=11).state_dict(), small_args(), tmp_path / "hf")
    cpu = load_model(tmp_path / "hf", max_seq_len=64, device=torch.device("cpu"))
    gpu = load_model(tmp_path / "hf", max_seq_len=64, device=torch.device("cuda", 0))
    assert next(gpu.parameters()).device.type == "cuda"
    expected, _ = generate(cpu, PROMPT, 12)
    cached, tps = generate(gpu, PROMPT, 12)
    recomputed, _ = generate(gpu, PROMPT, 12, use_cache=False)
    assert cached == recomputed == expected
    assert tps > 0 and len(set(cached)) > 2
    sampled = [generate(gpu, PROMPT, 8, temperature=1.0, top_k=5, seed=3)[0] for _ in range(2)]
    assert sampled[0] == sampled[1]  # the seeded CUDA generator repeats
