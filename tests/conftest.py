import os
from pathlib import Path

import pytest

# Tests never touch the network; torchao's C++ extensions are not needed for its Python paths.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


@pytest.fixture
def shared_data() -> Path:
    """../shared/data beside the repo (developers and CI have it; users don't)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} not present (test data lives beside the repo, not in it)")
    return SHARED_DATA
