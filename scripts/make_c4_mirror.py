"""Write a synthetic corpus in allenai/c4's file layout (for the loader benchmark and trials).

    python scripts/make_c4_mirror.py --out /tmp/c4 [--shards 16] [--docs 10000] [--mean_words 100]
        [--validation_shards 0]

Writes OUT/en/c4-train.NNNNN-of-01024.json.gz (gzip'd JSON lines: text, timestamp, url), the
layout `training.dataset = "c4"` reads when `training.dataset_path = OUT`. For the real data see
docs/datasets.md ("Mirroring C4").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# the synthetic corpus is test data; this script runs from a checkout, where tests/ is beside titan/
from tests.helpers.c4_mirror import write_c4_mirror  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="mirror root (gets an en/ folder)")
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--docs", type=int, default=10_000, help="documents per shard")
    p.add_argument("--mean_words", type=int, default=100)
    p.add_argument("--validation_shards", type=int, default=0)
    args = p.parse_args(argv)
    if args.shards < 1 or args.docs < 1 or args.validation_shards > 8:
        print("make_c4_mirror: error: --shards and --docs must be >= 1, --validation_shards <= 8", file=sys.stderr)
        return 2
    from tqdm import tqdm

    with tqdm(total=args.shards + args.validation_shards, unit="shard", disable=not sys.stderr.isatty()) as bar:
        files = write_c4_mirror(
            args.out, args.shards, args.docs, mean_words=args.mean_words, on_shard=lambda _: bar.update()
        )
        if args.validation_shards:
            files += write_c4_mirror(
                args.out,
                args.validation_shards,
                args.docs,
                split="validation",
                mean_words=args.mean_words,
                on_shard=lambda _: bar.update(),
            )
    size = sum(f.stat().st_size for f in files)
    print(f"wrote {len(files)} shards, {size / 2**20:.1f} MiB, to {Path(args.out) / 'en'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
