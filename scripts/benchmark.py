"""Benchmark training throughput of a config across named configs (eager, compile, float8, AC, flex).

    python scripts/benchmark.py                                   # debug model; CPU or the GPUs present
    python scripts/benchmark.py --preset llama3_8b_8layers        # the benchmark model on one GPU
    python scripts/benchmark.py --preset llama3_8b_8layers --only eager,compile,float8-tensorwise
    python scripts/benchmark.py --preset moe_debug_cpu            # MoE: dense vs EP 1 vs EP 2 on 2 CPU ranks
    python scripts/benchmark.py --preset llama4_17bx16e_4layers   # MoE on the GPUs present: EP 1 vs EP = GPUs
    python scripts/benchmark.py --preset gpt_oss_debug_cpu        # gpt-oss: EP 1 vs EP 2 on 2 CPU ranks
    python scripts/benchmark.py --preset gpt_oss_20b_4layers      # gpt-oss 20b, 4 layers: EP 1 vs EP = GPUs
    python scripts/benchmark.py --preset deepseek_v3_debug_cpu    # DeepSeek-V3 debug: EP 1 vs EP 2, 2 CPU ranks
    python scripts/benchmark.py --preset deepseek_v3_16b_4layers  # DeepSeek-V3 16B, 4 layers: EP 1 vs EP = GPUs
    python scripts/benchmark.py --preset llama4_debug             # Llama 4's debug shape, bf16: EP 1 vs EP = GPUs
    python scripts/benchmark.py --preset families_bf16            # every registered family, bf16, 20 steps
    python scripts/benchmark.py --preset qwen3_5_gdn              # Gated DeltaNet: fla kernels vs the torch path
    python scripts/benchmark.py --steps 20 --warmup 5 --nproc 8 --job.config_file train_configs/llama3_8b.toml \\
        --variant "eager=" --variant "compile+fp8=--compile.enable --float8.enable_float8_linear"

Each config runs in a fresh process (torchrun when --nproc > 1) with the shared overrides plus its
own, through the trainer's own loop (Trainer.train) with a metrics line every step: ``warmup``
steps are left out (compilation, allocator warm-up), the next ``steps`` are reported. Columns are
medians over those steps of what the trainer logs: step time, tokens/s per device, TFLOP/s per
device, MFU against the device's dense bf16 peak (float8 rows too, so rows compare; see
titan/training/flops.py), and the peak memory (CUDA max reserved, the trainer's memory column; peak
resident memory on CPU) and the last loss.

``--memory``: the loss/memory table of docs/performance.md: full logits against the chunked loss
(training.loss_chunk_tokens) at Llama 3's vocabulary (128,256 rows), seq 8,192, a small width
(dim 64, 2 layers; on CUDA the 8B shape cut to 8 layers), local batch 1 and 2, then every
activation_checkpoint.mode the config offers with the chunked loss at batch 1; each row in a fresh
process, so its peak resident memory (CPU) or CUDA max reserved is its own.

Default config set: with CUDA, GPU_CONFIGS (eager, compile, float8 tensorwise / rowwise, AC
none / selective / full, flex) on all GPUs present; on CPU the debug-model set STANDARD.
``--configs gpu|cpu`` picks the set whatever the device (e.g. the GPU rows rehearsed on CPU). Float8
on a device without float8 tensor cores (CPU, pre-SM89 GPU) runs emulated and says so.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

FLOAT8 = "--float8.enable_float8_linear"
STANDARD = [
    ("eager", ""),
    ("compile", "--compile.enable"),
    ("AC full", "--activation_checkpoint.mode full"),
    ("AC selective op", "--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op"),
    ("AC every 2nd block", "--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option 2"),
    ("float8", FLOAT8),
]
_EAGER = "--compile.enable false"
_COMPILE = "--compile.enable true --compile.components model,loss"
# The rows of the GPU comparison table (and AC full, flex). AC comes from the base config unless named.
GPU_CONFIGS = [
    ("eager", _EAGER),
    ("compile", _COMPILE),
    ("float8-tensorwise", f"{_COMPILE} {FLOAT8} --float8.recipe tensorwise"),
    # torchao has no float8 all-gather for rowwise scales: FSDP gathers bf16 weights there.
    (
        "float8-rowwise",
        f"{_COMPILE} {FLOAT8} --float8.recipe rowwise --float8.enable_fsdp_float8_all_gather false "
        "--float8.precompute_float8_dynamic_scale_for_fsdp false",
    ),
    ("ac-none", f"{_EAGER} --activation_checkpoint.mode none"),
    ("ac-selective", f"{_EAGER} --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op"),
    ("ac-full", f"{_EAGER} --activation_checkpoint.mode full"),
    ("flex", f"{_COMPILE} --model.attn_type flex"),
]
# The GPU measurement: the Llama 3 8B shape cut to 8 layers, seq 8192, local batch 1, bf16,
# fused AdamW lr 3e-4 warmup 5, max_norm 1, AC selective op; 30 steps, medians over steps 11-30.
# Data and tokenizer are the offline ones shipped with titan (the torchtitan comparison used tinyshakespeare and a
# 2,020-token tokenizer; the shipped one has 2,048, so FLOPs/token are within 0.1%).
PRESETS = {
    "llama3_8b_8layers": {
        "warmup": 10,
        "steps": 20,
        "args": [
            "--job.config_file",
            str(REPO / "train_configs/llama3_8b.toml"),
            "--model.n_layers",
            "8",
            "--model.tokenizer_path",
            "",
            "--training.dataset",
            "pydoc",
            "--training.seq_len",
            "8192",
            "--training.local_batch_size",
            "1",
            "--training.mixed_precision_param",
            "bfloat16",
            "--optimizer.implementation",
            "fused",
            "--optimizer.lr",
            "3e-4",
            "--lr_scheduler.warmup_steps",
            "5",
            "--training.max_norm",
            "1",
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "op",
        ],
    },
}


_MOE_CPU = "--training.seq_len 128 --training.local_batch_size 4"
_LLAMA4_DEBUG = "--model.name llama4 --model.flavor debugmodel"
# MoE rows. On CPU (2 ranks): the debug MoE (8 experts, top 1 + a shared expert, every 2nd block)
# at EP 1 (FSDP 2) and EP 2, next to llama3's debug model, whose FFNs have the width of one MoE
# layer's active experts (the same active parameters, but the router's 2k and the embedding).
# On GPUs: Llama 4 Scout's shape (17bx16e: 16 experts in every block) cut to 4 layers, seq 8192,
# bf16, per-op selective AC (torchtitan's), EP over all GPUs present against EP 1 (run with 8
# GPUs: 16 experts, EP 8).
PRESETS["moe_debug_cpu"] = {
    "warmup": 3,
    "steps": 10,
    "nproc": 2,
    "variants": [
        ("dense llama3 debugmodel", f"--model.name llama3 --model.flavor debugmodel {_MOE_CPU}"),
        ("llama4 debugmodel EP 1", f"{_LLAMA4_DEBUG} {_MOE_CPU}"),
        ("llama4 debugmodel EP 2", f"{_LLAMA4_DEBUG} {_MOE_CPU} --parallelism.expert_parallel_degree 2"),
    ],
}
PRESETS["llama4_17bx16e_4layers"] = {
    "warmup": 5,
    "steps": 10,
    "args": [
        *PRESETS["llama3_8b_8layers"]["args"][2:],  # the llama3 preset's data, precision, optimizer and AC
        "--model.name",
        "llama4",
        "--model.flavor",
        "17bx16e",
        "--model.n_layers",
        "4",
    ],
    "variants": [
        ("EP 1", ""),
        ("EP = GPUs", "--parallelism.expert_parallel_degree {nproc}"),
    ],
}
# gpt-oss rows. On CPU (2 ranks): the debug model (8 experts of width 2880, top 4, eager sink
# attention) at EP 1 (FSDP 2) and EP 2. On GPUs: 20b's shape cut to 4 layers (2 sliding-window),
# seq 8192, bf16, flex sink attention, EP over all GPUs present against EP 1 (8 GPUs: 32 experts, EP 8).
_GPT_OSS_DEBUG = "--model.name gpt_oss --model.flavor debugmodel"
PRESETS["gpt_oss_debug_cpu"] = {
    "warmup": 2,
    "steps": 5,
    "nproc": 2,
    "variants": [
        ("gpt_oss debugmodel EP 1", f"{_GPT_OSS_DEBUG} {_MOE_CPU}"),
        ("gpt_oss debugmodel EP 2", f"{_GPT_OSS_DEBUG} {_MOE_CPU} --parallelism.expert_parallel_degree 2"),
    ],
}
PRESETS["gpt_oss_20b_4layers"] = {
    "warmup": 5,
    "steps": 10,
    "args": [
        *PRESETS["llama3_8b_8layers"]["args"][2:],  # the llama3 preset's data, precision, optimizer and AC
        "--model.name",
        "gpt_oss",
        "--model.flavor",
        "20b",
        "--model.n_layers",
        "4",
        "--model.attn_type",
        "flex",
    ],
    "variants": [
        ("EP 1", ""),
        ("EP = GPUs", "--parallelism.expert_parallel_degree {nproc}"),
    ],
}
# DeepSeek-V3: the debug model (latent attention, 8 experts top 3 + 2 shared, softmax) at EP 1 and
# EP 2 on 2 CPU ranks; on GPUs the 16B shape (64 experts, top 6) cut to 4 layers with the llama3
# preset's data, precision, optimizer and per-op selective AC (torchtitan's 16B file's).
_DEEPSEEK_DEBUG = "--model.name deepseek_v3 --model.flavor debugmodel"
PRESETS["deepseek_v3_debug_cpu"] = {
    "warmup": 3,
    "steps": 10,
    "nproc": 2,
    "variants": [
        ("deepseek_v3 debugmodel EP 1", f"{_DEEPSEEK_DEBUG} {_MOE_CPU}"),
        ("deepseek_v3 debugmodel EP 2", f"{_DEEPSEEK_DEBUG} {_MOE_CPU} --parallelism.expert_parallel_degree 2"),
    ],
}
PRESETS["deepseek_v3_16b_4layers"] = {
    "warmup": 5,
    "steps": 10,
    "args": [
        *PRESETS["llama3_8b_8layers"]["args"][2:],  # the llama3 preset's data, precision, optimizer and AC
        *("--model.name", "deepseek_v3", "--model.flavor", "16B", "--model.n_layers", "4"),
    ],
    "variants": [
        ("EP 1", ""),
        ("EP = GPUs", "--parallelism.expert_parallel_degree {nproc}"),
    ],
}

# The GPU check's MoE row (scripts/gpu_check.sh): Llama 4's debug shape in bf16, as users run it,
# at EP 1 and at EP = the GPUs present (the check runs "ep-gpus" only with more than one GPU).
PRESETS["llama4_debug"] = {
    "warmup": 5,
    "steps": 10,
    "args": [*_LLAMA4_DEBUG.split(), "--training.mixed_precision_param", "bfloat16"],
    "variants": [("ep1", ""), ("ep-gpus", "--parallelism.expert_parallel_degree {nproc}")],
}


# The GPU check's linear-attention rows: the Gated DeltaNet's fla kernels against its exact torch path
# on qwen3_5's debug model in bf16 at a length where the chunked recurrence matters (seq 2048): the
# same loss within bf16's tolerance, and the tokens/s of each.
PRESETS["qwen3_5_gdn"] = {
    "warmup": 5,
    "steps": 10,
    "args": ["--job.config_file", str(REPO / "train_configs/qwen3_5_debug.toml"), "--training.seq_len", "2048",
             "--training.local_batch_size", "4", "--training.mixed_precision_param", "bfloat16",
             "--metrics.enable_tensorboard", "false"],
    "variants": [("torch", "--model.linear_attn_backend torch"), ("fla", "--model.linear_attn_backend fla")],
}  # fmt: skip


def family_variants() -> list[tuple[str, str]]:
    """One row per model family registered in titan.models (a new family joins by registering):
    its debugmodel flavor (else its first), named by the family."""
    from titan.models import get_model_spec, model_names

    rows = []
    for name in model_names():
        flavors = list(get_model_spec(name).flavors)
        flavor = "debugmodel" if "debugmodel" in flavors else flavors[0]
        rows.append((name, f"--model.name {name} --model.flavor {flavor}"))
    return rows


# Every family's smoke run in bf16 parameters (the default users run): 20 steps, the last loss and
# the peak memory per row.
PRESETS["families_bf16"] = {
    "warmup": 10,
    "steps": 10,
    "args": ["--training.mixed_precision_param", "bfloat16"],
    "variants": family_variants,
}

MEMORY_CHUNK = 1024
MEMORY_ARGS = {
    "cpu": ["--job.config_file", str(REPO / "train_configs/debug_model.toml"), "--model.dim", "64", "--model.n_layers",
            "2", "--model.n_heads", "4", "--model.n_kv_heads", "2", "--training.mixed_precision_param", "float32"],
    "cuda": [*PRESETS["llama3_8b_8layers"]["args"], "--activation_checkpoint.mode", "none"],
}  # fmt: skip
MEMORY_SHAPE = ["--model.vocab_size", "128256", "--training.seq_len", "8192", "--lr_scheduler.warmup_steps", "1"]


def memory_configs() -> list[list[str]]:
    """Full logits vs chunked loss at batch 1 and 2, then each AC mode (the config's choices)."""
    from titan.config.choices import ACMode, choices

    rows = []
    for batch in (1, 2):
        for name, chunk in (("full logits", 0), (f"chunked {MEMORY_CHUNK}", MEMORY_CHUNK)):
            rows.append(
                [f"{name}, batch {batch}", f"--training.local_batch_size {batch} --training.loss_chunk_tokens {chunk}"]
            )
    for mode in choices(ACMode):
        extra = "--compile.enable true --activation_checkpoint.memory_budget 0.5" if mode == "memory_budget" else ""
        rows.append(
            [
                f"AC {mode}, chunked, batch 1",
                f"--training.local_batch_size 1 --training.loss_chunk_tokens {MEMORY_CHUNK}"
                f" --activation_checkpoint.mode {mode} --activation_checkpoint.selective_ac_option op {extra}".strip(),
            ]
        )
    return rows


def _float8_needs_emulation() -> bool:
    import torch

    return not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9)


