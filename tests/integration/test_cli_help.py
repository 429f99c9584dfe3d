"""`python train.py --help | head`: the reader closing the pipe early is not an error."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_help_into_a_closed_pipe_exits_0_without_traceback():
    proc = subprocess.Popen(
        [sys.executable, "train.py", "--help"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().startswith("usage:")
    proc.stdout.close()  # what `head -1` does after its line
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in err, err
