"""Progress bars are drawn on a terminal only: logs and pipes stay free of bar lines."""

from __future__ import annotations

import io
import sys

import torch

from titan.progress import progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_on_a_terminal_only(monkeypatch):
    for stream, drawn in ((_Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr(sys, "stderr", stream)
        assert list(progress(range(3), desc="converting", unit="tensor")) == [0, 1, 2]
        text = stream.getvalue()
        assert ("converting" in text and "/3 " in text) == drawn, text  # known end


def test_dcp_to_torch_conversion_shows_a_bar_on_a_terminal(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from titan.checkpointing.model_dcp import dcp_to_torch_file

    state = {"model": {"a": torch.arange(4.0), "b": torch.ones(2, 2)}, "step": 3}
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"))
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    dcp_to_torch_file(tmp_path / "ckpt", tmp_path / "all.pt", model_only=False)
    loaded = torch.load(tmp_path / "all.pt", weights_only=False)
    assert torch.equal(loaded["model"]["b"], torch.ones(2, 2)) and loaded["step"] == 3
    assert "reading checkpoint" in term.getvalue() and "/3 " in term.getvalue(), term.getvalue()  # a, b, step
