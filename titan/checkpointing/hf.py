"""Hugging Face folders: config.json + model-0000x-of-0000y.safetensors + model.safetensors.index.json.

Export streams: shards are planned from the DCP metadata and each is read, remapped and written
on its own, so peak memory is about one shard (max_shard_bytes), not the whole model. It writes
the layout the family's releases use: one key per routed expert where the adapter says
``hf_per_expert`` (DeepSeek-V3, Kimi K2, Qwen3-MoE), fused experts otherwise (gpt-oss, Llama 4).
Import (titan.checkpointing.hf_load) reads the release's own layout, streaming.
The model family's state-dict adapter (ModelSpec.state_dict_adapter) does the key/layout and
config mapping: found from the args being written, or from config.json's model_type when reading.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from titan.checkpointing import model_dcp as dcp_io
from titan.checkpointing.hf_check import ROUTING_BIAS, check_export_config, refuse_dropped_bias
from titan.checkpointing.hf_folder import INDEX_FILE, split_experts
from titan.checkpointing.hf_load import import_hf_to_dcp, load_hf, load_hf_into_model, read_hf_config
from titan.errors import TitanError
from titan.models import get_flavor, get_model_spec, spec_for_args
from titan.progress import progress

DEFAULT_SHARD_BYTES = 5 * 1024**3  # what transformers' save_pretrained uses


def _plan_shards(
    nbytes: dict[str, int], max_shard_bytes: int, unit_of: Callable[[str], str] | None = None
) -> list[list[str]]:
    """Greedy in layer order, so a layer's tensors mostly land in one file; a module's tensors always
    do (an adapter may fuse them: Llama 4's experts.w1 and w3 become one gate_up_proj), and so do the
    keys an adapter's ``export_unit`` puts together (modules it fuses)."""

    def order(key: str) -> tuple[int, str]:
        parts = key.split(".")
        return (int(parts[1]) if parts[0] == "layers" else (-1 if parts[0] == "tok_embeddings" else 1 << 30), key)

    modules: dict[str, list[str]] = {}
    for key in sorted(nbytes, key=order):
        modules.setdefault(unit_of(key) if unit_of is not None else key.rsplit(".", 1)[0], []).append(key)
    shards: list[list[str]] = [[]]
    size = 0
    for keys in modules.values():
        unit = sum(nbytes[k] for k in keys)
        if shards[-1] and size + unit > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(keys)
        size += unit
    return shards


def model_args_of(model: nn.Module) -> Any:
    """The args a model was built from: every spec's model class keeps them as `model_args`
    (titan.models.ModelSpec.model_cls), which nn.Module's attribute typing cannot know."""
    args: Any = model.model_args
    return args


def export_args(args: Any, record: dict[str, Any] | None, flavor_max: int | None = None) -> Any:
    """The model args an export of a run's weights writes. config.json's max_position_embeddings
    is the model's context length: its flavor's max_seq_len (``flavor_max``, else the flavor the
    run ``record`` names), or the run's training.seq_len where it trained on longer sequences. A
    run sets max_seq_len to its seq_len only to keep its RoPE table small; the weights do not
    depend on it, so the in-training export and scripts/convert_hf.py to_hf write the same file."""
    model, training = (record or {}).get("model") or {}, (record or {}).get("training") or {}
    if flavor_max is None and model.get("name") is not None:
        try:
            folder = folder_model_args(record, get_model_spec(model["name"]))
        except TitanError:  # the folder is gone or unreadable: the flavor's context, as below
            folder = None
        flavor_max = folder.max_seq_len if folder is not None else None
    if flavor_max is None:
        try:
            flavor_max = get_flavor(get_model_spec(model["name"]), model["flavor"]).max_seq_len
        except (KeyError, TypeError, TitanError):  # no record of a registered flavor: as trained
            return args
    seq_len = training.get("seq_len")
    context = max(int(flavor_max or 0), seq_len if isinstance(seq_len, int) else 0)
    return dataclasses.replace(args, max_seq_len=context) if context > 0 else args


def _specs() -> dict[str, Any]:
    from titan.models import _REGISTRY

    return _REGISTRY.specs()


def checkpoint_family(dcp_dir: str | Path, model: str | None = None) -> Any:
    """The model spec a DCP folder was written with: its model_args.json's args class, else the
    run's saved config (model.name in the step folder's config.json). ``model`` (--model) must
    agree with what the folder records; it is needed only when the folder records nothing."""
    from titan.checkpointing.config_diff import read_config

    recorded = dcp_io.family_of(dcp_dir, _specs())
    record_model = ((read_config(str(dcp_dir)) or {}).get("model") or {}).get("name")
    recorded = recorded or (record_model if isinstance(record_model, str) else None)
    if model is not None and recorded is not None and model != recorded:
        raise TitanError(f"--model {model} disagrees with {dcp_dir}, which holds a {recorded} model; drop --model")
    name = model or recorded
    if name is None:
        dcp_io.model_tensor_metadata(dcp_dir)  # a clear error first if this is no DCP model checkpoint
        raise TitanError(
            f"{dcp_dir} records no model family (no model_args.json, no run config.json); pass --model"
            f" (valid: {', '.join(_specs())})"
        )
    return get_model_spec(name)


def folder_model_args(record: dict[str, Any] | None, spec: Any) -> Any:
    """The model args a run took from its checkpoint.initial_load_path folder (an HF folder's
    config.json or a converted folder's model_args.json) with config_mismatch use_checkpoint;
    None where the run's model is its flavor's."""
    ckpt = (record or {}).get("checkpoint") or {}
    path = ckpt.get("initial_load_path")
    if not isinstance(path, str) or not path or ckpt.get("config_mismatch") != "use_checkpoint":
        return None
    if ckpt.get("initial_load_in_hf"):
        return read_hf_config(path)
    return dcp_io.read_model_args(path, spec.args_cls)


def _run_model_args(spec: Any, record: dict[str, Any] | None, flavor: str | None, where: str) -> Any:
    """The model the run built: its initial_load_path folder's (folder_model_args), else its flavor
    with its [model] shape overrides (None without a record of a flavor). ``flavor`` (--flavor)
    must be the recorded one."""
    from types import SimpleNamespace

    from titan.config.sections.model import SHAPE_OVERRIDES
    from titan.models import model_args_from_config

    folder = folder_model_args(record, spec)
    if folder is not None:  # the run trained the folder's model, not its flavor's
        return folder
    model = (record or {}).get("model") or {}
    if not isinstance(model.get("flavor"), str):
        return None
    if flavor is not None and flavor != model["flavor"]:
        raise TitanError(
            f"--flavor {flavor} disagrees with {where}, trained as flavor {model['flavor']!r}; drop --flavor"
        )
    fields = {k: model.get(k) for k in SHAPE_OVERRIDES}
    depth = model.get("mtp_depth") or 0
    return model_args_from_config(spec, SimpleNamespace(flavor=model["flavor"], mtp_depth=depth, **fields))


def training_checkpoint_args(dcp_dir: str | Path, spec: Any, flavor: str | None) -> Any:
    """The model args to export a DCP folder with: its model_args.json as a converter wrote it,
    or, for a training checkpoint, the model the run trained (its saved config's flavor with its
    [model] shape overrides, else ``flavor``) reshaped to the tensors, with the context length
    of export_args (the run's config.json in the step folder gives its training.seq_len)."""
    from titan.checkpointing.config_diff import read_config

    if dcp_io.read_model_args(dcp_dir, spec.args_cls) is not None:
        return dcp_io.model_args_for(dcp_dir, spec, flavor)
    record = read_config(str(dcp_dir))
    trained = _run_model_args(spec, record, flavor, str(dcp_dir))
    if trained is None:
        args = dcp_io.model_args_for(dcp_dir, spec, flavor)
    else:
        _, meta = dcp_io.model_tensor_metadata(dcp_dir)
        shapes = {k: tuple(m.size) for k, m in meta.items()}
        args = spec.state_dict_adapter.args_from_shapes(shapes, trained, str(dcp_dir))
    return export_args(args, record, flavor_max=args.max_seq_len)


def dcp_model_args(dcp_dir: str | Path, model: str | None = None, flavor: str | None = None) -> Any:
    """The model a DCP folder holds, read the one way scripts/convert_hf.py to_hf and
    scripts/generate.py both read it: the family from the folder (checkpoint_family), the shape
    from its model_args.json or the run's saved config (training_checkpoint_args); ``model`` and
    ``flavor`` only where the folder records none (and never against what it records)."""
    return training_checkpoint_args(dcp_dir, checkpoint_family(dcp_dir, model), flavor)


def _adapter(args: Any) -> Any:
    spec = spec_for_args(args)
    if spec.state_dict_adapter is None:
        raise TitanError(f"model {spec.name} has no Hugging Face format")
    return spec.state_dict_adapter


def _write(
    out_dir: str | Path,
    args: Any,
    groups: list[list[str]],
    dtype: torch.dtype | None,
    load: Callable[[list[str]], dict[str, torch.Tensor]],
    saved_dtype: torch.dtype,
    drop_routing_bias: bool,
    writer: bool = True,
) -> None:
    """Check config.json first, then write everything into a temporary folder renamed at the end.
    A rank that is not the ``writer`` makes the same ``load`` calls in the same order (they may be
    collectives) and writes nothing."""
    adapter = _adapter(args)
    config = adapter.args_to_hf_config(args, dtype or saved_dtype)
    check_export_config(adapter, args, config)
    if not drop_routing_bias:  # before the folder exists: the biases are small
        biases = [k for keys in groups for k in keys if k.endswith(ROUTING_BIAS)]
        refuse_dropped_bias(adapter, load(biases) if biases else {}, spec_for_args(args).name)
    if not writer:
        for keys in groups:
            load(keys)
        return
    with dcp_io.atomic_folder(out_dir) as out:
        _write_files(out, adapter, args, groups, dtype, load, config)


def _write_files(
    out: Path,
    adapter: Any,
    args: Any,
    groups: list[list[str]],
    dtype: torch.dtype | None,
    load: Callable[[list[str]], dict[str, torch.Tensor]],
    config: dict[str, Any],
) -> None:
    weight_map: dict[str, str] = {}
    total = 0
    for i, keys in enumerate(progress(groups, desc="writing safetensors", unit="file")):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        hf = adapter.to_hf(load(keys), args, dtype)
        if getattr(adapter, "hf_per_expert", False):
            hf = split_experts(hf)
        if not hf:
            continue
        # safetensors refuses views into shared storage; contiguous copies where needed.
        hf = {k: v.detach().contiguous() for k, v in hf.items()}
        save_file(hf, str(out / name), metadata={"format": "pt"})
        for k, v in hf.items():
            weight_map[k] = name
            total += v.numel() * v.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def save_hf(
    state_dict: dict[str, torch.Tensor],
    args: Any,
    out_dir: str | Path,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    dtype: torch.dtype | None = None,
    drop_routing_bias: bool = False,
) -> None:
    """In-memory titan state dict -> HF folder (``drop_routing_bias``: see _refuse_dropped_bias)."""
    tensors = {k: v for k, v in state_dict.items() if not (args.tie_embeddings and k == "output.weight")}
    groups, saved = _plan_tensors(tensors, args, max_shard_bytes)
    _write(out_dir, args, groups, dtype, lambda ks: {k: state_dict[k] for k in ks}, saved, drop_routing_bias)


def _plan_tensors(
    tensors: dict[str, torch.Tensor], args: Any, max_shard_bytes: int
) -> tuple[list[list[str]], torch.dtype]:
    """The output files' keys (by each tensor's whole size: a DTensor's numel is the global one) and
    the dtype the tensors are saved in (the first floating one's)."""
    nbytes = {k: v.numel() * v.element_size() for k, v in tensors.items()}
    saved = next((v.dtype for v in tensors.values() if v.is_floating_point()), torch.float32)
    return _plan_shards(nbytes, max_shard_bytes, getattr(_adapter(args), "export_unit", None)), saved


def export_dcp_to_hf(
    dcp_dir: str | Path,
    out_dir: str | Path,
    args: Any,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    dtype: torch.dtype | None = None,
    drop_routing_bias: bool = False,
) -> None:
    """Model tensors of a DCP checkpoint -> HF folder, one output shard in memory at a time."""
    nbytes = dcp_io.tensor_nbytes(dcp_dir)
    if args.tie_embeddings:
        nbytes.pop("output.weight", None)
    expected = set(_expected_keys(args))
    if set(nbytes) != expected:
        missing, extra = sorted(expected - set(nbytes)), sorted(set(nbytes) - expected)
        raise TitanError(
            f"{dcp_dir}: model tensors do not match the model args; missing {missing[:3]}, unexpected {extra[:3]}"
        )
    _, meta = dcp_io.model_tensor_metadata(dcp_dir)
    shapes = _adapter(args).state_dict_shapes(args)
    for key in sorted(nbytes):
        if tuple(meta[key].size) != tuple(shapes[key]):
            raise TitanError(
                f"{dcp_dir}: {key} has shape {tuple(meta[key].size)}, the model args give {tuple(shapes[key])};"
                " export with the args the run trained (its model_args.json or config.json)"
            )
    saved = next((m.properties.dtype for m in meta.values() if m.properties.dtype.is_floating_point), torch.float32)
    groups = _plan_shards(nbytes, max_shard_bytes, getattr(_adapter(args), "export_unit", None))
    _write(out_dir, args, groups, dtype, lambda ks: dcp_io.read_model_tensors(dcp_dir, ks), saved, drop_routing_bias)


def _expected_keys(args: Any) -> list[str]:
    shapes = _adapter(args).state_dict_shapes(args)
    return [k for k in shapes if not (args.tie_embeddings and k == "output.weight")]


def save_model_hf(
    model_parts: list[nn.Module],
    out_dir: str | Path,
    args: Any = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    record: dict[str, Any] | None = None,
    drop_routing_bias: bool = False,
) -> None:
    """Write an HF folder of a (possibly sharded) model from rank 0: the hook for
    `[checkpoint] last_save_in_hf`. Collective: every rank must call it. It gathers one output file's
    tensors at a time, a parameter at a time, so rank 0 holds at most one file (max_shard_bytes) and
    the other ranks one unsharded parameter, whatever the model's size. Pipeline-parallel parts live
    on different ranks, so a rank without all of them refuses before gathering anything.
    ``record``: the run's config, for the context length config.json states (export_args)."""
    args = args if args is not None else model_args_of(model_parts[0])
    if record is not None:
        args = export_args(args, record)
    tensors: dict[str, torch.Tensor] = {}
    for part in model_parts:  # the rank's own shards (DTensors under FSDP/TP): nothing gathered yet
        tensors.update(dcp_io.model_tensors(part))
    if args.tie_embeddings:
        tensors.pop("output.weight", None)
    missing = sorted(set(_expected_keys(args)) - set(tensors))
    if missing:
        raise TitanError(
            f"HF export needs the whole model on every rank's mesh but {missing[0]!r} is on another pipeline "
            "stage; export the DCP checkpoint with scripts/convert_hf.py to_hf instead"
        )
    writer = not dist.is_initialized() or dist.get_rank() == 0

    def gather(keys: list[str]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for key in keys:  # full_tensor is a collective over the parameter's mesh: same order everywhere
            value = tensors[key]
            full = value.full_tensor() if isinstance(value, DTensor) else value
            # Routing biases come back on every rank (they are tiny) so every rank refuses alike.
            if writer or key.endswith(ROUTING_BIAS):
                out[key] = full.detach().cpu()
        return out

    groups, saved = _plan_tensors(tensors, args, max_shard_bytes)
    _write(out_dir, args, groups, dtype, gather, saved, drop_routing_bias, writer=writer)


__all__ = [
    "INDEX_FILE",
    "dcp_model_args",
    "export_dcp_to_hf",
    "import_hf_to_dcp",
    "load_hf",
    "load_hf_into_model",
    "read_hf_config",
    "save_hf",
    "save_model_hf",
]
