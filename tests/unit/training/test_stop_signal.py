"""What a stop says is what happened: a SIGTERM during step 3 of a run without checkpointing ends
that step and the run cleanly (exit 0 under a launcher), and the run says it saved nothing;
before, the signal killed the rank and the launcher called it a stop "while the ranks were
starting"."""

import json

from tests.helpers.runs import signal_during, trainer
from titan.training.goodput import RECORD_FILE


def test_sigterm_without_checkpointing_stops_after_its_step_and_says_nothing_was_saved(tmp_path, caplog):
    t = trainer(tmp_path)  # checkpoint.enable is off
    signal_during(t, 3, send=True)
    with caplog.at_level("WARNING", logger="titan"):
        losses = t.train()
    assert sorted(losses) == [1, 2, 3]
    line = "received SIGTERM: stopping after this step without a save, then exiting (checkpoint.enable is off)"
    assert line in caplog.text, caplog.text
    assert not (tmp_path / "checkpoint").exists()
    end = json.loads((tmp_path / RECORD_FILE).read_text().splitlines()[-1])
    assert end["kind"] == "end" and end["cause"] == "stopped after a signal" and end["step"] == 3, end
