"""Errors a user can cause (bad config, data, checkpoint, CLI)."""

from __future__ import annotations

import os


class TitanError(Exception):
    """A user-caused error; the message is one line naming the key/file and what is valid."""


def require(ok: bool, key: str, value: object = None, valid: str = "", *, rule: str | None = None) -> None:
    """The one shape of a config check: ``config key 'KEY' got VALUE; valid: VALID``. A rule between
    keys, where no single value is wrong, states it instead: ``config key 'KEY' RULE``."""
    if not ok:
        if rule is not None:
            raise TitanError(f"config key '{key}' {rule}")
        raise TitanError(f"config key '{key}' got {value!r}; valid: {valid}")


def read_user_json(path: os.PathLike[str] | str, missing: str) -> object:
    """A JSON file the user pointed at: ``missing`` when it is not there, one line when it is not JSON."""
    import json
    from pathlib import Path

    path = Path(path)
    if not path.is_file():
        raise TitanError(missing)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TitanError(f"{path} is not valid JSON: {e}") from None
