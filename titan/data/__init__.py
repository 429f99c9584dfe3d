"""Data: tokenizers, datasets, packing and the stateful loader."""

from __future__ import annotations

from .build import build_dataloader, check_data
from .datasets import DATASETS, DocumentSource, build_source
from .loader import TitanDataLoader
from .mixture import MixtureLoader

__all__ = [
    "DATASETS",
    "DocumentSource",
    "MixtureLoader",
    "TitanDataLoader",
    "Tokenizer",
    "build_dataloader",
    "build_source",
    "check_data",
    "build_tokenizer",
]


def __getattr__(name: str):
    # lazy: the tokenizer module (tiktoken, sentencepiece, tokenizers) loads only when asked for
    if name in ("build_tokenizer", "Tokenizer"):
        from . import tokenizer

        return getattr(tokenizer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
