import os

import pytest


@pytest.fixture(autouse=True)
def _environment_restored():
    """The launcher's main() marks the environment its ranks inherit (the config checked, its pid):
    called in this process, those marks would reach every later test's launches in this process
    (under pytest-xdist, whichever tests the worker runs next), so each test here gets it back."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
