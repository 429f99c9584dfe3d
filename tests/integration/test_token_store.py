"""train.py from a token store and from a mixture; a damaged store, a store of another tokenizer, a
weight <= 0 and an empty source each end in one `titan: error:` line, exit 2, nothing written."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

import train
from titan.data.token_store import MANIFEST
from titan.data.tokenize import tokenize_to_store

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "--job.config_file",
    str(REPO / "train_configs/debug_model.toml"),
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--metrics.enable_tensorboard",
    "false",
    "--metrics.log_freq",
    "1",
    "--metrics.disable_color_printing",
    "--training.steps",
    "3",
]


def _main(argv) -> int:
    from titan.log import logger

    for h in logger.handlers:  # the logger keeps the stream of the test that created its handler
        if isinstance(h, logging.StreamHandler):
            h.stream = sys.stderr
    return train.main(argv)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("data")
    docs = [f"document {i}: " + "the quick brown fox jumps over the lazy dog " * (i % 7 + 1) for i in range(400)]
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tokenize_to_store(
        dataset="",
        dataset_path=str(folder / "docs.jsonl"),
        tokenizer_path="",
        out=str(folder / "store"),
        workers=0,
        shard_mb=0.01,
    )
    return folder / "store"


def test_train_from_a_store(store, tmp_path, capsys):
    rc = _main([*TINY, "--training.dataset_path", str(store), "--job.dump_folder", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 0, err[-3000:]
    assert f"token store {str(store)!r}" in err and "step:  3" in err


def test_train_from_a_mixture_with_validation(store, tmp_path, capsys):
    config = tmp_path / "mix.toml"
    config.write_text(
        f'[[training.mixture]]\npath = "{store}"\nweight = 0.7\n\n'
        '[[training.mixture]]\ndataset = "pydoc"\nweight = 0.3\n\n'
        f'[validation]\nenable = true\nfreq = 3\nsteps = 2\n\n[[validation.mixture]]\npath = "{store}"\n\n'
        '[[validation.mixture]]\ndataset = "pydoc_validation"\n'
    )
    dump = tmp_path / "run"
    rc = _main(
        [
            *TINY,
            "--job.config_file",
            str(REPO / "train_configs/debug_model.toml"),
            "--job.dump_folder",
            str(dump),
            "--training.dataset_shuffle_seed",
            "1",
        ]
        + _toml_args(config)
    )
    err = capsys.readouterr().err
    assert rc == 0, err[-3000:]
    lines = [json.loads(x) for x in next((dump / "metrics").glob("*.jsonl")).read_text().splitlines()]
    last = [x for x in lines if "data/tokens/store" in x][-1]
    assert last["data/tokens/store"] + last["data/tokens/pydoc"] == 3 * 2 * 32
    assert any("validation/loss/store" in x and "validation/loss/pydoc_validation" in x for x in lines)


def _toml_args(config: Path) -> list[str]:
    """The mixture tables of ``config`` as CLI flags (the run's own config file stays the debug model's)."""
    import tomllib

    data = tomllib.loads(config.read_text())
    out = []
    for section, body in data.items():
        for key, value in body.items():
            if isinstance(value, list):
                items = ", ".join("{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in t.items()) + "}" for t in value)
                out += [f"--{section}.{key}", f"[{items}]"]
            else:
                out += [f"--{section}.{key}", json.dumps(value).strip('"')]
    return out


def fail(capsys, dump: Path, argv, *needles):
    rc = _main([*TINY, "--job.dump_folder", str(dump), *argv])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("titan: error")]
    assert rc == 2, err[-2000:]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    for n in needles:
        assert n in lines[0], lines[0]
    assert not dump.exists(), sorted(dump.rglob("*"))


def _copy(store: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(store, to)
    return to


def test_truncated_shard(store, tmp_path, capsys):
    bad = _copy(store, tmp_path / "s")
    with open(bad / "00001.tokens", "r+b") as f:
        f.truncate(3)
    fail(capsys, tmp_path / "run", ["--training.dataset_path", str(bad)], "00001.tokens has 3 bytes")


def test_bad_manifest(store, tmp_path, capsys):
    bad = _copy(store, tmp_path / "s")
    (bad / MANIFEST).write_text('{"format": "titan-token-store"')
    fail(capsys, tmp_path / "run", ["--training.dataset_path", str(bad)], "manifest.json is not valid JSON")


def test_store_of_another_tokenizer(store, tmp_path, capsys):
    ranks = (REPO / "titan/data/assets/tokenizer.model").read_text().splitlines()
    other = tmp_path / "other.model"
    other.write_text("\n".join(ranks[:-1]) + "\n")
    fail(
        capsys,
        tmp_path / "run",
        ["--training.dataset_path", str(store), "--model.tokenizer_path", str(other)],
        "was made with tokenizer",
        str(other),
    )


def test_weight_not_positive(store, tmp_path, capsys):
    fail(
        capsys,
        tmp_path / "run",
        ["--training.mixture", f'[{{path = "{store}", weight = 0}}]'],
        "training.mixture[0].weight",
    )


def test_empty_source(store, tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    fail(
        capsys,
        tmp_path / "run",
        ["--training.mixture", f'[{{path = "{store}", weight = 1}}, {{path = "{tmp_path / "empty.jsonl"}"}}]'],
        "empty",
    )


def test_tokenize_script_interrupted_then_finished(tmp_path):
    """SIGINT mid-run: exit 130, no manifest, only whole shards; the same command again keeps them
    and ends with the JSON line; the store equals one made in a single run."""
    import os
    import subprocess

    from tests.helpers.debug_kill import kill_env
    from tests.helpers.distributed import cpu_env
    from titan.data.token_store import TokenStore

    words = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor".split()
    docs = [" ".join(words[(i + j) % len(words)] for j in range(300 + i % 50)) for i in range(400)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = tmp_path / "store"
    cmd = [
        sys.executable,
        "scripts/tokenize_dataset.py",
        "--dataset_path",
        str(tmp_path / "docs.jsonl"),
        "--out",
        str(out),
        "--workers",
        "2",
        "--shard_mb",
        "0.05",
    ]
    # Ctrl-C once the first shard is written (a kill point, not a timer: the run cannot finish first;
    # the kill point also receives it as from a terminal when this suite runs with SIGINT ignored)
    env = cpu_env(**kill_env("interrupt:shard=0"))
    interrupted = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    stderr = interrupted.stderr
    assert interrupted.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr and "interrupted; finished shards are kept" in stderr
    assert not (out / MANIFEST).exists()
    finished = {p.stem for p in out.glob("[0-9]*.json")}
    assert finished
    again = subprocess.run(cmd, cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    result = json.loads(again.stdout.strip().splitlines()[-1])
    assert set(result) == {"text_bytes", "documents", "tokens", "seconds"} and result["documents"] == len(docs)
    assert f"({len(finished)} kept from an earlier run)" in again.stderr
    whole = tmp_path / "whole"
    tokenize_to_store(
        dataset="",
        dataset_path=str(tmp_path / "docs.jsonl"),
        tokenizer_path="",
        out=str(whole),
        workers=0,
        shard_mb=0.05,
    )
    a, b = TokenStore(str(out)), TokenStore(str(whole))
    assert a.num_tokens == b.num_tokens == result["tokens"]
    assert (a.read(0, a.num_tokens) == b.read(0, b.num_tokens)).all()
    assert os.listdir(out) == [p.name for p in out.iterdir()] and not list(out.glob("*.tmp"))


def _losses(err: str) -> dict[int, str]:
    import re

    return {int(m[1]): m[2] for m in re.finditer(r"step:\s*(\d+)\s+loss:\s*([0-9.]+)", err)}


def test_resume_mid_mixture_continues_the_same_run(store, tmp_path, capsys):
    """A mixture run stopped at step 2 and resumed from its checkpoint logs the losses of the run
    that was not stopped (store windows shuffled, pydoc tokenized online)."""
    mix = [
        "--training.mixture",
        f'[{{path = "{store}", weight = 0.6}}, {{dataset = "pydoc", weight = 0.4}}]',
        "--training.dataset_shuffle_seed",
        "3",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
        # an lr schedule that does not depend on training.steps: the cut run trains 2 of the 4 steps
        "--lr_scheduler.warmup_steps",
        "1",
        "--lr_scheduler.decay_ratio",
        "0",
        "--training.steps",
        "4",
    ]
    assert _main([*TINY, "--job.dump_folder", str(tmp_path / "whole"), *mix]) == 0
    whole = _losses(capsys.readouterr().err)
    assert _main([*TINY, "--job.dump_folder", str(tmp_path / "cut"), *mix[:-1], "2"]) == 0
    capsys.readouterr()
    assert _main([*TINY, "--job.dump_folder", str(tmp_path / "cut"), *mix]) == 0
    resumed = _losses(capsys.readouterr().err)
    assert sorted(resumed) == [3, 4] and all(resumed[s] == whole[s] for s in (3, 4)), (whole, resumed)


def test_benchmark_reads_a_store_and_a_mixture(store):
    import subprocess

    from tests.helpers.distributed import cpu_env

    for args in (
        ["--dataset_path", str(store), "--dp", "2", "--resume_at", "3,20"],
        [
            "--mixture",
            f'[{{path = "{store}", weight = 0.5}}, {{dataset = "pydoc", weight = 0.5}}]',
            "--resume_at",
            "5",
            "--max_docs",
            "50",
        ],
    ):
        proc = subprocess.run(
            [sys.executable, "scripts/benchmark_loader.py", "--seq_len", "64", "--batch_size", "2", *args],
            cwd=REPO,
            env=cpu_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert (
            result["unit"] == "windows"
            and result["tokens_per_s"] > 0
            and set(result["resume_s"]) == set(args[-3 if args[0] == "--mixture" else -1].split(","))
        )
