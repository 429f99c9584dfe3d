"""Data parallelism: FSDP2 (fully_shard, HSDP with a 2-D mesh) and DDP (replicate)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from titan.config.choices import DType, choices
from titan.errors import TitanError
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
    cpu_offload: bool = False,
) -> None:
    """fully_shard each TransformerBlock, then the root (which holds embeddings, norm, output).

    `mesh` is 1-D for FSDP or 2-D (dp_replicate, dp_shard_cp) for HSDP. With `cpu_offload` the
    sharded parameters (and so their gradients and optimizer states) stay on the host; the model
    must then be materialized on the CPU (offload_init_device).
    """
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])
    # Pinned host memory makes the copies to the GPU asynchronous; pinning needs an accelerator.
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if cpu_offload else OffloadPolicy()
    reshard = reshard_policy(reshard_after_forward, pp_enabled)
    layers = getattr(model, "layers", None)
    if layers is not None:
        for block in layers.values():
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, offload_policy=offload)
    output = getattr(model, "output", None)
    if getattr(model, "loss_owns_output", False) and output is not None:
        # The chunked loss calls `output` after the model's forward: its own unit, so its hooks
        # gather the weight for the chunks (once; the loss reshards it after the last backward).
        if output.weight is getattr(getattr(model, "tok_embeddings", None), "weight", None):
            raise TitanError(
                "training.loss_chunk_tokens > 0 with FSDP needs untied output weights (model tie_embeddings"
                " shares them with the embedding, which FSDP gathers with the model);"
                " set training.loss_chunk_tokens = 0"
            )
        fully_shard(output, mesh=mesh, mp_policy=mp, reshard_after_forward=False, offload_policy=offload)
    # The root is used last in forward and first in backward: keeping it gathered saves a re-gather.
    fully_shard(
        model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward == "always", offload_policy=offload
    )
    logger.info(
        f"applied FSDP2 (mesh {tuple(mesh.shape)}, param {param_dtype}, reduce {reduce_dtype}"
        + (", parameters, gradients and optimizer states offloaded to the CPU)" if cpu_offload else ")")
    )


def offload_init_device(device: torch.device, cpu_offload: bool) -> torch.device:
    """Where parameters are materialized: the host under CPU offload (FSDP2 requires it), else the device."""
    return torch.device("cpu") if cpu_offload else device


def check_cpu_offload(  # float8: config.Float8
    fsdp_enabled: bool, float8, nonfinite: str = "stop", device_type: str = "cpu"
) -> None:
    """CPU offload is FSDP2's offload policy: it needs FSDP, and float8's FSDP all-gather casts and
    scales the sharded weights where they live, which offload moves off the device. On GPUs the
    skip_step decision is a device tensor that masks the optimizer's update in place: the offloaded
    weights and states are host tensors."""
    if not fsdp_enabled:
        raise TitanError(
            "training.enable_cpu_offload needs FSDP (data_parallel_shard_degree x context_parallel_degree > 1):"
            " it offloads FSDP2's sharded parameters, gradients and optimizer states; set it to false"
        )
    scales_on_device = float8.enable_fsdp_float8_all_gather or float8.precompute_float8_dynamic_scale_for_fsdp
    if float8.enable_float8_linear and scales_on_device:
        raise TitanError(
            "training.enable_cpu_offload does not combine with float8.enable_fsdp_float8_all_gather /"
            " precompute_float8_dynamic_scale_for_fsdp; turn those off to offload"
        )
    if nonfinite == "skip_step" and device_type == "cuda":
        raise TitanError(
            "training.enable_cpu_offload does not combine with training.nonfinite = skip_step on GPUs (the skip"
            " decision stays on the GPU, the offloaded optimizer states on the host); use nonfinite = stop"
        )


def apply_ddp(model: nn.Module, mesh: DeviceMesh) -> None:
    from torch.distributed._composable.replicate import replicate

    replicate(model, device_mesh=mesh, bucket_cap_mb=100)
    logger.info(f"applied DDP (replicas {mesh.size()})")
