"""[fault_tolerance]: replica groups through torchft (torchtitan v0.2.2's keys and meanings)."""

from __future__ import annotations

from dataclasses import dataclass, field

from titan.config.choices import FTProcessGroup, SemiSyncMethod
from titan.errors import require


@dataclass
class FaultTolerance:
    enable: bool = False
    """Train as one of several replica groups joined by torchft: the data-parallel replicate
    dimension runs across groups through torchft's Manager, a failed group does not stop the
    others, and a restarted group heals from a live peer. Needs the `titan[ft]` extra and a
    lighthouse (TORCHFT_LIGHTHOUSE); docs/fault_tolerance.md."""
    process_group: FTProcessGroup = "gloo"
    """The process group between replica groups: gloo or nccl (nccl needs CUDA)."""
    process_group_timeout_ms: int = 10000
    """A collective between replica groups that does not finish in this time fails the step
    (discarded) instead of hanging."""
    replica_id: int = 0
    """This replica group's id, 0 .. group_size - 1; unique among the live groups."""
    group_size: int = 0
    """How many replica groups the job has (the data is split over them); 0 = one."""
    min_replica_size: int = 1
    """Replica groups that must take part in a step for it to commit; fewer discard it."""
    semi_sync_method: SemiSyncMethod = "none"
    """none (every step's gradients averaged over the groups), local_sgd (weights averaged every
    sync_steps) or diloco (an outer optimizer step on the averaged weight deltas every sync_steps)."""
    sync_steps: int = 5
    """Inner steps between synchronizations (local_sgd, diloco)."""
    num_fragments: int = 1
    """diloco: the model split into this many fragments, synchronized in turn (streaming DiLoCo)."""
    fragment_sync_delay: int = 0
    """diloco: inner steps between starting a fragment's all-reduce and waiting for it."""
    fragment_update_alpha: float = 0.0
    """diloco: mix of local (alpha) and global (1 - alpha) parameters after a fragment sync."""
    should_quantize: bool = False
    """diloco: quantize the pseudo-gradients before the all-reduce (needs triton on CUDA)."""
    module_fqns_per_model_fragment: list[list[str]] = field(default_factory=list)
    """diloco: the modules of each fragment, e.g. [["tok_embeddings", "layers.0"], ["layers.1",
    "norm", "output"]]; empty = num_fragments split by layer."""

    @property
    def groups(self) -> int:
        """The number of replica groups (group_size, 0 read as one)."""
        return max(self.group_size, 1)

    def data_shard(self, dp_rank: int, dp_degree: int) -> tuple[int, int]:
        """This rank's share of the data among all replica groups: (rank, world). Each group reads
        its own slice, so no document is read by two groups."""
        if not self.enable:
            return dp_rank, dp_degree
        return self.replica_id * dp_degree + dp_rank, self.groups * dp_degree

    def validate(self) -> None:
        if not self.enable:
            return
        ints = (("process_group_timeout_ms", 1), ("group_size", 0), ("min_replica_size", 1), ("sync_steps", 1))
        for key, low in ints:
            value = getattr(self, key)
            require(value >= low, f"fault_tolerance.{key}", value, f"an integer >= {low}")
        require(self.num_fragments >= 1, "fault_tolerance.num_fragments", self.num_fragments, "an integer >= 1")
        require(
            0 <= self.replica_id < self.groups,
            "fault_tolerance.replica_id",
            self.replica_id,
            f"0 .. {self.groups - 1} (fault_tolerance.group_size = {self.group_size})",
        )
        require(
            self.min_replica_size <= self.groups,
            "fault_tolerance.min_replica_size",
            rule=f"({self.min_replica_size}) is larger than the replica groups given"
            f" (fault_tolerance.group_size = {self.group_size}): no step could ever commit",
        )
        if self.semi_sync_method == "diloco":
            frags = len(self.module_fqns_per_model_fragment) or self.num_fragments
            require(
                self.sync_steps % frags == 0,
                "fault_tolerance.sync_steps",
                rule=f"({self.sync_steps}) must be a multiple of the fragments ({frags}): they synchronize in turn",
            )
            require(
                self.fragment_sync_delay < self.sync_steps // frags,
                "fault_tolerance.fragment_sync_delay",
                rule=f"({self.fragment_sync_delay}) must be below sync_steps / fragments ({self.sync_steps // frags})",
            )
        alpha = self.fragment_update_alpha
        require(0.0 <= alpha <= 1.0, "fault_tolerance.fragment_update_alpha", alpha, "a number in [0, 1]")
        delay = self.fragment_sync_delay
        require(delay >= 0, "fault_tolerance.fragment_sync_delay", delay, "an integer >= 0")
        frags = self.module_fqns_per_model_fragment
        if self.semi_sync_method == "diloco" and frags:
            require(
                len(frags) == self.num_fragments or self.num_fragments == 1,
                "fault_tolerance.module_fqns_per_model_fragment",
                rule=f"has {len(frags)} fragments but fault_tolerance.num_fragments is {self.num_fragments}",
            )
        require(
            self.semi_sync_method == "diloco" or (self.num_fragments == 1 and not frags),
            "fault_tolerance.num_fragments",
            rule='and module_fqns_per_model_fragment split the model only with semi_sync_method = "diloco"',
        )
