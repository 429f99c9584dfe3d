"""Data parallelism: FSDP2 (fully_shard, HSDP with a 2-D mesh) and DDP (replicate)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from titan.config.choices import DType, choices
from titan.log import logger

# The one dtype-name table (config values, checkpoint exports, scripts' --dtype); the names are the
# config's DType choices and torch's attribute names. Bytes per element: DTYPES[name].itemsize.
DTYPES: Mapping[str, torch.dtype] = MappingProxyType({name: getattr(torch, name) for name in choices(DType)})


def reshard_policy(option: str, pp_enabled: bool) -> bool:
    """'default' frees gathered params after forward, except under PP, where a stage runs several
    micro-batches forward before their backwards and would re-gather each time."""
    if option == "always":
        return True
    if option == "never":
        return False
    return not pp_enabled


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: str,
    reduce_dtype: str,
    reshard_after_forward: str,
    pp_enabled: bool = False,
) -> None:
    """fully_shard each TransformerBlock, then the root (which holds embeddings, norm, output).

    `mesh` is 1-D for FSDP or 2-D (dp_replicate, dp_shard_cp) for HSDP.
    """
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])
    reshard = reshard_policy(reshard_after_forward, pp_enabled)
    layers = getattr(model, "layers", None)
    if layers is not None:
        for block in layers.values():
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    # The root is used last in forward and first in backward: keeping it gathered saves a re-gather.
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward == "always")
    logger.info(f"applied FSDP2 (mesh {tuple(mesh.shape)}, param {param_dtype}, reduce {reduce_dtype})")


def apply_ddp(model: nn.Module, mesh: DeviceMesh) -> None:
    from torch.distributed._composable.replicate import replicate

    replicate(model, device_mesh=mesh, bucket_cap_mb=100)
    logger.info(f"applied DDP (replicas {mesh.size()})")
