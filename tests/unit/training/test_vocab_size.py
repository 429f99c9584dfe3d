"""model.vocab_size: the model's vocabulary rows over the tokenizer's, with every tokenizer format;
too few rows is one clear error; HF export/import and the checkpoint config keep the saved rows."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers.tiny import build, small_args
from titan.checkpointing import config_diff
from titan.checkpointing.hf import load_hf, save_hf
from titan.config import load_config
from titan.data.tokenizer import DEFAULT_TOKENIZER_PATH, build_tokenizer
from titan.errors import TitanError
from titan.training.plan import plan_run


def _sentencepiece(tmp: Path) -> str:
    from pydoc_data.topics import topics

    import sentencepiece as spm

    corpus = tmp / "corpus.txt"
    corpus.write_text("\n".join(topics[k] for k in sorted(topics)[:10]), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp / "sp"), vocab_size=400, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", minloglevel=2,
    )  # fmt: skip
    return str(tmp / "sp.model")


def _hf_json(tmp: Path) -> str:
    from tokenizers import Tokenizer, pre_tokenizers, trainers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tok.save(str(tmp / "tokenizer.json"))
    return str(tmp / "tokenizer.json")


def _tiktoken_copy(tmp: Path) -> str:
    path = tmp / "tokenizer.model"  # Meta's Llama 3 ranks format, at a path of its own
    shutil.copy(DEFAULT_TOKENIZER_PATH, path)
    return str(path)


FORMATS = {"shipped": lambda tmp: "", "tiktoken": _tiktoken_copy, "sentencepiece": _sentencepiece, "hf_json": _hf_json}


def _plan(tokenizer_path: str, vocab_size: int | None):
    flags = ["--model.tokenizer_path", tokenizer_path]
    flags += [] if vocab_size is None else ["--model.vocab_size", str(vocab_size)]
    return plan_run(load_config(flags), 1, "cpu", data_here=False)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_vocab_size_override_with_every_tokenizer_format(tmp_path, fmt):
    path = FORMATS[fmt](tmp_path)
    size = build_tokenizer(path).vocab_size
    assert _plan(path, None).model_args.vocab_size == size
    assert _plan(path, size).model_args.vocab_size == size
    padded = (size // 64 + 1) * 64
    assert _plan(path, padded).model_args.vocab_size == padded
    with pytest.raises(TitanError, match=rf"model\.vocab_size' got {size - 1}; valid: at least .* {size}") as e:
        _plan(path, size - 1)
    assert "\n" not in str(e.value)


def test_vocab_size_must_be_positive():
    with pytest.raises(TitanError, match=r"model\.vocab_size"):
        load_config(["--model.vocab_size", "0"])


def test_hf_export_and_import_keep_the_padded_rows(tmp_path):
    """A model with rows beyond the tokenizer's: config.json and the tensors keep them both ways."""
    args = small_args(vocab_size=320)
    model = build(args)
    save_hf(model.state_dict(), args, tmp_path / "hf")
    state, back = load_hf(tmp_path / "hf")
    assert back.vocab_size == 320
    assert state["tok_embeddings.weight"].shape[0] == state["output.weight"].shape[0] == 320


def test_resuming_with_other_rows_is_named():
    """The checkpoint's config records model.vocab_size: a resume with other rows is a difference."""
    saved = config_diff.snapshot(load_config(["--model.vocab_size", "2112"]), 1)
    now = config_diff.snapshot(load_config([]), 1)
    assert config_diff.differences(saved, now) == {"model.vocab_size": (2112, None)}
