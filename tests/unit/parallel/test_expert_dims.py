"""The experts' layout: EP borrows dp_shard x cp x tp ranks, ETP is 1 or TP, and what cannot work is
refused in one line before any process group exists."""

from types import SimpleNamespace

import pytest

from titan.config import load_config
from titan.errors import TitanError
from titan.parallel.dims import ParallelDims, check_experts


def _dims(world: int, **degrees) -> ParallelDims:
    d = dict(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1) | degrees
    return ParallelDims(world_size=world, **d)


@pytest.mark.parametrize(
    ("world", "degrees", "efsdp"),
    [
        (2, {"ep": 2}, 1),
        (4, {"ep": 2}, 2),
        (4, {"tp": 2, "ep": 2, "etp": 2}, 1),
        (4, {"tp": 2, "ep": 2}, 2),  # ETP 1: EP takes TP ranks as well
        (4, {"tp": 2, "ep": 4}, 1),
        (16, {"dp_replicate": 2, "tp": 2, "pp": 2, "ep": 2, "etp": 2}, 1),
        (64, {"tp": 8, "etp": 8}, 8),  # torchtitan's 17bx16e layout: EP 1, experts follow TP
    ],
)
def test_efsdp_is_what_ep_and_etp_leave_of_shard_cp_tp(world: int, degrees: dict, efsdp: int) -> None:
    dims = _dims(world, **degrees)
    assert dims.efsdp == efsdp


def test_impossible_expert_layouts_are_refused_in_one_line() -> None:
    with pytest.raises(TitanError, match=r"expert_tensor_parallel_degree' got 2; valid: 1 or the tensor parallel"):
        _dims(4, tp=4, ep=2, etp=2)
    with pytest.raises(TitanError, match=r"expert_parallel_degree' got 3; .* must divide .* = 4"):
        _dims(4, ep=3)
    with pytest.raises(TitanError, match="got 4; .* must divide"):
        _dims(4, tp=2, ep=4, etp=2)  # ETP ranks are not EP ranks: 4 x 2 > 4
    moe = SimpleNamespace(moe_args=SimpleNamespace(num_experts=6))
    with pytest.raises(TitanError, match="valid: a divisor of the model's 6 experts"):
        check_experts(_dims(4, ep=4), moe)
    with pytest.raises(TitanError, match="this model has no routed experts"):
        check_experts(_dims(2, ep=2), SimpleNamespace())
    check_experts(_dims(4, ep=2), moe)


def test_config_keys_and_torchtitan_spellings() -> None:
    par = load_config(["--parallelism.expert_parallel_degree", "2"]).parallelism
    assert (par.expert_parallel_degree, par.expert_tensor_parallel_degree) == (2, 1)
    with pytest.raises(TitanError, match="expert_tensor_parallel_degree' got 2; valid: 1 or tensor_parallel_degree"):
        load_config(["--parallelism.expert_tensor_parallel_degree", "2"])
    with pytest.raises(TitanError, match="expert_parallel_degree' got 0"):
        load_config(["--parallelism.expert_parallel_degree", "0"])
    load_config(["--parallelism.expert_parallel_comm_backend", "standard"])
    with pytest.raises(TitanError, match="expert_parallel_comm_backend' is not supported by titan: DeepEP"):
        load_config(["--parallelism.expert_parallel_comm_backend", "deepep"])


@pytest.mark.parametrize(
    ("shape", "efsdp", "ep", "experts", "dim"),
    [
        ((16, 2880, 5760), 8, 8, 128, 0),  # gpt-oss 120b at EP 8 x 8: a whole expert or more each
        ((16, 2880, 5760), 64, 8, 128, 1),  # 512 ranks: 2880 / 64 = 45 rows of the hidden dim each
        ((16, 2880, 5760), 128, 8, 128, 2),  # 1,024 ranks: 2880 does not split over 128, 5760 does
        ((16, 2880, 2880), 128, 8, 128, 0),  # neither does: whole experts, padded
        ((256, 2048, 7168), 512, 1, 256, 1),  # DeepSeek-V3 without EP beyond 256 ranks
    ],
)
def test_the_experts_shard_dim_is_one_fsdp_can_split(shape, efsdp, ep, experts, dim) -> None:
    from titan.parallel.expert_parallel import experts_shard_dim

    assert experts_shard_dim(shape, efsdp, ep, experts) == dim
