"""Build titan's shipped default tokenizer (titan/data/assets/tokenizer.model).

A byte-level BPE is trained with Hugging Face `tokenizers` on the text every Python installation
carries (`pydoc_data.topics`, the stdlib's documentation), with Llama 3's split regex, and the
learned merges are written as a tiktoken ranks file -- the format of Meta's Llama 3
`tokenizer.model`. The debug model therefore exercises exactly the code path of the real Llama 3
tokenizer (tiktoken + Llama 3 regex + 256 special tokens after the ranks), offline.

    python scripts/build_tokenizer.py                 # rewrite the shipped asset
    python scripts/build_tokenizer.py --output /tmp/t.model --num_ranks 1000

The output is deterministic for a given Python version (the corpus is that version's docs).
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from titan.data.tokenizer import (  # noqa: E402
    DEFAULT_TOKENIZER_PATH,
    LLAMA3_PAT_STR,
    NUM_LLAMA3_SPECIAL_TOKENS,
)

# 1792 ranks + 256 Llama 3 special tokens = 2048 ids: exactly the debug model's embedding size.
DEFAULT_NUM_RANKS = 2048 - NUM_LLAMA3_SPECIAL_TOKENS
# The HF trainer can learn two merges with the same result ("a"+"bc", "ab"+"c"); tiktoken ranks
# need distinct byte strings, so train a few extra merges and keep the first distinct ones.
_EXTRA_MERGES = 64


def corpus() -> Iterator[str]:
    from pydoc_data.topics import topics

    for key in sorted(topics):
        yield topics[key]


def bytes_to_unicode() -> dict[int, str]:
    """The byte <-> printable character table byte-level BPE uses (GPT-2's scheme): printable
    Latin-1 bytes map to themselves, the others to code points from 256 upwards."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def train_merges(num_ranks: int) -> list[tuple[str, str]]:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PAT_STR), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=num_ranks + _EXTRA_MERGES,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    merges = json.loads(tok.to_str())["model"]["merges"]
    # tokenizers writes merges as [a, b] pairs (new) or "a b" strings (old).
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in merges]


def merges_to_ranks(merges: list[tuple[str, str]], num_ranks: int) -> dict[bytes, int]:
    """Single bytes get ranks 0..255 (by byte value); each new merge result the next rank.
    Truncating the merge list is still a valid BPE: later merges never affect earlier ones."""
    decode = {ch: b for b, ch in bytes_to_unicode().items()}
    ranks = {bytes([b]): b for b in range(256)}
    for a, b in merges:
        if len(ranks) == num_ranks:
            break
        token = bytes(decode[c] for c in a + b)
        ranks.setdefault(token, len(ranks))
    if len(ranks) != num_ranks:
        raise SystemExit(f"corpus too small: only {len(ranks)} ranks learned, {num_ranks} asked")
    return ranks


def write_ranks(ranks: dict[bytes, int], path: Path) -> None:
    ordered = sorted(ranks.items(), key=lambda kv: kv[1])
    lines = [f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ordered]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines), encoding="ascii")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_TOKENIZER_PATH)
    parser.add_argument(
        "--num_ranks", type=int, default=DEFAULT_NUM_RANKS,
        help="BPE ranks incl. the 256 single bytes; vocab_size = this + 256 special tokens",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.num_ranks <= 256:
        parser.error("--num_ranks must be > 256 (the single bytes)")

    ranks = merges_to_ranks(train_merges(args.num_ranks), args.num_ranks)
    write_ranks(ranks, args.output)

    from titan.data.tokenizer import TikTokenizer

    tok = TikTokenizer(args.output)
    docs = list(corpus())
    n_tokens = sum(len(tok.encode(d, bos=True, eos=True)) for d in docs)
    assert all(tok.decode(tok.encode(d, bos=False, eos=False)) == d for d in docs)
    print(
        f"wrote {args.output} ({args.output.stat().st_size:,} bytes): vocab_size={tok.vocab_size} "
        f"bos_id={tok.bos_id} eos_id={tok.eos_id}; corpus {sum(map(len, docs)):,} chars -> "
        f"{n_tokens:,} tokens (with BOS/EOS per topic)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
