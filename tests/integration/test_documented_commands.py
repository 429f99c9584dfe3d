"""Every command the README and docs/ show runs as written, on this CPU machine.

Commands are read from the Markdown itself (the README and every page of docs/): fenced shell
blocks, indented code blocks and inline `code` spans that start with ./run_train.sh, python
train.py, python -m titan.train, python -m titan.launch[.check], torchrun, python scripts/...,
python examples/... or sbatch (leading VAR=value assignments allowed). Each runs with a small step
count and a 2-sequence local batch appended where it trains (a later flag wins; a command that sets
the batch keeps its own) and its output in a temporary folder. The only ones not run are in SKIP,
each with the reason (hardware, a cluster, network or weights absent here), and templates with
elided arguments ("...", "<dump_folder>"). A new command in the docs is run by default.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers.distributed import cpu_env

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TIMEOUT_S = 600  # per command, generous: the machine is shared

# Commands another test runs as written, longer and with more checks: not run twice.
RUN_ELSEWHERE = {
    "./run_train.sh": "tests/integration/test_default_run.py (as shipped, 150 steps: it learns)",
    "NGPU=2 ./run_train.sh": "tests/integration/test_train.py (30 steps: the loss falls)",
    "python scripts/benchmark.py --job.config_file train_configs/debug_model.toml": "tests/integration/"
    "test_benchmark.py (the script and its table; its six rows are the docs' own ./run_train.sh commands with"
    " --compile.enable and each activation_checkpoint mode, and float8 emulated in tests/unit/parallel/"
    "test_float8.py)",
}
SKIP = {
    "CONFIG_FILE=train_configs/llama3_8b.toml ./run_train.sh": "8B model: needs GPUs (its layout is checked by the"
    " dry-run commands)",
    "NGPU=8 CONFIG_FILE=train_configs/llama3_8b.toml ./run_train.sh --training.steps 100": "8 GPUs",
    "NGPU=8 CONFIG_FILE=train_configs/llama3_8b_float8.toml ./run_train.sh": "8 GPUs of SM89+ (the variants'"
    " layouts are dry-run by tests/unit/tools/test_presets.py)",
    "NGPU=8 CONFIG_FILE=train_configs/llama3_8b_long_context.toml ./run_train.sh": "8 GPUs (context parallel is"
    " CUDA only)",
    "python scripts/convert_llama_to_dcp.py Meta-Llama-3.1-70B/original ckpt/llama3_70b": "Meta's 70B weights"
    " (a hub download)",
    "python scripts/convert_hf.py from_hf meta-llama/Llama-3.1-8B-local-copy dcp_out": "Llama 3.1 8B weights",
    "./run_train.sh --training.dataset_path /tmp/pydoc_tokens": "the store the tokenize_dataset.py command writes,"
    " run at the same time (tests/integration/test_token_store.py trains from a store)",
    "python scripts/benchmark.py --nproc 8 --steps 20 --warmup 5 --job.config_file train_configs/llama3_8b.toml"
    " --variant 'eager=--compile.enable false' --variant compile=--compile.enable": "8 GPUs (the 8B model)",
    "python scripts/benchmark.py --memory": "up to 25 GiB and minutes a row: full logits at vocab 128,256 x seq"
    " 8,192 (tests/unit/training/test_chunked_loss.py checks the loss's memory without the whole logits)",
    "python scripts/benchmark.py": "the README's benchmark command runs the same script and rows on the debug"
    " config (tests/integration/test_benchmark.py checks the table)",
    "python -m titan.train": "the README's `python -m titan.train --job.config_file train_configs/debug_model.toml`"
    " runs the same entry point",
    "python scripts/benchmark.py --preset moe_debug_cpu": "three 2-rank rows of minutes each"
    " (tests/integration/test_llama4_configs.py checks each row's layout; test_expert_parallel.py trains them)",
}
SKIP_PREFIXES = [
    # (command prefix, reason): families of commands that need what this machine lacks
    (
        "./run_train.sh --training.dataset HuggingFaceFW/",
        "the Hugging Face hub or a mirror of it (tests/integration/test_hub_dataset.py trains from a generated"
        " mirror and runs the FineWeb command offline: one line naming the mirror)",
    ),
    (
        "python scripts/tokenize_dataset.py --dataset HuggingFaceFW/",
        "the Hugging Face hub or a mirror of it (tests/integration/test_hub_dataset.py tokenizes a generated mirror)",
    ),
    ("./run_train.sh --float8.enable_float8_linear", "float8 matmuls on an SM89+ GPU (CPU: add --float8.emulate)"),
    ("python examples/sagemaker/launch.py --image-uri", "an AWS account and SageMaker (its --help runs)"),
    ("python scripts/convert_hf.py to_hf outputs/checkpoint/step-1000", "a 1000-step 8B checkpoint"),
    ("python scripts/convert_hf.py dcp_to_torch outputs/checkpoint/step-1000", "a 1000-step checkpoint"),
    ("python scripts/convert_hf.py torch_to_dcp model.pt", "model.pt from the dcp_to_torch command"),
    ("python scripts/dcp_to_torch.py", "a 1000-step checkpoint (tests/unit/interop covers the conversion)"),
    ("python scripts/generate.py --checkpoint", "a trained checkpoint (tests/unit/interop covers generation)"),
    # Runs of minutes to hours on this machine: the code they drive is tested on small shapes.
    (
        "python scripts/scale_tables.py",
        "a simulation of minutes per rank count, 7 counts, and its results file (tests/unit/tools/"
        "test_scale_tables.py draws the tables and the chart from a small results file)",
    ),
    (
        "python scripts/simulate.py --world_size 512 --job.config_file train_configs/llama3_405b.toml",
        "minutes of 405B simulation (the README's COMM_MODE=fake_backend 405B run covers the same path;"
        " tests/unit/tools/test_simulate.py checks the simulator against real runs)",
    ),
    (
        "python scripts/benchmark_muon.py",
        "a timing benchmark of minutes, meaningful on an idle machine only (tests/unit/training/"
        "test_muon_layouts.py checks the distributed step)",
    ),
    (
        "torchrun --nproc_per_node 2 scripts/generate.py --checkpoint",
        "a trained checkpoint (tests/unit/interop covers tensor-parallel generation)",
    ),
    ("python scripts/benchmark.py --preset", "a GPU: the 8B-shape preset (1.76B parameters at seq 8192)"),
    (
        "python scripts/tokenize_dataset.py --dataset c4",
        "a C4 mirror (tests/unit/data/test_token_store.py and "
        "tests/integration/test_token_store.py tokenize generated files)",
    ),
    ("python scripts/benchmark_loader.py --dataset_path /tmp/tk_store", "the token store the command above writes"),
    ("python scripts/benchmark_loader.py --mixture", "the token store and mirror the commands above write"),
    (
        "python scripts/convert_config.py",
        "a torchtitan TOML file of the user's (tests/unit/config/"
        "test_dialects_convert.py converts files in each dialect)",
    ),
    (
        "python train.py --job.config_file torchtitan/",
        "a torchtitan checkout's config file"
        " (tests/unit/config/test_dialects.py loads files in each dialect; test_torchtitan_matrix.py runs its flags)",
    ),
    (
        "python scripts/benchmark_recovery.py",
        "minutes of 2-rank training with failures by design"
        " (tests/integration/test_launchers.py covers restarts and goodput)",
    ),
    (
        "python scripts/benchmark_loader.py --dataset c4 --dataset_path /tmp/c4",
        "the 16 x 10,000-document mirror, minutes to read"
        " (tests/unit/data/test_c4_mirror.py runs the benchmark on a small one)",
    ),
]

_COMMAND = re.compile(
    r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)*"
    r"(?:\./run_train\.sh|sbatch|torchrun|python (?:train\.py|-m titan\.(?:train|launch(?:\.check)?)|scripts/\S+\.py"
    r"|examples/\S+\.py))(?:\s|$)"
)


def _candidates(text: str) -> list[str]:
    """Shell lines from fenced shell blocks, indented code blocks and inline code spans."""
    lines: list[str] = []
    fenced = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
    for lang, body in fenced.findall(text):
        if lang in ("", "bash", "sh", "shell", "console"):
            lines += body.replace("\\\n", " ").splitlines()
    prose = fenced.sub("", text)
    lines += [m.group(1) for m in re.finditer(r"^ {4}(\S.*)$", prose.replace("\\\n", " "), re.M)]
    lines += re.findall(r"`([^`\n]+)`", prose)
    return lines


def documented_commands() -> dict[str, str]:
    """command (comments stripped, whitespace normalised) -> first doc that shows it."""
    found: dict[str, str] = {}
    for doc in DOCS:
        for line in _candidates(doc.read_text()):
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue
            command = shlex.join(words)
            if words and _COMMAND.match(command):
                found.setdefault(command, doc.name)
    return found


def _skip_reason(command: str) -> str | None:
    program = next(w for w in shlex.split(command) if not re.match(r"^[A-Z_][A-Z0-9_]*=", w))
    if program == "sbatch":
        return "a Slurm cluster (tests/integration/test_slurm.py runs the script locally)"
    if command in SKIP:
        return SKIP[command]
    if command in RUN_ELSEWHERE:
        return f"run by {RUN_ELSEWHERE[command]}"
    launcher = program == "torchrun" or command.split()[:3] == ["python", "-m", "titan.launch"]
    if launcher and not any(w.endswith(".py") for w in shlex.split(command)):
        return "a template: the launcher named in prose, without the script it starts"
    for prefix, reason in SKIP_PREFIXES:
        if command.startswith(prefix):
            return reason
    if "..." in command.split() or re.search(r"<[a-z_]+>", command):
        return "a template with elided arguments ('...', '<name>'), not a complete command"
    return None


def _small_batch(words: list[str]) -> list[str]:
    """2 sequences a step instead of the configs' 8, unless the command sets its batch: the same code
    path for a quarter of the work (the MoE debug models' steps, not their start-up, dominate here)."""
    if any(w.startswith(("--training.local_batch_size", "--training.global_batch_size")) for w in words):
        return []
    return ["--training.local_batch_size", "2"]


def _prepare(command: str, out: Path) -> tuple[list[str], dict[str, str]]:
    """argv and environment to run ``command`` here, small: a 2-step run in a temporary folder."""
    words = shlex.split(command)
    env = cpu_env()  # one thread each: two commands run at once on this 2-core machine
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    # Optional arguments shown as [--flag value] run without them.
    words = re.sub(r"\[[^\]]*\]", " ", " ".join(words)).split()
    if words[0] == "python":
        words[0] = sys.executable
    if words[0] == "torchrun":  # the same launcher, from this interpreter
        words[:1] = [sys.executable, "-m", "torch.distributed.run"]
    script = next((w for w in words[1:] if w.endswith(".py")), words[1] if words[0] == sys.executable else words[0])
    if words[0] != sys.executable:
        script = words[0]
    module = words[1:3] if words[0] == sys.executable else []
    titan_cli = script in ("./run_train.sh", "train.py") or module in (["-m", "titan.train"], ["-m", "titan.launch"])
    if titan_cli and not {"--help", "-h"} & set(words):
        words += ["--job.dump_folder", str(out)]
        if env.get("COMM_MODE") != "fake_backend" and "--job.dry_run" not in words:
            words += ["--training.steps", "2", *_small_batch(words)]
    elif script == "scripts/benchmark.py" and not {"--help", "-h"} & set(words):
        words += ["--warmup", "1", "--steps", "1", *_small_batch(words)]
    elif script == "scripts/benchmark_loader.py":
        words += ["--max_docs", "200"]
    elif script == "scripts/make_c4_mirror.py":
        at = words.index("--out") + 1
        words[at] = str(out / "c4")  # never /tmp/c4 itself: a user's mirror may be there
        words += ["--shards", "2", "--docs", "50"]
    return words, env


def _run(command: str, out: Path) -> tuple[int, str, float]:
    argv, env = _prepare(command, out)
    start = time.perf_counter()
    proc = subprocess.run(
        argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL
    )
    return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - start


COMMANDS = documented_commands()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, tuple[int, str, float]]:
    """Runs every command not skipped, two at a time; command -> (exit status, output, seconds)."""
    runnable = [c for c in COMMANDS if _skip_reason(c) is None]
    root = tmp_path_factory.mktemp("docs")
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {c: pool.submit(_run, c, root / f"cmd{i}") for i, c in enumerate(runnable)}
        return {c: f.result() for c, f in futures.items()}


