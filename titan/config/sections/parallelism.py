"""[parallelism]: the Parallelism section of the config tree (assembled in titan/config/job_config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from titan.config.choices import ReshardAfterForward, RotateMethod
from titan.errors import require


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
    InterleavedZeroBubble, ZBVZeroBubble, DualPipeV; or PipelineScheduleSingle /
    PipelineScheduleMulti with pipeline_parallel_schedule_csv. Looped/interleaved/ZB-V schedules
    (and PipelineScheduleMulti) run several stages per rank, the others one."""
    pipeline_parallel_schedule_csv: str = ""
    """CSV file with the order of a custom schedule (torch's format: one row per rank, actions
    such as 0F1, 2B0, or 2I0/2W0 for split backward), run by torch's _PipelineScheduleRuntime.
    The schedule name still decides the stages per rank: PipelineScheduleMulti (2 per rank, or
    from pipeline_parallel_layers_per_stage) or PipelineScheduleSingle (1)."""
    pipeline_parallel_microbatch_size: int = 1
    """Sequences per pipeline micro-batch; local_batch_size must be a multiple of it."""
    pipeline_parallel_layers_per_stage: int = -1
    """Layers per (virtual) pipeline stage, the embedding and the output counting as
    pipeline_parallel_first/last_stage_less_layers layers: ceil((n_layers + first + last) /
    this) stages, a multiple of pipeline_parallel_degree (6 layers at 4: 2 stages). -1: one stage
    per rank for single-stage schedules, two per rank for looped ones."""
    pipeline_parallel_first_stage_less_layers: int = 1
    """Layers the first stage holds fewer than the others, for the embedding's cost."""
    pipeline_parallel_last_stage_less_layers: int = 1
    """Layers the last stage holds fewer than the others, for the final norm, output projection
    and loss."""
    module_fqns_per_model_part: list[list[str]] = field(default_factory=list)
    """Explicit split: one list of module names per stage, e.g. [["tok_embeddings", "layers.0"],
    ["layers.1", "norm", "output"]]; together they name every module once, in forward order.
    Empty: split from the layer counts above."""
    context_parallel_degree: int = 1
    """Context parallel degree: each sequence is split over this many ranks (ring attention).
    training.seq_len must be divisible by 2 x this degree (head-tail load balancing)."""
    context_parallel_rotate_method: RotateMethod = "allgather"
    """How context-parallel ranks exchange key/value shards: allgather or alltoall."""
    expert_parallel_degree: int = 1
    """Expert parallel (MoE models): the routed experts are split over this many ranks, taken from
    data_parallel_shard x context_parallel x tensor_parallel; tokens reach their experts by
    all-to-all. Must divide the model's number of experts."""
    expert_tensor_parallel_degree: int = 1
    """Expert tensor parallel: 1 (under EP the routed experts are not TP-sharded: EP borrows the
    TP ranks as well) or tensor_parallel_degree (each expert's hidden dim sharded over TP).
    Without EP, routed experts follow TP like the dense feed-forward."""

    def validate(self) -> None:
        require(
            self.data_parallel_replicate_degree >= 1,
            "parallelism.data_parallel_replicate_degree",
            self.data_parallel_replicate_degree,
            "an integer >= 1",
        )
        require(
            self.data_parallel_shard_degree == -1 or self.data_parallel_shard_degree >= 1,
            "parallelism.data_parallel_shard_degree",
            self.data_parallel_shard_degree,
            "-1 (the rest) or an integer >= 1",
        )
        for key in (
            "tensor_parallel_degree",
            "pipeline_parallel_degree",
            "context_parallel_degree",
            "pipeline_parallel_microbatch_size",
            "expert_parallel_degree",
            "expert_tensor_parallel_degree",
        ):
            require(getattr(self, key) >= 1, f"parallelism.{key}", getattr(self, key), "an integer >= 1")
        require(
            self.pipeline_parallel_layers_per_stage == -1 or self.pipeline_parallel_layers_per_stage >= 1,
            "parallelism.pipeline_parallel_layers_per_stage",
            self.pipeline_parallel_layers_per_stage,
            "-1 (automatic) or an integer >= 1",
        )
        for key in ("pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers"):
            require(getattr(self, key) >= 0, f"parallelism.{key}", getattr(self, key), "an integer >= 0")
        etp, tp = self.expert_tensor_parallel_degree, self.tensor_parallel_degree
        require(
            etp in (1, tp),
            "parallelism.expert_tensor_parallel_degree",
            etp,
            f"1 or tensor_parallel_degree ({tp})",
        )
