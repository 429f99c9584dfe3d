"""Block-causal (document-masked) attention for the Llama model: the masks (the varlen kernel is in kernels.py).

With ``attn_mask_type = "block_causal"`` a token attends to the earlier tokens of its own document
only, never to the previous document of the packed window. ``Transformer.forward`` gets the
batch's document ids (titan/models/documents.py) and builds the mask once per forward, before its
blocks, for the attention type:

- sdpa: a boolean [B, 1, S, S] block-diagonal causal mask (materialised: S^2 bytes per sequence;
  use flex or varlen for long windows);
- flex: a BlockMask from a document mask_mod (fully masked blocks are skipped);
- varlen: on CUDA the cumulative document lengths over the flattened batch for torch's flash
  varlen kernel (``torch.nn.attention.varlen.varlen_attn``); torch has no CPU varlen kernel, so on
  CPU the same per-document attention runs as SDPA with the boolean mask above.

Nothing here is module-global: the model owns its ``DocumentMasks`` (and its compiled mask
builder).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

__all__ = ["DocumentMasks", "VarlenMask", "block_causal_dense"]


@dataclass(frozen=True)
class VarlenMask:
    """Document boundaries over the flattened [B * S] tokens: cu_seqlens [N + 1] int32 (every row
    starts a new document) and the longest document."""

    cu_seqlens: torch.Tensor
    max_len: int


def block_causal_dense(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S] bool: query i sees key j <= i of the same document."""
    s = doc_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=doc_ids.device).tril()
    return ((doc_ids[:, :, None] == doc_ids[:, None, :]) & causal)[:, None]


def varlen_mask(doc_ids: torch.Tensor) -> VarlenMask:
    b, s = doc_ids.shape
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = starts.flatten().nonzero().flatten().to(torch.int32)
    cu = torch.cat([first, torch.tensor([b * s], dtype=torch.int32, device=doc_ids.device)])
    # The kernel takes the longest document as a host int: one read per forward, not per layer.
    return VarlenMask(cu, int((cu[1:] - cu[:-1]).max()))


class DocumentMasks:
    """Builds the block-causal mask of one batch for the model's attention type (see the module
    docstring). ``builds`` counts the masks made (once per forward, never per layer)."""

    def __init__(self, attn_type: str) -> None:
        self.attn_type = attn_type
        self.builds = 0
        self._create_block_mask: Callable | None = None

    def _block_mask(self, doc_ids: torch.Tensor) -> BlockMask:
        def same_document_causal(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

        create = create_block_mask
        if doc_ids.device.type == "cuda":
            # Eager create_block_mask materialises the whole [B, S, S] mask; compiled it works block by block.
            if self._create_block_mask is None:
                self._create_block_mask = torch.compile(create_block_mask)
            create = self._create_block_mask
        b, s = doc_ids.shape
        return create(same_document_causal, b, None, s, s, device=doc_ids.device)

    def build(self, doc_ids: torch.Tensor) -> BlockMask | VarlenMask | torch.Tensor:
        self.builds += 1
        if self.attn_type == "flex":
            return self._block_mask(doc_ids)
        if self.attn_type == "varlen" and doc_ids.device.type == "cuda":
            return varlen_mask(doc_ids)
        return block_causal_dense(doc_ids)
