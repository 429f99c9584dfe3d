"""Dataset registry and sources: local formats, the embedded corpus, the hub path, user errors."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from titan.data import datasets as ds_mod
from titan.data.datasets import DATASETS, build_source, check_dataset, register_dataset
from titan.errors import TitanError

DOCS = ["first document", "second one\nwith two lines", "third", "fourth — unicode ✓"]


def _texts(source) -> list[str]:
    return list(source.iter_docs(0))


def test_pydoc_is_sorted_topics():
    from pydoc_data.topics import topics

    src = build_source("pydoc")
    assert src.num_docs == len(topics) > 10
    assert src.get(0) == topics[sorted(topics)[0]]
    assert _texts(src)[-1] == topics[sorted(topics)[-1]]


def test_jsonl(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(DOCS)))
    assert _texts(build_source("ignored", str(f))) == DOCS


def test_json_array_and_custom_field(tmp_path):
    f = tmp_path / "d.json"
    f.write_text(json.dumps([{"body": t} for t in DOCS]))
    assert _texts(build_source("x", str(f), text_field="body")) == DOCS


def test_parquet(tmp_path):
    f = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": DOCS}), f)
    assert _texts(build_source("x", str(f))) == DOCS


def test_arrow(tmp_path):
    f = tmp_path / "d.arrow"
    table = pa.table({"text": DOCS})
    with pa.OSFile(str(f), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    assert _texts(build_source("x", str(f))) == DOCS


def test_txt_splits(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("para one\nline two\n\npara two\n\n\npara three\n")
    # paragraph (default): blocks split on a blank line, datasets' `text` builder semantics
    assert _texts(build_source("x", str(f))) == ["para one\nline two", "para two", "\npara three\n"]
    assert _texts(build_source("x", str(f), txt_split="line"))[:2] == ["para one", "line two"]
    assert _texts(build_source("x", str(f), txt_split="document")) == [f.read_text()]


def test_folder_recursive_sorted(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "B"}) + "\n")
    (tmp_path / "sub" / "a.jsonl").write_text(json.dumps({"text": "A"}) + "\n")
    (tmp_path / "notes.md").write_text("ignored")
    # sorted by full path: b.jsonl < sub/a.jsonl
    assert _texts(build_source(str(tmp_path))) == ["B", "A"]


def test_dataset_name_can_be_a_path(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"text": "x"}))
    assert _texts(build_source(str(f))) == ["x"]


@pytest.mark.parametrize(
    "setup, match",
    [
        (lambda p: ("nope", ""), "unknown dataset 'nope'.*pydoc"),
        (lambda p: ("x", str(p / "missing.jsonl")), "does not exist"),
        (lambda p: ("x", str(p)), "no supported files"),
        (lambda p: ("x", str(_write(p / "d.jsonl", '{"body": "a"}\n'))), "no column 'text'.*body"),
        (lambda p: ("x", str(_write(p / "e.jsonl", ""))), "empty"),
        (lambda p: ("x", str(_write(p / "f.csv", "a,b"))), "unsupported type"),
    ],
)
def test_user_errors(tmp_path, setup, match):
    dataset, path = setup(tmp_path)
    with pytest.raises(TitanError, match=match):
        build_source(dataset, path)


def test_mixed_formats_rejected(tmp_path):
    _write(tmp_path / "a.jsonl", '{"text": "a"}\n')
    _write(tmp_path / "b.txt", "b")
    with pytest.raises(TitanError, match="mixes formats"):
        build_source("x", str(tmp_path))


def _write(path, text):
    path.write_text(text)
    return path


def test_c4_builds_streaming_request(monkeypatch):
    calls = []

    class FakeStream:
        def skip(self, n):
            return self

        def __iter__(self):
            return iter([{"text": "hello", "timestamp": "x"}])

        def iter(self, batch_size):
            return iter([{"text": ["hello"], "timestamp": ["x"]}])

    monkeypatch.setattr(ds_mod, "_load_dataset", lambda *a, **k: calls.append((a, k)) or FakeStream())
    src = build_source("c4")
    assert calls[-1] == (("allenai/c4", "en"), {"split": "train", "streaming": True})
    assert _texts(src) == ["hello"]
    build_source("c4_validation")
    assert calls[-1][1]["split"] == "validation"


def test_c4_offline_is_one_clear_error(monkeypatch):
    def fail(*a, **k):
        raise ConnectionError("no network\nlong trace")

    monkeypatch.setattr(ds_mod, "_load_dataset", fail)
    with pytest.raises(TitanError, match="cannot stream allenai/c4.*dataset_path"):
        build_source("c4")


def test_registered_dataset_builds_and_the_table_is_read_only():
    from titan.data.datasets import ListSource

    with pytest.raises(TypeError):
        DATASETS["unit_test_docs"] = None  # type: ignore[index]
    spec = register_dataset(
        "unit_test_docs",
        lambda field: ListSource("unit_test_docs", [field, "b"]),
        text_field="body",
        description="two documents",
    )
    assert DATASETS["unit_test_docs"] is spec
    assert _texts(build_source("unit_test_docs")) == ["body", "b"]  # the registered default text field
    check_dataset("unit_test_docs")
    with pytest.raises(TitanError, match="'unit_test_docs' is already registered"):
        register_dataset("unit_test_docs", lambda field: ListSource("x", []))


def test_play_txt_paragraphs_are_documents(tmp_path):
    from tests.fixtures import play_speeches, write_play

    src = build_source("x", str(write_play(tmp_path / "play.txt")))
    docs = list(src.iter_docs(0))
    # One document per paragraph (speech), so many ranks can share one big .txt file.
    assert [d.strip() for d in docs] == play_speeches()
    assert docs[0].startswith("First Citizen:")
