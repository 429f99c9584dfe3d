"""Weight init that gives the same weights for a seed whatever the parallel layout.

DTensor's random ops are layout-independent only on CUDA (its offset-based RNG tracker); on CPU
every shard would draw the same local numbers. And pipeline stages own different parameters, so a
single shared RNG stream would advance differently on each stage. So every random init op on a
parameter is redirected: draw the *full* tensor from a generator seeded by (seed, parameter name),
then keep the local shard. Cost: one full-size temporary per parameter, once, at start-up.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.overrides import TorchFunctionMode

# In-place random Tensor methods, caught by a TorchFunctionMode when called on a parameter.
_RANDOM_METHODS: frozenset[Callable] = frozenset(
    {
        torch.Tensor.normal_,
        torch.Tensor.uniform_,
        torch.Tensor.bernoulli_,
        torch.Tensor.exponential_,
        torch.Tensor.random_,
        torch.Tensor.cauchy_,
        torch.Tensor.log_normal_,
        torch.Tensor.geometric_,
    }
)
# nn.init functions are swapped for the duration of init: some (trunc_normal_) resample into
# temporaries with extra RNG draws, so only wrapping the whole call makes them layout-independent.
_INIT_FUNCTIONS = (
    "normal_",
    "uniform_",
    "trunc_normal_",
    "xavier_normal_",
    "xavier_uniform_",
    "kaiming_normal_",
    "kaiming_uniform_",
    "orthogonal_",
    "sparse_",
)

# Wrappers (compile, activation checkpointing) add these to names; the init seed must not change.
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def canonical_fqn(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def param_seed(seed: int, fqn: str) -> int:
    digest = hashlib.sha256(f"{seed}:{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _init_full(fn: Callable, target: torch.Tensor, fqn: str, seed: int, args: tuple, kwargs: dict) -> torch.Tensor:
    """fn(full tensor, *args) under a (seed, fqn) generator, then keep this rank's shard."""
    full = torch.empty(target.shape, dtype=target.dtype, device=target.device)
    devices = [full.device] if full.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=full.device.type):
        torch.manual_seed(param_seed(seed, fqn))
        fn(full, *args, **kwargs)
    with torch.no_grad():
        if isinstance(target, DTensor):
            local = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
            target.to_local().copy_(local.to_local())
        else:
            target.copy_(full)
    return target


class _LayoutIndependentInit(TorchFunctionMode):
    """Catches random in-place methods called directly on a parameter (p.normal_())."""

    def __init__(self, names: dict[int, str], seed: int):
        super().__init__()
        self.names = names
        self.seed = seed

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _RANDOM_METHODS and args and id(args[0]) in self.names:
            return _init_full(func, args[0], self.names[id(args[0])], self.seed, args[1:], kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def _patched_init_functions(names: dict[int, str], seed: int) -> Iterator[None]:
    originals = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}

    def wrap(original: Callable) -> Callable:
        @functools.wraps(original)
        def wrapper(tensor: torch.Tensor, *args, **kwargs):
            fqn = names.get(id(tensor))
            if fqn is None:
                return original(tensor, *args, **kwargs)
            return _init_full(original, tensor, fqn, seed, args, kwargs)

        return wrapper

    try:
        for name, original in originals.items():
            setattr(nn.init, name, wrap(original))
        yield
    finally:
        for name, original in originals.items():
            setattr(nn.init, name, original)


def init_model_weights(model: nn.Module, seed: int, buffer_device: torch.device | None = None) -> None:
    """Run the model's own init_weights() with layout-independent random draws."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), canonical_fqn(name))
    with torch.no_grad(), _patched_init_functions(names, seed), _LayoutIndependentInit(names, seed):
        # Every registered model class defines init_weights(buffer_device); nn.Module's attribute
        # typing cannot know it.
        init_weights: Any = model.init_weights
        init_weights(buffer_device=buffer_device)
