"""Hostile inputs caught before any rank starts, and failures the launcher reports for the ranks.

Every error the launch check can decide (titan.training.checks.check_job: config, model shape, layout,
device, the files the config names) ends there in one line, exit 2, nothing written; a failed rank
whose output the console does not show gets its own words shown once. The rest of the hostile inputs:
tests/integration/test_bad_inputs.py.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.distributed import cpu_env
from tests.helpers.runs import REPO, TINY, run_args

# ---------------------------------------------------------------- the launch check (no process group)
# What a launcher checks before any rank starts (titan.training.checks.check_job, the function the
# dry run and the ranks run too): one line, exit 2, nothing written. In-process: no subprocess start-up.
FINEWEB = "HuggingFaceFW/fineweb-edu"
LLAMA4 = ["--model.name", "llama4", "--model.flavor", "debugmodel"]


def _files(root: Path) -> list[str]:
    return sorted(str(p) for p in root.rglob("*"))


def precheck(capsys, tmp_path, argv, *needles, world=2):
    """python -m titan.launch.check for ``world`` ranks: exit 2, one line with every needle, no file."""
    from titan.launch import check

    before = _files(tmp_path)
    rc = check.main(["--world_size", str(world), *run_args(tmp_path / "run"), *argv])
    out = capsys.readouterr()
    lines = [ln for ln in (out.out + out.err).splitlines() if ln.strip() and not ln.startswith("[titan]")]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("titan: error: "), lines
    for n in needles:
        assert n in lines[0], lines[0]
    assert _files(tmp_path) == before  # no dump folder, no TensorBoard or metrics file
    return lines[0]


@pytest.fixture(scope="module")
def mirrors(tmp_path_factory):
    """A hub mirror, and damaged copies of it: a truncated parquet file, corrupt data pages in the
    first file, no data files at all."""
    from tests.helpers.hub_mirror import write_hub_mirror

    root = tmp_path_factory.mktemp("mirrors")
    good = write_hub_mirror(root / "good")
    names = {}
    for kind in ("truncated", "corrupt", "empty"):
        shutil.copytree(good.root, root / kind)
        files = [root / kind / f.relative_to(good.root) for f in good.files[("sample-10BT", "train")]]
        if kind == "truncated":
            data = files[-1].read_bytes()
            files[-1].write_bytes(data[: len(data) // 2])
            names[kind] = files[-1]
        elif kind == "corrupt":
            data = bytearray(files[0].read_bytes())
            for i in range(64, len(data) // 2):  # the data pages, not the footer
                data[i] ^= 0x5A
            files[0].write_bytes(bytes(data))
            names[kind] = files[0]
        else:
            for f in files:
                f.unlink()
    return good.root, root, names


def _hub(path, *extra):
    return ["--training.dataset", FINEWEB, "--training.dataset_path", str(path), *extra]


@pytest.mark.parametrize(
    "argv, world, needles",
    [
        ([*LLAMA4, "--parallelism.expert_parallel_degree", "3"], 3, ["got 3", "a divisor of the model's 8 experts"]),
        (["--parallelism.expert_parallel_degree", "2"], 2, ["expert_parallel_degree", "no routed experts"]),
        (["--model.vocab_size", "100"], 2, ["'model.vocab_size' got 100", "tokenizer's vocabulary size 2048"]),
        (
            [*LLAMA4, "--float8.enable_float8_grouped_mm", "--float8.grouped_mm_fqns", "experts"],
            1,
            ["float8.enable_float8_grouped_mm needs CUDA", "this run is on cpu"],
        ),
        (["--parallelism.tensor_parallel_degree", "3"], 2, ["tp 3", "world size 2"]),
    ],
    ids=["ep-not-dividing-experts", "ep-on-dense", "vocab-below-tokenizer", "float8-grouped-cpu", "tp"],
)
def test_model_and_layout_errors_at_the_launch_check(capsys, tmp_path, argv, world, needles):
    precheck(capsys, tmp_path, argv, *needles, world=world)


def test_hub_mirror_errors_at_the_launch_check(capsys, tmp_path, mirrors):
    good, root, names = mirrors
    cases = [
        (_hub(good, "--training.dataset_config", "nope"), ["training.dataset_config: 'nope'", "sample-10BT"]),
        (_hub(good, "--training.dataset_config", "code", "--training.dataset_split", "test"), ["'test'", "validation"]),
        (
            _hub(good, "--training.dataset_config", "sample-10BT", "--training.dataset_text_field", "body"),
            ["no column 'body'", "training.dataset_text_field"],
        ),
        (_hub(root / "truncated", "--training.dataset_config", "sample-10BT"), [str(names["truncated"])]),
        (_hub(root / "corrupt", "--training.dataset_config", "sample-10BT"), [str(names["corrupt"])]),
        (_hub(root / "empty", "--training.dataset_config", "sample-10BT"), [str(root / "empty")]),
    ]
    for argv, needles in cases:
        precheck(capsys, tmp_path, argv, *needles, world=1)


def test_checkpoint_of_another_model_or_config_at_the_launch_check(capsys, tmp_path):
    import dataclasses

    from titan.checkpointing import config_diff
    from titan.checkpointing.folders import write_marker
    from titan.checkpointing.model_dcp import MODEL_ARGS_FILE
    from titan.config import load_config
    from titan.models.llama.args import get_model_args

    weights = tmp_path / "weights"
    weights.mkdir()
    other = dataclasses.replace(get_model_args("debugmodel"), dim=128)
    (weights / MODEL_ARGS_FILE).write_text(json.dumps(dataclasses.asdict(other)))
    load = ["--checkpoint.enable", "--checkpoint.initial_load_path", str(weights)]
    precheck(capsys, tmp_path, load, f"checkpoint.initial_load_path {weights}", "dim = 128 there", world=1)
    # a dump folder whose checkpoint was trained with another config: resuming it is refused
    step = tmp_path / "run" / "checkpoint" / "step-1"
    step.mkdir(parents=True)
    config_diff.write_config(str(step), config_diff.snapshot(load_config([*TINY, "--optimizer.lr", "0.5"]), 1))
    write_marker(str(step), 1, model_only=False, world_size=1, dp_degree=1)
    precheck(capsys, tmp_path, ["--checkpoint.enable"], f"resuming from {step}", "optimizer.lr", world=1)


def _run_train(tmp_path, *argv, **env):
    return subprocess.run(
        ["./run_train.sh", "--job.dump_folder", str(tmp_path / "run"), *argv],
        cwd=REPO,
        env=cpu_env(NGPU="2", **env),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_run_train_sh_ends_a_model_error_in_one_line_before_any_rank(tmp_path):
    """End to end: torchrun never starts, so none of its lines and no rank's copy of the line."""
    out = _run_train(tmp_path, *LLAMA4, "--parallelism.expert_parallel_degree", "3")
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]
    assert out.returncode == 2 and len(lines) == 1, lines
    assert "'parallelism.expert_parallel_degree' got 3" in lines[0], lines[0]
    assert _files(tmp_path) == []


