"""Token stores: tokenize -> store -> windows equal to the online loader's; re-runs, damaged stores,
a tokenizer mismatch, and an O(1) seek in a store whose index claims 1e11 tokens."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from titan.data import build_dataloader, build_tokenizer
from titan.data.loader import build_dataloader as text_loader
from titan.data.token_store import (
    FORMAT,
    MANIFEST,
    VERSION,
    TokenStore,
    tokenizer_fingerprint,
)
from titan.data.tokenize import tokenize_to_store
from titan.errors import TitanError

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]


def write_docs(path: Path, n: int = 60, seed: int = 0) -> list[str]:
    """A .jsonl file of n documents of different lengths (a few to ~120 words)."""
    rng = np.random.default_rng(seed)
    docs = [
        " ".join(WORDS[j] for j in rng.integers(0, len(WORDS), int(rng.integers(3, 120)))) + f" doc {i}."
        for i in range(n)
    ]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return docs


def make_store(tmp_path: Path, n: int = 60, workers: int = 0, name: str = "store", shard_mb: float = 0.002) -> Path:
    src = tmp_path / f"{name}.jsonl"
    if not src.exists():
        write_docs(src, n)
    out = tmp_path / name
    tokenize_to_store(
        dataset="", dataset_path=str(src), tokenizer_path="", out=str(out), workers=workers, shard_mb=shard_mb
    )
    return out


def batches(loader) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(loader)


def store_loader(path, **kw):
    args = dict(
        dataset="",
        dataset_path=str(path),
        text_field="text",
        tokenizer=build_tokenizer(""),
        seq_len=31,
        local_batch_size=3,
        dp_rank=0,
        dp_world_size=1,
        infinite=False,
    )
    return build_dataloader(**{**args, **kw})


def check_round_trip(tmp_path, workers):
    store = make_store(tmp_path, workers=workers)
    manifest = json.loads((store / MANIFEST).read_text())
    assert len(manifest["shards"]) > 3 and manifest["dtype"] == "uint16"  # windows cross shard boundaries
    online = text_loader(
        dataset="",
        dataset_path=str(tmp_path / "store.jsonl"),
        text_field="text",
        tokenizer=build_tokenizer(""),
        seq_len=31,
        local_batch_size=3,
        dp_rank=0,
        dp_world_size=1,
        infinite=False,
    )
    a, b = batches(store_loader(store)), batches(online)
    assert len(a) == len(b) > 10
    for (x1, y1), (x2, y2) in zip(a, b):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_round_trip_equals_online_windows(tmp_path):
    check_round_trip(tmp_path, workers=0)


@pytest.mark.slow
def test_round_trip_with_worker_processes(tmp_path):
    check_round_trip(tmp_path, workers=2)


def test_manifest_and_shard_files(tmp_path):
    docs = write_docs(tmp_path / "store.jsonl", 20)
    store = make_store(tmp_path, 20)
    m = json.loads((store / MANIFEST).read_text())
    tok = build_tokenizer("")
    ids = [t for d in docs for t in tok.encode(d, bos=True, eos=True)]
    assert (m["format"], m["version"], m["bos"], m["eos"]) == (FORMAT, VERSION, True, True)
    assert m["tokenizer"] == tokenizer_fingerprint(tok)
    assert m["documents"] == 20 and m["tokens"] == len(ids)
    assert m["text_bytes"] == sum(len(d.encode()) for d in docs)
    s = TokenStore(str(store))
    assert s.read(0, len(ids)).tolist() == ids
    offsets = np.fromfile(store / f"{m['shards'][0]['name']}.offsets", dtype=np.int64)
    assert offsets[0] == 0 and len(offsets) == m["shards"][0]["documents"] + 1
    assert not list(store.glob("*.tmp"))


def test_rerun_keeps_finished_shards_and_redoes_damaged_ones(tmp_path):
    store = make_store(tmp_path)
    before = TokenStore(str(store)).read(0, TokenStore(str(store)).num_tokens).copy()
    shards = json.loads((store / MANIFEST).read_text())["shards"]
    # an interrupted run: manifest not yet written, one shard unfinished, a temporary file left
    (store / MANIFEST).unlink()
    (store / f"{shards[2]['name']}.json").unlink()
    (store / "00007.tokens.tmp").write_bytes(b"\0" * 10)
    # a finished shard whose data no longer matches its checksum
    data = bytearray((store / f"{shards[4]['name']}.tokens").read_bytes())
    data[0] ^= 1
    (store / f"{shards[4]['name']}.tokens").write_bytes(bytes(data))
    result = tokenize_to_store(
        dataset="",
        dataset_path=str(tmp_path / "store.jsonl"),
        tokenizer_path="",
        out=str(store),
        workers=0,
        shard_mb=0.002,
    )
    assert result["kept"] == len(shards) - 2
    after = TokenStore(str(store))
    assert np.array_equal(after.read(0, after.num_tokens), before)
    assert not list(store.glob("*.tmp"))


def test_output_folder_of_another_plan_is_refused(tmp_path):
    store = make_store(tmp_path)
    with pytest.raises(TitanError, match="holds shards of another run") as e:
        tokenize_to_store(
            dataset="",
            dataset_path=str(tmp_path / "store.jsonl"),
            tokenizer_path="",
            out=str(store),
            workers=0,
            shard_mb=1.0,
        )
    assert "\n" not in str(e.value)


def one_line_error(fn, *needles):
    with pytest.raises(TitanError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, msg
    return msg


def test_truncated_shard_is_named(tmp_path):
    store = make_store(tmp_path)
    name = json.loads((store / MANIFEST).read_text())["shards"][1]["name"]
    with open(store / f"{name}.tokens", "r+b") as f:
        f.truncate(10)
    one_line_error(lambda: store_loader(store), f"{name}.tokens has 10 bytes", "re-run scripts/tokenize_dataset.py")


@pytest.mark.parametrize(
    "text, needle",
    [
        ("{not json", "is not valid JSON"),
        (json.dumps({"format": "other"}), "is not a titan-token-store manifest"),
        (json.dumps({"format": FORMAT, "version": 99}), "has version 99"),
    ],
)
def test_bad_manifest_is_one_line(tmp_path, text, needle):
    store = make_store(tmp_path)
    (store / MANIFEST).write_text(text)
    one_line_error(lambda: store_loader(store), needle, MANIFEST)


def test_store_of_another_tokenizer_is_refused(tmp_path):
    store = make_store(tmp_path)

    class Other:
        vocab_size, bos_id, eos_id, path = 258, 256, 257, ""

    theirs = json.loads((store / MANIFEST).read_text())["tokenizer"]["fingerprint"]
    mine = tokenizer_fingerprint(Other())["fingerprint"]
    one_line_error(lambda: store_loader(store, tokenizer=Other()), theirs, mine, "model.tokenizer_path")


def test_fingerprint_follows_the_tokenizer_file(tmp_path):
    a = tokenizer_fingerprint(build_tokenizer(""))
    copy = tmp_path / "tokenizer.model"
    text = Path(build_tokenizer("").path).read_text()
    copy.write_text(text)
    assert tokenizer_fingerprint(build_tokenizer(str(copy)))["fingerprint"] == a["fingerprint"]
    lines = text.splitlines()
    copy.write_text("\n".join(lines[:-1]) + "\n")  # one rank fewer: another vocabulary
    assert tokenizer_fingerprint(build_tokenizer(str(copy)))["fingerprint"] != a["fingerprint"]


def test_empty_source_is_refused(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    one_line_error(
        lambda: tokenize_to_store(
            dataset="",
            dataset_path=str(tmp_path / "empty.jsonl"),
            tokenizer_path="",
            out=str(tmp_path / "out"),
            workers=0,
        ),
        "empty",
    )
    assert not (tmp_path / "out" / MANIFEST).exists()


class _Tok:
    vocab_size, bos_id, eos_id, path = 50_000, 1, 2, ""


def fake_huge_store(folder: Path, shards: int = 100, per_shard: int = 10**9) -> np.ndarray:
    """A store whose manifest claims shards x per_shard tokens, as sparse files (nothing written but
    a marker near the end); returns the marker."""
    folder.mkdir()
    entries = []
    for i in range(shards):
        name = f"{i:05d}"
        with open(folder / f"{name}.tokens", "wb") as f:
            f.truncate(per_shard * 2)
        with open(folder / f"{name}.offsets", "wb") as f:
            f.truncate(16)
        entries.append(
            {
                "name": name,
                "tokens": per_shard,
                "documents": 1,
                "text_bytes": 0,
                "tokens_xxh3": f"{i:016x}",
                "offsets_xxh3": "0",
            }
        )
    marker = np.arange(7, 7 + 40, dtype=np.uint16)
    fd = os.open(folder / f"{shards - 1:05d}.tokens", os.O_WRONLY)
    os.pwrite(fd, marker.tobytes(), (per_shard - 1000) * 2)
    os.close(fd)
    (folder / MANIFEST).write_text(
        json.dumps(
            {
                "format": FORMAT,
                "version": VERSION,
                "tokenizer": tokenizer_fingerprint(_Tok()),
                "bos": True,
                "eos": True,
                "dtype": "uint16",
                "tokens": shards * per_shard,
                "documents": shards,
                "text_bytes": 0,
                "shards": entries,
            }
        )
    )
    return marker


def test_resume_is_a_direct_seek_at_1e11_tokens(tmp_path):
    marker = fake_huge_store(tmp_path / "huge")
    seq_len = 19  # windows of 20 tokens: the marker (at token 1e11 - 1000) starts window 5e9 - 50
    times = {}
    for position in (1000 // 20, 10**11 // 20 - 50):
        loader = build_dataloader(
            dataset="",
            dataset_path=str(tmp_path / "huge"),
            text_field="text",
            tokenizer=_Tok(),
            seq_len=seq_len,
            local_batch_size=1,
            dp_rank=0,
            dp_world_size=1,
        )
        state = loader.state_dict()
        state["streams"][0]["next"] = position
        start = time.perf_counter()
        resumed = build_dataloader(
            dataset="",
            dataset_path=str(tmp_path / "huge"),
            text_field="text",
            tokenizer=_Tok(),
            seq_len=seq_len,
            local_batch_size=1,
            dp_rank=0,
            dp_world_size=1,
        )
        resumed.load_state_dict(state)
        inputs, labels = next(iter(resumed))
        times[position] = time.perf_counter() - start
        if position > 1000:
            assert inputs[0].tolist() == marker[:seq_len].tolist() and labels[0, -1] == marker[seq_len]
    # a scan over 1e11 tokens would take minutes; both seeks are one binary search and one read
    assert max(times.values()) < 2.0, times
