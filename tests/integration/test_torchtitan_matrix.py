"""torchtitan v0.2.2's integration-test matrix (the flag lists of its tests/integration_tests/features.py, as
torchtitan passes them) on titan's debug config.

Every case goes through the dry run at its full rank count. Each case of at most 4 ranks also trains for real
on CPU ranks (gloo) for a few steps, each case on its own process group (cases sharing one group
left it out of step whenever one failed on some ranks only); one case also runs through run_train.sh as a
user starts it. torchtitan's 10 / 20 steps shrink to 2 / 4 and its 2048-token windows to 32. The first step's
collective timeout is long: a rank compiling on a busy machine must not time out its peers.

Cases that need CUDA go through the dry run only (`cuda` says why); they are the ones torchtitan runs on
GPUs that titan cannot run on CPU ranks: context parallelism (ring attention uses CUDA SDPA kernels),
flex attention (no CPU backward in torch) and async tensor parallelism (symmetric memory).
"""

from __future__ import annotations

import math
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.distributed import cpu_env, run_distributed

REPO = Path(__file__).resolve().parents[2]
BASE = [
    "--job.config_file",
    str(REPO / "train_configs/debug_model.toml"),
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "4",
    "--training.steps",
    "2",
    "--lr_scheduler.warmup_steps",
    "1",
    "--checkpoint.interval",
    "2",
    "--metrics.log_freq",
    "1",
    "--metrics.enable_tensorboard",
    "false",
    "--metrics.disable_color_printing",
    "--metrics.startup_memory_estimate",  # the start-up table's fake forward/backward: a second a run
    "false",
    "--comm.init_timeout_seconds",
    "900",
]
STEPS = {"10": "2", "20": "4"}
DUMP = "{dump}"  # the case's dump folder, as torchtitan's artifacts-to-be-uploaded/<test name>
CP = "context parallelism needs CUDA (ring attention over CUDA SDPA kernels)"
FLEX = "flex attention trains on CUDA only (torch's flex_attention has no CPU backward)"
ASYNC_TP = "async tensor parallelism needs CUDA (symmetric memory)"


@dataclass(frozen=True)
class Case:
    name: str
    ngpu: int
    runs: tuple[tuple[str, ...], ...]
    cuda: str = ""
    """Why the case cannot train on CPU ranks (dry run only)."""
    refused: str = ""
    """The line titan stops with (a torchtitan key titan does not implement)."""


def _c(name: str, ngpu: int, *runs: list[str], cuda: str = "", refused: str = "") -> Case:
    return Case(name, ngpu, tuple(tuple(r) for r in runs), cuda, refused)


