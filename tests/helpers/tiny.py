"""A tiny Llama for the parallel/speed tests (every Linear has dims that are multiples of 16),
and extra llama3 flavors for tests that train through the config, added through the registry
(titan.models.register_flavor) for the test's duration."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
import torch.nn as nn

from titan.models import get_model_spec, register_flavor, register_model_spec
from titan.models.llama import Transformer, TransformerModelArgs
from titan.training.loss import cross_entropy_sum

TINY = TransformerModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=32)


@contextlib.contextmanager
def extra_flavors(**extra: TransformerModelArgs) -> Iterator[None]:
    """Inside the block `--model.flavor NAME` finds the `extra` llama3 flavors too (a name the
    shipped table has is replaced); afterwards the llama3 spec is the one from before."""
    saved = get_model_spec("llama3")
    try:
        for name, args in extra.items():
            register_flavor("llama3", name, args, replace=True)
        yield
    finally:
        register_model_spec(saved, replace=True)


def patch_flavors(monkeypatch, **extra: TransformerModelArgs) -> None:
    """extra_flavors for the rest of a pytest test: monkeypatch puts the llama3 spec back at teardown
    (it restores the registry's entry, which register_flavor replaces)."""
    import titan.models

    specs = titan.models._REGISTRY.specs()
    monkeypatch.setitem(specs, "llama3", specs["llama3"])
    for name, args in extra.items():
        register_flavor("llama3", name, args, replace=True)


def build(args: TransformerModelArgs = TINY, seed: int = 0) -> Transformer:
    with torch.device("meta"):
        model = Transformer(copy.deepcopy(args))
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def batch(args: TransformerModelArgs = TINY, bsz: int = 4, seq: int = 32, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, args.vocab_size, (bsz, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def train_losses(model: nn.Module, steps: int, loss_fn=cross_entropy_sum, lr: float = 3e-3) -> list[float]:
    """AdamW steps on one fixed batch (the loss falls as the model memorises it)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    inputs, labels = batch()
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model(inputs), labels) / labels.numel()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# An HF-interop tiny model: GQA and Llama 3.1 RoPE scaling at a size where every band occurs.
def small_args(**kw) -> TransformerModelArgs:
    # GQA (8 q / 2 kv heads) and 3.1 RoPE scaling whose bands all occur at head_dim 8:
    # wavelengths 6.3 .. ~3500 straddle original_ctx / high (8) and original_ctx / low (32).
    base = dict(
        dim=64,
        n_layers=2,
        n_heads=8,
        n_kv_heads=2,
        vocab_size=128,
        multiple_of=32,
        rope_theta=10000.0,
        use_rope_scaling=True,
        rope_scale_factor=4.0,
        rope_original_max_position_embeddings=32,
        max_seq_len=64,
        norm_eps=1e-5,
    )
    return TransformerModelArgs(**(base | kw))


def random_model(args: TransformerModelArgs, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    with torch.no_grad():  # norms start at 1; perturb them so a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif ".wq." in name or ".wk." in name:
                p.mul_(4.0)  # sharper attention, so positions (RoPE) visibly shape the logits
    return model.eval()


def assert_bitwise(a: dict, b: dict) -> None:
    assert set(a) == set(b), set(a) ^ set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
