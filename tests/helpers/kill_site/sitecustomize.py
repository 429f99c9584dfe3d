"""Imported by every Python process whose PYTHONPATH holds this folder (tests/helpers/debug_kill.py
puts it there): installs the TITAN_DEBUG_KILL_AT kill point, when one is set."""

import os
import sys

if any(os.environ.get(k) for k in ("TITAN_DEBUG_KILL_AT", "TITAN_DEBUG_READY_FILE", "TITAN_DEBUG_WAIT_AT")):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
    from tests.helpers.debug_kill import install

    install()
