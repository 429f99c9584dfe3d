"""training.enable_cpu_offload: FSDP2 keeps parameters, gradients and optimizer states on the host and
steps there; on CPU ranks the losses equal the 1-process run's, with grad-norm clipping applied to the
offloaded gradients, and with the optimizer step in backward (which also runs with TP)."""

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

from tests.helpers.distributed import run_distributed
from tests.helpers.parity import FLAVORS, check, layouts_on_ranks, reference, run_layouts
from tests.helpers.tiny import extra_flavors, patch_flavors

SHARD2 = ("--parallelism.data_parallel_shard_degree", "2")
OFFLOAD = ("--training.enable_cpu_offload", "true")
EARLY = ("--optimizer.early_step_in_backward", "true")
CLIP = ("--training.max_norm", "0.5")
NO_CLIP = ("--training.max_norm", "0")


def _offload_policies(trainer) -> set[str]:
    """The offload policy of every FSDP module of the trainer's model."""
    return {
        type(m._get_fsdp_state()._fsdp_param_group.offload_policy).__name__
        for part in trainer.model_parts
        for m in part.modules()
        if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group is not None
    }


def _on_ranks(rank: int, world: int, dump: str) -> dict:
    from titan.training import trainer as trainer_mod

    built = []
    original = trainer_mod.Trainer.__init__

    def init(self, config):
        original(self, config)
        built.append(self)

    trainer_mod.Trainer.__init__ = init
    with extra_flavors(**FLAVORS):
        results = run_layouts(
            dump,
            {
                "fsdp2_offload_clip": (*SHARD2, *OFFLOAD, *CLIP),
                "fsdp2_step_in_backward": (*SHARD2, *EARLY, *NO_CLIP),
                "fsdp2_offload_step_in_backward": (*SHARD2, *OFFLOAD, *EARLY, *NO_CLIP),
                # Sequence-parallel norm weights: replicated parameters whose gradients the hooks see too.
                "tp2_step_in_backward": ("--parallelism.tensor_parallel_degree", "2", *EARLY, *NO_CLIP),
            },
        )
    offloaded, plain, both, _ = built
    optimizer_states = [
        t for o in offloaded.optimizers for s in o.state.values() for t in s.values() if isinstance(t, torch.Tensor)
    ]
    results["policies"] = [_offload_policies(t) for t in (offloaded, plain, both)]
    results["state_devices"] = {t.device.type for t in optimizer_states}
    return results


@pytest.mark.slow
def test_offload_matches_one_process(tmp_path, monkeypatch):
    patch_flavors(monkeypatch, **FLAVORS)
    clipped = reference(str(tmp_path / "ref_clip"), *CLIP)
    assert any(norm > 0.5 for _, norm in clipped)  # clipping acts on these steps
    unclipped = reference(str(tmp_path / "ref"), *NO_CLIP)
    results = run_distributed(_on_ranks, 2, str(tmp_path), timeout=900)
    for per_rank in results:
        assert per_rank["policies"] == [{CPUOffloadPolicy.__name__}, {"OffloadPolicy"}, {CPUOffloadPolicy.__name__}]
        assert per_rank["state_devices"] == {"cpu"}
    check([{"fsdp2_offload_clip": r["fsdp2_offload_clip"]} for r in results], clipped)
    early = ("fsdp2_step_in_backward", "fsdp2_offload_step_in_backward", "tp2_step_in_backward")
    check([{k: r[k] for k in early} for r in results], unclipped)


@pytest.mark.slow
def test_offload_with_pipeline_stages_matches_one_process(tmp_path, monkeypatch):
    """PP 2 x FSDP 2 on 4 ranks: each stage's FSDP shards offloaded, losses as in one process."""
    patch_flavors(monkeypatch, **FLAVORS)
    clipped = reference(str(tmp_path / "ref_clip"), *CLIP)
    layouts = {"pp2_fsdp2_offload": ("--parallelism.pipeline_parallel_degree", "2", *SHARD2, *OFFLOAD, *CLIP)}
    check(run_distributed(layouts_on_ranks, 4, str(tmp_path), layouts, timeout=900), clipped)
