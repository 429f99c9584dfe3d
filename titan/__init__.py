"""titan: PyTorch-native pretraining of Llama-class language models."""

import os

# torchao's wheels carry C++ kernels built for one CUDA torch release and Python version; on any
# other setup (a CPU torch, another Python) importing torchao prints a "Failed to load ..._C*.so"
# line per library. titan uses only torchao's Python float8 and optimizer code (float8 matmuls go
# through torch._scaled_mm), which needs none of those kernels.
# Set here, before anything can import torchao, so every entry point (train.py, python -m
# titan.train, scripts, tests) gets it; an explicit TORCHAO_FORCE_SKIP_LOADING_SO_FILES=0 wins.
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

__version__ = "0.1.0"
