"""Model weights in DCP folders: the one place that knows how titan lays them out.

Layout: model tensors at their top-level FQN ("layers.0.attention.wq.weight", ...), as in a
model-only (seed / export / converted) checkpoint. A full training checkpoint may instead nest
them under "model." next to optimizer and dataloader state; readers accept both and ignore
everything that is not a model tensor. Converters also write `model_args.json` (the model's
args dataclass) beside the DCP files, so a converted folder is self-describing.

Works without a process group (single-process scripts, tests) and on FSDP/TP models, whose
DTensor shards DCP loads directly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from titan.checkpointing.states import dcp_call
from titan.errors import TitanError
from titan.models import ModelSpec, get_flavor
from titan.progress import progress

MODEL_ARGS_FILE = "model_args.json"
# The model's tensors (multi-token prediction's fusion parts included: titan.models.mtp).
_MODEL_KEY = re.compile(r"^(tok_embeddings|norm|output)\.weight$|^(layers|mtp)\.\d+\.")
_NESTED_PREFIX = "model."


def _metadata(path: str | Path) -> dict[str, TensorStorageMetadata]:
    path = Path(path)
    if not (path / ".metadata").is_file():
        hint = " (it holds config.json: a Hugging Face folder)" if (path / "config.json").is_file() else ""
        raise TitanError(f"{path} is not a DCP checkpoint: no .metadata file{hint}")
    try:
        meta = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a torn or foreign .metadata
        raise TitanError(f"{path}/.metadata cannot be read ({type(e).__name__}: {e})") from None
    return {k: v for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def model_tensor_metadata(path: str | Path) -> tuple[str, dict[str, TensorStorageMetadata]]:
    """(prefix, {model fqn: metadata}) where prefix is "" (top level) or "model." (nested)."""
    tensors = _metadata(path)
    flat = {k: v for k, v in tensors.items() if _MODEL_KEY.match(k)}
    if flat:
        return "", flat
    nested = {
        k[len(_NESTED_PREFIX) :]: v
        for k, v in tensors.items()
        if k.startswith(_NESTED_PREFIX) and _MODEL_KEY.match(k[len(_NESTED_PREFIX) :])
    }
    if not nested:
        raise TitanError(f"{path} holds no model tensors (expected keys like 'layers.0.attention.wq.weight')")
    return _NESTED_PREFIX, nested


def _nest(prefix: str, state: dict) -> dict:
    return {prefix[:-1]: state} if prefix else state


@contextlib.contextmanager
def atomic_folder(out_dir: str | Path) -> Iterator[Path]:
    """A temporary folder beside ``out_dir`` that becomes ``out_dir`` when the block succeeds and
    is removed when it fails, so a refused or failed conversion leaves nothing behind. An existing
    non-empty ``out_dir`` is refused before anything is written (never overwritten)."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TitanError(f"output folder {out} already exists and is not empty; choose a new folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # a leftover of this pid's crashed run
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            out.rmdir()  # empty (checked above); rename cannot replace a folder on every OS
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_model_dcp(state_dict: dict[str, torch.Tensor], model_args: Any, out_dir: str | Path) -> None:
    """Write a model-only DCP checkpoint (+ model_args.json) that load_model_from_dcp reads."""
    with atomic_folder(out_dir) as out:
        # Tied weights are one tensor under two names; DCP writes each name, readers get both back.
        dcp_call(dcp_save, {k: v.contiguous() for k, v in state_dict.items()}, checkpoint_id=str(out))
        write_model_args(out, model_args)


def write_model_args(out: Path, model_args: Any) -> None:
    """model_args.json beside a converted folder's tensors: the folder describes itself."""
    (out / MODEL_ARGS_FILE).write_text(json.dumps(dataclasses.asdict(model_args), indent=2) + "\n")


def read_model_args(path: str | Path, args_cls: type) -> Any | None:
    """The `args_cls` instance recorded in the folder's model_args.json; None without one."""
    f = Path(path) / MODEL_ARGS_FILE
    if not f.is_file():
        return None
    fields = {f.name for f in dataclasses.fields(args_cls)}
    raw = json.loads(f.read_text())
    unknown = set(raw) - fields
    if unknown:
        raise TitanError(f"{f}: unknown fields {sorted(unknown)}; valid: {sorted(fields)}")
    args = args_cls(**raw)
    args.validate()
    return args


def family_of(path: str | Path, specs: dict[str, ModelSpec]) -> str | None:
    """The family (registered model name) a DCP folder was written as: the registered args class
    whose fields are exactly model_args.json's keys; None without a model_args.json or a unique match."""
    f = Path(path) / MODEL_ARGS_FILE
    if not f.is_file():
        return None
    keys = set(json.loads(f.read_text()))
    names = [n for n, s in specs.items() if {x.name for x in dataclasses.fields(s.args_cls)} == keys]
    return names[0] if len(names) == 1 else None


def model_args_for(path: str | Path, spec: ModelSpec, flavor: str | None = None) -> Any:
    """A DCP folder's model args: model_args.json if it has one, else `flavor` reshaped to the
    tensors (vocabulary, depth, tied embeddings) by the family's state-dict adapter."""
    _, meta = model_tensor_metadata(path)  # a clear error first if this is no DCP model checkpoint
    args = read_model_args(path, spec.args_cls)
    if args is not None:
        return args
    if flavor is None:
        raise TitanError(f"{path} has no {MODEL_ARGS_FILE}; pass --flavor (valid: {', '.join(spec.flavors)})")
    if spec.state_dict_adapter is None:
        raise TitanError(
            f"{path} has no {MODEL_ARGS_FILE} and model {spec.name} cannot infer its shape from the tensors"
        )
    shapes = {k: tuple(m.size) for k, m in meta.items()}
    return spec.state_dict_adapter.args_from_shapes(shapes, get_flavor(spec, flavor), str(path))


