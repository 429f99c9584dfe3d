"""Tokenize a dataset once into a token store that training reads without tokenizing.

    python scripts/tokenize_dataset.py --dataset c4 --dataset_path /data/c4 \
        --tokenizer_path assets/tokenizer/original/tokenizer.model --out /data/c4_tokens [--workers N]

    python scripts/tokenize_dataset.py --dataset HuggingFaceFW/fineweb-edu --dataset_config sample-10BT \
        --out /data/fineweb_tokens

--dataset / --dataset_path / --dataset_config / --dataset_split / --tokenizer_path /
--dataset_text_field / --dataset_txt_split mean what training.dataset, training.dataset_path,
training.dataset_config, ..., model.tokenizer_path mean in the config (same defaults: the embedded
pydoc corpus and the shipped tokenizer). A hub dataset id is streamed, never downloaded whole.
Interrupt it at any time: a re-run with the same arguments keeps the finished shards (checked
against their checksums). Train from the store with --training.dataset_path OUT
(docs/datasets.md). The last line is JSON:

    {"text_bytes": ..., "documents": ..., "tokens": ..., "seconds": ...}
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from titan.config.sections.model import Model  # noqa: E402
from titan.config.sections.training import Training  # noqa: E402
from titan.data.tokenize import tokenize_to_store  # noqa: E402
from titan.errors import TitanError  # noqa: E402
from titan.log import init_logger  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    t, m = Training(), Model()
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument(
        "--dataset", default=t.dataset, help="registry name, hub dataset id or local path (training.dataset)"
    )
    p.add_argument("--dataset_path", default=t.dataset_path, help="local copy to read (training.dataset_path)")
    p.add_argument("--dataset_config", default=t.dataset_config, help="hub config (training.dataset_config)")
    p.add_argument("--dataset_split", default=t.dataset_split, help="hub split (training.dataset_split)")
    p.add_argument("--dataset_text_field", default=t.dataset_text_field)
    p.add_argument("--dataset_txt_split", default=t.dataset_txt_split, choices=["paragraph", "line", "document"])
    p.add_argument("--dataset_bad_lines", default=t.dataset_bad_lines, choices=["fail", "skip"])
    p.add_argument("--tokenizer_path", default=m.tokenizer_path, help="model.tokenizer_path; empty: the shipped one")
    p.add_argument("--out", required=True, help="folder of the token store (created; re-run to finish it)")
    p.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="tokenizer processes (default: all cores; 0: this process)",
    )
    p.add_argument("--shard_mb", type=float, default=64.0, help="text per shard, in MB (characters)")
    args = p.parse_args(argv)
    init_logger()
    try:
        result = tokenize_to_store(
            dataset=args.dataset,
            dataset_path=args.dataset_path,
            tokenizer_path=args.tokenizer_path,
            out=args.out,
            workers=args.workers,
            text_field=args.dataset_text_field,
            txt_split=args.dataset_txt_split,
            bad_lines=args.dataset_bad_lines,
            shard_mb=args.shard_mb,
            dataset_config=args.dataset_config,
            dataset_split=args.dataset_split,
        )
    except TitanError as e:
        print(f"titan: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "tokenize_dataset: interrupted; finished shards are kept, re-run the same command to go on", file=sys.stderr
        )
        return 130
    print(json.dumps({k: result[k] for k in ("text_bytes", "documents", "tokens", "seconds")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
