"""Validation with context parallelism: each cp rank evaluates its sequence shard and the summed
loss equals the cp-1 validation (flex forward on 2 gloo ranks; the forward is all it needs)."""

import pytest
import torch

from tests.helpers.distributed import run_distributed
from titan.config import load_config
from titan.data import build_tokenizer
from titan.models import get_model_spec, model_args_from_config
from titan.models.llama.parallelize import apply_llama_cp, cp_buffers
from titan.parallel.dims import ParallelDims
from titan.training.build import build_loader
from titan.training.metrics import MetricsProcessor
from titan.training.plan import run_model_args
from titan.training.validator import Validator

# flex CP on CPU: seq_len a multiple of 2 x cp x 128
ARGS = [
    "--model.attn_type",
    "flex",
    "--training.seq_len",
    "512",
    "--training.local_batch_size",
    "2",
    "--validation.enable",
    "--validation.steps",
    "2",
    "--metrics.enable_tensorboard",
    "false",
]


def _validation_loss(cp: int, world: int, folder: str) -> float:
    config = load_config([*ARGS, "--parallelism.context_parallel_degree", str(cp), "--job.dump_folder", folder])
    dims = ParallelDims(1, 1, cp, 1, 1, world)
    if world > 1:
        dims.build_mesh("cpu")
    spec = get_model_spec(config.model.name)
    args = model_args_from_config(spec, config.model)
    tokenizer = build_tokenizer(config.model.tokenizer_path)
    args = run_model_args(config, args, tokenizer.vocab_size)
    torch.manual_seed(0)
    model = spec.model_cls(args)
    model.init_weights()
    if cp > 1:
        apply_llama_cp(model, dims.submesh("cp"), "flex")
    metrics = MetricsProcessor(
        config.metrics, dump_folder=config.job.dump_folder, rank=0, device=torch.device("cpu"), num_flops_per_token=1
    )
    validator = Validator(
        config.validation,
        last_step=config.training.steps,
        model_parts=[model],
        parallel_dims=dims,
        loader=build_loader(config, tokenizer, dims, validation=True),
        device=torch.device("cpu"),
        metrics=metrics,
        cp_buffers=cp_buffers(model) if cp > 1 else (),
        cp_rotate_method=config.parallelism.context_parallel_rotate_method,
    )
    loss = validator.validate(1)
    assert model.freqs_cis.shape[0] == 512  # the RoPE table is whole again after the pass
    return loss


def _cp_rank(rank: int, world: int, folder: str) -> float:
    return _validation_loss(world, world, folder)


@pytest.mark.slow
def test_validation_with_cp_equals_cp1(tmp_path):
    reference = _validation_loss(1, 1, str(tmp_path / "ref"))
    losses = run_distributed(_cp_rank, 2, str(tmp_path / "cp"))
    assert losses[0] == losses[1]
    print("validation loss cp 1:", reference, "cp 2:", losses)
    assert abs(losses[0] - reference) < 1e-5, (losses, reference)
