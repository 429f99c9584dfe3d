"""Loading Hugging Face folders, streaming: into a built (sharded) model, into a full state dict,
or into a model-only DCP folder.

A plan maps each titan tensor to the one view tensor it comes from (titan.checkpointing.hf_folder:
the folder as transformers holds it in memory, per-expert keys fused and quantized weights
dequantized), found by running the family adapter's ``from_hf`` on meta tensors: the adapter
stays about names and layouts. Every titan tensor's first dim is its view tensor's (rows of a
matrix, experts of a stack; an adapter that permutes rows inside a block says so with
``hf_row_block``), so a rank reads the rows of its shard and nothing else; a layout whose local
part is no box of rows (strided shards) reads one whole tensor at a time. Converting to DCP writes
one tensor at a time (a planner that reads each tensor when DCP writes it).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from titan.checkpointing import model_dcp as dcp_io
from titan.checkpointing.hf_check import converted_layout, refuse_untied_copy
from titan.checkpointing.hf_folder import HFFolder
from titan.checkpointing.hf_quant import quantization_of
from titan.checkpointing.states import dcp_call
from titan.errors import TitanError, read_user_json
from titan.log import logger
from titan.models import spec_for_hf_model_type
from titan.models.mtp import mtp_depth as model_mtp_depth

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_CACHED = 4  # view tensors kept converted: a layer's w1, w2, w3 come from two of them


def read_hf_config(hf_dir: str | Path) -> Any:
    """The model args a Hugging Face folder's config.json describes (its family's args class); a
    quantization titan cannot dequantize is refused here, before anything is read."""
    f = Path(hf_dir) / "config.json"
    config = read_user_json(f, f"{hf_dir} is not a Hugging Face model folder: no config.json")
    if not isinstance(config, dict) or "model_type" not in config:
        raise TitanError(f"{f} has no 'model_type'; is this a transformers model folder?")
    quantization_of(config, str(f))
    return spec_for_hf_model_type(config["model_type"]).state_dict_adapter.hf_config_to_args(config)


class HFPlan:
    """Which view tensor of ``folder`` each titan tensor comes from, and its converted rows.
    ``mtp_depth``: the multi-token-prediction depths to import (the model's model.mtp_depth), at most
    what the folder holds; the adapter's ``skipped_hf_layer`` skips the others (and says so)."""

    def __init__(self, folder: HFFolder, mtp_depth: int = 0) -> None:
        self.folder = folder
        self.adapter = spec_for_hf_model_type(folder.config["model_type"]).state_dict_adapter
        self.args = self.adapter.hf_config_to_args(folder.config)
        held = getattr(self.adapter, "hf_mtp_depth", lambda keys, args: 0)(folder.keys(), self.args)
        if mtp_depth > held:
            raise TitanError(
                f"{folder.path}: model.mtp_depth = {mtp_depth} needs {mtp_depth} multi-token-prediction layer(s)"
                f" but the folder's weights hold {held}; set model.mtp_depth to at most {held}"
            )
        if mtp_depth:
            self.args.mtp_depth = mtp_depth
        self.source: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._cache: OrderedDict[tuple[str, tuple[int, int] | None], dict[str, torch.Tensor]] = OrderedDict()
        skipped: dict[str, set[int]] = {}
        dropped: dict[str, int] = {}  # whole tensors an adapter leaves out (skipped_hf_key), by reason
        skip_key = getattr(self.adapter, "skipped_hf_key", None)
        for key in folder.keys():
            why = skip_key(key, self.args) if skip_key is not None else None
            if why is not None:
                dropped[why] = dropped.get(why, 0) + 1
                continue
            reason = self._skipped(key)
            if reason is not None:
                skipped.setdefault(reason, set()).add(int(_LAYER.search(key)[1]))  # type: ignore[index]
                continue
            if self.args.tie_embeddings and key == "lm_head.weight":
                refuse_untied_copy(folder, self.args)  # some exports store the tied copy too
                continue
            meta = torch.empty(folder.shape(key), device="meta")
            for name, value in converted_layout(self.adapter, {key: meta}, self.args, folder.path).items():
                self.source[name], self.shapes[name] = key, tuple(value.shape)
        for reason, layers in skipped.items():
            logger.info(f"{folder.path}: not loading Hugging Face layer(s) {sorted(layers)}: {reason}")
        for reason, n in dropped.items():
            logger.info(f"{folder.path}: not loading {n} Hugging Face tensor(s): {reason}")
        self._check()

    def _skipped(self, key: str) -> str | None:
        skip = getattr(self.adapter, "skipped_hf_layer", None)
        m = _LAYER.search(key)
        return skip(int(m[1]), self.args) if skip is not None and m is not None else None

    def _check(self) -> None:
        expected = self.adapter.state_dict_shapes(self.args)
        if set(self.source) != set(expected):
            missing, extra = sorted(set(expected) - set(self.source)), sorted(set(self.source) - set(expected))
            raise TitanError(
                f"{self.folder.path}: weights do not match config.json; missing {missing[:3]}, unexpected {extra[:3]}"
            )
        for name, shape in expected.items():
            if self.shapes[name] != tuple(shape):
                raise TitanError(
                    f"{self.folder.path}: {self.source[name]} gives {name} shape {self.shapes[name]}, config.json"
                    f" gives {tuple(shape)}"
                )

    def dtype(self, name: str) -> torch.dtype:
        """The dtype ``name`` is saved in (a dequantized weight: the release's torch_dtype)."""
        return self.folder.dtype(self.source[name])

    def rows(self, name: str, rows: tuple[int, int] | None) -> torch.Tensor:
        """Titan tensor ``name`` (rows ``rows`` of its first dim; None: all) in the saved or
        dequantized dtype, read through its view tensor's rows only."""
        key = self.source[name]
        total = self.shapes[name][0] if self.shapes[name] else 0
        if rows is not None and rows == (0, total):
            rows = None
        read = None
        if rows is not None:
            block = getattr(self.adapter, "hf_row_block", lambda k, a: 1)(key, self.args)
            read = (rows[0] // block * block, min(-(-rows[1] // block) * block, self.folder.shape(key)[0]))
        converted = self._cache.get((key, read))
        if converted is None:
            converted = self.adapter.from_hf({key: self.folder.read(key, read)}, self.args)
            self._cache[(key, read)] = converted
            while len(self._cache) > _CACHED:
                self._cache.popitem(last=False)
        value = converted[name]
        if rows is None or read is None:
            return value
        if value.shape[0] == total and read != (0, total):  # derived whole (a zero routing bias)
            return value[rows[0] : rows[1]]
        return value[rows[0] - read[0] : rows[1] - read[0]]


def _local_box(target: torch.Tensor, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(local shape, global offset) of ``target``'s part of a ``shape`` tensor; None when it is
    no box (strided shards)."""
    if not isinstance(target, DTensor):
        return shape, (0,) * len(shape)
    if not all(type(p) in (Shard, Replicate) for p in target.placements):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, offset = compute_local_shape_and_global_offset(shape, target.device_mesh, target.placements)
    return tuple(local), tuple(offset)


def load_hf_into_model(model_parts: list[nn.Module], hf_dir: str | Path, folder: HFFolder | None = None) -> Any:
    """Fill a built model (plain, FSDP, TP, EP; pipeline parts take their own keys) from an HF
    folder: the hook for `[checkpoint] initial_load_in_hf`. Each rank reads the rows of its own
    shards (``folder``: a reader to reuse, which counts what it read)."""
    depth = max(model_mtp_depth(getattr(part, "model_args", None)) for part in model_parts)
    plan = HFPlan(folder if folder is not None else HFFolder(hf_dir), mtp_depth=depth)
    with torch.no_grad():
        for part in model_parts:
            for name, target in dcp_io.model_tensors(part).items():
                if name not in plan.source:
                    raise TitanError(f"{hf_dir}: no weight for model parameter {name!r}; wrong model folder?")
                shape = plan.shapes[name]
                if shape != tuple(target.shape):
                    raise TitanError(f"{hf_dir}: {name!r} has shape {shape}, the model expects {tuple(target.shape)}")
                box = _local_box(target, shape)
                if box is None:  # each rank cuts its part of the whole tensor, without communication
                    assert isinstance(target, DTensor)
                    whole = plan.rows(name, None).to(device=target.device, dtype=target.dtype)
                    target.to_local().copy_(
                        distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None).to_local()
                    )
                    continue
                local, offset = box
                if 0 in local:
                    continue
                rows = (offset[0], offset[0] + local[0]) if local else None
                value = plan.rows(name, rows)[(slice(None), *(slice(o, o + n) for o, n in zip(offset[1:], local[1:])))]
                dest = target.to_local() if isinstance(target, DTensor) else target
                dest.copy_(value)
    f = plan.folder
    logger.info(
        f"read {f.bytes_read / 2**30:.3f} GiB in {f.tensors_read} tensor reads of {hf_dir}'s"
        f" {f.stored_bytes / 2**30:.3f} GiB"
    )
    return plan.args


def load_hf(
    hf_dir: str | Path, dtype: torch.dtype | None = None, mtp_depth: int = 0
) -> tuple[dict[str, torch.Tensor], Any]:
    """HF folder -> (full titan state dict, model args), in ``dtype`` or the saved one; in one
    process's memory, so for tests and small models (import_hf_to_dcp streams). ``mtp_depth``:
    the multi-token-prediction layers to read (HFPlan)."""
    plan = HFPlan(HFFolder(hf_dir), mtp_depth)
    state = {name: plan.rows(name, None).to(dtype or plan.dtype(name)) for name in plan.source}
    if plan.args.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    return state, plan.args


class _StreamingSavePlanner(DefaultSavePlanner):
    """Plans from meta tensors; each tensor is read and converted when DCP writes it."""

    def __init__(self, plan: HFPlan, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.hf_plan, self.dtype = plan, dtype

    def resolve_data(self, write_item: Any) -> Any:
        name = write_item.index.fqn
        return self.hf_plan.rows(name, None).to(self.dtype or self.hf_plan.dtype(name)).contiguous()


def import_hf_to_dcp(
    hf_dir: str | Path, out_dir: str | Path, dtype: torch.dtype | None = None, mtp_depth: int = 0
) -> Any:
    """HF folder -> model-only DCP folder (+ model_args.json), one tensor in memory at a time;
    ``mtp_depth``: the multi-token-prediction layers to convert (HFPlan)."""
    plan = HFPlan(HFFolder(hf_dir), mtp_depth)
    meta = {n: torch.empty(s, dtype=dtype or plan.dtype(n), device="meta") for n, s in plan.shapes.items()}
    with dcp_io.atomic_folder(out_dir) as out:
        dcp_call(dcp_save, meta, checkpoint_id=str(out), planner=_StreamingSavePlanner(plan, dtype))
        dcp_io.write_model_args(out, plan.args)
    return plan.args


__all__ = ["HFPlan", "import_hf_to_dcp", "load_hf", "load_hf_into_model", "read_hf_config"]
