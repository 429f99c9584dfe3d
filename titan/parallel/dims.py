"""ParallelDims: the parallelism degrees, their checks, and the DeviceMesh built from them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan.config.job_config import Parallelism
from titan.errors import TitanError

# Outer to inner: pipeline stages talk least, tensor parallel ranks talk most (keep them closest).
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# The routed experts' mesh over the same ranks in the same order: the inner dp_shard x cp x tp
# ranks regrouped as efsdp x ep x etp, so EP borrows data-parallel, CP and TP ranks.
SPARSE_ORDER = ("pp", "dp_replicate", "efsdp", "ep", "etp")


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    enable_loss_parallel: bool = True
    ep: int = 1
    """Expert parallel: the routed experts split over this many ranks taken from dp_shard x cp x tp."""
    etp: int = 1
    """Expert tensor parallel: 1 (EP borrows the TP ranks too) or tp (experts' hidden dim sharded over TP)."""
    _mesh: DeviceMesh | None = field(default=None, repr=False)
    _sparse: DeviceMesh | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._resolve_and_check()

    def _resolve_and_check(self) -> None:
        """Against the world size; each degree's own range is Parallelism.validate's (load_config)."""
        assert min(self.dp_replicate, self.cp, self.tp, self.pp) >= 1, self
        assert self.dp_shard == -1 or self.dp_shard >= 1, self
        if self.dp_shard == -1:
            others = self.dp_replicate * self.cp * self.tp * self.pp
            if self.world_size % others:
                raise TitanError(
                    f"parallelism degrees replicate {self.dp_replicate} x cp {self.cp} x tp {self.tp} x pp {self.pp}"
                    f" = {others} do not divide the world size {self.world_size}"
                )
            self.dp_shard = self.world_size // others
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp
        if product != self.world_size:
            raise TitanError(
                f"parallelism degrees replicate {self.dp_replicate} x shard {self.dp_shard} x cp {self.cp}"
                f" x tp {self.tp} x pp {self.pp} = {product}, but the world size is {self.world_size};"
                " make them multiply to the number of ranks (data_parallel_shard_degree = -1 takes the rest)"
            )
        self._check_experts()

    def _check_experts(self) -> None:
        if self.etp not in (1, self.tp):
            raise TitanError(
                f"config key 'parallelism.expert_tensor_parallel_degree' got {self.etp}; valid: 1 or the"
                f" tensor parallel degree {self.tp} (the experts' hidden dim is sharded over TP or not at all)"
            )
        if self.ep == 1:
            return
        borrowed = self.dp_shard * self.cp * self.tp
        if borrowed % (self.ep * self.etp):
            raise TitanError(
                f"config key 'parallelism.expert_parallel_degree' got {self.ep}; expert parallel x expert"
                f" tensor parallel ({self.ep} x {self.etp}) must divide data_parallel_shard x context_parallel x"
                f" tensor_parallel = {self.dp_shard} x {self.cp} x {self.tp} = {borrowed} (EP takes its ranks"
                " from those)"
            )

    # ------------------------------------------------------------ which dims are on
    @property
    def dp_enabled(self) -> bool:
        return self.dp_replicate * self.dp_shard > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP shards over dp_shard x cp (CP ranks also shard parameters)."""
        return self.dp_shard * self.cp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def loss_parallel_enabled(self) -> bool:
        return self.tp_enabled and self.enable_loss_parallel

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def etp_enabled(self) -> bool:
        return self.ep > 1 and self.etp > 1

    @property
    def efsdp(self) -> int:
        """FSDP degree of the routed experts: the dp_shard x cp x tp ranks EP and ETP leave."""
        return self.dp_shard * self.cp * self.tp // (self.ep * self.etp)

    @property
    def non_data_parallel_size(self) -> int:
        """Ranks that work on the same tokens (TP/CP/PP); throughput per device divides by it."""
        return self.cp * self.tp * self.pp

    @property
    def dp_degree(self) -> int:
        """Ranks that see different data (replicas x shards)."""
        return self.dp_replicate * self.dp_shard

    # ------------------------------------------------------------ mesh
    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """One mesh with named dims (degree-1 dims left out) plus flattened dp meshes."""
        if self.world_size == 1:
            return None
        dims = [(name, getattr(self, name)) for name in MESH_ORDER if getattr(self, name) > 1]
        names = tuple(n for n, _ in dims)
        mesh = init_device_mesh(device_type, tuple(d for _, d in dims), mesh_dim_names=names)
        self._flatten(mesh, names, ("dp_replicate", "dp_shard"), "dp")
        self._flatten(mesh, names, ("dp_shard", "cp"), "dp_shard_cp")
        self._flatten(mesh, names, ("dp_replicate", "dp_shard", "cp"), "dp_cp")
        self._mesh = mesh
        if self.ep_enabled:
            self._sparse = self._build_sparse(device_type)
        return mesh

    def _build_sparse(self, device_type: str) -> DeviceMesh:
        """pp x dp_replicate x efsdp x ep x etp over the same ranks as the dense mesh. efsdp is
        kept at size 1: the experts are FSDP-wrapped on their own mesh (mixed precision, and the
        block's FSDP must not take their EP-sharded parameters)."""
        keep = {"efsdp", "ep"}
        dims = [(n, getattr(self, n)) for n in SPARSE_ORDER if getattr(self, n) > 1 or n in keep]
        return init_device_mesh(device_type, tuple(d for _, d in dims), mesh_dim_names=tuple(n for n, _ in dims))

    def sparse_submesh(self, names: tuple[str, ...]) -> DeviceMesh | None:
        """A sub-mesh of the experts' mesh (ep, etp, efsdp, dp_replicate); None without EP or when
        a named dim has size 1 (efsdp excepted)."""
        if self._sparse is None:
            return None
        have = self._sparse.mesh_dim_names or ()
        if any(n not in have for n in names):
            return None
        return self._sparse[tuple(names)]

    def experts_fsdp_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP shards the routed experts over under EP: efsdp, or (dp_replicate, efsdp)."""
        names = ("dp_replicate", "efsdp") if self.dp_replicate_enabled else ("efsdp",)
        return self.sparse_submesh(names)

    @staticmethod
    def _flatten(mesh: DeviceMesh, names: tuple[str, ...], parts: tuple[str, ...], flat: str) -> None:
        present = tuple(p for p in parts if p in names)
        if len(present) >= 2:
            mesh[present]._flatten(mesh_dim_name=flat)

    @property
    def mesh(self) -> DeviceMesh | None:
        return self._mesh

    def submesh(self, name: str) -> DeviceMesh | None:
        """The named (or flattened) sub-mesh; None when that dimension has size 1."""
        if self._mesh is None:
            return None
        names = self._mesh.mesh_dim_names or ()
        if name in names:
            return self._mesh[name]
        flat = {
            "dp": ("dp_replicate", "dp_shard"),
            "dp_shard_cp": ("dp_shard", "cp"),
            "dp_cp": ("dp_replicate", "dp_shard", "cp"),
        }
        present = [p for p in flat.get(name, ()) if p in names]
        if len(present) == 1:
            return self._mesh[present[0]]
        if len(present) > 1:
            return self._mesh[name]
        return None

    def fsdp_mesh(self) -> DeviceMesh:
        """FSDP's mesh: 1-D over dp_shard x cp, or 2-D (dp_replicate, shard) for HSDP. A
        flattened name exists only when both of its parts are > 1, so pick what is present."""
        if self.dp_shard_enabled and self.cp_enabled:
            shard = "dp_shard_cp"
        else:
            shard = "dp_shard" if self.dp_shard_enabled else "cp"
        # Only called with FSDP on, hence with a mesh holding the shard dims.
        mesh = self.submesh(shard) if not self.dp_replicate_enabled else self._mesh
        assert mesh is not None, "fsdp_mesh needs a built mesh with FSDP on"
        return mesh if not self.dp_replicate_enabled else mesh[("dp_replicate", shard)]

    def dp_rank(self) -> int:
        dp = self.submesh("dp")
        return 0 if dp is None else dp.get_local_rank()


def check_layout(
    dims: ParallelDims,
    par: Parallelism | None,
    model_args: Any,
    seq_len: int,
    device_type: str,
    attn_type: str = "sdpa",
    compiled: bool = False,
) -> None:
    """Checks that need the degrees, the model shape and the device, but no process group: run
    on every rank before init_distributed so a bad layout fails at once instead of hanging.
    ``par`` may be None only when neither TP nor PP is on (nothing reads it then)."""
    from titan.parallel.cp import check_cp_seq_len
    from titan.parallel.pp_layout import split_modules
    from titan.parallel.tp import check_tp_shapes

    if attn_type == "flex" and device_type == "cpu":
        # torch's flex_attention raises NotImplementedError in a CPU forward that needs grad.
        raise TitanError(
            'model.attn_type = "flex" cannot train on CPU (torch\'s flex_attention has no CPU backward);'
            ' use "sdpa" on CPU, flex on CUDA'
        )
    if dims.tp_enabled:
        check_tp_shapes(model_args.n_heads, model_args.kv_heads, dims.tp)
        if dims.dp_replicate_enabled and not dims.fsdp_enabled:
            raise TitanError(
                "DDP (data_parallel_replicate_degree > 1 with shard degree 1) does not compose with"
                " tensor parallel; use HSDP (data_parallel_shard_degree > 1) or FSDP instead"
            )
        assert par is not None, "check_layout needs the [parallelism] section with TP"
        if par.enable_async_tensor_parallel and device_type != "cuda":
            raise TitanError(
                "parallelism.enable_async_tensor_parallel needs CUDA (symmetric memory between GPUs);"
                f" this run's device is {device_type}: set it to false"
            )
        if par.enable_async_tensor_parallel and not compiled:
            raise TitanError(
                "parallelism.enable_async_tensor_parallel works through compile's micro-pipeline pass:"
                " also set compile.enable (with 'model' in compile.components)"
            )
    if dims.pp_enabled:
        assert par is not None, "check_layout needs the [parallelism] section with PP"
        split_modules(model_args.n_layers, dims.pp, par)
        if model_args.tie_embeddings:
            raise TitanError(
                "model tie_embeddings cannot be split across pipeline stages; untie it or set"
                " pipeline_parallel_degree 1"
            )
    if dims.ep_enabled:
        check_experts(dims, model_args)
    if dims.cp_enabled:
        check_cp_seq_len(seq_len, dims.cp, attn_type)
        if device_type != "cuda":
            raise TitanError(
                "parallelism.context_parallel_degree > 1 trains only on CUDA: on CPU, SDPA has no"
                " context-parallel sharding rule and flex_attention has no backward"
            )


def check_experts(dims: ParallelDims, model_args: Any) -> None:
    """EP needs routed experts, as many on each EP rank, and with TP the experts split over TP too."""
    moe = getattr(model_args, "moe_args", None)
    if moe is None:
        raise TitanError(
            f"config key 'parallelism.expert_parallel_degree' got {dims.ep}; this model has no routed experts"
            " (it needs a mixture-of-experts model): set it to 1"
        )
    if moe.num_experts % dims.ep:
        raise TitanError(
            f"config key 'parallelism.expert_parallel_degree' got {dims.ep}; valid: a divisor of the model's"
            f" {moe.num_experts} experts"
        )
    if dims.tp_enabled and not dims.etp_enabled:
        raise TitanError(
            f"parallelism.expert_tensor_parallel_degree = 1 with tensor_parallel_degree {dims.tp} and"
            f" expert_parallel_degree {dims.ep} is not supported by titan's MoE plan (EP would have to split each"
            f" TP group's tokens); set expert_tensor_parallel_degree = {dims.tp}"
        )
