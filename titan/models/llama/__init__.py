"""Llama 3 / 3.1: flavors (args.py) and the pure-PyTorch model (model.py)."""

from __future__ import annotations

from titan.models.llama.args import (
    TransformerModelArgs,
    get_model_args,
    get_nparams_and_flops,
    llama3_configs,
)
from titan.models.llama.model import Transformer

__all__ = [
    "Transformer",
    "TransformerModelArgs",
    "get_model_args",
    "get_nparams_and_flops",
    "llama3_configs",
]
