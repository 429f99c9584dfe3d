"""Dataset registry and document sources.

A *source* is an ordered sequence of text documents addressed by index 0..N-1. The loader never
needs more than that: sharding, resume and resharding are all expressed as document indices (see
titan/data/packing.py), so every source supports them the same way.

Built in: ``pydoc`` (the stdlib's own documentation, always available offline), ``c4`` and
``c4_validation`` (streamed from the Hugging Face hub), and any local file or folder of
.jsonl/.json(.gz), .parquet, .arrow or .txt files (streamed through ``datasets``).
Add your own with :func:`register_dataset`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from titan.errors import TitanError
from titan.tools.logging import logger

__all__ = [
    "DATASETS",
    "DatasetSpec",
    "DocumentSource",
    "HFStreamSource",
    "ListSource",
    "TXT_SPLITS",
    "build_source",
    "check_dataset",
    "local_source",
    "register_dataset",
]

# How a .txt file becomes documents (the `text` builder's sample_by): paragraph = blocks separated
# by a blank line (the default: a single big .txt such as tinyshakespeare then still yields many
# documents to deal to the ranks), line = every line, document = the whole file.
TXT_SPLITS = ("paragraph", "line", "document")

_READ_BATCH = 64  # rows per read from a `datasets` stream

# suffix -> `datasets` packaged builder
_BUILDERS = {
    ".jsonl": "json",
    ".json": "json",
    ".jsonl.gz": "json",
    ".json.gz": "json",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".txt": "text",
    ".txt.gz": "text",
}


class DocumentSource:
    """An ordered, re-iterable sequence of text documents.

    ``num_docs`` is the count when known up front (None for streams: the loader learns it when a
    pass ends). ``iter_docs(start)`` yields the texts of documents start, start+1, ...
    ``seekable`` sources also answer ``get(i)`` in O(1).
    """

    name: str = ""
    seekable: bool = False

    @property
    def num_docs(self) -> int | None:
        return None

    def iter_docs(self, start: int = 0) -> Iterator[str]:
        raise NotImplementedError

    def get(self, index: int) -> str:
        raise NotImplementedError


class ListSource(DocumentSource):
    """Documents held in memory (the embedded corpus, tests)."""

    seekable = True

    def __init__(self, name: str, docs: list[str]) -> None:
        self.name = name
        self.docs = list(docs)

    @property
    def num_docs(self) -> int:
        return len(self.docs)

    def iter_docs(self, start: int = 0) -> Iterator[str]:
        for i in range(start, len(self.docs)):
            yield self.docs[i]

    def get(self, index: int) -> str:
        return self.docs[index]


class HFStreamSource(DocumentSource):
    """A streaming ``datasets.IterableDataset``; document i is its i-th row's ``text_field``.

    Streaming keeps memory flat for data larger than RAM; the price is that reaching document i
    re-reads (parses, but does not tokenize) rows 0..i-1, which only happens on resume.
    """

    def __init__(self, name: str, dataset, text_field: str) -> None:
        self.name = name
        self.dataset = dataset
        self.text_field = text_field

    def iter_docs(self, start: int = 0) -> Iterator[str]:
        ds = self.dataset.skip(start) if start > 0 else self.dataset
        # .iter(batch_size) rather than iter(ds): inside a DataLoader worker the latter hands each
        # worker only some of the files, which would break the document numbering
        try:
            for batch in ds.iter(batch_size=_READ_BATCH):
                yield from self._texts(batch[self.text_field])
        except UnicodeDecodeError as e:
            raise TitanError(f"dataset {self.name!r} is not UTF-8 text ({e.reason} at byte {e.start}); "
                             "convert it, e.g. iconv -f latin1 -t utf-8") from None
        except (TitanError, GeneratorExit):
            raise
        except Exception as e:  # pyarrow parse errors and the like: one line naming the dataset
            first = str(e).splitlines()[0] if str(e) else ""
            raise TitanError(f"cannot read dataset {self.name!r}: {type(e).__name__}: {first}") from None

    def _texts(self, column: list) -> Iterator[str]:
        for text in column:
            if not isinstance(text, str):
                raise TitanError(
                    f"dataset {self.name!r}: column {self.text_field!r} holds {type(text).__name__}, "
                    "expected str; set training.dataset_text_field to a text column"
                )
            yield text

    def validate(self) -> None:
        """Fail early, with one clear line, on an empty dataset or a missing text column."""
        try:
            first = next(iter(self.dataset))
        except StopIteration:
            raise TitanError(f"dataset {self.name!r} is empty (no rows)") from None
        except UnicodeDecodeError as e:
            raise TitanError(f"dataset {self.name!r} is not UTF-8 text ({e.reason} at byte {e.start}); "
                             "convert it, e.g. iconv -f latin1 -t utf-8") from None
        if self.text_field not in first:
            raise TitanError(
                f"dataset {self.name!r} has no column {self.text_field!r} "
                f"(training.dataset_text_field); available columns: {sorted(first)}"
            )


@dataclass(frozen=True)
class DatasetSpec:
    """A registry entry: ``loader(text_field)`` builds the source; ``text_field`` is its default
    column (used when the config keeps the default "text")."""

    name: str
    loader: Callable[[str], DocumentSource]
    text_field: str = "text"
    description: str = ""


DATASETS: dict[str, DatasetSpec] = {}


def register_dataset(
    name: str, loader: Callable[[str], DocumentSource], text_field: str = "text", description: str = ""
) -> None:
    """Make ``training.dataset = name`` build ``loader(text_field)``."""
    DATASETS[name] = DatasetSpec(name, loader, text_field, description)


def _pydoc_source(text_field: str) -> DocumentSource:
    from pydoc_data.topics import topics

    # sorted keys: the document order (hence every shard and checkpoint) must not depend on the
    # dict's insertion order in a given Python release
    return ListSource("pydoc", [topics[k] for k in sorted(topics)])


def _load_dataset(*args, **kwargs):
    # looked up at call time so tests can monkeypatch datasets.load_dataset
    import datasets

    return datasets.load_dataset(*args, **kwargs)


def _hub_source(name: str, repo: str, config: str, split: str) -> Callable[[str], DocumentSource]:
    def load(text_field: str) -> DocumentSource:
        logger.info(f"streaming dataset {name!r} from the hub: {repo} {config} {split}")
        try:
            ds = _load_dataset(repo, config, split=split, streaming=True)
        except Exception as e:  # offline, no access, ... -> one actionable line
            raise TitanError(
                f"cannot stream {repo} ({config}/{split}) for dataset {name!r}: "
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; without network "
                "use a local copy via training.dataset_path"
            ) from e
        return HFStreamSource(name, ds, text_field)

    return load


register_dataset("pydoc", _pydoc_source, description="embedded offline corpus: pydoc_data.topics")

# A held-out split of the same corpus: every 10th topic (sorted) is validation, the rest train.
PYDOC_VALIDATION_EVERY = 10


def _pydoc_split(validation: bool) -> Callable[[str], DocumentSource]:
    def load(text_field: str) -> DocumentSource:
        from pydoc_data.topics import topics

        keys = [k for i, k in enumerate(sorted(topics)) if (i % PYDOC_VALIDATION_EVERY == 0) == validation]
        return ListSource("pydoc_validation" if validation else "pydoc_train", [topics[k] for k in keys])

    return load


register_dataset("pydoc_train", _pydoc_split(False), description="pydoc without the pydoc_validation topics")
register_dataset("pydoc_validation", _pydoc_split(True), description="every 10th pydoc topic, held out")
register_dataset("c4", _hub_source("c4", "allenai/c4", "en", "train"), description="allenai/c4 en train")
register_dataset(
    "c4_validation",
    _hub_source("c4_validation", "allenai/c4", "en", "validation"),
    description="allenai/c4 en validation",
)


def _builder_for(path: Path) -> str | None:
    name = path.name.lower()
    for suffix, builder in _BUILDERS.items():
        if name.endswith(suffix):
            return builder
    return None


def local_source(path: str, text_field: str = "text", txt_split: str = "paragraph",
                 bad_lines: str = "fail") -> DocumentSource:
    """Stream a local file or folder (searched recursively, files in sorted path order).

    .txt files have one column, "text" (``text_field`` is ignored for them); ``txt_split`` says
    how they are cut into documents (see TXT_SPLITS). A folder must hold one format only.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise TitanError(f"dataset path {path!r} does not exist (training.dataset_path)")
    if txt_split not in TXT_SPLITS:
        raise TitanError(f"txt_split {txt_split!r} is not one of {list(TXT_SPLITS)}")
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and _builder_for(f) and not f.name.startswith("."))
        if not files:
            raise TitanError(
                f"dataset folder {path!r} has no supported files; supported: {sorted(_BUILDERS)}"
            )
    else:
        if _builder_for(p) is None:
            raise TitanError(f"dataset file {path!r} has an unsupported type; supported: {sorted(_BUILDERS)}")
        files = [p]
    builders = sorted({_builder_for(f) for f in files})
    if len(builders) > 1:
        raise TitanError(f"dataset folder {path!r} mixes formats {builders}; keep one format per folder")
    builder = builders[0]
    if all(f.name.lower().endswith(".jsonl") for f in files):  # line by line: broken lines get named
        from .jsonl import JsonlSource

        jsonl = JsonlSource(str(path), files, text_field, bad_lines)
        jsonl.validate()
        return jsonl
    kwargs: dict = {"sample_by": txt_split} if builder == "text" else {}
    field = "text" if builder == "text" else text_field
    try:
        ds = _load_dataset(builder, data_files=[str(f) for f in files], split="train", streaming=True, **kwargs)
    except StopIteration:  # the json builder infers the schema from the first rows
        raise TitanError(f"dataset {path!r} is empty (no rows)") from None
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise TitanError(f"cannot read dataset {path!r} as {builder}: {type(e).__name__}: {first}") from e
    source = HFStreamSource(str(path), ds, field)
    source.validate()
    return source


