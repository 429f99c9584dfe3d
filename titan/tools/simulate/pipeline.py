"""Pipeline stages in the simulator: shapes given, not inferred over the wire.

torch's pipeline stages learn what they receive either from shapes given to them ("static") or by
running a first forward and sending each stage's output metadata to the next rank as a pickled
object ("dynamic"), which the fake process group cannot carry. The simulator gives every stage
of its rank its shapes: the first stage takes the micro-batch's tokens, every other stage the
hidden states between blocks ([micro-batch, sequence / CP / TP (sequence parallel), dim], in the
compute dtype: FSDP's param dtype, else float32 under autocast), and each stage checks what it
receives and sends against them (torch's runtime validation, on for the simulated stages). The
schedule's warm-up vote (whether every stage has its shapes) is then read as "yes".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.pipelining._utils import _StageMeta, extract_tensor_metas

from titan.parallel.fsdp import DTYPES
from titan.tools.simulate.reads import HostReads

__all__ = ["static_stage_shapes"]


def _stages(schedule: Any) -> list[Any]:
    stages = getattr(schedule, "_stages", None)
    return list(stages) if stages is not None else [schedule._stage]


def static_stage_shapes(rank: Any, reads: HostReads) -> None:
    """Give the rank's pipeline stages (if any) their input and output shapes."""
    schedule = rank.pp_schedule
    if schedule is None:
        return
    config, dims = rank.config, rank.parallel_dims
    t = config.training
    micro = config.parallelism.pipeline_parallel_microbatch_size
    seq = t.seq_len // dims.cp
    dtype = DTYPES[t.mixed_precision_param] if dims.fsdp_enabled else torch.float32
    tokens = torch.empty(micro, seq, dtype=torch.int64, device=rank.device)
    hidden = torch.empty(micro, seq // dims.tp, rank.plan.model_args.dim, dtype=dtype, device=rank.device)
    hidden.requires_grad_(True)  # stages send gradients back for it
    for stage in _stages(schedule):
        inputs = (tokens,) if stage.is_first else (hidden,)
        # The last stage sends nothing: its output's shape (logits, or hidden states for the chunked
        # loss) is not used, only that it has one.
        stage._user_meta = _StageMeta(inputs=extract_tensor_metas(inputs), outputs=extract_tensor_metas((hidden,)))
        stage._runtime_validate = True
    warm_up: Callable[..., Any] = schedule._warmup_p2p

    def vote(*args: Any, **kwargs: Any) -> Any:
        with reads.answering(1):  # every stage voted "static": the shapes above
            return warm_up(*args, **kwargs)

    schedule._warmup_p2p = vote
