"""Hostile inputs: every user mistake ends in one `titan: error:` line naming the key/file/rank/step
and what is valid, a non-zero exit code, no traceback, and no checkpoint lost.

Most cases run train.main in-process (no subprocess start-up); layout errors use the dry run
(no process group). Only the two-rank failures need real processes (torchrun). Kill -9 / SIGTERM
of a 1-process run during a save are covered by test_checkpoint_recovery.py.
"""

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train
from tests.helpers.debug_kill import kill_env
from tests.helpers.distributed import cpu_env
from tests.helpers.runs import TINY, run_args
from titan.checkpointing.folders import MARKER
from titan.errors import TitanError

REPO = Path(__file__).resolve().parents[2]


def _main(argv):
    """train.main, with the titan logger writing to this test's captured stderr (its handler keeps
    the stream of the test that created it; setStream would flush that closed one)."""
    from titan.log import logger

    for h in logger.handlers:
        if isinstance(h, logging.StreamHandler):
            h.stream = sys.stderr
    return train.main(argv)


def fail(capsys, argv, *needles, code=2):
    """train.main(argv) fails with exactly one error line that contains every needle."""
    rc = _main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("titan: error")]
    assert rc == code, err[-2000:]
    assert len(lines) == 1, err[-2000:]
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]
    return err


def ok(capsys, argv):
    rc = _main(argv)
    out = capsys.readouterr()
    assert rc == 0, out.err[-3000:]
    return out.out + out.err


def dry(*extra):
    return [*TINY, "--job.dry_run", *extra]


# ---------------------------------------------------------------- config
@pytest.mark.parametrize(
    "argv, needles",
    [
        (["--trainin.steps", "3"], ["unknown config section 'trainin'", "did you mean 'training'"]),
        (["--training.stpes", "3"], ["unknown config key 'training.stpes'", "did you mean 'training.steps'"]),
        (["--training.steps", "ten"], ["'training.steps'", "'ten'", "int"]),
        (["--training.steps", "-3"], ["'training.steps'", "-3", ">= 1"]),
        (["--optimizer.lr", "-0.1"], ["config key 'optimizer.lr' got -0.1; valid: a number > 0"]),
        (["--model.flavor", "giant"], ["'model.flavor' got 'giant'", "debugmodel"]),
        (["--model.name", "gpt9"], ["'model.name' got 'gpt9'; valid: llama3"]),
        (["--job.config_file", "/nonexistent/x.toml"], ["config file '/nonexistent/x.toml' does not exist"]),
        (["--training.seq_len"], ["--training.seq_len", "needs a value"]),
        (["--compile.components", '["model", "optimizer"]'], ["compile.components", "'optimizer'", "model, loss"]),
        (["--checkpoint.load_step", "3"], ["checkpoint.load_step", "checkpoint.enable"]),
    ],
)
def test_config_errors(capsys, tmp_path, argv, needles):
    fail(capsys, [*TINY, "--job.dump_folder", str(tmp_path), *argv], *needles)


@pytest.mark.parametrize(
    "text, needles",
    [
        ("[training\nsteps = 3\n", ["is not valid TOML"]),
        ("[trainng]\nsteps = 3\n", ["unknown config section 'trainng'", "did you mean 'training'"]),
        ('[training]\nsteps = "ten"\n', ["training.steps", "'ten'"]),
        (b'[job]\ndescription = "\xff\xfe"\n', ["not UTF-8"]),
    ],
)
def test_bad_toml_files(capsys, tmp_path, text, needles):
    f = tmp_path / "bad.toml"
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    fail(capsys, ["--job.config_file", str(f)], f"config file '{f}'", *needles)


# ---------------------------------------------------------------- layout (dry run: no process group)
@pytest.mark.parametrize(
    "argv, needles",
    [
        (
            ["--job.dry_run_world_size", "8", "--parallelism.tensor_parallel_degree", "3"],
            ["tp 3", "do not divide the world size 8"],
        ),
        (
            ["--job.dry_run_world_size", "6", "--parallelism.data_parallel_shard_degree", "4"],
            ["= 4", "world size is 6"],
        ),
        (
            ["--job.dry_run_world_size", "3", "--parallelism.tensor_parallel_degree", "3"],
            ["tensor_parallel_degree 3 must divide model n_heads (16)"],
        ),
        (
            [
                "--job.dry_run_world_size",
                "8",
                "--parallelism.pipeline_parallel_degree",
                "8",
                "--parallelism.pipeline_parallel_schedule",
                "Interleaved1F1B",
            ],
            ["n_layers (6) cannot be split into 16 pipeline stages", "pipeline_parallel_layers_per_stage"],
        ),
        (
            ["--job.dry_run_world_size", "2", "--parallelism.context_parallel_degree", "2", "--training.seq_len", "30"],
            ["training.seq_len (30) must be divisible by 4", "context_parallel_degree 2"],
        ),
        (
            [
                "--job.dry_run_world_size",
                "2",
                "--parallelism.tensor_parallel_degree",
                "2",
                "--parallelism.enable_async_tensor_parallel",
            ],
            ["enable_async_tensor_parallel", "compile.enable"],
        ),
    ],
)
def test_layout_errors_dry_run(capsys, argv, needles):
    fail(capsys, dry(*argv), *needles)


