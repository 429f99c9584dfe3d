"""Quantized release folders loaded onto the GPU: dequantized on the host as on the CPU, the same
weights bitwise and the same logits as the CPU load (fp32)."""

import pytest
import torch

from tests.helpers import hf_release as H
from titan.tools.generate import load_model

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("release", ["deepseek_v3", "gpt_oss"])
def test_release_loads_on_the_gpu_as_on_the_cpu(release, tmp_path):
    (H.deepseek_release if release == "deepseek_v3" else H.gpt_oss_release)(tmp_path / "hf")
    cpu = load_model(tmp_path / "hf", max_seq_len=64, device=torch.device("cpu"))
    gpu = load_model(tmp_path / "hf", max_seq_len=64, device=torch.device("cuda", 0))
    for (name, a), (_, b) in zip(cpu.state_dict().items(), gpu.state_dict().items(), strict=True):
        if a.is_floating_point():
            assert torch.equal(a, b.cpu()), name
    tokens = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(gpu(tokens.cuda()).cpu(), cpu(tokens), atol=1e-4, rtol=1e-4)
