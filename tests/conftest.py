import os

# Tests never touch the network; torchao's C++ extensions are not needed for its Python paths.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
