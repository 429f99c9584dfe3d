"""The routed experts: E SwiGLU FFNs over tokens already sorted by expert.

Two paths with the same numbers: one ``torch._grouped_mm`` per weight (no host read: the group
offsets stay on the device) where device and dtype support it, else a loop over the experts, which
needs the per-expert counts on the host to split the tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

# Private but stable since torch 2.8 (torchtitan's MoE runs on it); the CPU kernel exists since 2.9.
_grouped_mm = torch._grouped_mm  # pyright: ignore[reportPrivateImportUsage]

# Rows per group the CUDA grouped GEMM wants each expert's token block to be a multiple of (16
# bytes of fp8/bf16 rows, as torchtitan pads); the CPU kernel takes any group sizes.
CUDA_GROUP_ALIGN = 16


def _local(w: torch.Tensor) -> torch.Tensor:
    """A DTensor parameter (tensor or expert parallel) as its local shard: the token counts here
    are this rank's, which a DTensor's global shape cannot express."""
    to_local = getattr(w, "to_local", None)
    return cast(torch.Tensor, to_local()) if callable(to_local) else w


def _shapes_only(x: torch.Tensor) -> bool:
    """Fake or meta tensors outside a compiled region (the memory estimate): shapes, no values."""
    return (x.device.type == "meta" or is_fake(x)) and not torch.compiler.is_compiling()


def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """Whether torch._grouped_mm runs ``x @ w`` here (all operands in ``dtype`` when given, as
    autocast casts them): CPU in fp32/bf16/fp16; CUDA in bf16 on SM90+ (Hopper's grouped GEMM).
    Every row stride must be a multiple of 16 bytes. torch's shape function (used when compiling)
    accepts bf16 only, so compiled regions run other dtypes in the loop."""
    dt = dtype if dtype is not None else x.dtype
    if dtype is None and any(w.dtype != dt for w in weights):
        return False
    if dt != torch.bfloat16 and torch.compiler.is_compiling():
        return False
    if x.device.type == "cpu" or _shapes_only(x):
        ok_dtype = dt in (torch.float32, torch.bfloat16, torch.float16)
    elif x.device.type == "cuda":
        ok_dtype = dt == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    else:
        return False
    size = torch.empty((), dtype=dt).element_size()
    return ok_dtype and all((w.shape[-1] * size) % 16 == 0 and (w.shape[-2] * size) % 16 == 0 for w in weights)


def _gmm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.bfloat16 and _shapes_only(x):
        # torch's shape function takes bf16 only; a matmul with one expert's weight gives the same
        # output shape, dtype and saved tensors (the memory estimate measures bytes, not values).
        return x @ w[0]
    return _grouped_mm(x, w, offs=offs)


Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(gate, up) projections -> the hidden activation the down projection reads."""
Biases = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""b1, b2, b3: per-expert biases of w1 / w2 / w3 ([E, hidden], [E, dim], [E, hidden])."""


class _ShareForward(torch.autograd.Function):
    """``bias / shares`` forward, the gradient unscaled backward: ``shares`` ranks each add their
    share to partial outputs that are then summed, and each rank's gradient is already the whole one."""

    @staticmethod
    def forward(ctx, bias: torch.Tensor, shares: int) -> torch.Tensor:  # type: ignore[override]
        return bias / shares

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's SwiGLU: the clamps keep its activations bounded; the + 1 lets up = 0 pass the gate."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _row_experts(offs: torch.Tensor, n: int) -> torch.Tensor:
    """The expert of each of ``n`` sorted rows from the groups' end offsets, on the device (no
    host read); rows past the last group (padding) get the last expert, their output is dropped."""
    rows = torch.arange(n, device=offs.device, dtype=offs.dtype)
    return torch.searchsorted(offs, rows, right=True).clamp_(max=offs.numel() - 1)


def _swiglu(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    offs: torch.Tensor,
    act: Activation = swiglu,
    biases: Biases | None = None,
) -> torch.Tensor:
    gate, up = _gmm(x, w1.transpose(-2, -1), offs), _gmm(x, w3.transpose(-2, -1), offs)
    rows = _row_experts(offs, x.shape[0]) if biases is not None else None
    if biases is not None:
        gate, up = gate + biases[0][rows], up + biases[2][rows]
    out = _gmm(act(gate, up), w2.transpose(-2, -1), offs)
    return out if biases is None else out + biases[1][rows]


def run_grouped(
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    x: torch.Tensor,
    counts: torch.Tensor,
    align: int = 1,
    *,
    act: Activation = swiglu,
    biases: Biases | None = None,
) -> torch.Tensor:
    """SwiGLU experts with grouped GEMMs. ``align`` > 1 pads each expert's block to a multiple of
    ``align`` rows (done on the device: an upper bound of the padded size keeps shapes static).
    ``biases``: added to each row by the expert it belongs to."""
    counts = counts.to(torch.int64)
    n = x.shape[0]
    if align == 1:
        # Rows past the last offset would be left unwritten; with counts summing to n there are none.
        return _swiglu(x, w1, w2, w3, torch.cumsum(counts, 0, dtype=torch.int32), act, biases)
    padded = (counts + align - 1) // align * align
    ends, padded_ends = torch.cumsum(counts, 0), torch.cumsum(padded, 0)
    # Sorted row r belongs to expert e = #ends <= r; it moves by e's padded start - its start.
    expert = torch.searchsorted(ends, torch.arange(n, device=x.device), right=True)
    dest = torch.arange(n, device=x.device) - (ends - counts)[expert] + (padded_ends - padded)[expert]
    buf = x.new_zeros(n + align * counts.numel(), x.shape[-1]).index_copy(0, dest, x)
    return _swiglu(buf, w1, w2, w3, padded_ends.to(torch.int32), act, biases)[dest]


def run_loop(
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    x: torch.Tensor,
    counts: torch.Tensor,
    *,
    act: Activation = swiglu,
    biases: Biases | None = None,
) -> torch.Tensor:
    """SwiGLU experts one at a time (reads ``counts`` on the host to split the rows)."""
    sizes = [int(c) for c in counts.tolist()]
    outs = []
    for e, xe in enumerate(torch.split(x[: sum(sizes)], sizes)):
        gate, up = xe @ w1[e].transpose(0, 1), xe @ w3[e].transpose(0, 1)
        if biases is not None:
            gate, up = gate + biases[0][e], up + biases[2][e]
        out = act(gate, up) @ w2[e].transpose(0, 1)
        outs.append(out if biases is None else out + biases[1][e])
    return torch.cat(outs) if outs else x.new_zeros(0, x.shape[-1])


class GroupedExperts(nn.Module):
    """``w1``/``w3`` [E, hidden, dim], ``w2`` [E, dim, hidden]: expert e is
    ``w2[e] @ (silu(w1[e] @ x) * (w3[e] @ x))``. E is whatever the local w1 holds (expert parallel
    shards dimension 0), and ``forward`` takes that many counts. With ``bias`` each projection adds
    its expert's ``b1`` / ``b3`` [E, hidden] / ``b2`` [E, dim]; with ``swiglu_limit`` the activation is
    gpt-oss's clamped SwiGLU (see clamped_swiglu).

    ``down_bias_shares``: how many ranks' partial outputs are summed into one (tensor parallel sets
    it to its degree, each rank holding a slice of every hidden dim): ``b2`` must be added once to
    the sum, so each rank adds 1 / shares of it."""

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        use_grouped_mm: bool = True,
        bias: bool = False,
        swiglu_limit: float | None = None,
        swiglu_alpha: float = 1.702,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.use_grouped_mm = use_grouped_mm
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.b1: nn.Parameter | None = None
        self.b2: nn.Parameter | None = None
        self.b3: nn.Parameter | None = None
        if bias:
            self.b1 = nn.Parameter(torch.empty(num_experts, hidden_dim))
            self.b2 = nn.Parameter(torch.empty(num_experts, dim))
            self.b3 = nn.Parameter(torch.empty(num_experts, hidden_dim))
        self.down_bias_shares = 1
        self.act: Activation = (
            swiglu if swiglu_limit is None else partial(clamped_swiglu, limit=swiglu_limit, alpha=swiglu_alpha)
        )

    def _autocast_dtype(self, x: torch.Tensor) -> torch.dtype | None:
        # Autocast does not know the grouped GEMM: its operands are cast as a matmul's would be.
        return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else None

    def uses_grouped_mm(self, x: torch.Tensor) -> bool:
        weights = (_local(self.w1), _local(self.w2), _local(self.w3))
        return self.use_grouped_mm and grouped_mm_supported(x, *weights, dtype=self._autocast_dtype(x))

    def group_align(self, x: torch.Tensor) -> int:
        """Rows each expert's block is padded to on the grouped path (1: none)."""
        return CUDA_GROUP_ALIGN if x.device.type == "cuda" else 1

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x [T, dim] sorted by expert, num_tokens_per_expert [E] summing to T -> [T, dim]."""
        use_grouped = self.uses_grouped_mm(x)
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        biases = None
        if self.b1 is not None and self.b2 is not None and self.b3 is not None:
            b2 = _local(self.b2)
            if self.down_bias_shares > 1:
                b2 = cast(torch.Tensor, _ShareForward.apply(b2, self.down_bias_shares))
            biases = (_local(self.b1), b2, _local(self.b3))
        dtype = self._autocast_dtype(x)
        if dtype is not None:
            x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
            biases = None if biases is None else (biases[0].to(dtype), biases[1].to(dtype), biases[2].to(dtype))
        if use_grouped:
            return run_grouped(w1, w2, w3, x, num_tokens_per_expert, self.group_align(x), act=self.act, biases=biases)
        return run_loop(w1, w2, w3, x, num_tokens_per_expert, act=self.act, biases=biases)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w2, mean=0.0, std=init_std)
        nn.init.trunc_normal_(self.w3, mean=0.0, std=init_std)
        for b in (self.b1, self.b2, self.b3):
            if b is not None:
                nn.init.zeros_(b)
