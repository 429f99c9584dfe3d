"""The run config saved with each checkpoint, and what auto-resume does when today's differs.

Each step folder holds ``config.json`` (the whole config tree plus the effective global batch).
On resume the *training-relevant* keys are compared; any difference is named and
``checkpoint.config_mismatch`` decides: ``error`` (default: stop), ``use_checkpoint`` (this run
takes the checkpoint's values for those keys, before anything is built) or ``use_new`` (keep
today's values; the optimizer hyperparameters and lr schedule loaded from the checkpoint are
replaced by today's).

Training-relevant: what changes the model, the optimization or the data a resumed run sees. The
parallel layout is not (DCP reshards the weights and optimizer state, the data loader re-deals its
documents), except through the global batch, which is compared as ``effective.global_batch``.
Everything else (steps, logging, checkpoint interval and folder, profiling, compile, ...) may
change freely between restarts.

Only what is loaded is compared: each key belongs to the checkpoint part it shapes (the batch shape
and the data keys to the data loader's state, the optimizer keys and clipping to the optimizer's,
the seed to the train state's RNG, ...), and a part in ``checkpoint.exclude_from_loading`` starts
from today's config, so its keys may differ (e.g. a new layout whose global batch differs, resumed
without the data loader state).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Collection, Mapping
from types import MappingProxyType
from typing import Any

from titan.config.choices import ConfigMismatch, choices
from titan.errors import TitanError
from titan.log import logger

CONFIG_FILE = "config.json"

# section -> keys compared (None: every key of the section) / keys never compared.
_RELEVANT: Mapping[str, tuple[str, ...] | None] = MappingProxyType(
    {
        "model": ("name", "flavor", "tokenizer_path", "vocab_size", "mtp_depth"),
        "optimizer": None,
        "lr_scheduler": None,
        "training": (
            "dataset",
            "dataset_path",
            "dataset_config",
            "dataset_split",
            "dataset_text_field",
            "dataset_txt_split",
            "local_batch_size",
            "seq_len",
            "max_norm",
            "seed",
            "mixed_precision_param",
            "mixed_precision_reduce",
            "dataset_infinite",
        ),
        "float8": ("enable_float8_linear", "recipe"),
        "effective": None,
    }
)
# The checkpoint part whose loaded state a key shapes (default: its section's name).
_PART = MappingProxyType(
    {
        "model": "model",
        "float8": "model",
        "training.mixed_precision_param": "model",
        "training.mixed_precision_reduce": "model",
        "training.max_norm": "optimizer",
        "training.seed": "rng",
        "training": "dataloader",
        "effective": "dataloader",
    }
)
# Kernel choices that give the same optimizer math.
_FREE = MappingProxyType({"optimizer": ("implementation",)})
POLICIES = choices(ConfigMismatch)
# Read before the dump folder is even looked at (model flavor, batch shape): use_checkpoint names
# the flag to pass instead of changing them under a half-built run.
_SHAPE_KEYS = (
    "model.name",
    "model.flavor",
    "model.tokenizer_path",
    "model.mtp_depth",
    "training.local_batch_size",
    "training.seq_len",
)


def snapshot(config: Any, dp_degree: int) -> dict[str, Any]:
    tree = dataclasses.asdict(config)
    t = config.training
    global_batch = t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * dp_degree
    tree["effective"] = {"global_batch": global_batch}
    return tree


def write_config(folder: str, tree: dict[str, Any]) -> None:
    with open(os.path.join(folder, CONFIG_FILE), "w") as f:
        json.dump(tree, f, indent=1, default=str)


def read_config(folder: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(folder, CONFIG_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def part_of(key: str) -> str:
    """The checkpoint part ('model', 'optimizer', ...) whose loaded state the 'section.key' shapes."""
    return _PART.get(key) or _PART.get(key.split(".", 1)[0]) or key.split(".", 1)[0]


def differences(
    saved: dict[str, Any], current: dict[str, Any], excluded: Collection[str] = ()
) -> dict[str, tuple[Any, Any]]:
    """'section.key' -> (checkpoint's value, this run's value) for the training-relevant keys of the
    parts that are loaded (those of ``excluded`` parts start from this run's config)."""
    out = {}
    for section, keys in _RELEVANT.items():
        old, new = saved.get(section, {}), current.get(section, {})
        for key in keys if keys is not None else sorted(set(old) | set(new)):
            if key in _FREE.get(section, ()) or key not in old:  # not recorded: an older titan
                continue
            if part_of(f"{section}.{key}") in excluded:
                continue
            if _norm(old.get(key)) != _norm(new.get(key)):
                out[f"{section}.{key}"] = (old.get(key), new.get(key))
    return out


def relevant(tree: dict[str, Any]) -> dict[str, Any]:
    """'section.key' -> value of every training-relevant key of a config tree (what a resume compares)."""
    out = {}
    for section, keys in _RELEVANT.items():
        values = tree.get(section, {})
        for key in keys if keys is not None else sorted(values):
            if key not in _FREE.get(section, ()):
                out[f"{section}.{key}"] = _norm(values.get(key))
    return out


def _norm(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))  # tuples vs lists, as JSON stores them


