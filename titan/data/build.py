"""The loader a run reads: one text source, a token store, or a weighted mixture of them.

A path is a token store when it holds a store manifest (scripts/tokenize_dataset.py); any other
path or name goes to the text loader (titan/data/loader.py). ``check_data`` runs the cheap checks
of all of it (names, paths, store manifests and shard sizes, the tokenizer a store was made with,
empty local sources) before a run writes anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from titan.errors import TitanError

from .datasets import _looks_like_path, _reads_hub_mirror, build_source, check_dataset, streams_from_hub
from .loader import TitanDataLoader
from .loader import build_dataloader as build_text_loader
from .mixture import MixtureLoader
from .sources import check_parquet_footers
from .token_store import TokenStore, is_token_store
from .windows import StoreDataLoader

__all__ = ["build_dataloader", "check_data", "check_hub", "mixture_names"]


def _store_path(dataset: str, dataset_path: str) -> str:
    path = dataset_path or (dataset if _looks_like_path(dataset) else "")
    return path if is_token_store(path) else ""


def mixture_names(mixture: list) -> list[str]:
    """A name per mixture source (metrics, state): its dataset name or its folder/file name."""
    names = [src.dataset if src.dataset and not src.path else (Path(src.path).name or src.path) for src in mixture]
    return [f"{n}_{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]


def _single(
    dataset: str,
    dataset_path: str,
    *,
    tokenizer: Any,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    num_workers: int,
    infinite: bool,
    shuffle_seed: int | None,
    pin_memory: bool,
    prefetch_factor: int | None,
    **text: Any,
) -> TitanDataLoader:
    store = _store_path(dataset, dataset_path)
    options = {
        "num_workers": num_workers,
        "infinite": infinite,
        "pin_memory": pin_memory,
        "prefetch_factor": prefetch_factor,
    }
    if store:
        return StoreDataLoader(
            TokenStore(store),
            tokenizer,
            seq_len=seq_len,
            local_batch_size=local_batch_size,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            shuffle_seed=shuffle_seed,
            **options,
        )
    return build_text_loader(
        dataset=dataset,
        dataset_path=dataset_path,
        tokenizer=tokenizer,
        seq_len=seq_len,
        local_batch_size=local_batch_size,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        **options,
        **text,
    )


def build_dataloader(
    *,
    dataset: str,
    dataset_path: str,
    text_field: str,
    tokenizer: Any,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    num_workers: int = 0,
    infinite: bool = True,
    txt_split: str = "paragraph",
    bad_lines: str = "fail",
    shuffle_seed: int | None = None,
    mixture: list | None = None,
    mixture_exhausted: str = "restart",
    validation: bool = False,
    pin_memory: bool = False,
    prefetch_factor: int | None = None,
    dataset_config: str = "",
    dataset_split: str = "",
) -> TitanDataLoader | MixtureLoader:
    """This dp rank's loader. ``mixture`` (MixtureSource entries) replaces dataset/dataset_path;
    ``validation`` makes a mixture read each source once, for a loss per source.
    ``dataset_config`` / ``dataset_split``: a hub dataset's config and split (titan/data/hub.py)."""
    section = "validation" if validation else "training"
    text = {"text_field": text_field, "txt_split": txt_split, "bad_lines": bad_lines, "section": section}
    common = {
        "tokenizer": tokenizer,
        "seq_len": seq_len,
        "dp_rank": dp_rank,
        "dp_world_size": dp_world_size,
        "num_workers": num_workers,
        "pin_memory": pin_memory,
        "prefetch_factor": prefetch_factor,
        **text,
    }
    if not mixture:
        if shuffle_seed is not None and not _store_path(dataset, dataset_path):
            raise TitanError(
                f"training.dataset_shuffle_seed ({shuffle_seed}) shuffles token-store windows; "
                f"{dataset_path or dataset!r} is not a token store (scripts/tokenize_dataset.py)"
            )
        return _single(
            dataset,
            dataset_path,
            local_batch_size=local_batch_size,
            infinite=infinite,
            shuffle_seed=shuffle_seed,
            config=dataset_config,
            split=dataset_split,
            **common,
        )
    if shuffle_seed is not None and not any(_store_path(s.dataset, s.path) for s in mixture):
        raise TitanError(
            f"training.dataset_shuffle_seed ({shuffle_seed}) shuffles token-store windows; no "
            "source of training.mixture is a token store (scripts/tokenize_dataset.py)"
        )
    if not infinite:  # training.dataset_infinite = false: the mixture ends with its first exhausted source
        mixture_exhausted = "stop"
    loaders = [
        _single(
            src.dataset,
            src.path,
            local_batch_size=local_batch_size if validation else 1,
            infinite=False if validation else mixture_exhausted == "restart",
            shuffle_seed=shuffle_seed,
            **common,
        )
        for src in mixture
    ]
    return MixtureLoader(
        mixture_names(mixture),
        loaders,
        [src.weight for src in mixture],
        local_batch_size=local_batch_size,
        seq_len=seq_len,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        exhausted=mixture_exhausted,
        validation=validation,
    )


