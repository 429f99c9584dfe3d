"""A replica group's data position after every step, so a restarted group reads on from where it
stopped instead of from its last checkpoint (which would read the documents since then twice).

Its weights and step come from a live peer (healing); its data stays its own: each rank writes its
loader's state to ``<checkpoint folder>/data_position/rank<R>.pt`` after drawing each step's
batches (a few KB, replaced atomically), and a restarted process takes it over the checkpoint's
when it is newer."""

from __future__ import annotations

import os
from typing import Any

import torch

from titan.log import logger

FOLDER = "data_position"


class DataPosition:
    """``loader``'s state, kept per step in ``root``/data_position for this ``rank``."""

    def __init__(self, root: str, rank: int, loader: Any) -> None:
        self.loader = loader
        self.path = os.path.join(root, FOLDER, f"rank{rank}.pt")
        self._warned = False

    def save(self, step: int) -> None:
        """After step ``step``'s batches were drawn (committed or discarded: the live group goes on
        reading after them either way)."""
        tmp = f"{self.path}.tmp"
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            torch.save({"step": step, "dataloader": self.loader.state_dict()}, tmp)
            os.replace(tmp, self.path)
        except OSError as e:  # a full disk must not stop training: a restart falls back to the checkpoint's
            if os.path.exists(tmp):
                os.remove(tmp)
            if not self._warned:
                self._warned = True
                logger.warning(
                    f"data position of step {step} not written to {self.path} ({e.strerror or e}): a restarted"
                    " group reads on from its last checkpoint's position until it can be written again"
                )

    def restore(self, loaded_step: int, *, resumed: bool, load_step: int, excluded: bool) -> None:
        """Continue from the saved position when it is newer than the checkpoint just loaded
        (``loaded_step``, 0 when none). ``resumed``: a checkpoint of this run was loaded, or this is
        a launcher restart; a first start without a checkpoint, a rollback to ``load_step`` or
        ``excluded`` (checkpoint.exclude_from_loading names the data loader) start the data as
        the checkpoint says instead (a stale file is removed)."""
        if not os.path.exists(self.path):
            return
        if not resumed or load_step >= 0 or excluded:
            os.remove(self.path)
            return
        saved = torch.load(self.path, weights_only=False)
        if saved["step"] <= loaded_step:
            return
        self.loader.load_state_dict(saved["dataloader"])
        logger.info(
            f"data position of step {saved['step']} restored from {self.path} (newer than the checkpoint's"
            f" step {loaded_step}): this group reads on where it stopped"
        )
