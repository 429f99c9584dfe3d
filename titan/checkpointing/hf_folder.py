"""A Hugging Face folder read as transformers holds the model in memory, whatever its layout on disk.

Releases store tensors in several layouts; family adapters see one, the in-memory one:
- Routed experts one key per expert (``mlp.experts.{e}.gate_proj.weight`` [hidden, dim], ``up_proj``,
  ``down_proj`` [dim, hidden]: DeepSeek-V3, Kimi K2, Qwen3-MoE, and what transformers' save_pretrained
  writes for them) are seen fused, as transformers fuses them on load: ``mlp.experts.gate_up_proj``
  [E, 2 * hidden, dim] (gate rows first) and ``mlp.experts.down_proj`` [E, dim, hidden].
- FP8 weights with block scales and gpt-oss's MXFP4 experts are seen dequantized (titan.checkpointing.hf_quant).
Reads are lazy and partial: ``read(key, rows)`` opens only the stored tensors (and scale rows)
behind rows ``rows`` of one view tensor, so a rank reads its shard, not the checkpoint. The folder
counts what it read (``tensors_read``, ``bytes_read``). ``split_experts`` is the fuse rule backwards,
for exports in the per-expert layout.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from titan.checkpointing.hf_quant import (
    FP8_SCALE,
    MXFP4_BLOCKS,
    MXFP4_SCALES,
    dequantize_fp8,
    dequantize_mxfp4,
    quantization_of,
)
from titan.errors import TitanError, read_user_json

INDEX_FILE = "model.safetensors.index.json"
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F8_E4M3": torch.float8_e4m3fn, "U8": torch.uint8, "I8": torch.int8, "I32": torch.int32,
           "I64": torch.int64, "BOOL": torch.bool}  # fmt: skip
_NAMES = {"torch_dtype", "dtype"}


def weight_files(hf_dir: Path) -> list[Path]:
    """The folder's safetensors files: those its index names, else model.safetensors."""
    index = hf_dir / INDEX_FILE
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [f for f in files if not (hf_dir / f).is_file()]
        if missing:
            raise TitanError(f"{hf_dir}: {INDEX_FILE} names {missing[0]}, which is missing")
        return [hf_dir / f for f in files]
    single = hf_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise TitanError(f"{hf_dir}: no model.safetensors or {INDEX_FILE} (only safetensors weights are supported)")


@dataclass(frozen=True)
class _Stored:
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class _View:
    """One tensor as transformers holds it: ``kind`` plain (``keys`` = (weight,) or (weight, scale)),
    mxfp4 (blocks, scales) or experts (per-expert weights in expert order; gate_up: gates then ups)."""

    kind: str
    keys: tuple[str, ...]
    shape: tuple[int, ...]
    quantized: bool