def test_float8_on_unsupported_gpu(monkeypatch):
    from titan.config import load_config
    from titan.parallel.float8 import check_float8_hardware

    cfg = load_config([*TINY, "--float8.enable_float8_linear"])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(TitanError, match=r"compute capability >= 8.9 \(this one: 8.0\).*float8.emulate"):
        check_float8_hardware(cfg.float8, torch.device("cuda", 0))


# ---------------------------------------------------------------- data and tokenizer
def test_unknown_dataset_and_missing_path(capsys, tmp_path):
    built = "parameters,"  # the trainer's "model ...: N parameters" line: these fail before it
    assert built not in fail(capsys, run_args(tmp_path, "--training.dataset", "c5"), "unknown dataset 'c5'", "pydoc")
    assert built not in fail(
        capsys,
        run_args(tmp_path, "--training.dataset_path", str(tmp_path / "nope.jsonl")),
        "nope.jsonl",
        "does not exist",
        "training.dataset_path",
    )


def test_empty_and_unsupported_datasets(capsys, tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    fail(capsys, run_args(tmp_path, "--training.dataset_path", str(tmp_path / "empty.jsonl")), "empty.jsonl", "empty")
    (tmp_path / "d.csv").write_text("a,b\n")
    fail(capsys, run_args(tmp_path, "--training.dataset_path", str(tmp_path / "d.csv")), "d.csv", ".jsonl")
    (tmp_path / "notext.jsonl").write_text('{"body": "x"}\n')
    fail(
        capsys,
        run_args(tmp_path, "--training.dataset_path", str(tmp_path / "notext.jsonl")),
        "no column 'text'",
        "body",
    )


def _jsonl_with_broken_line(path: Path) -> None:
    rows = [json.dumps({"text": f"document {i} " * 40}) for i in range(20)]
    rows.insert(1, '{"text": "unterminated')
    path.write_text("\n".join(rows) + "\n")


def test_jsonl_broken_line_fails_by_default_names_file_and_line(capsys, tmp_path):
    f = tmp_path / "broken.jsonl"
    _jsonl_with_broken_line(f)
    fail(
        capsys,
        run_args(tmp_path, "--training.dataset_path", str(f)),
        f"{f}:2",
        "not valid JSON",
        "training.dataset_bad_lines",
    )


def test_jsonl_broken_line_skipped_with_count(capsys, tmp_path):
    f = tmp_path / "broken.jsonl"
    _jsonl_with_broken_line(f)
    text = ok(capsys, run_args(tmp_path, "--training.dataset_path", str(f), "--training.dataset_bad_lines", "skip"))
    assert "skipped 1 broken line" in text and f"{f}:2" in text


def test_non_utf8_text_fails_naming_file(capsys, tmp_path):
    f = tmp_path / "latin1.txt"
    f.write_bytes("caf\xe9 au lait\n\nplain ascii paragraph\n".encode("latin-1"))
    fail(capsys, run_args(tmp_path, "--training.dataset_path", str(f)), "latin1.txt", "UTF-8")


def test_document_longer_than_many_windows_trains(capsys, tmp_path):
    f = tmp_path / "long.jsonl"
    f.write_text(json.dumps({"text": " ".join(f"word{i}" for i in range(2000))}) + "\n")  # ~100 windows of 32
    ok(capsys, run_args(tmp_path, "--training.dataset_path", str(f), "--training.steps", "2"))


def test_tokenizer_missing_and_wrong_format(capsys, tmp_path):
    fail(capsys, run_args(tmp_path, "--model.tokenizer_path", str(tmp_path / "tok.model")), "tok.model", "not found")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("this is not a tokenizer")
    fail(capsys, run_args(tmp_path, "--model.tokenizer_path", str(bad)), "tokenizer.json")


# ---------------------------------------------------------------- checkpoints and the dump folder
def _ckpt(tmp_path, *extra):
    return run_args(tmp_path, "--checkpoint.enable", "--checkpoint.interval", "1", *extra)


@pytest.fixture(scope="module")
def _saved_template(tmp_path_factory):
    """One dump folder with complete checkpoints of steps 1 and 2 (debugmodel, tiny), made once."""
    folder = tmp_path_factory.mktemp("saved")
    assert _main(_ckpt(folder)) == 0
    return folder


@pytest.fixture
def two_steps_saved(tmp_path, _saved_template):
    """This test's own copy of the template dump folder; returns its checkpoint folder."""
    shutil.copytree(_saved_template, tmp_path, dirs_exist_ok=True)
    root = tmp_path / "checkpoint"
    assert (root / "step-1" / MARKER).exists() and (root / "step-2" / MARKER).exists()
    return root


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_torn_step_warned_and_skipped(capsys, tmp_path, two_steps_saved):
    (two_steps_saved / "step-3").mkdir()
    (two_steps_saved / "step-3" / "__0_0.distcp").write_bytes(b"half")
    text = ok(capsys, _ckpt(tmp_path, "--training.steps", "3"))
    assert "step-3 is incomplete" in text and "resumed from" in text and "step-2" in text


def test_checkpoint_of_a_different_model_shape(capsys, tmp_path, two_steps_saved, monkeypatch):
    import dataclasses

    from tests.helpers.tiny import patch_flavors
    from titan.models.llama.args import get_model_args

    before = _snapshot(two_steps_saved)
    patch_flavors(monkeypatch, debugmodel=dataclasses.replace(get_model_args("debugmodel"), dim=128))
    fail(
        capsys,
        _ckpt(tmp_path, "--training.steps", "4"),
        str(two_steps_saved / "step-2"),
        "tok_embeddings.weight",
        "[2048, 256]",
        "[2048, 128]",
    )
    assert _snapshot(two_steps_saved) == before


# A disk that fills up during a save: tests/unit/checkpointing/test_save_failures.py (a real tmpfs).


def test_checkpoint_folder_not_writable(capsys, tmp_path):
    (tmp_path / "checkpoint").write_text("a file where the folder should be")
    fail(capsys, _ckpt(tmp_path), "checkpoint.folder", str(tmp_path / "checkpoint"), "not a writable folder")


def test_too_little_free_disk(capsys, tmp_path, monkeypatch):
    import titan.checkpointing.preflight as pf

    monkeypatch.setattr(pf.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    fail(capsys, _ckpt(tmp_path), "free", str(tmp_path / "checkpoint"), "needs about")


def test_older_load_step_does_not_replace_later_checkpoints(capsys, tmp_path, two_steps_saved):
    before = _snapshot(two_steps_saved)
    fail(
        capsys,
        _ckpt(tmp_path, "--checkpoint.load_step", "1", "--training.steps", "3"),
        "checkpoint.load_step 1",
        "step-2",
        "--job.overwrite",
    )
    assert _snapshot(two_steps_saved) == before
    ok(capsys, _ckpt(tmp_path, "--checkpoint.load_step", "1", "--training.steps", "2", "--job.overwrite"))


def test_debug_flag_shows_the_traceback(tmp_path):
    with pytest.raises(TitanError, match="unknown dataset"):
        train.main(run_args(tmp_path, "--training.dataset", "c5", "--job.debug"))


# ---------------------------------------------------------------- two ranks (real processes)
def _torchrun(tmp_path, kill_at: str, timeout: int = 400) -> tuple[int, str]:
    """Two ranks, one of which fails at ``kill_at``. The collective timeout is far beyond the
    guard: a job that ends at all ended because the failure was noticed, not timed out."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        "localhost:0",
        "train.py",
        *run_args(tmp_path, "--training.steps", "6", "--comm.train_timeout_seconds", "3600"),
    ]
    env = cpu_env(**kill_env(kill_at))
    try:
        out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the job did not end in {timeout} s: the other rank waits for a collective? {e.stderr!r:.3000}")
    return out.returncode, out.stdout + out.stderr


@pytest.mark.slow
def test_one_of_two_ranks_fails_job_ends_with_its_message(tmp_path):
    rc, text = _torchrun(tmp_path, "error:step=2@rank1")
    assert rc != 0, text[-3000:]
    assert "titan: error on rank 1: TITAN_DEBUG_KILL_AT: injected failure after step 2" in text, text[-3000:]
    # rank 0 either notices the lost peer (one line) or torchrun's SIGTERM ends it first: no traceback
    assert "[rank0]: Traceback" not in text and "[rank1]: Traceback" not in text, text[-3000:]


@pytest.mark.slow
def test_sigkill_of_one_of_two_ranks_ends_the_job(tmp_path):
    rc, text = _torchrun(tmp_path, "step=2@rank1")
    assert rc != 0, text[-3000:]
    assert "SIGKILL" in text and "rank      : 1" in text, text[-3000:]  # torchrun's Root Cause names rank 1
    assert "[rank0]: Traceback" not in text, text[-3000:]


def test_rank_waiting_on_a_lost_peer_says_so_in_one_line(capsys, monkeypatch, tmp_path):
    import torch.distributed as dist

    import titan.training.trainer

    class Lost:
        def __init__(self, config):
            raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:186. This is typically ...")

    monkeypatch.setattr(titan.training.trainer, "Trainer", Lost)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr("titan.parallel.utils.destroy_distributed", lambda: None)
    monkeypatch.setenv("RANK", "0")
    fail(
        capsys,
        run_args(tmp_path),
        "titan: error on rank 0: another rank failed during a collective",
        "Connection closed by peer",
        "Root Cause",
        code=3,
    )
