"""The checks that need more than the config, run before any process group or model exists.

titan.config.load_config returns a config that has checked itself (JobConfig.validate: types,
choices, ranges, the rules between sections). What needs runtime knowledge lives in the module that
owns each feature (the model registry and its flavors and shapes, the optimizer table, torch's
pipeline schedules and the schedule's CSV file); ``validate_job`` runs those.

``check_job`` is the one check of everything that can be decided before a process group: the merged
config, the model's shape (flavor, overrides, experts, the tokenizer's vocabulary), the layout for
the world size, the device's kernels, the files the config names (tokenizer, data, hub mirror, the
checkpoint to resume or start from) and the installed packages. The launch pre-check
(``python -m titan.launch.check``, run by run_train.sh, ``python -m titan.launch`` and the Slurm
script), the dry run and every rank call it; the ranks skip what only reads files or the network
(``once``) when the launcher already did it. It writes nothing: a run that never starts leaves no
file behind.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal

from titan.config import JobConfig
from titan.errors import TitanError
from titan.training.validation import load_job, validate_job

if TYPE_CHECKING:
    from titan.training.plan import RunPlan

__all__ = ["CHECKED_ENV", "check_checkpoint", "check_job", "checked_by_launcher", "load_job", "replan", "validate_job"]

# Set by titan's launcher for its ranks once check_job passed in the launcher for the same argv:
# the ranks then skip the checks that only read files or the network (nothing checked twice).
CHECKED_ENV = "TITAN_CONFIG_CHECKED"


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    from titan.log import logger

    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def checked_by_launcher() -> bool:
    """Whether this rank's launcher ran check_job (with ``once``) before starting it."""
    return os.environ.get(CHECKED_ENV) == "1"


def check_job(
    config: JobConfig,
    world_size: int | None,
    device_type: str,
    *,
    data_here: bool = True,
    once: bool = True,
    lighthouse: Literal["required", "if_set", "skip"] = "if_set",
) -> RunPlan | None:
    """Raise TitanError (one line) for the first problem found before any process group; return the
    run plan (None without ``world_size``: the checks that need the layout are skipped).

    ``data_here`` False (the dry run, away from the cluster's files): the tokenizer may be missing,
    data, hub and checkpoint files are not looked at. ``once`` False (a rank whose launcher ran this
    already): the checks that only read the hub or the checkpoint folders are skipped.
    ``lighthouse``: how the torchft lighthouse of replica groups is checked (titan.ft.preflight):
    "required" on the ranks, "if_set" in a launcher that starts its own, "skip" in the dry run."""
    from titan.ft.preflight import CONNECT_WAIT_S, QUICK_WAIT_S, check_torchft
    from titan.training.plan import check_run, plan_model, plan_run

    wait_s = CONNECT_WAIT_S if lighthouse == "required" else QUICK_WAIT_S
    check_torchft(config, lighthouse="skip" if not data_here else lighthouse, wait_s=wait_s)

    if world_size is None:
        spec, model_args, tokenizer = plan_model(config, data_here=data_here)
        plan = None
    else:
        plan = plan_run(config, world_size, device_type, data_here=data_here)
        spec, model_args, tokenizer = plan.spec, plan.model_args, plan.tokenizer
    if not (once and data_here):
        return plan
    from titan.data.build import check_hub

    with _quiet():  # what it logs, the ranks' loaders log
        check_hub(config)  # offline, a typo'd hub config / split / column, a damaged mirror
    dp_degree = plan.parallel_dims.dp_degree if plan is not None else None
    vocab = tokenizer.vocab_size if tokenizer is not None else None
    settled = copy.deepcopy(model_args)  # the ranks settle their own copy after the process group exists
    with _quiet():  # its warnings (a torn step, a settled mismatch) come from the ranks, once
        changed = check_checkpoint(config, spec, settled, vocab, dp_degree)
    if changed and plan is not None:
        check_run(config, plan.parallel_dims, settled, device_type)
    return plan


def replan(config: JobConfig, world_size: int, device_type: str, parallel_dims) -> RunPlan:  # a ParallelDims
    """The checkpoint's values were merged into the config (checkpoint.config_mismatch =
    use_checkpoint): check the merged config and plan it again. The layout stays: config_diff
    merges no parallelism key, so the mesh built for it (``parallel_dims``) still holds."""
    config.validate()
    plan = check_job(config, world_size, device_type, once=False)
    assert plan is not None  # a world size was given
    plan.parallel_dims = parallel_dims
    return plan


def check_checkpoint(config: JobConfig, spec, model_args, tokenizer_vocab: int | None, dp_degree: int | None) -> bool:
    """What the checkpoint a run resumes from or starts with says about this run, read from the
    files it keeps beside its tensors (run config, model_args.json, config.json): a checkpoint of
    another model, or of a config that checkpoint.config_mismatch = "error" rejects. ``model_args``
    is changed (and True returned) when the weights brought in decide the model settings. Reads
    only; the ranks verify the checkpoint's files and load it."""
    from titan.checkpointing import config_diff
    from titan.checkpointing.folders import resume_candidates
    from titan.checkpointing.model_settings import settle

    cfg = config.checkpoint
    if not cfg.enable or cfg.create_seed_checkpoint:
        return False
    candidates = []
    if cfg.load_step >= 0 or not config.job.overwrite:
        root = os.path.join(config.job.dump_folder, cfg.folder)
        candidates = resume_candidates(root, cfg.load_step) if os.path.isdir(root) else []
    if candidates and dp_degree is not None and cfg.config_mismatch == "error":
        # The ranks resume from the newest intact one: an error only when every candidate has one.
        errors = []
        for found in candidates:
            if not found.model_only:
                try:
                    config_diff.resolve(
                        found.path, config_diff.snapshot(config, dp_degree), "error", cfg.exclude_from_loading
                    )
                except TitanError as e:  # this candidate's config differs
                    errors.append(e)
                    continue
            errors = []
            break
        if errors:
            raise errors[0]
    return settle(config, spec, model_args, bool(candidates), tokenizer_vocab)
