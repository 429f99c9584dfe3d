"""Data: tokenizers, datasets, packing and the stateful loader."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .build import build_dataloader, check_data
from .datasets import DATASETS, DocumentSource, build_source, register_dataset
from .loader import TitanDataLoader
from .mixture import MixtureLoader

if TYPE_CHECKING:
    from .tokenizer import Tokenizer, build_tokenizer

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
    "register_dataset",
]


def __getattr__(name: str):
    # lazy: the tokenizer module (tiktoken, sentencepiece, tokenizers) loads only when asked for
    if name in ("build_tokenizer", "Tokenizer"):
        from . import tokenizer

        return getattr(tokenizer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