def _check_one(
    dataset: str, dataset_path: str, tokenizer: Any, seq_len: int, key: str, config: str = "", split: str = ""
) -> None:
    store = _store_path(dataset, dataset_path)
    if store:
        s = TokenStore(store)
        s.check_tokenizer(tokenizer)
        if s.num_windows(seq_len) < 1:
            raise TitanError(
                f"token store {store!r} ({key}) holds {s.num_tokens} tokens, fewer than one window of "
                f"training.seq_len + 1 = {seq_len + 1}"
            )
        return
    if streams_from_hub(dataset, dataset_path):
        # streamed from the hub: the launcher looked it up once (check_hub) and the loader resolves
        # it again; a third lookup here would add one hub request per rank for nothing
        return
    check_dataset(dataset, dataset_path, config, split, section=key.split(".")[0])


def check_hub(config: Any) -> None:
    """The hub datasets a run reads: one streamed by id is reachable and has the configured config
    and split (no rows read); a local mirror's (config, split) resolves, its first row has the text
    column, and every parquet file's footer reads (a truncated file is named). The launcher runs
    this once before any rank starts (titan.training.checks.check_job), so no network, a typo'd
    config or a damaged mirror is one line from one process."""
    t, v = config.training, config.validation
    parts = [("training", t)] + ([("validation", v)] if v.enable else [])
    for section, part in parts:
        if part.mixture:
            continue
        if streams_from_hub(part.dataset, part.dataset_path):
            check_dataset(part.dataset, "", part.dataset_config, part.dataset_split, section)
        elif _reads_hub_mirror(part.dataset, part.dataset_path, part.dataset_config, part.dataset_split, section):
            source = build_source(
                part.dataset,
                part.dataset_path,
                t.dataset_text_field,
                t.dataset_txt_split,
                t.dataset_bad_lines,
                config=part.dataset_config,
                split=part.dataset_split,
                section=section,
            )
            check_parquet_footers(source)


def check_data(config: Any, tokenizer: Any) -> None:
    """Every training (and, when enabled, validation) source: named right, present, a store made
    with this tokenizer, a local mixture source not empty. Reads no more than a first row."""
    t, v = config.training, config.validation
    text = {"text_field": t.dataset_text_field, "txt_split": t.dataset_txt_split, "bad_lines": t.dataset_bad_lines}
    groups = [(t, t.mixture, t.dataset, t.dataset_path)]
    if v.enable:
        groups.append((v, v.mixture, v.dataset, v.dataset_path))
    for part, mixture, dataset, dataset_path in groups:
        section = "validation" if part is v else "training"
        if not mixture:
            key = f"{section}.dataset_path"
            _check_one(dataset, dataset_path, tokenizer, t.seq_len, key, part.dataset_config, part.dataset_split)
            continue
        for i, src in enumerate(mixture):
            _check_one(src.dataset, src.path, tokenizer, t.seq_len, f"{section}.mixture[{i}]")
            if src.path and not _store_path(src.dataset, src.path) and src.dataset in ("", None):
                build_source("", src.path, **text, section=section)  # an empty or unreadable local source fails here
