"""Hub datasets on a generated mirror in the hub's layout (parquet and jsonl.gz files, a card with
three configs; no mocks): the config and split choose the files as the card says, each file is a
shard dealt to one dp rank, resume is exact and reopens one file, bad values and no network fail
with one line naming the key and what is valid."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.helpers.hub_mirror import ROW_GROUP, HubMirror, write_hub_mirror
from titan.config import load_config
from titan.data.build import build_dataloader, check_hub
from titan.data.datasets import DATASETS, ListSource, build_source, check_dataset, files_source, register_dataset
from titan.data.hub import is_hub_id
from titan.errors import TitanError

FINEWEB = "HuggingFaceFW/fineweb-edu"
SEQ, BATCH = 64, 2


class ByteTokenizer:
    vocab_size, bos_id, eos_id = 258, 256, 257

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        return [self.bos_id] * bos + list(text.encode()) + [self.eos_id] * eos


@pytest.fixture(scope="module")
def mirror(tmp_path_factory) -> HubMirror:
    return write_hub_mirror(tmp_path_factory.mktemp("hub"))


def _loader(mirror, config="sample-10BT", world=1, rank=0, infinite=True, **kw):
    return build_dataloader(
        dataset=kw.pop("dataset", FINEWEB),
        dataset_path=str(mirror.root),
        dataset_config=config,
        text_field=kw.pop("text_field", "text"),
        tokenizer=ByteTokenizer(),
        seq_len=SEQ,
        local_batch_size=BATCH,
        dp_rank=rank,
        dp_world_size=world,
        infinite=infinite,
        **kw,
    )


def _tokens(batches) -> Counter:
    c = Counter()
    for x, y in batches:
        c.update(torch.cat([x, y[:, -1:]], dim=1).flatten().tolist())
    return c


def _doc_tokens(docs) -> Counter:
    tok = ByteTokenizer()
    return Counter(t for d in docs for t in tok.encode(d, bos=True, eos=True))


def _leftover(docs_by_unit, state) -> Counter:
    """Tokens still in a finished rank's packing buffers (never emitted as a whole window)."""
    c, tok = Counter(), ByteTokenizer()
    for st in state["streams"]:
        for unit, row, off in st["segments"]:
            c.update(tok.encode(docs_by_unit(unit, row), bos=True, eos=True)[off:])
    return c


@pytest.mark.parametrize(
    ("config", "split", "field"),
    [
        ("sample-10BT", "train", "text"),
        ("", "train", "text"),
        ("code", "train", "content"),
        ("code", "validation", "content"),
    ],
)
def test_config_and_split_choose_the_files_as_the_card_says(mirror, config, split, field):
    source = build_source(FINEWEB, str(mirror.root), field, config=config, split=split)
    shards = mirror.shard_docs(config or "default", split)
    assert source.num_shards == len(shards)  # one shard per data file, no other config's files
    assert source.name == f"{FINEWEB}:{config or 'default'}/{split}"  # named by id: hub and mirror alike
    for j, docs in enumerate(shards):
        assert list(source.iter_shard(j)) == docs
        for row in (1, ROW_GROUP - 1, ROW_GROUP, ROW_GROUP + 1, len(docs) - 1, len(docs)):
            assert list(source.iter_shard(j, row)) == docs[row:], (j, row)
    assert list(source.iter_docs(0)) == [d for docs in shards for d in docs]


def test_bad_config_split_or_column_is_one_line_with_the_valid_values(mirror):
    cases = [
        ({"config": "sample-100BT"}, "training.dataset_config", "['default', 'sample-10BT', 'code']"),
        ({"config": "code", "split": "test"}, "training.dataset_split", "['train', 'validation']"),
        ({"config": "sample-10BT", "field": "content"}, "training.dataset_text_field", "['id', 'score', 'text']"),
        ({"config": "code"}, "training.dataset_text_field", "['content', 'repo']"),
    ]
    for kw, key, valid in cases:
        field = kw.pop("field", "text")
        with pytest.raises(TitanError) as e:
            build_source(FINEWEB, str(mirror.root), field, **kw)
        assert key in str(e.value) and valid in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(TitanError, match=r"validation.dataset_split: 'validation' .*valid: \['train'\]"):
        check_dataset(FINEWEB, str(mirror.root), "sample-10BT", "", section="validation")
    with pytest.raises(TitanError, match=r"training.dataset_config \('en'\) chooses the files of a hub dataset"):
        check_dataset("pydoc", "", "en")


