"""Convert a DCP checkpoint folder to a single torch.save file, and back.

    python scripts/dcp_to_torch.py to-torch outputs/checkpoint/step-1000 step-1000.pt
    python scripts/dcp_to_torch.py to-dcp step-1000.pt converted/step-1000

Runs in one process, no GPU, no process group: DCP reassembles the sharded tensors of every rank
into full tensors (the whole checkpoint must fit in host memory). The torch file holds the same
nested dict titan saved ("model", "optimizer", "lr_scheduler", ... or, for a model-only
checkpoint, the weights at the top level). A folder made by to-dcp has no titan COMPLETE marker:
start a run from it with `--checkpoint.initial_load_path converted/step-1000` rather than putting
it in a run's checkpoint folder.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from titan.checkpointing.model_dcp import read_all_state  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("direction", choices=("to-torch", "to-dcp"))
    parser.add_argument("src", help="DCP folder (to-torch) or torch.save file (to-dcp)")
    parser.add_argument("dst", help="torch.save file (to-torch) or new DCP folder (to-dcp)")
    args = parser.parse_args(argv)
    if args.direction == "to-torch":
        if not os.path.isfile(os.path.join(args.src, ".metadata")):
            print(f"error: {args.src} is not a DCP checkpoint folder (no .metadata)", file=sys.stderr)
            return 2
        torch.save(read_all_state(args.src), args.dst)
    else:
        if not os.path.isfile(args.src):
            print(f"error: {args.src} is not a file", file=sys.stderr)
            return 2
        torch_save_to_dcp(args.src, args.dst)
    print(f"wrote {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
