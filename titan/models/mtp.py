"""Multi-token prediction (MTP; DeepSeek-V3 report section 2.2), for any family on llama's skeleton.

Depth k (1 .. D) predicts token t + k + 1 at position t: it normalises the embedding of token t + k
(``enorm``) and the previous depth's hidden state at t (``hnorm``; depth 1 takes the main model's
final-normed state), concatenates them ([embedding, hidden]), projects 2 dim -> dim (``eh_proj``),
runs ONE block of the family's own kind, normalises (``norm``: the release's ``shared_head.norm``)
and hands the result to the main model's output head; the embedding is the main model's too. The
next depth takes that normed state.

Where the pieces live, so that every layout treats them as it treats the rest of the model:
- The depth-k block is ``layers.<n_layers + k - 1>`` (DeepSeek-V3's numbering: the release's layer
  61), built by the family's ``make_block``; TP/SP, EP, activation checkpointing, compile and FSDP
  wrap it like any block. ``Transformer.forward`` runs only the layers below ``n_layers`` as the main
  model.
- The fusion parts sit in ``mtp.<k - 1>`` (``enorm``, ``hnorm``, ``eh_proj``, ``norm``), a module of
  the root like the final norm (its TP plan: ``mtp_tp_plan``).
- The model returns the main rows and then each depth's rows stacked on the batch dim,
  [(1 + D) x B, S, vocab] (or the normed hidden states for the chunked loss), so the output
  projection, loss parallel and the chunked loss take all of them in one call; the loss reads the
  labels of every depth from ``mtp_labels``. A model in eval mode (validation) and generation (a
  KV cache) run the main model only.
- Pipeline parallel: the MTP modules live on the last stage; the first stage, which holds the
  embedding, embeds the shifted tokens of every depth and the stages hand them on below the hidden
  state (the tensor between stages is [(1 + D) x B, S, dim]), so the embedding weight stays in one
  place and its gradient flows back through the pipeline (Megatron keeps a second copy on the last
  stage instead and all-reduces the two gradients; torchtitan refuses PP with MTP).

Windows and documents, as torchtitan: the shifted tokens come from the same window (the loader
gives no extra tokens): positions whose token t + k is outside the window, or (block-causal
attention, documents known) in another document, embed token 0 and their labels are ignored, so
depth k has k fewer targets per window and document. torchtitan also zeroes the previous hidden
state there; those positions feed no loss and, attention being causal (block-causal across
documents), no position that does, so titan leaves it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = [
    "MTPDepth",
    "MultiTokenPrediction",
    "mtp_depth",
    "mtp_labels",
    "mtp_stage_modules",
    "mtp_tail",
    "mtp_tp_plan",
    "shift_left",
    "split_input",
    "split_mtp_shapes",
]


def mtp_depth(args: Any) -> int:
    """The model's MTP depths (0 for families without MTP modules)."""
    return int(getattr(args, "mtp_depth", 0) or 0)


def shift_left(x: torch.Tensor, k: int, fill: int, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[B, S] -> [B, S] with position t holding x[t + k]; ``fill`` where t + k is past the window or,
    with ``doc_ids``, in another document than t."""
    out = torch.full_like(x, fill)
    if k >= x.shape[1]:
        return out
    src = x[:, k:]
    if doc_ids is not None:
        src = torch.where(doc_ids[:, k:] == doc_ids[:, :-k], src, fill)
    out[:, : x.shape[1] - k] = src
    return out


def mtp_labels(
    labels: torch.Tensor, depth: int, ignore_index: int, doc_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, S] next-token labels -> [B, 1 + depth, S]: row 0 the labels, row k depth k's (token
    t + k + 1 = labels[t + k]), ignored where MTP has no target (``shift_left``)."""
    return torch.stack([labels, *(shift_left(labels, k, ignore_index, doc_ids) for k in range(1, depth + 1))], dim=1)


class MTPDepth(nn.Module):
    """One depth's fusion parts around its block: ``forward(embedding, hidden)`` -> the block's input."""

    def __init__(self, dim: int, eps: float, norm_cls: Callable[..., nn.Module]) -> None:
        super().__init__()
        self.enorm = norm_cls(dim, eps=eps)
        self.hnorm = norm_cls(dim, eps=eps)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.norm = norm_cls(dim, eps=eps)

    def forward(self, embedding: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.enorm(embedding), self.hnorm(hidden)], dim=-1))

    def init_weights(self) -> None:
        for norm in (self.enorm, self.hnorm, self.norm):
            norm.reset_parameters()  # type: ignore[operator]
        nn.init.trunc_normal_(self.eh_proj.weight, mean=0.0, std=0.02)


