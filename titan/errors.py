"""Errors a user can cause (bad config, data, checkpoint, CLI)."""


class TitanError(Exception):
    """A user-caused error; the message is one line naming the key/file and what is valid."""