def _check_shapes(
    path: str | Path, expected: dict[str, tuple[tuple[int, ...], torch.dtype]], meta: dict[str, TensorStorageMetadata]
) -> None:
    missing = sorted(set(expected) - set(meta))
    if missing:
        raise TitanError(
            f"{path}: checkpoint lacks {len(missing)} model tensors, e.g. {missing[:3]}; wrong model or flavor?"
        )
    for key, (shape, _) in expected.items():
        if tuple(meta[key].size) != tuple(shape):
            raise TitanError(
                f"{path}: tensor {key!r} has shape {tuple(meta[key].size)} but the model expects {tuple(shape)};"
                " wrong flavor?"
            )


def model_tensors(model: nn.Module, options: StateDictOptions | None = None) -> dict[str, torch.Tensor]:
    """The model's state dict (get_model_state_dict), refused if it holds anything but tensors: the
    weight formats here store tensors only (a module's extra state would be silently dropped)."""
    state = get_model_state_dict(model, options=options)
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    if len(tensors) != len(state):
        other = next(k for k in state if k not in tensors)
        raise TitanError(
            f"model state {other!r} is a {type(state[other]).__name__}, not a tensor; "
            "model-weight folders hold tensors only"
        )
    return tensors


def load_model_from_dcp(model: nn.Module, path: str | Path) -> None:
    """Load model weights (plain, FSDP or TP model) in place; dtype is cast to the model's."""
    prefix, meta = model_tensor_metadata(path)
    state = model_tensors(model)
    expected = {}
    for k, v in state.items():
        expected[k] = (tuple(v.shape), v.dtype)
    _check_shapes(path, expected, meta)
    dcp_call(dcp_load, _nest(prefix, state), checkpoint_id=str(path))
    # torch types the parameter as an (invariant) dict of any state value; tensors are such values.
    set_model_state_dict(model, cast(dict[str, Any], state))


class _ProgressLoads(DefaultLoadPlanner):
    """Load planner (and mixin) with a terminal-only bar ticking once per tensor or blob read."""

    desc = "reading checkpoint"

    def create_local_plan(self):
        plan = super().create_local_plan()
        self.bar = progress(desc=self.desc, total=len(plan.items), unit="item")
        return plan

    def load_bytes(self, read_item, value) -> None:
        super().load_bytes(read_item, value)
        self.bar.update()

    def commit_tensor(self, read_item, tensor) -> None:
        super().commit_tensor(read_item, tensor)
        self.bar.update()


class _ProgressEmptyLoadPlanner(_ProgressLoads, _EmptyStateDictLoadPlanner):
    """Loads everything the checkpoint holds (the state dict is built from its metadata)."""


def read_model_tensors(
    path: str | Path, keys: list[str] | None = None, show_progress: bool = False
) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU tensors of the model keys (all of them if keys is None), in the saved dtype."""
    prefix, meta = model_tensor_metadata(path)
    keys = sorted(meta) if keys is None else keys
    absent = [k for k in keys if k not in meta]
    if absent:
        raise TitanError(f"{path}: no tensor named {absent[0]!r}")
    state = {k: torch.empty(tuple(meta[k].size), dtype=meta[k].properties.dtype) for k in keys}
    dcp_call(
        dcp_load, _nest(prefix, state), checkpoint_id=str(path), planner=_ProgressLoads() if show_progress else None
    )
    return state


def read_all_state(path: str | Path) -> dict:
    """Everything a DCP folder holds (model, optimizer, dataloader, ...) as one nested dict of
    full CPU tensors and objects, in one process (torch's dcp_to_torch_save, with a progress bar)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    _metadata(path)
    state: dict = {}
    _load_state_dict(
        state, storage_reader=FileSystemReader(str(path)), planner=_ProgressEmptyLoadPlanner(), no_dist=True
    )
    return state


def tensor_nbytes(path: str | Path) -> dict[str, int]:
    """Bytes per model tensor, from metadata alone (plans export shards without loading)."""
    _, meta = model_tensor_metadata(path)
    return {k: m.size.numel() * m.properties.dtype.itemsize for k, m in meta.items()}


def dcp_to_torch_file(dcp_dir: str | Path, out_file: str | Path, model_only: bool = True) -> None:
    """DCP folder -> one torch.save file; model_only keeps just the model tensors (flat FQNs)."""
    out = Path(out_file)
    if out.exists():
        raise TitanError(f"{out} already exists; choose a new file name")
    torch.save(read_model_tensors(dcp_dir, show_progress=True) if model_only else read_all_state(dcp_dir), out)


def torch_file_to_dcp(in_file: str | Path, dcp_dir: str | Path) -> None:
    """torch.save file (a state dict) -> DCP folder with the same keys."""
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

    src, out = Path(in_file), Path(dcp_dir)
    if not src.is_file():
        raise TitanError(f"{src} does not exist")
    if out.exists() and any(out.iterdir()):
        raise TitanError(f"output folder {out} already exists and is not empty; choose a new folder")
    try:
        torch_save_to_dcp(str(src), str(out))
    except Exception as e:  # unpickling a foreign or truncated file
        raise TitanError(f"{src} is not a readable torch.save state dict ({type(e).__name__}: {e})") from None
