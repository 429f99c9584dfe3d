"""Cost-growth tables: one rank's memory by category and its collective bytes per step as the job
doubles from 64 to 4,096 ranks at a fixed global batch, simulated by scripts/simulate.py.

    python scripts/scale_tables.py run llama3_405b --optimizer AdamW            # every rank count
    python scripts/scale_tables.py run deepseek_v3_671b --ranks 64,128 --optimizer Muon
    python scripts/scale_tables.py table                # markdown tables of everything run so far
    python scripts/scale_tables.py chart -o docs/images/scale_growth.png

``run`` starts one simulator process per rank count (rank 0, the default depth cut) and appends its
JSON line to the results file (default outputs/scale_tables.jsonl; a case already there is not run
again). The global batch stays fixed, so the local batch halves as the data-parallel ranks double.
``table`` and ``chart`` read that file. Each simulation takes about a minute on a CPU core.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests/fixtures/torchtitan"
RANKS = [64, 128, 256, 512, 1024, 2048, 4096]
CATEGORIES = ["parameters", "gradients", "optimizer_state", "optimizer_aux", "activations", "communication", "loss"]
GIB = 1024**3

# name -> (description, config file, overrides, ranks per data-parallel replica, global batch in sequences)
CASES: dict[str, tuple[str, Path, list[str], int, int]] = {
    "llama3_405b": (
        "Llama 3 405B, torchtitan v0.2.2's file: TP 8 x FSDP, float8, full AC, seq 8192",
        FIXTURES / "llama3_405b.toml",
        [],
        8,
        512,
    ),
    "deepseek_v3_671b": (
        "DeepSeek-V3 671B, torchtitan v0.2.2's file: FSDP, EP 1, per-op AC, seq 4096",
        FIXTURES / "deepseek_v3_671b.toml",
        [],
        1,
        4096,
    ),
    "deepseek_v3_671b_ep64_pp4": (
        "DeepSeek-V3 671B, the same file with EP 64 and PP 4 (Interleaved1F1B)",
        FIXTURES / "deepseek_v3_671b.toml",
        ["--parallelism.expert_parallel_degree", "64", "--parallelism.pipeline_parallel_degree", "4"],
        4,
        4096,
    ),
    "qwen3_235b": (
        "Qwen3 235B-A22B: FSDP x EP 8, full AC, seq 4096",
        FIXTURES / "deepseek_v3_671b.toml",
        ["--model.name", "qwen3", "--model.flavor", "235B-A22B", "--parallelism.expert_parallel_degree", "8"],
        1,
        4096,
    ),
    "gpt_oss_120b": (
        "gpt-oss 120b: FSDP x EP 8, full AC, seq 4096",
        FIXTURES / "deepseek_v3_671b.toml",
        ["--model.name", "gpt_oss", "--model.flavor", "120b", "--parallelism.expert_parallel_degree", "8"],
        1,
        4096,
    ),
}
# the MoE cases not from a torchtitan file take the 671B file's settings with full AC
_FULL_AC = ["--activation_checkpoint.mode", "full"]


def _local_batch(case: str, ranks: int) -> int:
    _, _, _, model_parallel, global_batch = CASES[case]
    return max(1, global_batch // (ranks // model_parallel))


def _args(case: str, ranks: int, optimizer: str) -> list[str]:
    _, path, overrides, model_parallel, _ = CASES[case]
    dp = ranks // model_parallel
    local = _local_batch(case, ranks)
    extra = _FULL_AC if case in ("qwen3_235b", "gpt_oss_120b") else []
    return [
        *("--world_size", str(ranks), "--job.config_file", str(path)),
        *overrides,
        *extra,
        *("--optimizer.name", optimizer, "--training.local_batch_size", str(local)),
        *("--training.global_batch_size", str(local * dp), "--simulate.device_memory_gib", "1000000"),
    ]


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(case: str, ranks: list[int], optimizer: str, out: Path, timeout: float) -> int:
    done = {(r["case"], r["optimizer"], r["world_size"]) for r in _read(out)}
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    for n in ranks:
        if (case, optimizer, n) in done:
            continue
        cmd = [sys.executable, str(ROOT / "scripts/simulate.py"), *_args(case, n, optimizer)]
        print("scale_tables:", " ".join(cmd[1:]), flush=True)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            print(f"scale_tables: {case} {optimizer} N={n}: over {timeout:.0f} s, skipped", flush=True)
            continue
        lines = proc.stdout.strip().splitlines()
        if not lines or not lines[-1].startswith("{"):
            reason = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            print(f"scale_tables: {case} {optimizer} N={n} failed: {reason}", flush=True)
            continue
        row = {"case": case, "optimizer": optimizer, "local_batch": _local_batch(case, n)}
        row.update(json.loads(lines[-1]))
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"scale_tables: {case} {optimizer} N={n}: {row['simulated_peak_bytes']['total'] / GIB:.1f} GiB")
    return 0


def _sent(row: dict) -> float:
    return sum(c["bytes"] for c in row["collectives"].values()) / GIB


def _series(rows: list[dict], case: str, optimizer: str) -> list[dict]:
    return sorted((r for r in rows if r["case"] == case and r["optimizer"] == optimizer), key=lambda r: r["world_size"])


def table(rows: list[dict]) -> str:
    parts = []
    for case in CASES:
        for optimizer in ("AdamW", "Muon"):
            mine = sorted(
                (r for r in rows if r["case"] == case and r["optimizer"] == optimizer), key=lambda r: r["world_size"]
            )
            if not mine:
                continue
            depth = mine[0]["layers_run"]
            cut = (
                f"; extrapolated from runs of {' and '.join(map(str, depth))} blocks" if mine[0]["extrapolated"] else ""
            )
            parts.append(f"{CASES[case][0]}; {optimizer}, global batch {CASES[case][4]} sequences{cut}:\n")
            head = ["ranks", "local batch", *CATEGORIES, "total", "estimate", "sent GiB"]
            parts.append("| " + " | ".join(head) + " |\n|" + "---|" * len(head) + "\n")
            for r in mine:
                sim, est = r["simulated_peak_bytes"], r["estimate_bytes"].get("total")
                cells = [str(r["world_size"]), str(r["local_batch"]), *(f"{sim[k] / GIB:.1f}" for k in CATEGORIES)]
                cells += [
                    f"**{sim['total'] / GIB:.1f}**",
                    "n/a" if est is None else f"{est / GIB:.1f}",
                    f"{_sent(r):.1f}",
                ]
                parts.append("| " + " | ".join(cells) + " |\n")
            parts.append("\n")
    return "".join(parts)


def chart(rows: list[dict], path: Path) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, net) = plt.subplots(1, 2, figsize=(10, 4))
    for case in CASES:
        for optimizer, style in (("AdamW", "-o"), ("Muon", "--s")):
            mine = sorted(
                (r for r in rows if r["case"] == case and r["optimizer"] == optimizer), key=lambda r: r["world_size"]
            )
            if not mine:
                continue
            n = [r["world_size"] for r in mine]
            label = f"{case} {optimizer}"
            mem.plot(n, [r["simulated_peak_bytes"]["total"] / GIB for r in mine], style, label=label, markersize=4)
            net.plot(n, [_sent(r) for r in mine], style, label=label, markersize=4)
    for ax, title in ((mem, "peak memory of one rank, GiB"), (net, "bytes one rank sends per step, GiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks (fixed global batch)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    mem.axhline(80, color="grey", linewidth=0.8)
    mem.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    print(f"scale_tables: wrote {path}")
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["run", "table", "chart"])
    p.add_argument("case", nargs="?", choices=sorted(CASES))
    p.add_argument("--ranks", default=",".join(map(str, RANKS)), help="comma-separated rank counts")
    p.add_argument("--optimizer", default="AdamW", choices=["AdamW", "Muon"])
    p.add_argument("--results", type=Path, default=ROOT / "outputs/scale_tables.jsonl")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per simulation")
    p.add_argument("-o", "--output", type=Path, default=ROOT / "docs/images/scale_growth.png")
    a = p.parse_args(argv)
    if a.action == "run":
        if a.case is None:
            p.error("run needs a case: " + ", ".join(CASES))
        ranks = [int(x) for x in a.ranks.split(",")]
        return run(a.case, ranks, a.optimizer, a.results, a.timeout)
    rows = _read(a.results)
    if a.action == "table":
        print(table(rows), end="")
        return 0
    return chart(rows, a.output)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
