"""[parallelism]: the Parallelism section of the config tree (assembled in titan/config/job_config.py)."""

from __future__ import annotations

from dataclasses import dataclass

from titan.config.choices import ReshardAfterForward, RotateMethod


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    """Replicas of the model (DDP, or HSDP together with data_parallel_shard_degree)."""
    data_parallel_shard_degree: int = -1
    """FSDP shard group size. -1: the ranks left over by the other degrees."""
    fsdp_reshard_after_forward: ReshardAfterForward = "default"
    """Free gathered parameters after forward: default (yes, except the root module), always,
    never."""
    tensor_parallel_degree: int = 1
    """Tensor (+ sequence) parallel degree: each block's matmuls are split over this many ranks.
    Must divide model n_heads and n_kv_heads."""
    disable_loss_parallel: bool = False
    """With TP, gather the full logits before the loss instead of computing cross entropy on
    vocab-sharded logits (loss parallel, the default, saves the gather and its memory)."""
    enable_async_tensor_parallel: bool = False
    """Overlap TP collectives with matmuls (symmetric memory; CUDA only, takes effect in
    compiled blocks)."""
    pipeline_parallel_degree: int = 1
    """Pipeline stages' rank groups: the layers are split into stages over this many ranks."""
    pipeline_parallel_schedule: str = "1F1B"
    """torch.distributed.pipelining schedule by name: GPipe, 1F1B, Interleaved1F1B, LoopedBFS,
    InterleavedZeroBubble, ZBVZeroBubble, DualPipeV. Looped/interleaved/ZB-V schedules run
    several stages per rank."""
    pipeline_parallel_schedule_csv: str = ""
    """CSV file describing a custom schedule (torch's _PipelineScheduleRuntime format); when
    set it replaces pipeline_parallel_schedule."""
    pipeline_parallel_microbatch_size: int = 1
    """Sequences per pipeline micro-batch; local_batch_size must be a multiple of it."""
    pipeline_parallel_layers_per_stage: int = -1
    """Transformer layers per pipeline stage. -1: one stage per rank for single-stage schedules,
    two per rank for multi-stage ones, layers spread as evenly as possible (a remainder goes to
    the middle stages first, never to the last one, which holds the output and loss)."""
    context_parallel_degree: int = 1
    """Context parallel degree: each sequence is split over this many ranks (ring attention).
    training.seq_len must be divisible by 2 x this degree (head-tail load balancing)."""
    context_parallel_rotate_method: RotateMethod = "allgather"
    """How context-parallel ranks exchange key/value shards: allgather or alltoall."""
