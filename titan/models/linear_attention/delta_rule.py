"""The exact torch path of the Gated DeltaNet: the chunked gated delta rule and the short causal
convolution, on every device, with packed documents restarting both at their boundaries.

The arithmetic is transformers' ``torch_chunk_gated_delta_rule`` and its ``causal_conv1d_fn``
fallback (Qwen3.5, Qwen3-Next), step for step, so a model without document masking gives
transformers' numbers. With document ids the same chunks run with three masks more (a 0/1 factor
is exact, so one document per row gives the same numbers again):

- inside a chunk, position i reads position j only when both are in the same document (the
  pairwise decay and the within-chunk attention are zeroed across a boundary);
- a position reads the state carried in from the previous chunk only when it is in the document
  that state belongs to (the document of the previous chunk's last position);
- the state carried out of a chunk holds only the chunk's last document, decayed from its start.

That is the recurrence S_t = exp(g_t) S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T with S reset to
zero where a document starts, which running each document alone computes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (transformers' and fla's form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _chunk_masks(
    doc_ids: torch.Tensor, pad: int, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """From doc ids [B, S] (padded by repeating the last id): same-document pairs [B, 1, n, C, C],
    positions reading the carried state [B, 1, n, C], positions in the chunk's last document
    [B, 1, n, C] and chunks whose carried state survives to their end [B, 1, n] (all float 0/1)."""
    docs = F.pad(doc_ids[:, None].float(), (0, pad), mode="replicate")[:, 0].view(doc_ids.shape[0], n, CHUNK)
    last = docs[..., -1]
    # The previous chunk's last document; the first chunk's state (zero, or a cache's) is its own.
    prev = torch.cat([docs[:, :1, 0], last[:, :-1]], dim=1)
    same = (docs[..., :, None] == docs[..., None, :]).float()
    reads = (docs == prev[..., None]).float()
    in_last = (docs == last[..., None]).float()
    keeps = (last == prev).float()
    return same[:, None], reads[:, None], in_last[:, None], keeps[:, None]


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    doc_ids: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q, k [B, S, HK, Dk], v [B, S, HV, Dv], g (log decay, <= 0) and beta [B, S, HV] -> output
    [B, S, HV, Dv] in q's dtype and the final state [B, HV, Dk, Dv] (fp32) when asked. Each q/k
    head serves HV / HK consecutive value heads; q and k are L2-normalised, q scaled by Dk^-0.5.
    ``doc_ids`` [B, S]: restart the state where the id changes (titan.models.documents)."""
    dtype = q.dtype
    b, s, hk, dk = k.shape
    hv, dv = v.shape[-2:]
    if hk != hv:
        q, k = (t.repeat_interleave(hv // hk, dim=2) for t in (q, k))
    q, k, v, beta, g = (
        t.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format) for t in (q, k, v, beta, g)
    )
    q, k = l2norm(q), l2norm(k)
    q = q * dk**-0.5
    pad = -s % CHUNK
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    beta, g = (F.pad(t, (0, pad)) for t in (beta, g))
    n = (s + pad) // CHUNK
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (t.reshape(b, hv, n, CHUNK, t.shape[-1]) for t in (q, k, k_beta, v_beta))
    g = g.reshape(b, hv, n, CHUNK)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=3)
    pair = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    masks = _chunk_masks(doc_ids, pad, n) if doc_ids is not None else None
    if masks is not None:
        pair = pair * masks[0]
    # The UT transform (transformers' names): the delta rule's updates within a chunk as matmuls.
    ut = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    if masks is not None:
        decayed_k_beta = decayed_k_beta * masks[1].unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, decayed_k_beta, upper=False, unitriangular=True)
    state = (
        torch.zeros(b, hv, dk, dv, dtype=new_values.dtype, device=new_values.device)
        if initial_state is None
        else initial_state.to(new_values)
    )
    out = torch.zeros_like(new_values)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    if masks is not None:
        q, k = q * masks[1].unsqueeze(-1), k * masks[2].unsqueeze(-1)
        chunk_decay = chunk_decay * masks[3][..., None, None]
    for i in range(n):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = q[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(b, hv, -1, dv)[:, :, :s]
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), state if output_final_state else None


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    doc_ids: torch.Tensor | None = None,
    state: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depthwise causal convolution + SiLU: x [B, S, C], weight [C, W] -> [B, S, C]. Output t reads
    inputs t - W + 1 .. t, of its own document only when ``doc_ids`` [B, S] is given; ``state``
    [B, C, W - 1] holds the inputs before x (a generation cache), else zeros."""
    s, width = x.shape[1], weight.shape[-1]
    xt = x.transpose(1, 2)
    if doc_ids is None:
        if state is not None:
            xt = torch.cat([state.to(xt.dtype), xt], dim=-1)
        out = F.conv1d(xt.to(weight.dtype), weight.unsqueeze(1), None, padding=width - 1, groups=weight.shape[0])
        out = out[..., xt.shape[-1] - s : xt.shape[-1]]
        return F.silu(out).to(x.dtype).transpose(1, 2)
    # Every output position's window of W inputs, each tap kept only inside the position's document.
    windows = F.pad(xt, (width - 1, 0)).unfold(-1, width, 1)  # [B, C, S, W]
    docs = F.pad(doc_ids.float(), (width - 1, 0), value=-1.0).unfold(-1, width, 1)  # [B, S, W]
    same = (docs == doc_ids.float().unsqueeze(-1)).to(windows.dtype).unsqueeze(1)
    out = (windows.to(weight.dtype) * same * weight[None, :, None, :]).sum(-1)
    return F.silu(out).to(x.dtype).transpose(1, 2)