# ---------------------------------------------------------------- the launcher shows the failing rank
_RANKS = """
import os, sys, time
rank = os.environ["RANK"]
if sys.argv[1] == "crash" and rank == "1":
    raise RuntimeError("boom on rank 1")
if sys.argv[1] == "titan-error" and rank == "1":
    from titan.errors import TitanError
    from titan.launch.report import exit_status

    def fail():
        raise TitanError("dataset path '/x' does not exist (training.dataset_path)")

    sys.exit(exit_status(fail))
time.sleep(120)  # rank 0: stopped by torchrun once rank 1 failed
"""


def _launch_two(tmp_path, how, ranks_filter):
    script = tmp_path / "ranks.py"
    script.write_text(_RANKS)
    cmd = [sys.executable, "-m", "titan.launch", "--nproc_per_node", "2", "--rdzv_backend", "c10d"]
    cmd += ["--rdzv_endpoint", "localhost:0", "--local-ranks-filter", ranks_filter, "--role", "rank", "--tee", "3"]
    out = subprocess.run([*cmd, str(script), how], cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=300)
    return out.returncode, (out.stdout + out.stderr).strip().splitlines()


@pytest.mark.slow
def test_a_failed_rank_the_console_does_not_show_is_shown_once(tmp_path):
    rc, lines = _launch_two(tmp_path, "crash", "0")  # run_train.sh's default LOG_RANK=0
    assert rc == 1, lines[-20:]
    assert lines[-1].startswith("titan: error: rank 1 exited with status 1: RuntimeError: boom on rank 1"), lines[-20:]
    assert sum("RuntimeError: boom on rank 1" in ln for ln in lines) == 1, lines[-20:]  # the exception, once
    assert any(ln.startswith("[rank1]:") and "raise RuntimeError" in ln for ln in lines), lines[-20:]
    # a titan error of rank 1, with both ranks on the console: its line once, last
    rc, lines = _launch_two(tmp_path, "titan-error", "0,1")
    want = "titan: error: dataset path '/x' does not exist (training.dataset_path)"
    assert rc == 2 and lines[-1] == want and sum(want in ln for ln in lines) == 1, lines[-20:]
    # torchrun's own lines about the failed attempt say nothing the last line does not
    assert not any("closing signal" in ln or "failed (exitcode" in ln for ln in lines), lines[-20:]
