"""A hub dataset as a user runs it, on a generated mirror in the hub's layout: train.py on 2 ranks
(torchrun, gloo) resumes exactly from a checkpoint, tokenize_dataset.py turns a config of the
mirror into a token store in one command, and the documented FineWeb command fails without
network with one line naming the local mirror."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.distributed import cpu_env
from tests.helpers.hub_mirror import write_hub_mirror

REPO = Path(__file__).resolve().parents[2]
FINEWEB = "HuggingFaceFW/fineweb-edu"
STEP_RE = re.compile(r"step:\s*(\d+)\s+loss:\s*([0-9.]+)")

pytestmark = pytest.mark.slow


def _torchrun(dump: Path, mirror: Path) -> str:
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
        "--job.config_file",
        "train_configs/debug_model.toml",
        "--job.dump_folder",
        str(dump),
        "--metrics.disable_color_printing",
        "--metrics.enable_tensorboard",
        "false",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--training.steps",
        "4",
        "--training.dataset",
        FINEWEB,
        "--training.dataset_path",
        str(mirror),
        "--training.dataset_config",
        "sample-10BT",
        "--validation.enable",
        "--validation.dataset",
        FINEWEB,
        "--validation.dataset_path",
        str(mirror),
        "--validation.dataset_config",
        "default",
        "--validation.dataset_split",
        "train",
        "--validation.freq",
        "2",
        "--validation.steps",
        "1",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
    ]
    out = subprocess.run(cmd, cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    return text


def test_two_ranks_train_from_a_hub_mirror_and_resume_exactly(tmp_path):
    mirror = write_hub_mirror(tmp_path / "fineweb").root
    whole = _torchrun(tmp_path / "run", mirror)
    losses = {int(m[1]): m[2] for m in STEP_RE.finditer(whole)}
    assert sorted(losses) == [1, 2, 3, 4], whole[-3000:]
    assert "6 shards over 2 dp rank(s)" in whole and "each rank reads 3 of 6 shards" in whole, whole[-3000:]
    assert "validation" in whole and "loss" in whole
    # the same run, stopped after its step-2 checkpoint: resumed, it must continue bit for bit
    shutil.copytree(tmp_path / "run", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoint" / "step-4")
    again = _torchrun(tmp_path / "resumed", mirror)
    assert "resumed from" in again and "step 2" in again, again[-3000:]
    resumed = {int(m[1]): m[2] for m in STEP_RE.finditer(again)}
    assert resumed == {3: losses[3], 4: losses[4]}, (losses, resumed)


def test_tokenize_script_makes_a_store_from_a_mirror_config(tmp_path, capsys):
    from titan.data.token_store import TokenStore

    mirror = write_hub_mirror(tmp_path / "corpus", sample_files=2)
    out = tmp_path / "store"
    # the script's own main, in this process: the same argument parsing without a second interpreter
    spec = importlib.util.spec_from_file_location("tokenize_dataset", REPO / "scripts" / "tokenize_dataset.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    argv = [
        "--dataset",
        FINEWEB,
        "--dataset_path",
        str(mirror.root),
        "--dataset_config",
        "code",
        "--dataset_text_field",
        "content",
        "--out",
        str(out),
        "--workers",
        "0",
    ]
    assert script.main(argv) == 0, capsys.readouterr().err[-3000:]
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    docs = [d for shard in mirror.shard_docs("code") for d in shard]
    assert result["documents"] == len(docs) and result["text_bytes"] == sum(len(d) for d in docs), result
    store = TokenStore(str(out))
    assert store.num_tokens == result["tokens"]
    assert store.manifest["source"]["dataset_config"] == "code"


def test_fineweb_command_offline_is_one_line_naming_the_mirror():
    env = {k: v for k, v in os.environ.items() if k not in ("NGPU", "COMM_MODE", "CONFIG_FILE")}
    env.update(HF_HUB_OFFLINE="1", PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", NGPU="1")
    cmd = ["./run_train.sh", "--training.dataset", FINEWEB, "--training.dataset_config", "sample-10BT"]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("titan: error: cannot reach the Hugging Face hub"), lines[0]
    assert f"hf download {FINEWEB} --repo-type dataset" in lines[0] and "training.dataset_path" in lines[0]