def resolve(
    folder: str, current: dict[str, Any], policy: str, excluded: Collection[str] = ()
) -> dict[str, tuple[Any, Any]]:
    """The differences between ``folder``'s config and ``current`` that ``policy`` settles (logged),
    over the parts not in ``excluded``; raises with policy ``error``, or when ``use_checkpoint``
    cannot restore a key."""
    saved = read_config(folder)
    diff = differences(saved, current, excluded) if saved is not None else {}
    if not diff:
        return {}
    listing = ", ".join(f"{k} = {old!r} there, {new!r} now" for k, (old, new) in diff.items())
    names = diff.get("optimizer.name")
    if names is not None and "muon" in {str(n).lower() for n in names} and policy != "use_checkpoint":
        # Muon keeps one momentum per matrix, Adam(W) two moments: no state carries over, whatever
        # the policy says about the other keys.
        others = [k for k in diff if k != "optimizer.name"]
        rest = f" (and --checkpoint.config_mismatch for {', '.join(others)})" if others and policy == "error" else ""
        raise TitanError(
            f"resuming from {folder}: its optimizer state is {names[0]}'s, this run's optimizer is"
            f" {names[1]}; start the optimizer afresh with --checkpoint.exclude_from_loading optimizer{rest}"
        )
    if policy == "error":
        raise TitanError(
            f"resuming from {folder}, whose run config differs in training-relevant keys: {listing}; say which"
            " wins with --checkpoint.config_mismatch use_checkpoint (continue as the checkpoint was trained)"
            " or use_new (today's values), or use another job.dump_folder"
        )
    if policy == "use_checkpoint":
        fixed = [f"--{k} {diff[k][0]}" for k in diff if k in _SHAPE_KEYS]
        if "effective.global_batch" in diff:
            fixed.append(f"--training.global_batch_size {diff['effective.global_batch'][0]}")
        if fixed:
            raise TitanError(
                f"resuming from {folder}: checkpoint.config_mismatch use_checkpoint cannot change the"
                f" model or batch shape this run was set up with ({listing}); pass {' '.join(fixed)}"
            )
        logger.warning(f"checkpoint.config_mismatch=use_checkpoint: continuing with the checkpoint's values: {listing}")
    else:
        logger.warning(f"checkpoint.config_mismatch=use_new: this run uses today's values: {listing}")
    return diff


def apply(config: Any, diff: dict[str, tuple[Any, Any]]) -> None:
    """Set the checkpoint's values (use_checkpoint), before anything is built from the config."""
    for key, (old, _) in diff.items():
        section, name = key.split(".", 1)
        setattr(getattr(config, section), name, old)
