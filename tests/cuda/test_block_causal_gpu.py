"""Block-causal attention on CUDA: flash varlen (bf16, its kernel's dtype) and flex (fp32, TF32 off)
give each packed document the logits it gets alone; and a few training steps run."""

import itertools
from dataclasses import replace

import pytest
import torch

from tests.cuda._common import train
from tests.helpers.tiny import TINY
from titan.models.documents import document_ids
from titan.models.llama.masks import VarlenMask
from titan.models.llama.model import Transformer

pytestmark = pytest.mark.cuda
EOS = 2


@pytest.mark.parametrize("attn_type", ["varlen", "flex"])
def test_packed_documents_equal_alone_on_cuda(attn_type):
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(0)
    window = torch.randint(3, TINY.vocab_size, (2, 256), generator=g)
    window[0, [40, 100, 101, 200]] = EOS
    window[1, [7, 150]] = EOS
    window = window.cuda()
    torch.manual_seed(0)
    alone_model = Transformer(replace(TINY, max_seq_len=256)).cuda()
    alone_model.init_weights()
    model = Transformer(replace(TINY, max_seq_len=256, attn_type=attn_type, attn_mask_type="block_causal")).cuda()
    model.load_state_dict(alone_model.state_dict())
    tol = 1e-4
    if attn_type == "varlen":
        model, alone_model, tol = model.bfloat16(), alone_model.bfloat16(), 3e-2
    docs = document_ids(window, EOS)
    if attn_type == "varlen":
        assert isinstance(model.document_masks.build(docs), VarlenMask)
    with torch.no_grad():
        packed = model(window, doc_ids=docs)
        for row in range(2):
            bounds = [0, *((window[row] == EOS).nonzero().flatten() + 1).tolist(), 256]
            for a, b in itertools.pairwise(bounds):
                if b > a:
                    alone = alone_model(window[row : row + 1, a:b])[0]
                    torch.testing.assert_close(packed[row, a:b], alone, atol=tol, rtol=tol)


@pytest.mark.parametrize("attn_type", ["varlen", "flex", "sdpa"])
def test_block_causal_trains_on_cuda(tmp_path, attn_type):
    losses, _ = train(tmp_path, 4, "--model.attn_type", attn_type, "--model.attn_mask_type", "block_causal")
    assert losses[4] < losses[1]