def run_single(argv: list[str], warmup: int, steps: int, out_path: str) -> None:
    """Inside one config's process: train warmup + steps steps, summarize the logged rows (rank 0)."""
    import torch

    from titan.training.checks import load_job
    from titan.training.flops import get_peak_flops
    from titan.training.trainer import Trainer

    config = load_job(argv)
    config.job.dump_folder = os.path.dirname(out_path)
    config.training.steps = warmup + steps
    config.metrics.log_freq = 1
    config.metrics.enable_jsonl = True
    config.metrics.enable_tensorboard = config.metrics.enable_wandb = False
    config.checkpoint.enable = False
    trainer = Trainer(config)
    trainer.train()
    if trainer.rank != 0:
        return
    rows = [
        json.loads(line)
        for f in Path(config.job.dump_folder, config.metrics.save_jsonl_folder).glob("*.jsonl")
        for line in f.read_text().splitlines()
    ]
    timed = [r for r in rows if "grad_norm" in r and r["step"] > warmup]
    if len(timed) < steps:
        raise SystemExit(f"benchmark: {len(timed)} of {steps} timed steps ran (the dataset ran out?)")
    cuda = trainer.device.type == "cuda"
    name = torch.cuda.get_device_name(trainer.device) if cuda else "cpu"
    peak = get_peak_flops(name) if cuda else None  # dense bf16 peak for every row
    tflops = statistics.median(r["tflops"] for r in timed)
    step_times = [r["time_metrics/end_to_end(s)"] for r in timed]
    Path(out_path).write_text(
        json.dumps(
            {
                "step_s": statistics.median(step_times),
                "step_s_min": min(step_times),
                "step_s_max": max(step_times),
                "tokens_per_s": statistics.median(r["throughput(tps)"] for r in timed),
                "tflops": tflops,
                "mfu": 100 * tflops * 1e12 / peak if peak else None,
                # CPU: the process's peak resident memory over the whole run (the logged rss is the
                # current one at each log line, after the step's logits are freed).
                "peak_gib": max(r["memory/max_reserved(GiB)"] for r in timed) if cuda else _peak_rss_gib(),
                "loss": timed[-1]["loss_metrics/global_avg_loss"],
                "device": name,
                "torch": torch.__version__,
            }
        )
    )


