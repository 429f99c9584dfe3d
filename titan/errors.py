"""Errors a user can cause (bad config, data, checkpoint, CLI)."""


class TitanError(Exception):
    """A user-caused error; the message is one line naming the key/file and what is valid."""


def require(ok: bool, key: str, value: object, valid: str) -> None:
    """The one shape of a config check: ``config key 'KEY' got VALUE; valid: VALID``."""
    if not ok:
        raise TitanError(f"config key '{key}' got {value!r}; valid: {valid}")
