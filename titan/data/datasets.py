"""Dataset registry: names and local paths resolved to document sources (titan/data/sources.py).

Built in: ``pydoc`` (the stdlib's own documentation, always available offline), ``c4`` and
``c4_validation`` (streamed from the Hugging Face hub, or read from a local mirror in allenai/c4's
layout when a dataset path is set), any Hugging Face hub dataset by id (owner/name, streamed) or
its mirror in the hub's layout (titan/data/hub.py), and any local file or folder of
.jsonl(.gz)/.json(.gz), .parquet, .arrow or .txt files. Every file of a folder is a shard (see titan/data/packing.py for
how shards are dealt to ranks). Add a named dataset with ``register_dataset`` (before the run
builds its loader); ``DATASETS`` is a read-only view of every registered name.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from titan.config.choices import TxtSplit, choices
from titan.errors import TitanError
from titan.log import logger

from .hub import default_split, hub_layout, is_hub_id, resolve_files
from .jsonl import JsonlSource, is_json_lines
from .sources import DocumentSource, HFStreamSource, ListSource

__all__ = [
    "DATASETS",
    "DatasetSpec",
    "DocumentSource",
    "HFStreamSource",
    "ListSource",
    "TXT_SPLITS",
    "build_source",
    "check_dataset",
    "files_source",
    "hub_source",
    "local_source",
    "register_dataset",
    "streams_from_hub",
]

# How a .txt file becomes documents (the `text` builder's sample_by): paragraph = blocks separated
# by a blank line (the default: a single big .txt such as tinyshakespeare then still yields many
# documents to deal to the ranks), line = every line, document = the whole file.
TXT_SPLITS = choices(TxtSplit)

# suffix -> `datasets` packaged builder
_BUILDERS = MappingProxyType(
    {
        ".jsonl": "json",
        ".json": "json",
        ".jsonl.gz": "json",
        ".json.gz": "json",
        ".parquet": "parquet",
        ".arrow": "arrow",
        ".txt": "text",
        ".txt.gz": "text",
    }
)


@dataclass(frozen=True)
class DatasetSpec:
    """A registry entry: ``loader(text_field)`` builds the source; ``text_field`` is its default
    column (used when the config keeps the default "text"). ``local(path, text_field, bad_lines)``,
    when set, reads a local copy of the dataset (the config's dataset path) in its own layout."""

    name: str
    loader: Callable[[str], DocumentSource]
    text_field: str = "text"
    description: str = ""
    local: Callable[[str, str, str], DocumentSource] | None = None


def _pydoc_source(text_field: str) -> DocumentSource:
    from pydoc_data.topics import topics

    # sorted keys: the document order (hence every shard and checkpoint) must not depend on the
    # dict's insertion order in a given Python release
    return ListSource("pydoc", [topics[k] for k in sorted(topics)])


def _load_dataset(*args, **kwargs):
    # imported on first use: `datasets` takes seconds to import and a run of a token store never needs it
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


# A held-out split of the same corpus: every 10th topic (sorted) is validation, the rest train.
PYDOC_VALIDATION_EVERY = 10


def _pydoc_split(validation: bool) -> Callable[[str], DocumentSource]:
    def load(text_field: str) -> DocumentSource:
        from pydoc_data.topics import topics

        keys = [k for i, k in enumerate(sorted(topics)) if (i % PYDOC_VALIDATION_EVERY == 0) == validation]
        return ListSource("pydoc_validation" if validation else "pydoc_train", [topics[k] for k in keys])

    return load


# allenai/c4's file layout: <mirror>/en/c4-<split>.NNNNN-of-MMMMM.json.gz (JSON lines: text,
# timestamp, url). 1024 train shards, 8 validation shards.
C4_SHARDS = MappingProxyType({"train": 1024, "validation": 8})
C4_MIRROR_HINT = (
    "mirror it with `hf download allenai/c4 --repo-type dataset --include "
    '"en/c4-train.0000*-of-01024.json.gz" --local-dir DIR` (docs/datasets.md)'
)


def c4_files(path: str, split: str) -> list[Path]:
    """The shards of ``split`` in a local allenai/c4 mirror (the folder holding ``en/``, or ``en/``
    itself), in shard order."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise TitanError(f"c4 mirror {path!r} is not a folder (dataset path); {C4_MIRROR_HINT}")
    folder = root / "en" if (root / "en").is_dir() else root
    pattern = f"c4-{split}.[0-9][0-9][0-9][0-9][0-9]-of-{C4_SHARDS[split]:05d}.json.gz"
    files = sorted(folder.glob(pattern))
    if not files:
        raise TitanError(f"c4 mirror {path!r} has no en/{pattern.replace('[0-9]', 'N')} files; {C4_MIRROR_HINT}")
    return files


def _c4_local(split: str) -> Callable[[str, str, str], DocumentSource]:
    def load(path: str, text_field: str, bad_lines: str) -> DocumentSource:
        files = c4_files(path, split)
        logger.info(f"dataset c4 {split}: local mirror {path} ({len(files)} of {C4_SHARDS[split]} shards)")
        source = JsonlSource(f"c4_{split}:{path}", files, text_field, bad_lines)
        source.validate()
        return source

    return load


_REGISTRY: dict[str, DatasetSpec] = {}
# training.dataset = name -> its source: a read-only view of the registry, so it shows every registration
DATASETS: Mapping[str, DatasetSpec] = MappingProxyType(_REGISTRY)


def register_dataset(
    name: str,
    loader: Callable[[str], DocumentSource],
    *,
    text_field: str = "text",
    description: str = "",
    local: Callable[[str, str, str], DocumentSource] | None = None,
) -> DatasetSpec:
    """Make ``training.dataset = name`` read the source ``loader(text_field)`` builds (see DatasetSpec:
    ``text_field`` is the column used when the config keeps "text"; ``local(path, text_field,
    bad_lines)`` reads a copy at training.dataset_path in the dataset's own layout). A name is
    registered once."""
    if name in _REGISTRY:
        raise TitanError(f"dataset {name!r} is already registered ({_REGISTRY[name].description or 'no description'})")
    spec = DatasetSpec(name, loader, text_field=text_field, description=description, local=local)
    _REGISTRY[name] = spec
    return spec


register_dataset("pydoc", _pydoc_source, description="embedded offline corpus: pydoc_data.topics")
register_dataset("pydoc_train", _pydoc_split(False), description="pydoc without the pydoc_validation topics")
register_dataset("pydoc_validation", _pydoc_split(True), description="every 10th pydoc topic, held out")
register_dataset(
    "c4", _hub_source("c4", "allenai/c4", "en", "train"), description="allenai/c4 en train", local=_c4_local("train")
)
register_dataset(
    "c4_validation",
    _hub_source("c4_validation", "allenai/c4", "en", "validation"),
    description="allenai/c4 en validation",
    local=_c4_local("validation"),
)


def _builder_for(path: Path) -> str | None:
    name = path.name.lower()
    for suffix, builder in _BUILDERS.items():
        if name.endswith(suffix):
            return builder
    return None


def local_source(
    path: str, text_field: str = "text", txt_split: str = "paragraph", bad_lines: str = "fail"
) -> DocumentSource:
    """Stream a local file or folder (searched recursively, files in sorted path order).

    .txt files have one column, "text" (``text_field`` is ignored for them); ``txt_split`` says
    how they are cut into documents (see TXT_SPLITS). A folder must hold one format only.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise TitanError(f"dataset path {path!r} does not exist (training.dataset_path)")
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and _builder_for(f) and not f.name.startswith("."))
        if not files:
            raise TitanError(f"dataset folder {path!r} has no supported files; supported: {sorted(_BUILDERS)}")
    else:
        if _builder_for(p) is None:
            raise TitanError(f"dataset file {path!r} has an unsupported type; supported: {sorted(_BUILDERS)}")
        files = [p]
    return files_source(str(path), files, text_field, txt_split, bad_lines)


def files_source(
    name: str, files: list, text_field: str, txt_split: str = "paragraph", bad_lines: str = "fail", remote: bool = False
) -> DocumentSource:
    """The documents of ``files`` in order, one shard per file: local paths, or (``remote``) URLs
    that ``datasets`` streams (hf://...). All files must share one format."""
    if txt_split not in TXT_SPLITS:
        raise TitanError(f"txt_split {txt_split!r} is not one of {list(TXT_SPLITS)}")
    unsupported = [str(f) for f in files if _builder_for(Path(f)) is None]
    if unsupported:
        raise TitanError(f"dataset {name!r}: {unsupported[0]} has an unsupported type; supported: {sorted(_BUILDERS)}")
    builders = sorted({builder for f in files if (builder := _builder_for(Path(f))) is not None})
    if len(builders) > 1:
        raise TitanError(f"dataset {name!r} mixes formats {builders}; keep one format per folder")
    builder = builders[0]
    if not remote and _line_delimited([Path(f) for f in files]):  # read line by line: broken lines get named
        jsonl = JsonlSource(name, files, text_field, bad_lines)
        jsonl.validate()
        return jsonl
    kwargs: dict = {"sample_by": txt_split} if builder == "text" else {}
    field = "text" if builder == "text" else text_field
    try:
        ds = _load_dataset(builder, data_files=[str(f) for f in files], split="train", streaming=True, **kwargs)
    except StopIteration:  # the json builder infers the schema from the first rows
        raise TitanError(f"dataset {name!r} is empty (no rows)") from None
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise TitanError(f"cannot read dataset {name!r} as {builder}: {type(e).__name__}: {first}") from e
    named = [str(f) for f in files] if remote else [Path(f) for f in files]
    parquet = [str(f) for f in files] if builder == "parquet" else None
    source = HFStreamSource(name, ds, field, shard_files=named, parquet_files=parquet)
    source.validate()
    return source


def hub_source(
    dataset: str,
    dataset_path: str,
    text_field: str,
    txt_split: str = "paragraph",
    bad_lines: str = "fail",
    *,
    config: str = "",
    split: str = "",
    section: str = "training",
) -> DocumentSource:
    """A hub dataset by id (streamed), or its mirror at ``dataset_path``: the files of (config,
    split) as the dataset's card chooses them, one shard per file. Named by the id, config and
    split when the run names the id (the loader's state records the name)."""
    remote = not dataset_path
    where = dataset if remote else str(Path(dataset_path).expanduser())
    name, files = resolve_files(where, config, split, section, remote=remote)
    label = f"{dataset if is_hub_id(dataset) else where}:{name}/{split or default_split(section)}"
    return files_source(label, files, text_field, txt_split, bad_lines, remote=remote)


def _line_delimited(files: list[Path]) -> bool:
    names = [f.name.lower() for f in files]
    if all(n.endswith((".jsonl", ".jsonl.gz")) for n in names):
        return True
    # .json.gz (allenai/c4's shards) is JSON lines unless it holds one array
    return all(n.endswith((".jsonl", ".jsonl.gz", ".json.gz")) for n in names) and is_json_lines(files[0])


def _looks_like_path(name: str) -> bool:
    return os.sep in name or name.startswith(".") or Path(name).suffix != "" or Path(name).exists()


def _reads_hub_mirror(dataset: str, dataset_path: str, config: str, split: str, section: str) -> bool:
    # a registered dataset with its own mirror layout (c4) keeps it: its hub card lists configs too
    spec = DATASETS.get(dataset)
    if not dataset_path or (spec is not None and spec.local is not None):
        return False
    return hub_layout(dataset, dataset_path, config, split, section)


def streams_from_hub(dataset: str, dataset_path: str = "") -> bool:
    """The run streams ``dataset`` from the hub: an owner/name id that is neither a registered name
    nor a local path, and no local copy is set."""
    return not dataset_path and dataset not in DATASETS and is_hub_id(dataset)


def _not_for_registry(dataset: str, config: str, split: str, section: str) -> None:
    if config or split not in ("", default_split(section)):
        key, got = (f"{section}.dataset_config", config) if config else (f"{section}.dataset_split", split)
        raise TitanError(
            f"{key} ({got!r}) chooses the files of a hub dataset; {dataset!r} is a registry dataset with "
            f"its own split: leave it unset, or name a hub dataset id (owner/name) in {section}.dataset"
        )


def check_dataset(
    dataset: str, dataset_path: str = "", config: str = "", split: str = "", section: str = "training"
) -> None:
    """The cheap part of build_source (a known name, an existing path, a hub dataset's config and
    split), run before the model is built so a typo fails in seconds; reading rows is left to
    build_source."""
    mirror = _reads_hub_mirror(dataset, dataset_path, config, split, section)
    if mirror:
        resolve_files(str(Path(dataset_path).expanduser()), config, split, section, remote=False, log=False)
    elif dataset_path or (dataset not in DATASETS and not is_hub_id(dataset) and _looks_like_path(dataset)):
        path = dataset_path or dataset
        if not Path(path).expanduser().exists():
            key = f"{section}.dataset_path" if dataset_path else f"{section}.dataset"
            raise TitanError(f"dataset path {path!r} does not exist ({key})")
        if dataset in ("c4", "c4_validation"):
            c4_files(path, "train" if dataset == "c4" else "validation")
    elif streams_from_hub(dataset):
        resolve_files(dataset, config, split, section, remote=True, log=False)
    elif dataset not in DATASETS:
        raise TitanError(
            f"unknown dataset {dataset!r} ({section}.dataset); valid: {sorted(DATASETS)}, a hub dataset id "
            f"(owner/name) or a local path ({section}.dataset_path)"
        )
    if dataset in DATASETS and not mirror:
        _not_for_registry(dataset, config, split, section)


def build_source(
    dataset: str,
    dataset_path: str = "",
    text_field: str = "text",
    txt_split: str = "paragraph",
    bad_lines: str = "fail",
    *,
    config: str = "",
    split: str = "",
    section: str = "training",
) -> DocumentSource:
    """Resolve the config's (dataset, dataset_path, text_field, config, split) to a source.

    ``dataset_path`` set: read that local copy (in the registered dataset's own layout when it has
    one, e.g. a c4 mirror; in the hub's layout for a hub mirror, see titan/data/hub.py; else any
    supported file/folder). Otherwise ``dataset`` is a registry name, a hub dataset id
    (owner/name, streamed), or itself a local path. ``section`` names the keys in errors.
    """
    spec = DATASETS.get(dataset)
    hub = {"config": config, "split": split, "section": section}
    if _reads_hub_mirror(dataset, dataset_path, config, split, section):
        return hub_source(dataset, dataset_path, text_field, txt_split, bad_lines, **hub)
    if spec is not None:
        _not_for_registry(dataset, config, split, section)
    if dataset_path and spec is not None and spec.local is not None:
        return spec.local(dataset_path, text_field if text_field != "text" else spec.text_field, bad_lines)
    if dataset_path:
        return local_source(dataset_path, text_field, txt_split, bad_lines)
    if spec is not None:
        return spec.loader(text_field if text_field != "text" else spec.text_field)
    if streams_from_hub(dataset):
        return hub_source(dataset, "", text_field, txt_split, bad_lines, **hub)
    if _looks_like_path(dataset):
        return local_source(dataset, text_field, txt_split, bad_lines)
    raise TitanError(
        f"unknown dataset {dataset!r} ({section}.dataset); valid: {sorted(DATASETS)}, a hub dataset id "
        f"(owner/name) or a local path ({section}.dataset_path)"
    )