PP = "--parallelism.pipeline_parallel_degree"
SCHED = "--parallelism.pipeline_parallel_schedule"
CASES = [
    _c("default", 4, ["--profiling.enable_profiling", "--metrics.enable_tensorboard"]),
    _c("1d_compile", 4, ["--compile.enable"]),
    _c(
        "1d_compile_sac_op",
        4,
        [
            "--compile.enable",
            "--activation_checkpoint.mode selective",
            "--activation_checkpoint.selective_ac_option op",
        ],
    ),
    _c("2d_eager", 4, ["--parallelism.tensor_parallel_degree 2"]),
    _c("2d_compile", 4, ["--compile.enable", "--parallelism.tensor_parallel_degree 2"]),
    _c(
        "2d_asynctp_compile",
        4,
        ["--compile.enable", "--parallelism.tensor_parallel_degree 2", "--parallelism.enable_async_tensor_parallel"],
        cuda=ASYNC_TP,
    ),
    _c("full_checkpoint", 4, ["--checkpoint.enable"], ["--checkpoint.enable", "--training.steps 20"]),
    _c(
        "model_only_hf_checkpoint",
        4,
        [
            "--checkpoint.enable",
            "--checkpoint.folder hf_checkpoint",
            "--checkpoint.last_save_model_only",
            "--checkpoint.last_save_in_hf",
        ],
        [
            "--checkpoint.enable",
            f"--checkpoint.initial_load_path {DUMP}/hf_checkpoint/step-10/",
            "--checkpoint.initial_load_model_only",
            "--checkpoint.initial_load_in_hf",
        ],
    ),
    _c("last_save_model_only_fp32", 4, ["--checkpoint.enable", "--checkpoint.last_save_model_only"]),
    _c(
        "last_save_model_only_bf16",
        4,
        ["--checkpoint.enable", "--checkpoint.last_save_model_only", "--checkpoint.export_dtype bfloat16"],
    ),
    _c("pp_looped_zero_bubble", 4, [f"{PP} 4", f"{SCHED} InterleavedZeroBubble"]),
    _c("pp_zbv", 2, [f"{PP} 2", f"{SCHED} ZBVZeroBubble"]),
    _c("pp_1f1b", 2, [f"{PP} 2", f"{SCHED} 1F1B", "--parallelism.data_parallel_shard_degree 1"]),
    _c("pp_gpipe", 2, [f"{PP} 2", f"{SCHED} GPipe", "--parallelism.data_parallel_shard_degree 1"]),
    _c(
        "pp_dp_1f1b",
        4,
        [f"{PP} 2", f"{SCHED} 1F1B", "--parallelism.data_parallel_shard_degree 2"],
        [
            f"{PP} 2",
            f"{SCHED} 1F1B",
            "--parallelism.pipeline_parallel_layers_per_stage 4",
            "--parallelism.data_parallel_shard_degree 2",
        ],
    ),
    _c("pp_dp_gpipe", 4, [f"{PP} 2", f"{SCHED} GPipe", "--parallelism.data_parallel_shard_degree 2"]),
    _c("pp_tp", 4, [f"{PP} 2", "--parallelism.tensor_parallel_degree 2"]),
    _c(
        "pp_dp_tp",
        8,
        [
            "--checkpoint.enable",
            f"{PP} 2",
            "--parallelism.data_parallel_shard_degree 2",
            "--parallelism.tensor_parallel_degree 2",
        ],
        [
            "--training.steps 20",
            "--checkpoint.enable",
            f"{PP} 2",
            "--parallelism.data_parallel_shard_degree 2",
            "--parallelism.tensor_parallel_degree 2",
        ],
    ),
    _c(
        "3d_compile",
        8,
        [
            f"{PP} 2",
            "--parallelism.data_parallel_shard_degree 2",
            "--parallelism.tensor_parallel_degree 2",
            "--compile.enable",
        ],
    ),
    _c(
        "pp_looped_1f1b",
        4,
        [f"{PP} 4", f"{SCHED} Interleaved1F1B"],
        [f"{PP} 4", f"{SCHED} Interleaved1F1B", "--parallelism.pipeline_parallel_layers_per_stage 1"],
    ),
    _c(
        "pp_custom_csv",
        2,
        [
            f"{PP} 2",
            f"{SCHED} PipelineScheduleMulti",
            f"--parallelism.pipeline_parallel_schedule_csv {DUMP}/custom_schedule.csv",
        ],
    ),
    _c("optimizer_foreach", 2, ["--optimizer.name AdamW --optimizer.implementation foreach"]),
    _c("ddp", 4, ["--parallelism.data_parallel_shard_degree=1", "--parallelism.data_parallel_replicate_degree=4"]),
    _c("hsdp", 4, ["--parallelism.data_parallel_shard_degree=2", "--parallelism.data_parallel_replicate_degree=2"]),
    _c(
        "fsdp+flex_attn",
        4,
        [
            "--parallelism.data_parallel_shard_degree=4",
            "--activation_checkpoint.mode='full'",
            "--model.flavor=debugmodel_flex_attn",
        ],
        cuda=FLEX,
    ),
    _c(
        "fsdp+flex_attn+per_op_sac",
        4,
        [
            "--parallelism.data_parallel_shard_degree=4",
            "--activation_checkpoint.mode=selective",
            "--activation_checkpoint.selective_ac_option=op",
            "--model.flavor=debugmodel_flex_attn",
        ],
        cuda=FLEX,
    ),
    _c(
        "fsdp+varlen_attn+per_op_sac",
        4,
        [
            "--parallelism.data_parallel_shard_degree=4",
            "--activation_checkpoint.mode=selective",
            "--activation_checkpoint.selective_ac_option=op",
            "--model.flavor=debugmodel_varlen_attn",
        ],
    ),
    _c(
        "cp_allgather",
        4,
        ["--parallelism.context_parallel_degree=4", "--parallelism.context_parallel_rotate_method='allgather'"],
        cuda=CP,
    ),
    _c(
        "cp_alltoall",
        4,
        ["--parallelism.context_parallel_degree=4", "--parallelism.context_parallel_rotate_method='alltoall'"],
        cuda=CP,
    ),
    _c(
        "hsdp+tp",
        8,
        [
            "--parallelism.data_parallel_shard_degree=2",
            "--parallelism.data_parallel_replicate_degree=2",
            "--parallelism.tensor_parallel_degree=2",
        ],
    ),
    _c(
        "fsdp+cp", 4, ["--parallelism.data_parallel_shard_degree=2", "--parallelism.context_parallel_degree=2"], cuda=CP
    ),
    _c(
        "hsdp+cp_without_dp_shard",
        4,
        [
            "--parallelism.data_parallel_shard_degree=1",
            "--parallelism.data_parallel_replicate_degree=2",
            "--parallelism.context_parallel_degree=2",
        ],
        cuda=CP,
    ),
    _c(
        "hsdp+cp_with_dp_shard",
        8,
        [
            "--parallelism.data_parallel_shard_degree=2",
            "--parallelism.data_parallel_replicate_degree=2",
            "--parallelism.context_parallel_degree=2",
        ],
        cuda=CP,
    ),
    _c(
        "fsdp+tp+cp",
        8,
        [
            "--parallelism.data_parallel_shard_degree=2",
            "--parallelism.tensor_parallel_degree=2",
            "--parallelism.context_parallel_degree=2",
        ],
        cuda=CP,
    ),
    _c(
        "cpu_offload+opt_in_bwd+TP+DP+CP",
        8,
        [
            "--checkpoint.enable",
            "--parallelism.tensor_parallel_degree=2",
            "--parallelism.context_parallel_degree=2",
            "--training.enable_cpu_offload",
            "--optimizer.early_step_in_backward",
        ],
        [
            "--parallelism.tensor_parallel_degree=2",
            "--parallelism.context_parallel_degree=2",
            "--parallelism.data_parallel_replicate_degree=2",
            "--training.enable_cpu_offload",
            "--optimizer.early_step_in_backward",
        ],
        cuda=CP,
        # torchtitan steps in backward and never clips (its default max_norm 1.0 is silently ignored there);
        # titan says so instead of ignoring a key.
        refused="optimizer.early_step_in_backward steps each parameter before the whole gradient exists, so it"
        " cannot run with grad clipping (training.max_norm = 1.0; set it to 0)",
    ),
    # Disabled in torchtitan itself; titan's estimate is the dry run, so the key is refused with that pointer.
    _c(
        "fsdp2_memory_estimation",
        2,
        ["--memory_estimation.enable"],
        refused="torchtitan key 'memory_estimation.enable' is not supported by titan: use --job.dry_run (per-rank"
        " memory of any layout) or scripts/estimate_memory.py",
    ),
    _c("test_generate", 2, ["--checkpoint.enable"], []),
    _c("fsdp_reshard_always", 2, ["--parallelism.fsdp_reshard_after_forward always"]),
    _c(
        "optional_checkpoint",
        4,
        ["--checkpoint.enable", "--training.steps 10"],
        [
            "--checkpoint.enable",
            "--checkpoint.exclude_from_loading lr_scheduler,dataloader,optimizer",
            "--parallelism.tensor_parallel_degree 2",
            "--training.steps 20",
        ],
    ),
    _c(
        "float8_emulation",
        4,
        [
            "--model.converters quantize.linear.float8",
            "--quantize.linear.float8.enable_fsdp_float8_all_gather",
            "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
            "--quantize.linear.float8.emulate",
        ],
    ),
    _c("gradient_accumulation", 2, ["--training.local_batch_size 8", "--training.global_batch_size 32"]),
    _c(
        "validation_tp_cp_pp",
        8,
        [
            "--validation.enable",
            "--validation.dataset c4_test",
            "--parallelism.tensor_parallel_degree=2",
            "--parallelism.context_parallel_degree=2",
            "--parallelism.pipeline_parallel_degree=2",
            "--parallelism.pipeline_parallel_schedule Interleaved1F1B",
        ],
        cuda=CP,
    ),
    _c(
        "dataloader_kwargs",
        2,
        [
            "--training.dataloader.num_workers",
            "2",
            "--training.dataloader.pin_memory",
            "--training.dataloader.persistent_workers",
            "--training.dataloader.prefetch_factor",
            "4",
        ],
    ),
]
BY_NAME = {case.name: case for case in CASES}
REAL = {n: sorted(c.name for c in CASES if c.ngpu == n and not c.cuda and not c.refused) for n in (2, 4)}
# Cases whose training path another case trains with more on top: dry-run only here (compiling on
# four CPU ranks costs about a minute a case).
TRAINED_BY = {"1d_compile": "1d_compile_sac_op"}


