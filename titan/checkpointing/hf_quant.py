"""Quantized Hugging Face releases: which quantization a folder's config.json declares, and the
arithmetic that turns its stored tensors back into full-precision weights on load.

- ``fp8`` (DeepSeek-V3, Kimi K2, Qwen3-FP8): float8_e4m3fn weights beside a float32
  ``weight_scale_inv`` per ``weight_block_size`` block (128 x 128 in the releases). A weight is
  ``float32(q) * scale_inv[i // block_rows, j // block_cols]``, computed in float32 and cast to the
  run's dtype, as transformers' Fp8Dequantize does. The last row / column block of a weight whose
  size is no multiple of the block is a partial one (DeepSeek's own reference: its 576-row
  ``kv_a_proj_with_mqa``); transformers derives the block size from the scale grid instead and is
  only right where the size divides. ``ue8m0`` scales stored as bytes are powers of two, 2^(b - 127).
- ``mxfp4`` (gpt-oss's experts): ``*_blocks`` [..., rows, groups, 16] bytes, two e2m1 values per byte
  (low nibble first), and ``*_scales`` [..., rows, groups], one power of two per group of 32:
  ``value = e2m1 * 2^(scale - 127)``; the dequantized [..., rows, groups * 32] is transposed to
  the in-memory [..., groups * 32, rows], as transformers' convert_moe_packed_tensors does.
Every value above is exact in float32 and casts to the run's dtype as transformers casts it.
Any other ``quant_method`` is refused in one line naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from titan.errors import TitanError

FP8_SCALE = ".weight_scale_inv"
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
# e2m1: sign bit, two exponent bits, one mantissa bit; index = the nibble.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_SUPPORTED = ("fp8 (block-wise weight_scale_inv)", "mxfp4 (gpt-oss experts)")


@dataclass(frozen=True)
class Quantization:
    """What config.json's quantization_config says about the stored tensors."""

    method: str  # "fp8" or "mxfp4"
    block: tuple[int, int] | None = None  # fp8's weight_block_size; None: one scale per tensor


def quantization_of(config: dict[str, Any], where: str = "config.json") -> Quantization | None:
    """The folder's quantization (None: plain weights); an unknown one is refused in one line."""
    q = config.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method == "fp8":
        fmt = q.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise TitanError(f"{where} quantization_config fmt {fmt!r} is not supported; valid: 'e4m3'")
        block = q.get("weight_block_size")
        if block is not None and (len(block) != 2 or any(not isinstance(b, int) or b <= 0 for b in block)):
            raise TitanError(f"{where} quantization_config weight_block_size {block!r} must be two positive integers")
        return Quantization("fp8", (block[0], block[1]) if block is not None else None)
    if method == "mxfp4":
        return Quantization("mxfp4")
    raise TitanError(
        f"{where} quantization_config quant_method {method!r} is not supported; titan dequantizes on load:"
        f" {', '.join(_SUPPORTED)}"
    )


def _scales_fp32(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == torch.uint8:  # ue8m0 exponents stored as bytes
        return (scale.to(torch.float32) - 127.0).exp2()
    return scale.to(torch.float32)


def dequantize_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] | None, row_offset: int = 0
) -> torch.Tensor:
    """float32 weight from FP8 ``weight`` [..., rows, cols] and its scales: one per ``block`` of the
    last two dims, or one for the tensor (``block`` None). ``weight`` may be rows ``row_offset ..``
    of the stored 2-D tensor (a rank's shard): ``scale_inv`` then holds the scale rows from
    ``row_offset // block_rows`` on."""
    w = weight.to(torch.float32)
    s = _scales_fp32(scale_inv)
    if block is None:
        return w.mul_(s.reshape(()))
    br, bc = block
    rows, cols = w.shape[-2:]
    first = row_offset % br  # rows of the first scale row that lie before this slice
    s = s.repeat_interleave(br, dim=-2)[..., first : first + rows, :]
    full, rem = divmod(cols, bc)
    # Column blocks through a view of the weight: the scales are expanded over rows only.
    w[..., : full * bc].unflatten(-1, (full, bc)).mul_(s[..., :full, None])
    if rem:
        w[..., full * bc :].mul_(s[..., full : full + 1])
    return w


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [..., groups * 32, rows] from MXFP4 ``blocks`` [..., rows, groups, 16] and ``scales``
    [..., rows, groups] (the stored layout; the result is the transposed in-memory one)."""
    if blocks.shape[:-1] != scales.shape:
        raise TitanError(f"MXFP4 blocks {tuple(blocks.shape)} do not match their scales {tuple(scales.shape)}")
    lut = torch.tensor(_E2M1, dtype=torch.float32)
    b = blocks.to(torch.uint8)
    out = torch.empty(*b.shape[:-1], b.shape[-1] * 2, dtype=torch.float32)
    out[..., 0::2] = lut[(b & 0x0F).long()]
    out[..., 1::2] = lut[(b >> 4).long()]
    out = torch.ldexp(out, (scales.to(torch.int32) - 127).unsqueeze(-1).to(torch.float32))
    return out.flatten(-2).transpose(-2, -1)


__all__ = ["Quantization", "dequantize_fp8", "dequantize_mxfp4", "quantization_of"]
