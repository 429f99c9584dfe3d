"""Simulate one rank of an N-rank training job on this CPU: its memory by category, the collectives
and device-to-host reads of one step, next to the analytic estimate.

    python scripts/simulate.py --world_size 512 --job.config_file train_configs/llama3_405b.toml
    python scripts/simulate.py --world_size 256 --job.config_file F --simulate.rank 255 --optimizer.name Muon

One process plays rank ``simulate.rank`` (default 0) of ``--world_size`` ranks through titan's own
build functions and training step, with a fake process group and fake tensors (docs/performance.md,
"At scale"). Any config override works. The last line is one JSON object. Exit status 0; 1 when
the rank's peak is above ``simulate.device_memory_gib`` (one line says which category is largest);
2 with titan's one line on a bad config or layout. ``COMM_MODE=fake_backend NGPU=N ./run_train.sh``
runs the same.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

from titan.launch.check import print_help, split_world_size, wants_help  # noqa: E402
from titan.launch.report import debug_requested, exit_status  # noqa: E402


def main(argv: list[str]) -> int:
    if wants_help(argv):
        return print_help(argv)

    def run() -> int:
        from titan.config import load_config
        from titan.errors import TitanError

        args, world_size = split_world_size(argv)
        if world_size is None:
            raise TitanError("scripts/simulate.py needs --world_size N, the ranks of the job to simulate")
        config = load_config(args)  # a bad flag or TOML value: before torch is imported

        from titan.tools.simulate.run import main as simulate

        return simulate(config, world_size)

    return exit_status(run, debug=lambda: debug_requested(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
