"""The fixed choices of string options, as Literal types.

The section dataclasses (titan/config/sections/) annotate their fields with these, so the loader
checks them (one line naming the key, the value and the valid choices) and --help /
docs/config_reference.md list them. Code that maps a choice to behaviour (the dtype table in
titan/parallel/fsdp.py, the optimizer kernels, the activation-checkpointing modes) derives its list
from the same Literal with ``choices()``, so adding a choice happens here once.

Choices that need runtime knowledge (model names and flavors from the registry, optimizer and
pipeline-schedule names, which are matched case-insensitively) stay plain ``str`` and are
checked by the module that owns them.
"""

from __future__ import annotations

import typing
from typing import Any, Literal

AttnType = Literal["sdpa", "flex", "varlen"]
AttnMaskType = Literal["causal", "block_causal"]
LinearAttnBackend = Literal["auto", "torch", "fla"]
OptimizerImplementation = Literal["auto", "for-loop", "foreach", "fused"]
MuonAdjustLR = Literal["match_rms_adamw", "original"]
WeightDecayExclude = Literal["norms", "embeddings"]
DecayType = Literal["linear", "sqrt", "cosine"]
TxtSplit = Literal["paragraph", "line", "document"]
BadLines = Literal["fail", "skip"]
NonFinite = Literal["stop", "skip_step"]
MixtureExhausted = Literal["stop", "restart"]
DType = Literal["float32", "bfloat16", "float16"]
MixedPrecisionDType = Literal["float32", "bfloat16"]
ReshardAfterForward = Literal["default", "always", "never"]
FTProcessGroup = Literal["gloo", "nccl"]
SemiSyncMethod = Literal["none", "local_sgd", "diloco"]
RotateMethod = Literal["allgather", "alltoall"]
AsyncMode = Literal["disabled", "async", "async_with_pinned_mem"]
CheckpointPart = Literal["model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng"]
OnSaveError = Literal["stop", "retry"]
ConfigMismatch = Literal["error", "use_checkpoint", "use_new"]
ACMode = Literal["none", "full", "selective", "memory_budget"]
DeterminismCheck = Literal["default", "none"]
CompileComponent = Literal["model", "loss"]
Float8Recipe = Literal["tensorwise", "rowwise"]


def choices(literal: Any) -> tuple[str, ...]:
    """The options of one of the Literal types above, in their documented order."""
    return typing.get_args(literal)