class MultiTokenPrediction(nn.ModuleDict):
    """The fusion parts of every depth, keyed "0" .. "D-1" (FQNs ``mtp.<k>.enorm.weight``, ...)."""

    def __init__(self, depth: int, dim: int, eps: float, norm_cls: Callable[..., nn.Module]) -> None:
        super().__init__({str(k): MTPDepth(dim, eps, norm_cls) for k in range(depth)})

    def init_weights(self) -> None:
        for depth in self.values():
            depth.init_weights()  # type: ignore[operator]


def split_input(model: Any, tokens: torch.Tensor, doc_ids: torch.Tensor | None, kv_cache: Any) -> tuple:
    """The start of ``Transformer.forward``: (main hidden states [B, S, dim], the MTP embeddings
    [D x B, S, dim] or None). The part holding the embedding embeds the tokens and each depth's
    shifted tokens in one call; a later pipeline stage gets both stacked on the batch dim."""
    depth = mtp_depth(model.model_args) if model.training and kv_cache is None else 0
    emb = model.tok_embeddings
    if depth == 0:
        return (emb(tokens) if emb is not None else tokens), None
    if emb is None:
        rows = tokens.shape[0] // (1 + depth)
        return tokens[:rows], tokens[rows:]
    rows = tokens.shape[0]
    shifted = [shift_left(tokens, k, 0, doc_ids) for k in range(1, depth + 1)]
    h = emb(torch.cat([tokens, *shifted], dim=0))
    return h[:rows], h[rows:]


def mtp_tail(model: Any, h: torch.Tensor, embeddings: torch.Tensor, attn_mask: Any) -> torch.Tensor:
    """The end of ``Transformer.forward`` with MTP: on a stage without the final norm the hidden
    states and the MTP embeddings go on together; on the last one the main model's normed states,
    then each depth's, stacked on the batch dim, through the output (unless the loss owns it)."""
    if model.norm is None:
        return torch.cat([h, embeddings], dim=0)
    out = [model.norm(h)]
    n = model.n_layers
    for k, embedding in enumerate(embeddings.chunk(len(model.mtp), dim=0)):
        fused = model.mtp[str(k)](embedding, out[-1])
        out.append(model.mtp[str(k)].norm(model.layers[str(n + k)](fused, model.freqs_cis, attn_mask)))
    hidden = torch.cat(out, dim=0)
    if model.output is not None and not model.loss_owns_output:
        return model.output(hidden)
    return hidden


def mtp_stage_modules(stages: list[list[str]], args: Any) -> list[list[str]]:
    """A pipeline split (module names per stage) with the MTP blocks and ``mtp`` on the last stage,
    beside the output head they need."""
    depth = mtp_depth(args)
    if depth == 0:
        return stages
    extra = [f"layers.{args.n_layers + k}" for k in range(depth)] + ["mtp"]
    return [*stages[:-1], [*stages[-1], *extra]]


def mtp_tp_plan(model: nn.Module, sequence_parallel: Callable[..., Any]) -> dict[str, Any]:
    """TP/SP for the fusion parts (a plan for titan.parallel.tp): the norms are sequence parallel as
    the final norm is, and ``eh_proj`` runs whole on every rank on its sequence shard (its input
    is the two norms' outputs side by side), handing the block a plain sequence shard as the
    embedding does. ``sequence_parallel``: torch's SequenceParallel style (model files import no
    torch.distributed)."""
    mtp = getattr(model, "mtp", None)
    if mtp is None:
        return {}
    plan: dict[str, Any] = {}
    for k in mtp:
        plan |= {
            f"mtp.{k}.enorm": sequence_parallel(),
            f"mtp.{k}.hnorm": sequence_parallel(),
            f"mtp.{k}.eh_proj": sequence_parallel(use_local_output=True),
            f"mtp.{k}.norm": sequence_parallel(),
        }
    return plan


def split_mtp_shapes(shapes: dict[str, tuple[int, ...]]) -> tuple[dict[str, tuple[int, ...]], int]:
    """A state dict's shapes without its MTP tensors (the fusion parts and the last blocks), and how
    many MTP depths it holds: what a family's ``args_from_shapes`` reads the main model from."""
    depth = sum(1 for k in shapes if k.startswith("mtp.") and k.endswith(".eh_proj.weight"))
    if depth == 0:
        return shapes, 0
    n_layers = 1 + max(int(k.split(".")[1]) for k in shapes if k.startswith("layers.")) - depth
    main = {
        k: v
        for k, v in shapes.items()
        if not k.startswith("mtp.") and not (k.startswith("layers.") and int(k.split(".")[1]) >= n_layers)
    }
    return main, depth
