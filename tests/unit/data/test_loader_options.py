"""The loader options torchtitan's [training.dataloader] names: pin_memory and prefetch_factor reach
the worker loader and change no batch; a tokenizer folder laid out as a hub download resolves."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from titan.data import loader as loader_module
from titan.data.loader import build_dataloader
from titan.data.tokenizer import DEFAULT_TOKENIZER_PATH, build_tokenizer
from titan.errors import TitanError


class ByteTokenizer:
    vocab_size, bos_id, eos_id = 258, 256, 257

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        return [self.bos_id] * bos + list(text.encode()) + [self.eos_id] * eos


def _batches(path, **options) -> list[torch.Tensor]:
    loader = build_dataloader(
        dataset="local",
        dataset_path=str(path),
        text_field="text",
        tokenizer=ByteTokenizer(),
        seq_len=16,
        local_batch_size=2,
        dp_rank=0,
        dp_world_size=1,
        infinite=False,
        num_workers=1,
        **options,
    )
    return [inputs for inputs, _ in loader]


def test_pin_memory_and_prefetch_reach_the_worker_loader(tmp_path, monkeypatch) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"text": f"doc {i} " * 5}) + "\n" for i in range(20)))
    plain = _batches(f)
    seen = []

    class Recording(loader_module.StatefulDataLoader):
        def __init__(self, *args, **kwargs):
            seen.append((kwargs["pin_memory"], kwargs["prefetch_factor"]))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(loader_module, "StatefulDataLoader", Recording)
    with pytest.warns(UserWarning, match="pin_memory") if not torch.cuda.is_available() else _nothing():
        tuned = _batches(f, pin_memory=True, prefetch_factor=3)
    assert seen == [(True, 3)]
    assert len(tuned) == len(plain) and all(torch.equal(a, b) for a, b in zip(tuned, plain))


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_hub_download_folder_with_original_tokenizer_model(tmp_path) -> None:
    (tmp_path / "original").mkdir()
    shutil.copy(DEFAULT_TOKENIZER_PATH, tmp_path / "original" / "tokenizer.model")
    assert build_tokenizer(tmp_path).encode("hello", bos=False, eos=False) == build_tokenizer().encode(
        "hello", bos=False, eos=False
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    files = "tokenizer.json, tokenizer.model, original/tokenizer.model or tiktoken.model"
    with pytest.raises(TitanError, match=f"has no {files}"):
        build_tokenizer(empty)
