"""torch.compile: blocks compiled in place (names unchanged), loss compiled, eager-equal training."""

from __future__ import annotations

import pytest
import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from tests.helpers.tiny import build, train_losses
from titan.config import load_config
from titan.errors import TitanError
from titan.models.llama.parallelize import parallelize_llama
from titan.parallel.compile import build_loss_fn, is_compiled, wait_async_output
from titan.parallel.dims import ParallelDims
from titan.training.loss import cross_entropy_sum


@pytest.mark.slow
def test_compiled_blocks_with_selective_ac_train_like_eager(tmp_path, monkeypatch):
    # One cold inductor compile of a block (forward + backward, shared by both blocks) and the loss.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    cfg = load_config(["--compile.enable", "--activation_checkpoint.mode", "selective"])
    eager = build()
    model = build()
    names = [n for n, _ in model.named_parameters()]
    parallelize_llama(model, ParallelDims(1, 1, 1, 1, 1, world_size=1), cfg)
    for block in model.layers.values():
        assert isinstance(block, CheckpointWrapper) and is_compiled(block)
    assert [n.replace("_checkpoint_wrapped_module.", "") for n, _ in model.named_parameters()] == names
    loss_fn = build_loss_fn(cross_entropy_sum, True)
    assert loss_fn is not cross_entropy_sum

    got = train_losses(model, 3, loss_fn=loss_fn)
    ref = train_losses(eager, 3)
    assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-4, (got, ref)
    torch.testing.assert_close(
        model.layers["1"].feed_forward.w2.weight, eager.layers["1"].feed_forward.w2.weight, atol=1e-4, rtol=1e-4
    )


def test_components_are_checked_and_honoured():
    with pytest.raises(TitanError, match="compile.components"):
        load_config(["--compile.components", "model,optimizer"])
    model = build()
    config = load_config(["--compile.components", "loss", "--compile.enable"])
    parallelize_llama(model, ParallelDims(1, 1, 1, 1, 1, world_size=1), config)
    assert not any(is_compiled(b) for b in model.layers.values())
    parallelize_llama(model, ParallelDims(1, 1, 1, 1, 1, world_size=1), load_config(["--compile.components", "model"]))
    assert not any(is_compiled(b) for b in model.layers.values())  # compile.enable is false
    assert build_loss_fn(cross_entropy_sum, False) is cross_entropy_sum


class _AsyncOutput(torch.autograd.Function):
    """What a TP embedding hands the first block: an AsyncCollectiveTensor inside autograd."""

    @staticmethod
    def forward(ctx, x):
        return AsyncCollectiveTensor(x.detach().clone())

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_tp_embedding_output_is_waited_before_the_compiled_blocks():
    t = torch.randn(2, 3)
    out = wait_async_output(None, (), AsyncCollectiveTensor(t))
    assert type(out) is torch.Tensor and torch.equal(out, t)
    assert wait_async_output(None, (), t) is t
    # The wait keeps the autograd edge: the embedding before the compiled blocks gets its gradient.
    x = torch.randn(2, 3, requires_grad=True)
    waited = wait_async_output(None, (), _AsyncOutput.apply(x))
    assert type(waited) is torch.Tensor
    (waited * 2).sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.full_like(x, 2.0))