def test_no_network_is_one_line_naming_the_local_mirror(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TitanError) as e:
        build_source(FINEWEB, config="sample-10BT")
    line = str(e.value)
    assert "\n" not in line and "cannot reach the Hugging Face hub" in line, line
    assert f"hf download {FINEWEB} --repo-type dataset" in line and "training.dataset_path = DIR" in line, line
    config = load_config(
        ["--validation.enable", "--validation.dataset", FINEWEB, "--validation.dataset_split", "train"]
    )
    with pytest.raises(TitanError, match=r"validation.dataset .*validation.dataset_path = DIR"):
        check_hub(config)  # the launcher's check, before any rank starts


@pytest.mark.parametrize(("config", "field"), [("sample-10BT", "text"), ("code", "content")])
def test_streamed_files_are_one_shard_each(mirror, config, field):
    # what a hub id streams: the resolved file URLs (hf://... there; memory://... here, another
    # fsspec filesystem) through `datasets`, one shard per file, each readable on its own from a row
    import fsspec

    fs = fsspec.filesystem("memory")
    urls = []
    for f in mirror.files[(config, "train")]:
        fs.pipe(f"/titan-hub/{config}/{f.name}", f.read_bytes())
        urls.append(f"memory://titan-hub/{config}/{f.name}")
    shards = mirror.shard_docs(config)
    source = files_source("hub", urls, field, remote=True)
    assert source.num_shards == len(shards) and source.shard_name(1) == urls[1]
    assert [list(source.iter_shard(j, 0)) for j in range(len(shards))] == shards
    rows = (1, ROW_GROUP, 2 * ROW_GROUP + 1)
    assert [list(source.iter_shard(j, r)) for j in range(len(shards)) for r in rows] == [
        docs[r:] for docs in shards for r in rows
    ]


def test_hub_ids_and_local_paths_are_told_apart(tmp_path, monkeypatch):
    assert is_hub_id(FINEWEB) and is_hub_id("allenai/c4") and not is_hub_id("pydoc")
    for path in ("./a/b", "/data/x", "a/b/c", "~/x/y", "data.jsonl"):
        assert not is_hub_id(path), path
    (tmp_path / "org" / "corpus").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not is_hub_id("org/corpus")  # an existing folder of that name is read as a folder
    # a registered name wins over the hub, slash or not (offline here: a hub lookup would fail)
    if "titan-tests/registered" not in DATASETS:
        register_dataset("titan-tests/registered", lambda field: ListSource("registered", ["a", "b"]))
    check_dataset("titan-tests/registered")
    assert list(build_source("titan-tests/registered").iter_docs()) == ["a", "b"]


def test_each_rank_reads_whole_files_of_its_own_and_every_document_once(mirror):
    shards = mirror.shard_docs("sample-10BT")
    # 2 ranks x 2 loader workers = 4 streams over 6 files: whole files, each read by one worker
    loaders = [_loader(mirror, world=2, rank=r, infinite=False, num_workers=2) for r in range(2)]
    total, opened = Counter(), []
    for loader in loaders:
        batches = list(loader)
        state = loader.state_dict()
        assert state["layout"] == "shards"
        total += _tokens(batches) + _leftover(lambda u, r: shards[u % len(shards)][r], state)
        stats = loader.read_stats()
        opened.append(sorted(stats["opened"]))
        assert stats["bytes_read"] < stats["bytes_total"]  # about half of the files' bytes
    assert opened == [[0, 2, 4], [1, 3, 5]]  # shard j goes to rank j % 2, each read once
    assert total == _doc_tokens(d for docs in shards for d in docs)


