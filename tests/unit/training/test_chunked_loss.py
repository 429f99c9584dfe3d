"""The chunked output + cross-entropy loss (training.loss_chunk_tokens) against the full logits:
the same losses and gradients (fp32), bf16 within bf16's error of an fp32 reference, and the
logits never allocated whole."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.tiny import TINY, build
from titan.training.loss import IGNORE_INDEX, TokenLoss

SEQ, BSZ = 32, 4


def _batches(steps: int, vocab: int, seed: int = 3):
    """Fixed batches with ignored labels (as block-causal packing and padding produce)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (BSZ, SEQ + 1), generator=g)
        labels = tokens[:, 1:].clone()
        labels[torch.rand(labels.shape, generator=g) < 0.1] = IGNORE_INDEX
        out.append((tokens[:, :-1], labels))
    return out


def _step(model, loss: TokenLoss, inputs, labels, micro: int = 2) -> float:
    """One step of `micro` accumulated micro-batches, normalised by the step's token count."""
    tokens = (labels != IGNORE_INDEX).sum()
    total = 0.0
    for x, y in zip(inputs.chunk(micro), labels.chunk(micro)):
        scaled = loss(model(x), y, 1.0 / tokens)
        scaled.backward()
        total += scaled.item()
    return total


def _owning(model):
    model.loss_owns_output = True
    return model


def test_chunked_equals_full_over_20_steps():
    """fp32, 20 AdamW steps with 2 accumulated micro-batches and ignored labels, chunks of 48 of a
    64-token micro-batch (an uneven last chunk): losses within 1e-6, every gradient within 1e-5 relative."""
    full, chunked = build(), _owning(build())
    full_loss, chunk_loss = TokenLoss(0), TokenLoss(48)
    chunk_loss.bind([chunked])
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (full, chunked)]
    for inputs, labels in _batches(20, TINY.vocab_size):
        for opt in opts:
            opt.zero_grad()
        a = _step(full, full_loss, inputs, labels)
        b = _step(chunked, chunk_loss, inputs, labels)
        assert abs(a - b) <= 1e-6, (a, b)
        for (name, p), q in zip(full.named_parameters(), chunked.parameters()):
            assert p.grad is not None and q.grad is not None, name
            rel = ((p.grad - q.grad).norm() / p.grad.norm()).item()
            assert rel <= 1e-5, (name, rel)
        for opt in opts:
            opt.step()


def test_chunked_evaluation_equals_full():
    """Without grad (validation) the chunked loss is a plain sum over the chunks."""
    model = build()
    inputs, labels = _batches(1, TINY.vocab_size)[0]
    one = torch.ones(())
    with torch.no_grad():
        full = TokenLoss(0)(model(inputs), labels, one)
        loss = TokenLoss(40)
        loss.bind([_owning(model)])
        chunked = loss(model(inputs), labels, one)
    assert not chunked.requires_grad
    torch.testing.assert_close(chunked, full, rtol=1e-6, atol=0)


def test_bf16_chunked_within_bf16_error_of_fp32():
    """Autocast bf16: the chunked loss and gradients differ from the fp32 reference by no more
    than the full-logits bf16 run does (times a small factor), i.e. by bf16's own error."""
    inputs, labels = _batches(1, TINY.vocab_size)[0]
    ref_model = build()
    n = (labels != IGNORE_INDEX).sum()

    def run(chunk: int, bf16: bool):
        model = copy.deepcopy(ref_model)
        loss = TokenLoss(chunk)
        if chunk:
            loss.bind([_owning(model)])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            scaled = loss(model(inputs), labels, 1.0 / n)
        scaled.backward()
        return scaled.item(), torch.cat([p.grad.flatten() for p in model.parameters()])

    ref, ref_g = run(0, False)
    full, full_g = run(0, True)
    chunked, chunk_g = run(24, True)
    bf16_eps = 2.0**-8
    assert abs(chunked - ref) <= max(4 * abs(full - ref), 4 * bf16_eps * abs(ref))
    err_full = ((full_g - ref_g).norm() / ref_g.norm()).item()
    err_chunk = ((chunk_g - ref_g).norm() / ref_g.norm()).item()
    assert err_chunk <= max(2 * err_full, 4 * bf16_eps), (err_chunk, err_full)


class _LargestTensor(TorchDispatchMode):
    """The largest tensor (elements) any op returns, forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("chunk", [0, 64])
def test_logits_never_materialised_whole(chunk):
    """vocab 4096 x 512 tokens: the full logits are 2M elements. With chunks of 64 tokens no op
    (forward or backward) returns a tensor of more than 64 x vocab elements; the full path, the
    control, does return the whole logits."""
    args = copy.deepcopy(TINY)
    args.vocab_size, args.max_seq_len = 4096, 256
    model = build(args)
    inputs = torch.randint(0, args.vocab_size, (2, 256))
    labels = torch.randint(0, args.vocab_size, (2, 256))
    loss = TokenLoss(chunk)
    if chunk:
        loss.bind([_owning(model)])
    with _LargestTensor() as mode:
        loss(model(inputs), labels, torch.tensor(1.0 / labels.numel())).backward()
    full_logits = labels.numel() * args.vocab_size
    if chunk:
        assert mode.largest <= chunk * args.vocab_size, mode.largest
    else:
        assert mode.largest >= full_logits


def test_memory_estimate_counts_the_chunked_loss_and_the_padded_vocabulary():
    """The estimator runs the configured loss: chunks save at least the fp32 logits and their
    gradient; model.vocab_size adds its rows to the embedding and the output projection."""
    from titan.config import load_config
    from titan.training.memory import estimate_memory

    def estimate(*flags: str):
        base = ["--training.seq_len", "256", "--training.local_batch_size", "2", "--model.n_layers", "1"]
        base += ["--training.mixed_precision_param", "float32", "--model.vocab_size", "32768"]
        return estimate_memory(load_config([*base, *flags]), 1)

    full, chunked = estimate(), estimate("--training.loss_chunk_tokens", "128")
    logits_fp32 = 2 * 256 * 32768 * 4
    assert full.activation_bytes - chunked.activation_bytes >= logits_fp32
    padded = estimate("--model.vocab_size", str(32768 + 4096))
    assert padded.params - full.params == 2 * 4096 * 256  # debugmodel: dim 256, untied
