"""Block-causal (document-masked) attention: a packed window gives each document the logits it
gets when run alone (fp32), for sdpa, varlen (SDPA with the block-diagonal mask on CPU) and the
flex forward; the mask is built once per forward."""

from dataclasses import replace

import pytest
import torch

from tests.helpers.tiny import TINY
from titan.config import load_config
from titan.errors import TitanError
from titan.models.documents import document_ids
from titan.models.llama.masks import varlen_mask
from titan.models.llama.model import Transformer
from titan.parallel.dims import ParallelDims
from titan.training.plan import check_run

BOS, EOS, SEQ = 1, 2, 32
# Three documents packed into one window, the last one cut by the window's end (no EOS).
LENGTHS = (9, 14, 9)


def _window(seed: int) -> tuple[torch.Tensor, list[slice]]:
    g = torch.Generator().manual_seed(seed)
    rows, spans, start = [], [], 0
    for i, n in enumerate(LENGTHS):
        doc = torch.randint(3, TINY.vocab_size, (n,), generator=g)
        doc[0] = BOS
        if i < len(LENGTHS) - 1:
            doc[-1] = EOS
        rows.append(doc)
        spans.append(slice(start, start + n))
        start += n
    return torch.cat(rows)[None], spans


def _model(attn_type: str, mask: str) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(replace(TINY, max_seq_len=SEQ, attn_type=attn_type, attn_mask_type=mask))
    model.init_weights()
    return model.eval()


def test_document_ids_end_at_eos():
    tokens = torch.tensor([[BOS, 5, EOS, BOS, 6, 7, EOS, BOS], [5, 6, 7, 8, EOS, EOS, BOS, 9]])
    assert document_ids(tokens, EOS).tolist() == [[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 0, 0, 0, 1, 2, 2]]
    v = varlen_mask(document_ids(tokens, EOS))
    assert v.cu_seqlens.tolist() == [0, 3, 7, 8, 13, 14, 16] and v.max_len == 5


@pytest.mark.parametrize("attn_type", ["sdpa", "varlen", "flex"])
def test_packed_window_equals_each_document_alone(attn_type):
    window, spans = _window(0)
    batch = torch.cat([window, _window(1)[0]])  # two rows: the mask is per row
    alone_model = _model("sdpa", "causal")
    model = _model(attn_type, "block_causal")
    with torch.no_grad():
        packed = model(batch, doc_ids=document_ids(batch, EOS))
        assert model.document_masks.builds == 1  # once per forward, not per layer
        plain = alone_model(batch)
        for row in range(2):
            for span in spans:
                alone = alone_model(batch[row : row + 1, span])[0]
                torch.testing.assert_close(packed[row, span], alone, atol=2e-5, rtol=1e-5)
    # the plain causal window does let the later documents see the earlier ones
    assert (plain[0, spans[1]] - packed[0, spans[1]]).abs().max() > 1e-3


def test_varlen_trains_on_cpu_and_needs_the_document_ids():
    model = _model("varlen", "block_causal").train()
    window, _ = _window(0)
    model(window, doc_ids=document_ids(window, EOS)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(TitanError, match="needs the batch's document ids"):
        model(window)


def test_config_refusals():
    with pytest.raises(TitanError, match=r"'model.attn_type' = \"varlen\" .*needs model.attn_mask_type"):
        load_config(["--model.attn_type", "varlen"])
    with pytest.raises(TitanError, match=r"\"block_causal\" does not combine with parallelism.context_parallel"):
        load_config(["--model.attn_mask_type", "block_causal", "--parallelism.context_parallel_degree", "2"])
    config = load_config(
        [
            "--model.attn_type",
            "varlen",
            "--model.attn_mask_type",
            "block_causal",
            "--training.mixed_precision_param",
            "float32",
        ]
    )
    dims = ParallelDims(1, 1, 1, 1, 1, 1)
    check_run(config, dims, TINY, "cpu")  # SDPA with the document mask on CPU: any dtype
    with pytest.raises(TitanError, match=r"flash varlen kernel on CUDA, which takes bfloat16"):
        check_run(config, dims, TINY, "cuda")


@pytest.mark.parametrize("attn_type", ["sdpa", "varlen"])
def test_generation_with_kv_cache_treats_the_prompt_as_one_document(attn_type):
    from titan.models.kv_cache import KVCache

    window, spans = _window(0)
    prompt = window[:, spans[0]]  # one document
    model = _model(attn_type, "block_causal")
    with torch.no_grad():
        cache = KVCache(SEQ)
        first = model(prompt[:, :5], kv_cache=cache)
        cache.advance(5)
        rest = model(prompt[:, 5:], kv_cache=cache)
        whole = model(prompt, doc_ids=document_ids(prompt, EOS))
    torch.testing.assert_close(torch.cat([first, rest], 1), whole, atol=2e-5, rtol=1e-5)