def argv(flags: tuple[str, ...], dump: str) -> list[str]:
    """torchtitan's flag strings as its runner passes them through a shell, shrunk to this test's sizes."""
    words = shlex.split(" ".join(flags).replace(DUMP, dump).replace("step-10", "step-2"))
    for i, word in enumerate(words[:-1]):
        if word == "--training.steps":
            words[i + 1] = STEPS[words[i + 1]]
    return words


def _write_schedule(dump: Path) -> None:
    """A PipelineScheduleMulti schedule for 2 ranks x 2 stages (rank r holds stages r and r + 2) and the
    4 micro-batches of local_batch_size 4: all forwards, then input/weight gradients in pairs (the
    shape of torchtitan's test schedule, sized to this test)."""
    lines = []
    for r in range(2):
        first, second = r, r + 2
        row = [f"{first}F{m}" for m in range(4)] + [f"{second}F{m}" for m in range(4)]
        for pair in ((0, 1), (2, 3)):
            row += [f"{second}{a}{m}" for m in pair for a in "IW"]
            row += [f"{first}{a}{m}" for m in pair for a in "IW"]
        lines.append(",".join(row))
    dump.mkdir(parents=True, exist_ok=True)
    (dump / "custom_schedule.csv").write_text("\n".join(lines) + "\n")


