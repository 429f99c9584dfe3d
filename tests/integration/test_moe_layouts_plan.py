"""Every MoE family under TP, EP x TP and CP, as the dry run plans it for 4 GPUs: what the one check
before any rank (check_job: the run plan's check_run and the family args' check_parallelism) lets
through, the shared MoE driver parallelizes; what it refuses, the dry run refuses with the same line
before building anything, and writes nothing. Router scores before the experts (llama4's default)
and after them (qwen3, deepseek_v3, gpt_oss, a llama4 flavor) both take TP."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from titan.errors import TitanError
from titan.launch.entry import main
from titan.models import get_model_spec, register_flavor, register_model_spec
from titan.training.checks import check_job, load_job

WORLD = 4
TP2 = ("--parallelism.tensor_parallel_degree", "2")
EP2_ETP2 = ("--parallelism.expert_parallel_degree", "2", "--parallelism.expert_tensor_parallel_degree", "2")
CP2 = ("--parallelism.context_parallel_degree", "2")
SMALL = ("--model.n_layers", "2", "--training.seq_len", "256", "--activation_checkpoint.mode", "none")


@contextlib.contextmanager
def llama4_scores_after_experts() -> Iterator[None]:
    saved = get_model_spec("llama4")
    args = saved.flavors["debugmodel"]
    after = dataclasses.replace(args, moe_args=dataclasses.replace(args.moe_args, score_before_experts=False))
    try:
        register_flavor("llama4", "debugmodel_sae", after, replace=True)
        yield
    finally:
        register_model_spec(saved, replace=True)


CASES = {
    "llama4 ep2 x tp2": (("llama4", "debugmodel"), (*TP2, *EP2_ETP2), None),
    "llama4 scores after the experts, ep2 x tp2": (("llama4", "debugmodel_sae"), (*TP2, *EP2_ETP2), None),
    "llama4 irope cp2": (
        ("llama4", "debugmodel_irope"),
        (*CP2, "--model.attn_type", "flex", "--training.seq_len", "512"),
        "iRoPE",
    ),
    "qwen3 tp2": (("qwen3", "debugmodel_moe"), TP2, None),
    "qwen3 ep2 x tp2": (("qwen3", "debugmodel_moe"), (*TP2, *EP2_ETP2), None),
    "qwen3 cp2": (("qwen3", "debugmodel_moe"), CP2, None),
    "deepseek_v3 ep2 x tp2": (("deepseek_v3", "debugmodel"), (*TP2, *EP2_ETP2), None),
    "gpt_oss ep2 x tp2": (("gpt_oss", "debugmodel"), (*TP2, *EP2_ETP2), None),
    "gpt_oss cp2": (("gpt_oss", "debugmodel"), CP2, "attention sinks"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_check_before_the_ranks_decides_every_moe_layout(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    (name, flavor), layout, refused = CASES[case]
    dump = tmp_path / "out"
    argv = ["--model.name", name, "--model.flavor", flavor, *SMALL, *layout, "--job.dump_folder", str(dump)]
    with llama4_scores_after_experts():
        verdict = None
        try:
            check_job(load_job(argv), WORLD, "cuda", data_here=False)
        except TitanError as e:
            verdict = str(e)
        status = main([*argv, "--job.dry_run", "--job.dry_run_world_size", str(WORLD)])
    out = capsys.readouterr()
    lines = (out.out + out.err).strip().splitlines()
    if refused is None:
        assert verdict is None and status == 0, lines[-1:]
        assert "matches the model's" in out.out + out.err
    else:
        assert verdict is not None and refused in verdict, verdict
        assert status == 2 and lines[-1] == f"titan: error: {verdict}", lines[-1:]
        assert "applied" not in out.out + out.err  # refused before anything was built
    assert not dump.exists()
