"""Entry point: `torchrun --nproc_per_node N train.py --job.config_file train_configs/debug_model.toml`."""

from __future__ import annotations

import os
import sys

from titan.errors import TitanError


def _report(error: TitanError, after_init: bool) -> None:
    rank = os.environ.get("RANK", "0")
    # Before the process group exists every rank hits the same error: rank 0 reports it.
    # Later errors can be rank-specific, so a failing rank reports with its id.
    if rank == "0":
        print(f"titan: error: {error}", file=sys.stderr)
    elif after_init:
        print(f"titan: error on rank {rank}: {error}", file=sys.stderr)


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        from titan.config import format_help

        print(format_help())
        return 0
    debug = bool(os.environ.get("TITAN_DEBUG"))
    try:
        from titan.config import load_config

        config = load_config(argv)  # bad flags fail here, before torch is even imported
    except TitanError as e:
        if debug:
            raise
        _report(e, after_init=False)
        return 2

    if config.job.dry_run:
        from titan.dry_run import main as dry_run_main

        try:
            return dry_run_main(config)
        except TitanError as e:
            if debug:
                raise
            _report(e, after_init=False)
            return 2

    import torch.distributed as dist

    from titan.parallel.utils import destroy_distributed
    from titan.trainer import Trainer

    try:
        Trainer(config).train()
    except TitanError as e:
        if debug:
            raise
        _report(e, after_init=dist.is_initialized())
        return 2
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