def test_fewer_files_than_streams_deals_documents(mirror):
    shards = mirror.shard_docs("code")  # 3 files for 4 ranks: documents are dealt instead
    docs = [d for s in shards for d in s]
    total = Counter()
    for r in range(4):
        loader = _loader(mirror, "code", world=4, rank=r, infinite=False, text_field="content")
        batches = list(loader)
        state = loader.state_dict()
        assert state["layout"] == "documents"
        total += _tokens(batches) + _leftover(lambda u, _r: docs[u % len(docs)], state)
    assert total == _doc_tokens(docs)


def test_resume_is_exact_and_reopens_only_the_current_file(mirror):
    reference = _loader(mirror, world=2, rank=1)
    it = iter(reference)
    for _ in range(40):  # about 5 kB: deep into the first file; the next batches cross into another
        next(it)
    state = reference.state_dict()
    expected = [next(it) for _ in range(6)]
    resumed = _loader(mirror, world=2, rank=1)
    resumed.load_state_dict(state)
    got = [b for b, _ in zip(resumed, range(6))]
    for (x, y), (ex, ey) in zip(got, expected):
        assert torch.equal(x, ex) and torch.equal(y, ey)
    assert len(set(resumed.read_stats()["opened"])) <= 2  # the open file (and maybe the next), not a re-read


def test_reaching_a_row_of_a_parquet_file_skips_the_row_groups_before_it(mirror, monkeypatch):
    import pyarrow.parquet as pq

    read: list[list[int]] = []
    iter_batches = pq.ParquetFile.iter_batches

    def recording(self, *args, row_groups=None, **kw):
        read.append(list(row_groups) if row_groups is not None else list(range(self.metadata.num_row_groups)))
        return iter_batches(self, *args, row_groups=row_groups, **kw)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", recording)
    source = build_source(FINEWEB, str(mirror.root), config="sample-10BT")
    docs = mirror.shard_docs("sample-10BT")[4]
    row = 3 * ROW_GROUP + 2
    assert list(source.iter_shard(4, row)) == docs[row:]
    assert read == [list(range(3, -(-len(docs) // ROW_GROUP)))]  # from the row's group on, nothing before


def test_validation_reads_the_validation_split_once(mirror):
    loader = _loader(mirror, "code", infinite=False, validation=True, text_field="content", dataset_split="validation")
    shards = mirror.shard_docs("code", "validation")
    total = _tokens(list(loader)) + _leftover(lambda u, r: shards[u % len(shards)][r], loader.state_dict())
    assert total == _doc_tokens(d for s in shards for d in s)


def test_a_mirror_path_reads_the_default_config_and_a_plain_folder_stays_plain(mirror, tmp_path):
    source = build_source("pydoc", str(mirror.root))  # the card lists configs: the hub's layout
    assert list(source.iter_docs(0)) == [d for docs in mirror.shard_docs("default") for d in docs]
    # a folder without a configs card stays a plain folder of files: every supported file is a shard
    plain = tmp_path / "plain"
    plain.mkdir()
    for p in mirror.files[("sample-10BT", "train")][:2]:
        (plain / p.name).write_bytes(p.read_bytes())
    assert build_source("pydoc", str(plain)).num_shards == 2
    assert Path(build_source("pydoc", str(plain)).name) == plain


def test_the_files_are_logged_once_per_run(mirror, caplog):
    # The check before the build and the build both look the files up: one line says how many.
    with caplog.at_level("INFO", logger="titan"):
        check_dataset(FINEWEB, str(mirror.root), "sample-10BT", "")
        build_source(FINEWEB, str(mirror.root), "text", config="sample-10BT")
    lines = [r.getMessage() for r in caplog.records if "data file(s)" in r.getMessage()]
    assert len(lines) == 1 and "(config sample-10BT, split train)" in lines[0], lines