def _peak_rss_gib() -> float:
    import resource

    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return (maxrss if sys.platform == "darwin" else maxrss * 1024) / 2**30


def run_variant(base: list[str], extra: str, warmup: int, steps: int, nproc: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        script = [str(Path(__file__).resolve()), "--_single", out, "--warmup", str(warmup), "--steps", str(steps)]
        launcher = [sys.executable]
        if nproc > 1:
            launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
        cmd = launcher + script + base + shlex.split(extra)
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(out):
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
            return {"error": f"exit {proc.returncode}: {tail}"}
        return json.loads(Path(out).read_text())


def _pop(argv: list[str], flag: str, default: str | None, repeat: bool = False):
    values = []
    while flag in argv:
        i = argv.index(flag)
        values.append(argv[i + 1])
        del argv[i : i + 2]
    if repeat:
        return values
    return values[-1] if values else default


def default_configs(cuda: bool) -> list[list[str]]:
    configs = [list(c) for c in (GPU_CONFIGS if cuda else STANDARD)]
    if _float8_needs_emulation():
        configs = [[f"{n} (emulated)", f"{e} --float8.emulate"] if FLOAT8 in e else [n, e] for n, e in configs]
    return configs


def _preset_variants(preset: dict) -> list[tuple[str, str]]:
    variants = preset.get("variants", [])
    return variants() if callable(variants) else variants  # a function: rows that follow the registry


def _usage_error(message: str) -> None:
    print(f"benchmark: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str]) -> None:
    argv = list(argv)
    if {"-h", "--help"} & set(argv):  # not a config key: every row would fail on it
        print(__doc__)
        return
    single = _pop(argv, "--_single", None)
    preset_name = _pop(argv, "--preset", None)
    preset = PRESETS.get(preset_name or "", {})
    if preset_name is not None and not preset:
        _usage_error(f"--preset got {preset_name!r}; valid: {', '.join(PRESETS)}")
    memory = "--memory" in argv
    if memory:
        argv.remove("--memory")
    warmup = int(_pop(argv, "--warmup", str(preset.get("warmup", 1 if memory else 3))))
    steps = int(_pop(argv, "--steps", str(preset.get("steps", 2 if memory else 10))))
    if single is not None:
        run_single(argv, warmup, steps, single)
        return
    import torch

    cuda = torch.cuda.is_available()
    nproc = int(_pop(argv, "--nproc", str(preset.get("nproc", torch.cuda.device_count() if cuda else 1))))
    only = _pop(argv, "--only", None)
    config_set = _pop(argv, "--configs", None)
    if config_set not in (None, "gpu", "cpu"):
        _usage_error(f"--configs got {config_set!r}; valid: gpu, cpu")
    gpu_set = cuda if config_set is None else config_set == "gpu"
    variants = [v.split("=", 1) for v in _pop(argv, "--variant", None, repeat=True)] or [
        [n, e.format(nproc=nproc)] for n, e in _preset_variants(preset)
    ]
    variants = variants or (memory_configs() if memory else default_configs(gpu_set))
    if only is not None:
        wanted = only.split(",")
        names = [n.split(" (")[0] for n, _ in variants]
        unknown = [w for w in wanted if w not in names]
        if unknown:
            _usage_error(f"--only got {unknown[0]!r}; valid: {', '.join(names)}")
        variants = [v for v, n in zip(variants, names) if n in wanted]
    argv = list(preset.get("args", [])) + argv
    if memory:
        argv = MEMORY_ARGS["cuda" if cuda else "cpu"] + MEMORY_SHAPE + argv
    if not any(a in ("--job.config_file", "--config_file") or a.startswith("--job.config_file=") for a in argv):
        argv = ["--job.config_file", str(REPO / "train_configs/debug_model.toml")] + argv

    from tabulate import tabulate

    rows, base_tps, device, torch_version = [], None, "?", torch.__version__
    for name, extra in variants:
        print(f"running {name} ({extra or 'no overrides'}) ...", file=sys.stderr, flush=True)
        r = run_variant(argv, extra, warmup, steps, nproc)
        print(f"{name}: {json.dumps(r)}", file=sys.stderr, flush=True)  # each row as it lands (long runs)
        if "error" in r:
            rows.append([name, "failed"] + [""] * 7)
            print(f"{name} failed: {r['error']}", file=sys.stderr)
            continue
        device, torch_version = r["device"], r["torch"]
        base_tps = base_tps or r["tokens_per_s"]
        rows.append(
            [
                name,
                f"{1000 * r['step_s']:.1f}",
                f"{1000 * r['step_s_min']:.0f}-{1000 * r['step_s_max']:.0f}",
                f"{r['tokens_per_s']:,.0f}",
                f"{r['tokens_per_s'] / base_tps:.2f}x",
                f"{r['tflops']:,.2f}",
                f"{r['mfu']:.1f}%" if r["mfu"] is not None else "n/a",
                f"{r['peak_gib']:,.2f}",
                f"{r['loss']:.4f}",
            ]
        )
    memory = "CUDA max reserved" if device != "cpu" else "the process's peak resident memory, imports and data included"
    print(
        f"device: {device} x {nproc}; torch {torch_version}; {warmup} warm-up + {steps} timed steps (medians);"
        f" MFU vs the dense bf16 peak; peak mem: {memory}; overrides: {shlex.join(argv)}"
    )
    headers = [
        "config",
        "median step (ms)",
        "min-max (ms)",
        "tokens/s/device",
        "vs first",
        "TFLOP/s/device",
        "MFU",
        "peak mem (GiB)",
        "last loss",
    ]
    print(tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True))


if __name__ == "__main__":
    main(sys.argv[1:])
