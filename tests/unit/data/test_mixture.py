"""Weighted mixtures: the schedule's shares, the TOML/CLI form, exact resume mid-mixture, reshard,
per-source token counts, a source that runs out, and the validation form."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from titan.config import load_config
from titan.config.sections.training import MixtureSource
from titan.data import build_dataloader
from titan.data.mixture import schedule_source
from titan.data.token_store import (
    FORMAT,
    MANIFEST,
    VERSION,
    tokenizer_fingerprint,
    write_shard,
)
from titan.errors import TitanError

SEQ = 7


class Tok:
    vocab_size, bos_id, eos_id, path = 60_000, 0, 1, ""

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        return [self.bos_id] * bos + [50_000 + b for b in text.encode()] + [self.eos_id] * eos


def store(folder: Path, base: int, tokens: int) -> Path:
    """One shard whose token t is base + t: every window says which store and which window it is."""
    folder.mkdir()
    entry = write_shard(folder, "00000", [list(range(base, base + tokens))], np.dtype(np.uint16), 0)
    (folder / MANIFEST).write_text(
        json.dumps(
            {
                "format": FORMAT,
                "version": VERSION,
                "tokenizer": tokenizer_fingerprint(Tok()),
                "bos": True,
                "eos": True,
                "dtype": "uint16",
                "shards": [entry],
            }
        )
    )
    return folder


@pytest.fixture
def sources(tmp_path):
    a = store(tmp_path / "web", 10_000, 8 * 40)
    b = store(tmp_path / "code", 20_000, 8 * 30)
    (tmp_path / "books.txt").write_text("\n\n".join(f"book paragraph {i} " * (i % 5 + 1) for i in range(30)))
    return [
        MixtureSource(path=str(a), weight=0.5),
        MixtureSource(path=str(b), weight=0.3),
        MixtureSource(path=str(tmp_path / "books.txt"), weight=0.2),
    ]


def make(mixture, world=1, rank=0, workers=0, batch=3, exhausted="restart", validation=False, seed=None):
    return build_dataloader(
        dataset="",
        dataset_path="",
        text_field="text",
        tokenizer=Tok(),
        seq_len=SEQ,
        local_batch_size=batch,
        dp_rank=rank,
        dp_world_size=world,
        num_workers=workers,
        mixture=mixture,
        mixture_exhausted=exhausted,
        validation=validation,
        shuffle_seed=seed,
    )


def source_of_row(row) -> str:
    first = int(row[0])
    return "web" if 10_000 <= first < 20_000 else "code" if 20_000 <= first < 30_000 else "books.txt"


@pytest.mark.parametrize("weights", [[0.7, 0.3], [0.5, 0.3, 0.2], [1, 1, 1, 97], [3, 1]])
def test_schedule_shares_within_one_percent(weights):
    total = sum(weights)
    cumulative = [sum(weights[: i + 1]) / total for i in range(len(weights))]
    for start in (0, 123_456_789):  # any stretch of the schedule, e.g. after a resume
        counts = Counter(schedule_source(t, cumulative) for t in range(start, start + 10_000))
        for i, w in enumerate(weights):
            assert abs(counts[i] / 10_000 - w / total) < 0.01, (weights, counts)


def take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def test_batches_follow_the_weights_and_count_tokens(sources):
    loader = make(sources, batch=4)
    rows = [r for x, _ in take(loader, 250) for r in x]
    counts = Counter(source_of_row(r) for r in rows)
    for name, w in (("web", 0.5), ("code", 0.3), ("books.txt", 0.2)):
        assert abs(counts[name] / len(rows) - w) < 0.01
    assert loader.scalars() == {f"data/tokens/{n}": float(counts[n] * SEQ) for n in ("web", "code", "books.txt")}


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("k", [1, 7, 30])
def test_exact_resume_mid_mixture(sources, workers, k):
    reference = take(make(sources, workers=workers), k + 5)
    first = make(sources, workers=workers)
    take(first, k)
    state = first.state_dict()
    resumed = make(sources, workers=workers)
    resumed.load_state_dict(state)
    for (x1, y1), (x2, y2) in zip(take(resumed, 5), reference[k:]):
        assert x1.equal(x2) and y1.equal(y2)
    assert resumed.state_dict()["tokens"] == make_and_count(sources, workers, k + 5)


def make_and_count(sources, workers, n):
    loader = make(sources, workers=workers)
    take(loader, n)
    return loader.state_dict()["tokens"]


@pytest.mark.parametrize("old, new", [(2, 1), (1, 2)])
def test_reshard_mid_mixture_repeats_and_skips_no_store_window(tmp_path, old, new):
    mixture = [
        MixtureSource(path=str(store(tmp_path / "web", 10_000, 8 * 40)), weight=2),
        MixtureSource(path=str(store(tmp_path / "code", 20_000, 8 * 30)), weight=1),
    ]
    seen, states = [], []
    for rank in range(old):
        loader = make(mixture, old, rank, exhausted="stop", batch=1)
        seen += [int(x[0, 0]) for x, _ in take(loader, 5)]
        states.append(loader.state_dict())
    for rank in range(new):
        loader = make(mixture, new, rank, exhausted="stop", batch=1)
        loader.load_resharded(states)
        assert loader.t == max(s["t"] for s in states)
        seen += [int(x[0, 0]) for x, _ in take(loader, 12)]
    assert len(seen) == len(set(seen))  # no window twice
    web = sorted(s for s in seen if s < 20_000)
    assert web == list(range(10_000, 10_000 + 8 * len(web), 8))  # and none skipped


def test_exhausted_stop_ends_and_restart_goes_on(tmp_path):
    mixture = [
        MixtureSource(path=str(store(tmp_path / "big", 10_000, 8 * 100)), weight=1),
        MixtureSource(path=str(store(tmp_path / "small", 20_000, 8 * 3)), weight=1),
    ]
    assert len(list(make(mixture, exhausted="stop", batch=2))) < 4
    assert len(take(make(mixture, exhausted="restart", batch=2), 20)) == 20


def test_validation_mixture_reads_each_source_once(sources):
    loader = make(sources[:2], batch=2, validation=True)
    seen = Counter()
    for x, _ in loader:
        names = {source_of_row(r) for r in x}
        assert names == {["web", "code"][loader.last_source]}
        seen[loader.last_source] += len(x)
    assert seen == {0: 40, 1: 30}


def test_shuffle_seed_needs_a_store(tmp_path):
    (tmp_path / "a.txt").write_text("x\n\ny")
    with pytest.raises(TitanError, match="no source of training.mixture is a token store"):
        make([MixtureSource(path=str(tmp_path / "a.txt"))], seed=1)


def test_toml_and_cli_forms(tmp_path):
    toml = tmp_path / "mix.toml"
    toml.write_text(
        '[training]\nmixture_exhausted = "stop"\n\n'
        '[[training.mixture]]\npath = "/data/web"\nweight = 0.7\n\n'
        '[[training.mixture]]\ndataset = "pydoc"\nweight = 0.3\n'
    )
    c = load_config(["--job.config_file", str(toml)])
    web = MixtureSource(path="/data/web", weight=0.7)
    assert c.training.mixture == [web, MixtureSource(dataset="pydoc", weight=0.3)]
    assert c.training.mixture_exhausted == "stop"
    c = load_config(["--training.mixture", '[{path = "/data/web", weight = 0.7}, {dataset = "pydoc", weight = 3}]'])
    assert c.training.mixture == [web, MixtureSource(dataset="pydoc", weight=3.0)]


@pytest.mark.parametrize(
    "value, needle",
    [
        ('[{path = "a", weight = 0}]', "config key 'training.mixture[0].weight' got 0.0; valid: a number > 0"),
        ('[{path = "a", weight = -1}]', "training.mixture[0].weight' got -1.0"),
        ('[{path = "a", wieght = 1}]', "has unknown field 'wieght'; valid: path, dataset, weight"),
        ("[{weight = 1}]", "training.mixture[0]' got"),
        ('[{path = "a", weight = "x"}]', "training.mixture.weight' got 'x', expected float"),
        ("a,b", "training.mixture' got 'a', expected MixtureSource"),
    ],
)
def test_bad_mixture_config_is_one_line(value, needle):
    with pytest.raises(TitanError) as e:
        load_config(["--training.mixture", value])
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_finite_mixture_stops_at_the_first_exhausted_source(tmp_path):
    mixture = [
        MixtureSource(path=str(store(tmp_path / "big", 10_000, 8 * 100)), weight=1),
        MixtureSource(path=str(store(tmp_path / "small", 20_000, 8 * 3)), weight=1),
    ]
    finite = build_dataloader(
        dataset="",
        dataset_path="",
        text_field="text",
        tokenizer=Tok(),
        seq_len=SEQ,
        local_batch_size=2,
        dp_rank=0,
        dp_world_size=1,
        infinite=False,
        mixture=mixture,
    )
    assert len(list(finite)) < 4
