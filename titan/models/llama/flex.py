"""flex_attention for the Llama model: the causal BlockMask, a per-model mask cache, and the kernel.

The mask is built at the model level (Transformer.forward), once per sequence length, outside the
compiled and checkpointed blocks: building it inside a block puts create_block_mask's torch-function
mode and any cache write into the traced region, which dynamo rejects under activation checkpointing
("HOP: Unsafe side effect"). Nothing here is module-global: each model owns its cache and kernel.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

if TYPE_CHECKING:  # a TypedDict only: older torch releases in the supported range may lack it
    from torch.nn.attention.flex_attention import FlexKernelOptions

__all__ = ["BlockMaskCache", "FlexKernel", "causal_block_mask", "causal_mask_mod"]

MaskBuilder = Callable[[int, torch.device], BlockMask]


def causal_mask_mod(b, h, q_idx, kv_idx):  # signature fixed by flex_attention
    return q_idx >= kv_idx


def causal_block_mask(seq_len: int, device: torch.device | str) -> BlockMask:
    """The causal BlockMask for ``seq_len`` queries and keys, shared by every batch row and head."""
    return create_block_mask(causal_mask_mod, None, None, seq_len, seq_len, device=device)


class BlockMaskCache:
    """The BlockMask for each (attention length, device) one model has used.

    ``builds`` counts the masks made (tests check one per new length, none per layer). The cache is
    small and drops the oldest length: generation feeds a new length every step.
    """

    def __init__(self, build: MaskBuilder = causal_block_mask, max_entries: int = 4) -> None:
        self._build = build
        self._masks: OrderedDict[tuple[int, str], BlockMask] = OrderedDict()
        self.max_entries = max_entries
        self.builds = 0

    def set_builder(self, build: MaskBuilder) -> None:
        """Use another mask (context parallel rewrites it for the local query rows)."""
        self._build = build
        self._masks.clear()

    def get(self, seq_len: int, device: torch.device) -> BlockMask:
        key = (seq_len, str(device))
        mask = self._masks.get(key)
        if mask is None:
            mask = self._build(seq_len, torch.device(device))
            self.builds += 1
            self._masks[key] = mask
            while len(self._masks) > self.max_entries:
                self._masks.popitem(last=False)
        else:
            self._masks.move_to_end(key)
        return mask


class FlexKernel:
    """flex_attention with grouped-query heads, shared by all layers of one model.

    Eager flex_attention is a reference implementation that materialises the full score matrix
    (slow, and O(S^2) memory); torch.compile turns it into the fused Triton kernel. Outside a
    compiled block the kernel is compiled here, once per model object; inside one (compiled
    TransformerBlocks) the block's graph already lowers it. On CPU it stays eager: flex has no
    CPU backward (training is refused at start-up), and the forward is only used for evaluation
    and tests there, where compiling would cost tens of seconds per shape.
    """

    def __init__(self) -> None:
        self._compiled: Callable | None = None

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask, return_aux: Any = None
    ) -> Any:
        """The attention output, or (output, AuxOutput) with ``return_aux`` (an AuxRequest)."""
        # Deterministic mode: the Triton backend's backward has no atomics; the FLASH backend's
        # deterministic backward needs SM100 and extra mask metadata.
        deterministic = torch.are_deterministic_algorithms_enabled()
        options: FlexKernelOptions | None = {"BACKEND": "TRITON"} if deterministic else None
        gqa = q.shape[1] != k.shape[1]
        if q.device.type == "cpu":
            # Inductor's CPU flex template reads the 4-D size off the underlying buffer and fails
            # on transposed views (torch 2.13); a dense copy avoids that and is cheap on CPU.
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if q.device.type == "cpu" or torch.compiler.is_compiling():
            kernel = flex_attention
        else:
            if self._compiled is None:
                self._compiled = torch.compile(flex_attention, dynamic=False)
            kernel = self._compiled
        return kernel(q, k, v, block_mask=block_mask, enable_gqa=gqa, kernel_options=options, return_aux=return_aux)
