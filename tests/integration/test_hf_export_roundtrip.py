"""torchtitan's model-only HF round trip through train.py: the first run saves its last step with
last_save_in_hf, the second (same dump folder, its own checkpoint folder) starts from
<dump>/<folder>/step-N with initial_load_in_hf."""

import pytest

from tests.helpers.runs import train_subprocess

pytestmark = pytest.mark.slow


def test_last_save_in_hf_then_initial_load_in_hf(tmp_path):
    code, out, losses = train_subprocess(
        tmp_path,
        "--training.steps",
        "3",
        "--checkpoint.folder",
        "hf_checkpoint",
        "--checkpoint.last_save_model_only",
        "--checkpoint.last_save_in_hf",
    )
    assert code == 0, out
    step = tmp_path / "hf_checkpoint" / "step-3"
    assert (step / "config.json").is_file() and (step / "model.safetensors.index.json").is_file()

    code, out2, losses2 = train_subprocess(
        tmp_path,
        "--training.steps",
        "2",
        "--checkpoint.initial_load_path",
        str(step),
        "--checkpoint.initial_load_model_only",
        "--checkpoint.initial_load_in_hf",
    )
    assert code == 0, out2
    assert f"loaded Hugging Face weights from checkpoint.initial_load_path {step}" in out2
    # it starts from the trained weights: its first loss is below the first run's first loss
    assert float(losses2[1]) < float(losses[1])
