"""Where the documents of a packed window begin and end, for block-causal (document-masked) attention.

The loader packs tokenized documents back to back, each as BOS ... EOS (titan/data/packing.py), and
cuts the stream into windows regardless of document boundaries. A document ends at its EOS token,
which it still sees; the next position starts the next document (the same boundary torchtitan's
document mask uses). The ids are built once per batch from the input tokens by the trainer and
handed to the model's forward, which turns them into its attention masks before its blocks run.
"""

from __future__ import annotations

import torch

__all__ = ["document_ids"]


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[B, S] int32: for each position, how many EOS tokens come strictly before it in its row
    (the index of its document within the window)."""
    ends = (tokens == eos_id).to(torch.int32)
    return torch.cumsum(ends, dim=1, dtype=torch.int32) - ends
