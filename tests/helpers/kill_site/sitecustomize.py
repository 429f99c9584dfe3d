"""Imported by every Python process whose PYTHONPATH holds this folder (tests/helpers/debug_kill.py
puts it there): installs the TITAN_DEBUG_KILL_AT kill point, when one is set."""

import os
import sys

if os.environ.get("TITAN_DEBUG_KILL_AT"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
    from tests.helpers.debug_kill import install

    install()
