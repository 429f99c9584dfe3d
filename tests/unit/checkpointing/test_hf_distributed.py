"""HF folders into and out of an FSDP2-sharded model on 2 gloo ranks (initial_load_in_hf / last_save_in_hf hooks)."""

from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.tiny import assert_bitwise, random_model, small_args
from titan.checkpointing.hf import load_hf, save_hf


def _fsdp_round_trip(rank: int, world: int, src: str, out: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from titan.checkpointing.hf import load_hf_into_model, save_model_hf
    from titan.models.llama.model import Transformer
    from titan.parallel.fsdp import apply_fsdp

    args = small_args()
    with torch.device("meta"):
        model = Transformer(args)
    apply_fsdp(
        model,
        init_device_mesh("cpu", (world,)),
        param_dtype="float32",
        reduce_dtype="float32",
        reshard_after_forward="default",
    )
    model.to_empty(device="cpu")
    load_hf_into_model([model], src)
    sharded = all(isinstance(p, DTensor) for p in model.parameters())
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in model.state_dict().items()}
    save_model_hf([model], out)  # args from model.model_args
    return sharded, full if rank == 0 else None


@pytest.mark.slow
def test_fsdp_model_loads_and_exports_hf_bitwise(tmp_path: Path):
    args = small_args()
    sd = random_model(args, seed=5).state_dict()
    save_hf(sd, args, tmp_path / "src")
    results = run_distributed(_fsdp_round_trip, 2, str(tmp_path / "src"), str(tmp_path / "out"))
    assert all(sharded for sharded, _ in results)
    assert_bitwise(results[0][1], sd)
    assert_bitwise(load_hf(tmp_path / "out")[0], sd)