def test_commands_are_found():
    """The extraction works on the docs as they are (a broken parser would test nothing)."""
    assert "./run_train.sh" in COMMANDS
    assert "NGPU=2 ./run_train.sh" in COMMANDS
    assert "python train.py --help" in COMMANDS
    assert any(c.startswith("python scripts/convert_hf.py") for c in COMMANDS)  # indented blocks
    assert "python -m titan.launch.check" in COMMANDS and any(c.startswith("torchrun ") for c in COMMANDS)
    pages = {doc for doc in COMMANDS.values() if doc != "README.md"}
    assert {"launching.md", "configs.md", "datasets.md", "checkpoint_conversion.md"} <= pages, pages
    assert len(COMMANDS) >= 30
    stale = [c for c in [*SKIP, *RUN_ELSEWHERE] if c not in COMMANDS]
    assert not stale, f"SKIP or RUN_ELSEWHERE names commands the docs no longer show: {stale}"


@pytest.mark.parametrize("command", list(COMMANDS), ids=lambda c: c[:90])
def test_documented_command_runs(command, results):
    reason = _skip_reason(command)
    if reason is not None:
        plain = reason.startswith(("a template", "run by"))
        pytest.skip(reason if plain else f"{COMMANDS[command]}: needs {reason}")
    status, output, seconds = results[command]
    assert status == 0, f"{COMMANDS[command]}: `{command}` exited {status} after {seconds:.0f}s:\n{output[-4000:]}"
    assert "Traceback" not in output, output[-4000:]