def _train_case(rank: int, world: int, dump: str, name: str, kernels: str) -> list[float]:
    """On each rank of the case's own process group: every run of the case in order, in its dump folder."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    from titan.training.checks import load_job
    from titan.training.trainer import Trainer

    # Every rank compiles its own graphs, cold: compiled graphs are not cached (TP + compile ranks sharing
    # them once failed on CPU with "Could not resolve the process group registered under the name 4" in the
    # compiled loss-parallel graph). The C++ kernels those graphs lower to are shared by every rank and
    # case: inductor files them by a hash of their source and build flags, one build each under a file
    # lock, where four ranks each ran g++ on the same sources. Compiling in the rank itself spares each
    # rank inductor's pool of compile-worker interpreters (2 cores: no parallel build to gain).
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = kernels
    inductor_config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False
    inductor_config.compile_threads = 1
    losses: list[float] = []
    for flags in BY_NAME[name].runs:
        if flags:  # an empty run is a step that is not training (test_generate's generation)
            losses += list(Trainer(load_job([*BASE, "--job.dump_folder", dump, *argv(flags, dump)])).train().values())
    return losses


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The inductor cache of the module's compiled C++ kernels (empty at its start)."""
    return str(tmp_path_factory.mktemp("inductor"))


def _train(tmp_path: Path, name: str, kernels: str) -> tuple[Path, list[float]]:
    """One case on its own process group: a rank that fails ends the case at once (its peers are
    stopped), and no case can leave a process group out of step for another."""
    case = BY_NAME[name]
    dump = tmp_path / name
    if name == "pp_custom_csv":
        _write_schedule(dump)
    return dump, run_distributed(_train_case, case.ngpu, str(dump), name, kernels, timeout=900)[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in REAL[2] + REAL[4] if n != "test_generate" and n not in TRAINED_BY])
def test_trains_on_cpu_ranks(tmp_path: Path, name: str, kernels: str) -> None:
    _, losses = _train(tmp_path, name, kernels)
    assert losses and all(math.isfinite(loss) for loss in losses), losses


@pytest.mark.slow
def test_generation_from_the_checkpoint(tmp_path: Path, kernels: str) -> None:
    dump, losses = _train(tmp_path, "test_generate", kernels)
    assert losses and all(math.isfinite(loss) for loss in losses), losses
    step = dump / "checkpoint" / "step-2"
    out = subprocess.run(
        [
            sys.executable,
            "scripts/generate.py",
            "--checkpoint",
            str(step),
            "--flavor",
            "debugmodel",
            "--prompt",
            "What is the meaning of life?",
            "--max_new_tokens",
            "8",
        ],
        cwd=REPO,
        env=cpu_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_dry_run_at_full_rank_count(case: Case, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from titan.launch.entry import main

    dump = tmp_path / case.name
    if case.name == "pp_custom_csv":
        _write_schedule(dump)
    for flags in case.runs:
        if not flags:
            continue
        # The dry run plans a GPU job: bf16 parameters, torchtitan's default (titan's debug config is fp32 for CPUs).
        status = main(
            [
                *BASE,
                "--training.mixed_precision_param",
                "bfloat16",
                "--job.dump_folder",
                str(dump),
                *argv(flags, str(dump)),
                "--job.dry_run",
                "--job.dry_run_world_size",
                str(case.ngpu),
            ]
        )
        err = capsys.readouterr().err.strip().splitlines()
        if case.refused:
            assert status == 2 and err[-1] == f"titan: error: {case.refused}"
        else:
            assert status == 0, err[-1:] if err else status


@pytest.mark.slow
def test_a_case_through_run_train_sh(tmp_path: Path) -> None:
    """As a torchtitan user starts it: run_train.sh, torchrun, 2 ranks."""
    case = BY_NAME["dataloader_kwargs"]
    env = cpu_env(NGPU="2", CONFIG_FILE=str(REPO / "train_configs/debug_model.toml"))
    args = [a for a in BASE if a != "--job.config_file" and not a.endswith("debug_model.toml")]
    out = subprocess.run(
        ["./run_train.sh", *args, "--job.dump_folder", str(tmp_path), *argv(case.runs[0], "")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "training done" in out.stdout + out.stderr
