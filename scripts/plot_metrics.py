"""Plot loss / grad norm / lr (and validation loss, when present) of a run to a PNG.

    python scripts/plot_metrics.py outputs/metrics/20250101-120000.jsonl -o curves.png
    python scripts/plot_metrics.py outputs/tb/20250101-120000 -o curves.png     # TensorBoard dir
    python scripts/plot_metrics.py a.jsonl b.jsonl -o compare.png               # overlay runs

Needs matplotlib (pip install 'titan[plot]'); TensorBoard input needs the tensorboard package.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

# (panel title, metric keys tried in order: JSONL / TensorBoard tags)
PANELS = [
    ("loss", ["loss_metrics/global_avg_loss"]),
    ("grad norm", ["grad_norm"]),
    ("lr", ["lr"]),
    ("validation loss", ["validation/loss"]),
]


def read_jsonl(path: Path) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                # The last line of a run that is still writing (or was killed) may be partial.
                print(f"warning: {path}:{n} is not valid JSON; skipped", file=sys.stderr)
                continue
            step = row.pop("step")
            for key, value in row.items():
                series.setdefault(key, []).append((int(step), float(value)))
    return series


def read_tensorboard(path: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_run(path: Path) -> dict[str, list[tuple[int, float]]]:
    if path.is_dir() or path.name.startswith("events.out.tfevents"):
        return read_tensorboard(path)
    return read_jsonl(path)


def plot(runs: dict[str, dict[str, list[tuple[int, float]]]], out: Path) -> list[str]:
    """Write the PNG; returns the panel titles drawn."""
    try:
        import matplotlib
    except ImportError:
        sys.exit("plot_metrics.py needs matplotlib: pip install 'titan[plot]' (or pip install matplotlib)")
    matplotlib.use("Agg")  # files only: works without a display
    import matplotlib.pyplot as plt

    panels = [(title, keys) for title, keys in PANELS if any(k in s for s in runs.values() for k in keys)]
    if not panels:
        sys.exit("no loss / grad_norm / lr / validation metrics found in the input")
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels)), sharex=True, squeeze=False)
    for ax, (title, keys) in zip(axes[:, 0], panels):
        for label, series in runs.items():
            key = next((k for k in keys if k in series), None)
            if key is None:
                continue
            points = [(s, v) for s, v in sorted(series[key]) if math.isfinite(v)]
            ax.plot([s for s, _ in points], [v for _, v in points], label=label, marker="." if len(points) < 50 else None)
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
        if title == "grad norm":
            ax.set_yscale("log")  # spikes are orders of magnitude; keep the baseline readable
    axes[-1, 0].set_xlabel("step")
    if len(runs) > 1:
        axes[0, 0].legend(fontsize="small")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return [title for title, _ in panels]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="+", type=Path, help="JSONL metrics files or TensorBoard log dirs")
    parser.add_argument("-o", "--output", type=Path, default=Path("metrics.png"), help="PNG to write")
    args = parser.parse_args(argv)
    runs = {}
    for path in args.inputs:
        if not path.exists():
            sys.exit(f"{path} does not exist")
        runs[str(path)] = read_run(path)
    drawn = plot(runs, args.output)
    print(f"wrote {args.output} ({', '.join(drawn)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
