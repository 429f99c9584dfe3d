"""Checkpoint folders on disk: naming, the completion marker, scanning, pruning.

Layout: ``<dump_folder>/<folder>/step-N/`` holds one DCP checkpoint (``*.distcp`` files from every
rank plus DCP's ``.metadata``) and each rank's ``rank_<r>.pt`` (rank_states.py). A save is
*committed* only when rank 0 writes ``COMPLETE`` into it, after DCP reported that every rank
finished writing; the marker itself is written to a temporary name and renamed, so it is never
seen half-written. A ``step-N`` folder without the
marker is *torn* (a crash or kill during the save): loading skips it with a warning and the next
save to that step replaces it. The final save of a run with ``checkpoint.last_save_in_hf`` is a
Hugging Face folder at ``step-N`` (where a torchtitan user loads it back from), committed the same
way with ``"format": "hf"`` in its marker: auto-resume passes over it like any model-only export.
DCP's own ``.metadata`` is not enough as a marker: it can exist while the run dies before the save
is acknowledged.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass

from titan.errors import TitanError
from titan.log import logger

MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step}")


@dataclass(frozen=True)
class Found:
    step: int
    path: str
    complete: bool
    model_only: bool = False
    hf: bool = False
    """A Hugging Face export (config.json + safetensors), not a DCP checkpoint."""


def write_marker(path: str, step: int, *, model_only: bool, world_size: int, dp_degree: int, fmt: str = "dcp") -> None:
    info = {
        "step": step,
        "model_only": model_only,
        "world_size": world_size,
        "dp_degree": dp_degree,
        "format": fmt,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    tmp = os.path.join(path, MARKER + ".tmp")
    with open(tmp, "w") as f:
        json.dump(info, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, MARKER))


def read_marker(path: str) -> dict | None:
    try:
        with open(os.path.join(path, MARKER)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def scan(root: str) -> list[Found]:
    """All step-N folders under root, oldest first, each with whether it is complete."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        if m and os.path.isdir(path):
            info = read_marker(path)
            found.append(
                Found(
                    int(m[1]),
                    path,
                    info is not None,
                    bool(info and info.get("model_only")),
                    bool(info and info.get("format") == "hf"),
                )
            )
    return sorted(found, key=lambda f: f.step)


def resume_candidates(root: str, load_step: int) -> list[Found]:
    """The checkpoints to resume from, best first: ``load_step`` alone, or the complete full ones
    newest first (loading verifies them in this order and takes the first intact one).

    A model-only ``step-0`` (a seed checkpoint) counts when nothing newer exists; other model-only
    folders are final exports and are never resumed from. Torn folders are skipped with a warning.
    """
    found = scan(root)
    for f in found:
        if not f.complete and (load_step == -1 or f.step == load_step):
            logger.warning(
                f"checkpoint {f.path} is incomplete (no {MARKER} marker: the save was interrupted); skipping it"
            )
    if load_step >= 0:
        match = [f for f in found if f.step == load_step and f.complete]
        if not match:
            steps = [f.step for f in found if f.complete]
            raise TitanError(
                f"checkpoint.load_step {load_step}: no complete checkpoint step-{load_step} in {root}"
                f" (complete steps: {steps or 'none'})"
            )
        if match[0].hf:
            raise TitanError(
                f"checkpoint.load_step {load_step}: {match[0].path} is a Hugging Face export (model"
                " weights only), not a checkpoint to resume; start a new run from it with"
                f" --checkpoint.initial_load_path {match[0].path} --checkpoint.initial_load_in_hf"
            )
        return match
    usable = [f for f in found if f.complete and (not f.model_only or f.step == 0)]
    for f in found:
        if f.complete and f.model_only and f.step > 0 and (not usable or f.step > usable[-1].step):
            logger.info(f"{f.path} is a model-only export; resuming from an earlier full checkpoint")
    return usable[::-1]


def pick_resume(root: str, load_step: int) -> Found | None:
    """The newest candidate of ``resume_candidates`` (without verifying its files)."""
    return next(iter(resume_candidates(root, load_step)), None)


def prune(root: str, keep_latest_k: int) -> None:
    """Delete all but the newest ``keep_latest_k`` complete checkpoints (rank 0 only).

    Never deletes the newest complete *full* checkpoint, even when newer model-only exports fill
    the K slots. Torn folders older than the newest complete one are garbage and go as well.
    """
    if keep_latest_k <= 0:
        return
    found = scan(root)
    complete = [f for f in found if f.complete]
    if not complete:
        return
    keep = {f.step for f in complete[-keep_latest_k:]}
    full = [f for f in complete if not f.model_only]
    if full:
        keep.add(full[-1].step)
    newest = complete[-1].step
    for f in found:
        if f.step not in keep and (f.complete or f.step < newest):
            logger.info(f"keep_latest_k={keep_latest_k}: deleting {f.path}")
            delete(f.path)


def delete(path: str, ignore_errors: bool = True) -> None:
    """Remove a step folder, its marker first: a kill in the middle leaves a torn folder (skipped,
    removed by the next prune), never one that is marked complete with files missing."""
    try:
        os.remove(os.path.join(path, MARKER))
    except FileNotFoundError:
        pass
    except OSError:
        if not ignore_errors:
            raise
    shutil.rmtree(path, ignore_errors=ignore_errors)