class HFFolder:
    """A Hugging Face model folder: config.json (``config``) and its weights, read lazily."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        f = self.path / "config.json"
        config = read_user_json(f, f"{path} is not a Hugging Face model folder: no config.json")
        if not isinstance(config, dict) or "model_type" not in config:
            raise TitanError(f"{f} has no 'model_type'; is this a transformers model folder?")
        self.config: dict[str, Any] = config
        self.quant = quantization_of(config, str(f))
        self.stored: dict[str, _Stored] = {}
        for file in weight_files(self.path):
            with safe_open(str(file), framework="pt") as fh:
                for k in fh.keys():
                    sl = fh.get_slice(k)
                    dtype = _DTYPES.get(sl.get_dtype())
                    if dtype is None:
                        raise TitanError(f"{file}: tensor {k} has dtype {sl.get_dtype()}, which titan does not read")
                    self.stored[k] = _Stored(file, tuple(sl.get_shape()), dtype)
        self.stored_bytes = sum(s.dtype.itemsize * _numel(s.shape) for s in self.stored.values())
        self.tensors_read = 0
        self.bytes_read = 0
        self._views = self._build_views()

    # ---------------------------------------------------------------- the view
    def keys(self) -> list[str]:
        return list(self._views)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._views[key].shape

    def dtype(self, key: str) -> torch.dtype:
        """The dtype a view tensor is saved in: a dequantized one takes the release's dtype."""
        view = self._views[key]
        if not view.quantized:
            return self.stored[view.keys[0]].dtype
        name = next((self.config[k] for k in _NAMES if isinstance(self.config.get(k), str)), "float32")
        return getattr(torch, name, torch.float32)

    def _build_views(self) -> dict[str, _View]:
        quant, stored = self.quant, self.stored
        views: dict[str, _View] = {}
        experts: dict[str, dict[str, dict[int, str]]] = {}
        for key, s in stored.items():
            if key.endswith(FP8_SCALE) or (quant and quant.method == "fp8" and key.endswith(".activation_scale")):
                continue  # read with their weight; activation scales only serve FP8 inference
            if quant is not None and quant.method == "mxfp4" and key.endswith((MXFP4_BLOCKS, MXFP4_SCALES)):
                if key.endswith(MXFP4_BLOCKS):
                    base = key.removesuffix(MXFP4_BLOCKS)
                    if base + MXFP4_SCALES not in stored:
                        raise TitanError(f"{self.path}: {key} has no {base + MXFP4_SCALES}")
                    *lead, rows, groups, width = s.shape
                    views[base] = _View("mxfp4", (key, base + MXFP4_SCALES), (*lead, groups * width * 2, rows), True)
                continue
            m = _PER_EXPERT.match(key)
            if m is not None:
                experts.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = key
                continue
            views[key] = self._plain(key)
        for prefix, projs in experts.items():
            views.update(self._fused(prefix, projs))
        return dict(sorted(views.items()))

    def _plain(self, key: str) -> _View:
        s = self.stored[key]
        scale = key.removesuffix(".weight") + FP8_SCALE if key.endswith(".weight") else None
        if scale is not None and scale in self.stored:
            if self.quant is None or self.quant.method != "fp8":
                raise TitanError(f"{self.path}: {scale} is an FP8 scale but config.json declares no fp8 quantization")
            return _View("plain", (key, scale), s.shape, True)
        if s.dtype == torch.float8_e4m3fn:
            raise TitanError(f"{self.path}: {key} is float8 without its {FP8_SCALE.lstrip('.')}")
        return _View("plain", (key,), s.shape, False)

    def _fused(self, prefix: str, projs: dict[str, dict[int, str]]) -> dict[str, _View]:
        n = max(max(ids) for ids in projs.values()) + 1
        for proj in ("gate_proj", "up_proj", "down_proj"):
            missing = sorted(set(range(n)) - set(projs.get(proj, {})))
            if missing:
                raise TitanError(f"{self.path}: {prefix}.{missing[0]}.{proj}.weight is missing ({n} experts found)")
        gates = tuple(projs["gate_proj"][e] for e in range(n))
        ups = tuple(projs["up_proj"][e] for e in range(n))
        downs = tuple(projs["down_proj"][e] for e in range(n))
        quantized = any(self._plain(k).quantized for k in gates + ups + downs)
        hidden, dim = self.stored[gates[0]].shape
        return {
            f"{prefix}.gate_up_proj": _View("experts", gates + ups, (n, 2 * hidden, dim), quantized),
            f"{prefix}.down_proj": _View("experts", downs, (n, *self.stored[downs[0]].shape), quantized),
        }

    # ---------------------------------------------------------------- reads
    def _slice(self, key: str, rows: tuple[int, int] | None) -> torch.Tensor:
        s = self.stored[key]
        with safe_open(str(s.file), framework="pt") as fh:
            if rows is None or not s.shape:
                t = fh.get_tensor(key)
            else:
                t = fh.get_slice(key)[rows[0] : rows[1]]
        self.tensors_read += 1
        self.bytes_read += t.numel() * t.element_size()
        return t

    def _fp8_block(self, key: str, scale: str) -> tuple[int, int] | None:
        """config.json's weight_block_size; without one, a single scale (None) or the block the
        scale grid implies, as transformers derives it (the weight must divide into it)."""
        assert self.quant is not None
        if self.quant.block is not None:
            return self.quant.block
        shape, grid = self.stored[key].shape, self.stored[scale].shape
        if _numel(grid) == 1:
            return None
        if len(grid) < 2 or shape[-2] % grid[-2] or shape[-1] % grid[-1]:
            raise TitanError(f"{self.path}: {key} {shape} does not divide into its scale grid {grid}")
        return (shape[-2] // grid[-2], shape[-1] // grid[-1])

    def _read_plain(self, keys: tuple[str, ...], rows: tuple[int, int] | None) -> torch.Tensor:
        weight = self._slice(keys[0], rows)
        if len(keys) == 1:
            return weight
        block = self._fp8_block(*keys)
        if rows is None or weight.dim() != 2 or block is None:  # whole, one scale, or [E, ...] by expert
            return dequantize_fp8(weight, self._slice(keys[1], rows if weight.dim() > 2 and block else None), block)
        scale = self._slice(keys[1], (rows[0] // block[0], -(-rows[1] // block[0])))
        return dequantize_fp8(weight, scale, block, rows[0])

    def read(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """View tensor ``key`` (rows ``rows`` of its first dim, default all): stored dtype when it
        is stored plain, float32 when dequantized (the caller casts)."""
        view = self._views[key]
        if view.kind == "plain":
            return self._read_plain(view.keys, rows)
        first, last = rows if rows is not None else (0, view.shape[0])
        if view.kind == "mxfp4":
            return dequantize_mxfp4(self._slice(view.keys[0], (first, last)), self._slice(view.keys[1], (first, last)))
        one = lambda k: self._read_plain(self._plain(k).keys, None)  # noqa: E731
        n = view.shape[0]
        if len(view.keys) == 2 * n:  # gate_up: each expert's gate rows, then its up rows
            parts = [torch.cat([one(view.keys[e]), one(view.keys[n + e])]) for e in range(first, last)]
        else:
            parts = [one(view.keys[e]) for e in range(first, last)]
        if not parts:
            return torch.empty((0, *view.shape[1:]))
        dtype = torch.float32 if view.quantized else parts[0].dtype
        return torch.stack([p.to(dtype) for p in parts])


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def split_experts(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused ``mlp.experts.gate_up_proj`` / ``down_proj`` -> one key per expert (the release layout
    of DeepSeek-V3, Kimi K2 and Qwen3-MoE); other keys unchanged. HFFolder's fusing, backwards."""
    out: dict[str, torch.Tensor] = {}
    for key, value in hf.items():
        m = _FUSED.match(key)
        if m is None:
            out[key] = value
        elif m[2] == "down_proj":
            out.update({f"{m[1]}.{e}.down_proj.weight": value[e].contiguous() for e in range(value.shape[0])})
        else:
            gate, up = value.chunk(2, dim=1)
            for e in range(value.shape[0]):
                out[f"{m[1]}.{e}.gate_proj.weight"] = gate[e].contiguous()
                out[f"{m[1]}.{e}.up_proj.weight"] = up[e].contiguous()
    return out


__all__ = ["INDEX_FILE", "HFFolder", "split_experts", "weight_files"]
