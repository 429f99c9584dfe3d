"""The c4 path on a generated mirror in allenai/c4's layout (real json.gz shards with text,
timestamp, url; no mocks): shard dealing, exact resume, dp changes, broken files."""

from __future__ import annotations

import gzip
import json
import logging
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.helpers.c4_mirror import c4_shard_path, write_c4_mirror
from titan.data.datasets import build_source, check_dataset
from titan.data.loader import build_dataloader
from titan.errors import TitanError

SHARDS, DOCS = 8, 200
SEQ, BATCH = 128, 4


class ByteTokenizer:
    vocab_size, bos_id, eos_id = 258, 256, 257

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        return [self.bos_id] * bos + list(text.encode()) + [self.eos_id] * eos


@pytest.fixture(scope="module")
def mirror(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("c4")
    write_c4_mirror(root, SHARDS, DOCS, mean_words=16)
    write_c4_mirror(root, 2, 50, split="validation", mean_words=16)
    return root


def _rows(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def _loader(mirror, world=1, rank=0, workers=2, infinite=True, dataset="c4"):
    return build_dataloader(
        dataset=dataset,
        dataset_path=str(mirror),
        text_field="text",
        tokenizer=ByteTokenizer(),
        seq_len=SEQ,
        local_batch_size=BATCH,
        dp_rank=rank,
        dp_world_size=world,
        num_workers=workers,
        infinite=infinite,
    )


def _tokens(batches) -> Counter:
    c = Counter()
    for x, y in batches:
        c.update(torch.cat([x, y[:, -1:]], dim=1).flatten().tolist())
    return c


def _leftover(mirror, state) -> Counter:
    """Tokens still in a finished rank's packing buffers; asserts every shard was read to its end."""
    c, tok = Counter(), ByteTokenizer()
    for st in state["streams"]:
        assert state["layout"] == "shards" and not st["pending"] and st["next"] >= SHARDS
        assert st["cur"] is None or st["cur"][0] >= SHARDS
        for unit, row, off in st["segments"]:
            c.update(tok.encode(_rows(c4_shard_path(mirror, "train", unit % SHARDS))[row], bos=True, eos=True)[off:])
    return c


def _all_tokens(mirror) -> Counter:
    tok = ByteTokenizer()
    return Counter(
        t
        for i in range(SHARDS)
        for d in _rows(c4_shard_path(mirror, "train", i))
        for t in tok.encode(d, bos=True, eos=True)
    )


def test_c4_mirror_layout_picks_the_split(mirror, tmp_path):
    train, val = build_source("c4", str(mirror)), build_source("c4_validation", str(mirror / "en"))
    assert train.num_shards == SHARDS and val.num_shards == 2  # validation files are not training data
    assert next(iter(train.iter_shard(3, 5))) == _rows(c4_shard_path(mirror, "train", 3))[5]
    (tmp_path / "en").mkdir()
    for name in ("c4", "c4_validation"):
        with pytest.raises(TitanError, match=r"no en/c4-.*json.gz files.*hf download allenai/c4") as e:
            check_dataset(name, str(tmp_path))
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("world", [1, 2])
def test_shards_disjoint_and_every_document_once(mirror, world, caplog):
    with caplog.at_level(logging.INFO, logger="titan"):
        loaders = [_loader(mirror, world, r, infinite=False) for r in range(world)]
    assert sum("whole shards" in r.getMessage() for r in caplog.records) == 1  # logged once, by rank 0
    total, per_rank = Counter(), []
    for loader in loaders:
        total += _tokens(list(loader)) + _leftover(mirror, loader.state_dict())
        stats = loader.read_stats()
        per_rank.append(stats["opened"])
        assert stats["bytes_read"] <= stats["bytes_total"] * (1 if world == 1 else 0.6)
    opened = [s for shards in per_rank for s in shards]
    assert sorted(opened) == list(range(SHARDS))  # each shard opened once, by one (rank, worker)
    assert total == _all_tokens(mirror)


def _check_resume(mirror, world, at=(3, 70, 150), n=6):
    for rank in range(world):
        reference, states = [], {}
        ref = _loader(mirror, world, rank)
        for batch in ref:  # one run gives the reference batches and the states after k of them
            reference.append(batch)
            if len(reference) in at:
                states[len(reference)] = ref.state_dict()
            if len(reference) == max(at) + n:
                break
        for k in at:
            resumed = _loader(mirror, world, rank)
            resumed.load_state_dict(states[k])
            got = [b for _, b in zip(range(n), resumed)]
            assert len(got) == n
            for (x, y), (rx, ry) in zip(reference[k : k + n], got):
                assert torch.equal(x, rx) and torch.equal(y, ry), (world, rank, k)


@pytest.mark.parametrize("world", [1, 2])
def test_exact_resume_two_workers(mirror, world):
    # positions inside the first shard, across a shard boundary, and deep into a later shard
    _check_resume(mirror, world)


@pytest.mark.parametrize("old, new", [(2, 1), (1, 2)])
def test_dp_change_no_repeat_no_skip(mirror, old, new, caplog):
    total, states = Counter(), []
    for rank in range(old):
        loader = _loader(mirror, old, rank, infinite=False)
        it = iter(loader)
        total += _tokens([next(it) for _ in range(30)])
        states.append(loader.state_dict())
    with caplog.at_level(logging.INFO, logger="titan"):
        for rank in range(new):
            loader = _loader(mirror, new, rank, infinite=False)
            loader.load_resharded(states)
            total += _tokens(list(loader)) + _leftover(mirror, loader.state_dict())
    assert total == _all_tokens(mirror)
    assert any("partly read, continued from their row" in r.getMessage() for r in caplog.records)


def _break(mirror: Path, tmp_path: Path, how: str, shard: int = 5) -> Path:
    copy = tmp_path / "c4"
    for i in range(SHARDS):
        src, dst = c4_shard_path(mirror, "train", i), c4_shard_path(copy, "train", i)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(src.read_bytes())
    bad = c4_shard_path(copy, "train", shard)
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) // 2] if how == "truncated" else data[:2000] + b"\x00" * 64 + data[2064:])
    return bad


@pytest.mark.parametrize("how", ["truncated", "corrupt"])
def test_broken_shard_is_one_line_naming_the_file(mirror, tmp_path, how):
    bad = _break(mirror, tmp_path, how)
    loader = _loader(tmp_path / "c4", world=2, rank=1, workers=2)  # shard 5 is read in a worker
    with pytest.raises(TitanError) as e:
        for _ in loader:
            pass
    msg = str(e.value)
    assert str(bad) in msg and "truncated or corrupt" in msg and "\n" not in msg and "Traceback" not in msg


@pytest.mark.slow
def test_broken_shard_through_train(mirror, tmp_path, capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    import train

    bad = _break(mirror, tmp_path, "truncated", shard=0)  # met by the start-up check (later ones: above)
    repo = Path(__file__).resolve().parents[3]
    rc = train.main(
        [
            "--job.config_file",
            str(repo / "train_configs/debug_model.toml"),
            "--job.dump_folder",
            str(tmp_path / "out"),
            "--training.dataset",
            "c4",
            "--training.dataset_path",
            str(tmp_path / "c4"),
            "--training.seq_len",
            "32",
            "--training.local_batch_size",
            "2",
            "--training.steps",
            "2",
            "--metrics.enable_tensorboard",
            "false",
        ]
    )
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("titan: error")]
    assert rc == 2 and len(lines) == 1 and str(bad) in lines[0] and "Traceback" not in err, err[-2000:]


def test_hub_code_path_on_a_real_stream(mirror, monkeypatch):
    # the hub path, fed a real datasets stream over the mirror's files instead of the network
    import datasets

    from titan.data import datasets as ds_mod

    files = [str(c4_shard_path(mirror, "train", i)) for i in range(SHARDS)]
    monkeypatch.setattr(
        ds_mod,
        "_load_dataset",
        lambda *a, **k: datasets.load_dataset("json", data_files=files, split="train", streaming=True),
    )
    kw = dict(
        dataset="c4",
        dataset_path="",
        text_field="text",
        tokenizer=ByteTokenizer(),
        seq_len=SEQ,
        local_batch_size=BATCH,
        dp_world_size=2,
        dp_rank=1,
        num_workers=0,
    )
    reference = [b for _, b in zip(range(12), build_dataloader(**kw))]
    first = build_dataloader(**kw)
    it = iter(first)
    for _ in range(7):
        next(it)
    state = first.state_dict()
    assert state["layout"] == "shards" and state["num_shards"] == SHARDS
    resumed = build_dataloader(**kw)
    resumed.load_state_dict(state)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(reference[7:], resumed))
    # rank 1 of 2 reads the odd shards only: its first document is shard 1's first row
    first_doc = _rows(c4_shard_path(mirror, "train", 1))[0].encode()
    assert bytes(reference[0][0][0, 1 : 1 + 20].tolist()) == first_doc[:20]


def test_benchmark_loader_json_line(mirror, capsys):
    import importlib.util

    path = Path(__file__).resolve().parents[3] / "scripts" / "benchmark_loader.py"
    spec = importlib.util.spec_from_file_location("benchmark_loader", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rc = bench.main(
        [
            "--dataset",
            "c4",
            "--dataset_path",
            str(mirror),
            "--dp",
            "2",
            "--workers",
            "0",
            "--resume_at",
            "10,300",
            "--seq_len",
            "64",
            "--batch_size",
            "2",
        ]
    )
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert rc == 0 and set(result["resume_s"]) == {"10", "300"} and result["docs_per_s"] > 0
    total = sum(c4_shard_path(mirror, "train", i).stat().st_size for i in range(SHARDS))
    assert result["bytes_total"] == total and sum(result["bytes_read_per_rank"]) == total
    assert all(b <= 0.6 * total for b in result["bytes_read_per_rank"])
    assert bench.main(["--resume_at", "x"]) == 2
