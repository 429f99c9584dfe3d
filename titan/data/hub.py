"""Hugging Face hub datasets by id, and local mirrors in the hub's layout.

A dataset on the hub is a repository of data files plus a card (README.md) whose YAML header may
list ``configs:``, each choosing its data files per split. ``hf download ID --repo-type dataset
--local-dir DIR`` writes the same tree, card included, so a mirror and the hub resolve to the
same files in the same order: ``resolve_files`` asks ``datasets`` for the files of one
(config, split) and nothing else. Reading them is left to titan/data/datasets.py, file by file, so
every file is a shard the loader can deal to one dp rank and reopen at a row on resume.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from titan.errors import TitanError
from titan.log import logger

__all__ = ["default_split", "hub_layout", "is_hub_id", "offline_hint", "resolve_files"]

# owner/name as the hub spells repository ids: no leading dot or slash, exactly one slash
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def default_split(section: str) -> str:
    """The split a section reads unless its dataset_split says otherwise."""
    return "validation" if section == "validation" else "train"


def is_hub_id(name: str) -> bool:
    """``owner/name`` that is not a local path (an existing path always wins)."""
    return bool(_HUB_ID.match(name)) and not Path(name).exists()


def _card_has_configs(folder: Path) -> bool:
    card = folder / "README.md"
    if not card.is_file():
        return False
    text = card.read_text(encoding="utf-8", errors="replace")
    if not text.startswith("---"):
        return False
    header = text.split("\n---", 1)[0]
    return re.search(r"^configs:", header, flags=re.MULTILINE) is not None


def hub_layout(dataset: str, path: str, config: str, split: str, section: str) -> bool:
    """Whether the local ``path`` is read as a hub mirror: the run names the hub dataset it copies
    (``dataset`` is an id), a config or a non-default split, or the folder's card lists configs."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return False
    return is_hub_id(dataset) or bool(config) or split not in ("", default_split(section)) or _card_has_configs(folder)


def offline_hint(repo: str, config: str, section: str) -> str:
    part = f" (--include the paths the card's configs list for {config!r})" if config else ""
    return (
        f"without network, mirror it from a machine with network: `hf download {repo} --repo-type dataset "
        f"--local-dir DIR`{part}, then set {section}.dataset_path = DIR (docs/datasets.md); HF_HUB_OFFLINE=1 "
        "stops the hub client's retries at once"
    )


PROBE_SECONDS = 3.0  # a reachable hub answers a TCP connect in well under a second


def _proxy() -> str:
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        if os.environ.get(name):
            return os.environ[name]
    return ""


def hub_unreachable(timeout: float = PROBE_SECONDS) -> str | None:
    """Why the hub (its endpoint, HF_ENDPOINT, or the HTTPS proxy) cannot be reached, or None.

    Without HF_HUB_OFFLINE a hub client with no network retries each request for about 20 s before
    it gives up; one TCP connect (name lookup included) tells the same in ``timeout`` seconds."""
    import socket
    import threading
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    target = urlsplit(_proxy() or constants.ENDPOINT)
    host = target.hostname or ""
    port = target.port or (443 if target.scheme == "https" else 80)
    outcome: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome.append(None)
        except OSError as e:
            outcome.append(f"{host}:{port}: {e.strerror or type(e).__name__}")

    probe = threading.Thread(target=connect, daemon=True)  # a name lookup has no timeout of its own
    probe.start()
    probe.join(timeout)
    return outcome[0] if outcome else f"{host}:{port}: no answer in {timeout:.0f} s"


def _offline() -> bool:
    from huggingface_hub import constants

    # the variable as huggingface_hub reads it, also when set after it was imported
    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _config_names(where: str) -> list[str]:
    import datasets

    try:
        return list(datasets.get_dataset_config_names(where))
    except Exception:  # the names are a courtesy in an error line; never hide the error itself
        return []


def resolve_files(
    where: str, config: str, split: str, section: str, *, remote: bool, log: bool = True
) -> tuple[str, list[str]]:
    """(config name, data files of ``split``) of the hub dataset ``where`` (an id when ``remote``,
    else a mirror folder). Each bad value fails with one line naming the key and the valid ones."""
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    label = f"hub dataset {where!r}" if remote else f"hub mirror {where!r} ({section}.dataset_path)"
    split = split or default_split(section)
    if remote and not _offline():
        why = hub_unreachable()
        if why is not None:
            raise TitanError(
                f"cannot reach the Hugging Face hub for {section}.dataset {where!r} ({why}); "
                + offline_hint(where, config, section)
            )
    try:
        builder = datasets.load_dataset_builder(where, name=config or None)
    except ConnectionError as e:
        raise TitanError(
            f"cannot reach the Hugging Face hub for {section}.dataset {where!r} ({_first_line(e)}); "
            + offline_hint(where, config, section)
        ) from None
    except DatasetNotFoundError as e:
        raise TitanError(
            f"{section}.dataset {where!r} is not a dataset on the hub, or is gated/private "
            f"(log in with `hf auth login`): {_first_line(e)}"
        ) from None
    except ValueError as e:
        names = _config_names(where)
        if not names:
            raise TitanError(f"cannot read {label}: {_first_line(e)}") from None
        got = repr(config) if config else "no config"
        raise TitanError(f"{section}.dataset_config: {got} is not a config of {label}; valid: {names}") from None
    except Exception as e:  # an empty folder, unreadable card, ...: one line naming the source
        raise TitanError(f"cannot read {label}: {_first_line(e)}") from None
    name = builder.config.name
    data_files = builder.config.data_files or {}
    if split not in data_files:
        raise TitanError(
            f"{section}.dataset_split: {split!r} is not a split of {label}, config {name!r}; "
            f"valid: {sorted(data_files)}"
        )
    files = [str(f) for f in data_files[split]]
    if not files:
        raise TitanError(
            f"{label}, config {name!r}, split {split!r} has no data files: the files its card's configs list are"
            " not there (a mirror made with hf download --include of other paths?)"
        )
    if log:  # the check before the build asks too: the build's lookup is the one logged
        logger.info(f"dataset {where} (config {name}, split {split}): {len(files)} data file(s)")
    return name, files
