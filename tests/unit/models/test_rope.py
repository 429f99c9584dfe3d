"""YaRN frequencies against transformers' own computation (the HF reference every family loads)."""

from __future__ import annotations

import pytest
import torch

from titan.models.rope import YarnScaling, yarn_inv_freq

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import _compute_yarn_parameters  # noqa: E402


@pytest.mark.parametrize(
    "params",
    [
        # gpt-oss's release: no truncation of the blend range
        {
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        # DeepSeek-V3's release: mscale / mscale_all_dim
        {"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
        {"factor": 8.0, "mscale": 0.707, "mscale_all_dim": 1.0, "original_max_position_embeddings": 2048},
        {"factor": 4.0, "attention_factor": 1.5, "beta_fast": 16.0, "original_max_position_embeddings": 512},
    ],
)
def test_yarn_matches_transformers(params: dict) -> None:
    head_dim, theta = 64, 150000.0
    config = transformers.LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        max_position_embeddings=params["original_max_position_embeddings"] * 4,
        rope_parameters={"rope_type": "yarn", "rope_theta": theta, **params},
    )
    expected, attention_factor = _compute_yarn_parameters(config)
    yarn = YarnScaling(**params)
    assert torch.equal(yarn_inv_freq(head_dim, theta, yarn), expected.float())
    assert yarn.cos_sin_scale() == pytest.approx(attention_factor, rel=1e-12)
