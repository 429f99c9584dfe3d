"""Weights brought in against the run's model settings.

A Hugging Face folder (``checkpoint.initial_load_in_hf``) or a converted DCP folder with
``model_args.json`` records the model its weights were trained as: RoPE theta and scaling, norm
eps, shapes, vocabulary. Loading those weights into a model built with other values would train
silently on a different function, so before the model is built every difference is named in one
line and ``checkpoint.config_mismatch`` decides: ``error`` (stop), ``use_checkpoint`` (build the
model with the folder's values) or ``use_new`` (keep this run's values; only where the weights
still fit, i.e. no tensor shape differs).

Not compared: what titan sets per run whatever the weights (the RoPE table length = training.seq_len,
the attention kernel, the init scheme).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from titan.errors import TitanError
from titan.log import logger

# mtp_depth: a run trains the multi-token-prediction depths it asks for (model.mtp_depth); the load
# reads that many of the folder's MTP layers and refuses more than it holds.
_PER_RUN = frozenset({"max_seq_len", "attn_type", "attn_mask_type", "depth_init", "mtp_depth"})
_SHAPE_FIELDS = frozenset({"dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "tie_embeddings"})
_ROPE_SCALING = (
    "rope_scale_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_position_embeddings",
)


def _value(args: Any, name: str) -> Any:
    # n_kv_heads None means "as many as n_heads": compare what the model builds.
    if name == "n_kv_heads" and hasattr(args, "kv_heads"):
        return args.kv_heads
    return getattr(args, name)


def differences(folder_args: Any, run_args: Any, shapes: Any = None) -> dict[str, tuple[Any, Any]]:
    """field -> (folder's value, this run's value). ``shapes(args)`` (the family's state-dict
    shapes) adds the tensor whose shape differs when the fields that encode it (e.g. the SwiGLU
    width's multiple_of / ffn_dim_multiplier) are spelled differently."""
    out: dict[str, tuple[Any, Any]] = {}
    scaled = getattr(folder_args, "use_rope_scaling", False) or getattr(run_args, "use_rope_scaling", False)
    for f in dataclasses.fields(run_args):
        name = f.name
        if name in _PER_RUN or name in ("multiple_of", "ffn_dim_multiplier") or (name in _ROPE_SCALING and not scaled):
            continue
        old, new = _value(folder_args, name), _value(run_args, name)
        if old != new:
            out[name] = (old, new)
    if shapes is not None:
        a, b = shapes(folder_args), shapes(run_args)
        changed = [key for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key)]
        if changed and not set(out) & _SHAPE_FIELDS:
            out[f"{changed[0]} shape"] = (a.get(changed[0]), b.get(changed[0]))
    return out


def settle(config: Any, spec: Any, run_args: Any, resuming: bool, tokenizer_vocab: int | None) -> bool:
    """Compare the weights ``checkpoint.initial_load_path`` will load with ``run_args`` and apply
    ``checkpoint.config_mismatch``; returns True when ``run_args`` took the folder's values.
    Resuming decides the same way (the run resumes the model it started with, e.g. use_checkpoint's),
    unless the folder is gone; the checkpoint's own shape check still guards that resume."""
    cfg = config.checkpoint
    if not (cfg.enable and cfg.initial_load_path) or cfg.create_seed_checkpoint:
        return False
    if resuming and not Path(cfg.initial_load_path).exists():
        return False
    path = cfg.initial_load_path
    if cfg.initial_load_in_hf:
        from titan.checkpointing.hf import read_hf_config

        folder_args, what = read_hf_config(path), "Hugging Face folder"
    else:
        from titan.checkpointing.model_dcp import read_model_args

        folder_args, what = read_model_args(path, spec.args_cls), "checkpoint"
        if folder_args is None:  # a training checkpoint: its tensors are shape-checked on load
            return False
    if type(folder_args) is not type(run_args):
        raise TitanError(
            f"checkpoint.initial_load_path {path} holds a {type(folder_args).__name__} model, this run"
            f" builds {type(run_args).__name__}; set model.name to the folder's model"
        )
    adapter = spec.state_dict_adapter
    diff = differences(folder_args, run_args, getattr(adapter, "state_dict_shapes", None))
    if not diff:
        return False
    listing = ", ".join(f"{name} = {old!r} there, {new!r} in this run" for name, (old, new) in diff.items())
    policy = cfg.config_mismatch
    if policy == "error":
        raise TitanError(
            f"checkpoint.initial_load_path {path}: the {what}'s model differs from this run's: {listing};"
            " train with its values with --checkpoint.config_mismatch use_checkpoint, keep this run's"
            " with use_new, or change the model settings"
        )
    if policy == "use_new":
        shaped = [name for name in diff if name in _SHAPE_FIELDS or name.endswith(" shape")]
        if shaped:
            raise TitanError(
                f"checkpoint.initial_load_path {path}: checkpoint.config_mismatch use_new cannot load"
                f" weights of another shape ({listing}); use use_checkpoint or change the model settings"
            )
        logger.warning(
            f"checkpoint.config_mismatch=use_new: the {what}'s weights train with this run's values: {listing}"
        )
        return False
    if tokenizer_vocab is not None and folder_args.vocab_size < tokenizer_vocab:
        raise TitanError(
            f"checkpoint.initial_load_path {path}: the {what}'s vocabulary has {folder_args.vocab_size}"
            f" tokens but the tokenizer ({config.model.tokenizer_path or 'the shipped one'}) has"
            f" {tokenizer_vocab}; set model.tokenizer_path to the folder's tokenizer"
        )
    for f in dataclasses.fields(run_args):
        if f.name not in _PER_RUN:
            setattr(run_args, f.name, getattr(folder_args, f.name))
    run_args.validate()
    logger.warning(
        f"checkpoint.config_mismatch=use_checkpoint: the model follows the {what} {Path(path).name}: {listing}"
    )
    return True
