"""Plot loss / grad norm / lr (and validation loss, when present) of a run to a PNG.

    python scripts/plot_metrics.py outputs/metrics/20250101-120000.jsonl -o curves.png
    python scripts/plot_metrics.py outputs/tb/20250101-120000 -o curves.png     # one TensorBoard run
    python scripts/plot_metrics.py outputs/tb -o runs.png                       # every run under it
    python scripts/plot_metrics.py outputs/metrics -o runs.png                  # every JSONL run in it
    python scripts/plot_metrics.py a.jsonl b.jsonl -o compare.png               # overlay runs

A folder is searched recursively: each folder holding TensorBoard event files is one run (titan
writes one per run stamp under <dump_folder>/tb), and so is each *.jsonl file.

Needs matplotlib (pip install 'titan[plot]'); TensorBoard input needs the tensorboard package.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import NoReturn

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
    """The scalars of one run: a folder of event files, or one event file."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        _fail(f"{path} is TensorBoard output; reading it needs the tensorboard package (pip install tensorboard)")
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _is_event_file(path: Path) -> bool:
    return path.name.startswith("events.out.tfevents")


def read_runs(path: Path) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """Runs found at `path`, by label: a JSONL file, an event file, or a folder searched
    recursively (each folder with event files is one run, each *.jsonl file another)."""
    if not path.is_dir():
        return {str(path): read_tensorboard(path) if _is_event_file(path) else read_jsonl(path)}
    runs = {}
    for folder in sorted({f.parent for f in path.rglob("events.out.tfevents*") if f.is_file()}):
        runs[str(folder)] = read_tensorboard(folder)
    for f in sorted(path.rglob("*.jsonl")):
        runs[str(f)] = read_jsonl(f)
    if not runs:
        _fail(f"{path} holds no TensorBoard event files (events.out.tfevents.*) and no *.jsonl metrics")
    return runs


def _fail(message: str) -> NoReturn:
    print(f"titan: error: {message}", file=sys.stderr)
    sys.exit(2)


def plot(runs: dict[str, dict[str, list[tuple[int, float]]]], out: Path) -> list[str]:
    """Write the PNG; returns the panel titles drawn."""
    try:
        import matplotlib
    except ImportError:
        _fail("plot_metrics.py needs matplotlib: pip install 'titan[plot]' (or pip install matplotlib)")
    matplotlib.use("Agg")  # files only: works without a display
    import matplotlib.pyplot as plt

    panels = [(title, keys) for title, keys in PANELS if any(k in s for s in runs.values() for k in keys)]
    if not panels:
        _fail(f"no loss / grad_norm / lr / validation metrics in {', '.join(runs)}")
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels)), sharex=True, squeeze=False)
    for ax, (title, keys) in zip(axes[:, 0], panels):
        for label, series in runs.items():
            key = next((k for k in keys if k in series), None)
            if key is None:
                continue
            points = [(s, v) for s, v in sorted(series[key]) if math.isfinite(v)]
            marker = "." if len(points) < 50 else None
            ax.plot([s for s, _ in points], [v for _, v in points], label=label, marker=marker)
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
            _fail(f"{path} does not exist (give JSONL metrics files or TensorBoard folders)")
        runs.update(read_runs(path))
    drawn = plot(runs, args.output)
    print(f"wrote {args.output} ({', '.join(drawn)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