def _looks_like_path(name: str) -> bool:
    return os.sep in name or name.startswith(".") or Path(name).suffix != "" or Path(name).exists()


def check_dataset(dataset: str, dataset_path: str = "") -> None:
    """The cheap part of build_source (a known name, an existing path), run before the model is
    built so a typo fails in seconds; reading the data is left to build_source."""
    if dataset_path or (dataset not in DATASETS and _looks_like_path(dataset)):
        path = dataset_path or dataset
        if not Path(path).expanduser().exists():
            key = "training.dataset_path" if dataset_path else "training.dataset"
            raise TitanError(f"dataset path {path!r} does not exist ({key})")
    elif dataset not in DATASETS:
        raise TitanError(
            f"unknown dataset {dataset!r} (training.dataset); valid: {sorted(DATASETS)} "
            "or a local path (training.dataset_path)"
        )


def build_source(
    dataset: str, dataset_path: str = "", text_field: str = "text", txt_split: str = "paragraph",
    bad_lines: str = "fail",
) -> DocumentSource:
    """Resolve the config's (dataset, dataset_path, text_field) to a source.

    ``dataset_path`` set: read that local file/folder. Otherwise ``dataset`` is a registry name, or
    itself a local path.
    """
    if dataset_path:
        return local_source(dataset_path, text_field, txt_split, bad_lines)
    spec = DATASETS.get(dataset)
    if spec is not None:
        return spec.loader(text_field if text_field != "text" else spec.text_field)
    if _looks_like_path(dataset):
        return local_source(dataset, text_field, txt_split, bad_lines)
    raise TitanError(
        f"unknown dataset {dataset!r} (training.dataset); valid: {sorted(DATASETS)} "
        "or a local path (training.dataset_path)"
    )
