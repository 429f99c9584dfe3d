"""Training runs for tests: the tiny debug-model run (CLI arguments), an in-process Trainer, a
train.py subprocess with the CPU environment, and a SIGTERM delivered during a chosen step."""

from __future__ import annotations

import importlib
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from tests.helpers.debug_kill import ENV, kill_env
from tests.helpers.distributed import cpu_env

REPO = Path(__file__).resolve().parents[2]
STEP_RE = re.compile(r"step:\s*(\d+)\s+loss:\s*([0-9.]+)")
# The debug model on 32-token windows, every step logged, no TensorBoard, plain console lines.
TINY_RUN = [
    "--job.config_file",
    str(REPO / "train_configs/debug_model.toml"),
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--metrics.log_freq",
    "1",
    "--metrics.enable_tensorboard",
    "false",
    "--metrics.disable_color_printing",
    "--metrics.startup_memory_estimate",  # the start-up table's fake forward/backward: a second a run
    "false",
]
TINY_CKPT = [*TINY_RUN, "--checkpoint.enable"]
# The bad-input runs: 2 steps, no metrics files (a rejected run must leave none of its own).
TINY = [
    "--job.config_file",
    str(REPO / "train_configs/debug_model.toml"),
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--metrics.enable_tensorboard",
    "false",
    "--metrics.enable_jsonl",
    "false",
    "--metrics.disable_color_printing",
    "--training.steps",
    "2",
]


# a 2-layer, dim-64 debug model: small checkpoints, fast steps
SMALL_MODEL = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2"]


def train_in_child(argv: list[str], log: str, kill_at: str = "", env: dict[str, str] | None = None) -> None:
    """``train.main(argv)`` in this (forked, fresh) child process with its output in ``log``, the
    kill point ``kill_at`` installed (tests/helpers/debug_kill.py) and ``env`` set; exits with
    train's status, without Python's teardown."""
    import logging
    import os

    code = 1
    try:
        out = open(log, "a", buffering=1)  # noqa: SIM115 - the child's stdout until it exits
        sys.stdout = sys.stderr = out
        for h in logging.getLogger("titan").handlers:
            if isinstance(h, logging.StreamHandler):
                h.setStream(out)
        os.environ.pop(ENV, None)
        os.environ.update(env or {})
        import train
        from tests.helpers.debug_kill import DebugKill, install

        install(DebugKill(kill_at))  # in this child only
        code = train.main(argv)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        os._exit(code)


def run_args(tmp_path, *extra):
    return [*TINY, "--job.dump_folder", str(tmp_path), *extra]


def trainer(folder: Path, *args: str):
    """A Trainer for a 6-step tiny run dumping into ``folder`` (``args`` override)."""
    from titan.config import load_config
    from titan.training.trainer import Trainer

    return Trainer(load_config([*TINY_RUN, "--training.steps", "6", "--job.dump_folder", str(folder), *args]))


def signal_during(trainer, step: int, send: bool) -> None:  # a Trainer
    """Deliver SIGTERM to this process while ``step`` runs (on the ranks where ``send``)."""
    original = trainer.train_step

    def train_step(microbatches):
        out = original(microbatches)
        if send and trainer.step == step:
            signal.raise_signal(signal.SIGTERM)
        return out

    trainer.train_step = train_step


def run_env(**extra: str) -> dict[str, str]:
    """cpu_env() without a fault-injection point inherited from the caller's environment."""
    env = cpu_env(**extra)
    if ENV not in extra:
        env.pop(ENV, None)
    return env


def train_subprocess(folder: Path, *args: str, kill_at: str = "") -> tuple[int, str, dict[int, str]]:
    """`python train.py` on the tiny run with checkpoints on: (exit status, output, {step: loss});
    ``kill_at``: a kill point (tests/helpers/debug_kill.py)."""
    cmd = [sys.executable, "train.py", *TINY_CKPT, "--job.dump_folder", str(folder), *args]
    env = run_env(**kill_env(kill_at)) if kill_at else run_env()
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    return out.returncode, text, {int(m[1]): m[2] for m in STEP_RE.finditer(text)}


def script_module(name: str) -> ModuleType:
    """scripts/<name>.py imported as a module (the scripts folder is not a package)."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)
