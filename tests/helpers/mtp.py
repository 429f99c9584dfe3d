"""Multi-token prediction references, independent of titan's MTP code: a DeepSeek-V3 folder with MTP
layers as the release lays them out (built from transformers' own MTP module, ``MtpModel``), that
module's forward per depth, and the loss formula written out in plain torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from transformers.modeling_layers import MtpModel

from tests.helpers.hf_release import _DS, _saved, _write, random_hf

IGNORE = -100


def deepseek_mtp_folder(path: Path, depth: int, seed: int = 0) -> tuple[Any, Any]:
    """A DeepSeek-V3 folder with ``depth`` MTP layers at num_hidden_layers on: save_pretrained's main
    model, then each transformers MtpModel layer's weights under the release's keys (enorm, hnorm,
    eh_proj, shared_head.norm, the block's own keys, and the copies of the embedding and head the
    release stores in every MTP layer), fp32. Returns (the transformers model, its MtpModel)."""
    model = random_hf("deepseek_v3", seed, dict(_DS, num_mtp_layers=depth))
    mtp = MtpModel(model, depth).eval()
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if name.startswith(("embed_tokens", "shared_head")):
                continue  # the main model's
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.08)
    tensors, config = _saved(model, path)
    n = model.config.num_hidden_layers
    for name, value in mtp.state_dict().items():
        if name.startswith(("embed_tokens", "shared_head")):
            continue
        _, k, rest = name.split(".", 2)
        rest = rest.removeprefix("mtp_block.").replace("post_norm.", "shared_head.norm.")
        if rest.startswith("mlp.experts."):  # per expert, as the release and save_pretrained store them
            tensors |= _per_expert(f"model.layers.{n + int(k)}.mlp.experts", rest.split(".")[2], value)
            continue
        tensors[f"model.layers.{n + int(k)}.{rest}"] = value
        tensors[f"model.layers.{n + int(k)}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[f"model.layers.{n + int(k)}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    _write(path, tensors, config)
    return model, mtp


# Qwen3.5 / Qwen3-Next at small widths: two key heads serving four value heads, one layer in four
# full attention (the last), four experts for the MoE classes.
QWEN_SMALL: dict[str, Any] = dict(
    vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=6, linear_num_key_heads=2,
    linear_num_value_heads=4, max_position_embeddings=128,
)  # fmt: skip
QWEN_MOE: dict[str, Any] = dict(
    moe_intermediate_size=24, shared_expert_intermediate_size=20, num_experts=4, num_experts_per_tok=2
)
QWEN_CLASSES = {
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", QWEN_SMALL),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", {**QWEN_SMALL, **QWEN_MOE}),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {**QWEN_SMALL, **QWEN_MOE}),
}
_QWEN_FUSION = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc", "post_norm": "norm"}


def qwen_mtp_folder(path: Path, model_type: str, seed: int = 0) -> tuple[Any, Any]:
    """A Qwen3.5 / Qwen3.5-MoE / Qwen3-Next folder with its release's MTP head (``mtp.fc``,
    ``mtp.pre_fc_norm_embedding`` / ``_hidden``, ``mtp.norm`` and the block ``mtp.layers.0``, one key
    per expert), built from transformers' MtpModel with random weights, fp32. Returns (the
    transformers model, its MtpModel)."""
    config_cls, model_cls, values = QWEN_CLASSES[model_type]
    config = getattr(transformers, config_cls)(**values)
    config.num_mtp_layers, config.mtp_layer_types = 1, ["full_attention"]  # what MtpModel reads
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    mtp = MtpModel(model, 1).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # norms away from their zero init, so a misplaced one shows
        for name, p in [*model.named_parameters(), *mtp.named_parameters()]:
            if not name.startswith(("embed_tokens", "shared_head")):
                p.copy_(
                    torch.rand(p.shape, generator=g) * 0.5
                    if "norm" in name
                    else torch.randn(p.shape, generator=g) * 0.2
                )
    tensors, saved = _saved(model, path)
    for name, value in mtp.state_dict().items():
        if name.startswith(("embed_tokens", "shared_head")):
            continue
        part, rest = name.removeprefix("layers.0.").split(".", 1)
        if part in _QWEN_FUSION:
            tensors[f"mtp.{_QWEN_FUSION[part]}.{rest}"] = value
        elif rest.startswith("mlp.experts."):
            tensors |= _per_expert("mtp.layers.0.mlp.experts", rest.split(".")[2], value)
        else:
            tensors[f"mtp.layers.0.{rest}"] = value
    _write(path, tensors, {**saved, "mtp_num_hidden_layers": 1})
    return model, mtp


def _per_expert(prefix: str, kind: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' fused experts (gate_up_proj [E, 2 hidden, dim] or down_proj) as one key per expert."""
    out = {}
    for e in range(value.shape[0]):
        if kind == "gate_up_proj":
            out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = value[e].chunk(2, dim=0)
        else:
            out[f"{prefix}.{e}.down_proj.weight"] = value[e]
    return out


def shifted(x: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """x[:, t + k] at t, ``fill`` past the window (written out, one position at a time)."""
    out = torch.full_like(x, fill)
    for t in range(x.shape[1] - k):
        out[:, t] = x[:, t + k]
    return out


@torch.no_grad()
def transformers_logits(model: Any, mtp: Any, tokens: torch.Tensor) -> list[torch.Tensor]:
    """[main logits, depth 1's, ...] from transformers: the main model's final-normed hidden state
    into MtpModel's depth 1, each depth's output into the next, token 0 past the window."""
    logits, hidden = [model(tokens).logits], model.model(tokens).last_hidden_state
    positions = torch.arange(tokens.shape[1])[None].expand(tokens.shape[0], -1)
    for k in range(len(mtp.layers)):
        hidden = mtp.forward_layer(k, hidden, positions, None, input_ids=shifted(tokens, k + 1, 0))
        logits.append(mtp._project_to_logits(hidden))
    return logits


def reference_losses(
    logits: list[torch.Tensor], labels: torch.Tensor, doc_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(next-token loss, MTP loss) per token of the next-token labels: depth k at t targets
    labels[t + k] when t + k is in the window (and in t's document), and the MTP loss is the mean
    of the depths' summed cross entropies, over the same token count (torchtitan's MTPLoss)."""
    tokens = (labels != IGNORE).sum()

    def ce(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(x.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE, reduction="sum")

    depths = []
    for k, x in enumerate(logits[1:], start=1):
        target = torch.full_like(labels, IGNORE)
        for b in range(labels.shape[0]):
            for t in range(labels.shape[1] - k):
                if doc_ids is None or doc_ids[b, t + k] == doc_ids[b, t]:
                    target[b, t] = labels[b, t + k]
        depths.append(ce(x, target))
    return ce(logits[0], labels) / tokens, torch.stack(depths).mean() / tokens


MTP2 = ("--model.mtp_depth", "2", "--metrics.log_freq", "1")
"""Two MTP depths, every step logged (the MTP loss is read on log steps)."""
MTP_STEPS = 3


def run_mtp(trainer: Any, steps: int = MTP_STEPS) -> list[tuple[float, float, float]]:
    """(loss, grad norm, MTP loss) of the first ``steps`` steps over the parity batches, this rank's rows."""
    from tests.helpers.parity import GLOBAL_BATCH, batches

    dp = trainer.parallel_dims.dp_degree
    per, r = GLOBAL_BATCH // dp, trainer.dp_rank
    out = []
    for inputs, labels in batches()[:steps]:
        x, y = inputs[r * per : (r + 1) * per], labels[r * per : (r + 1) * per]
        n = trainer.grad_accum_steps
        result = trainer.train_step(list(zip(x.chunk(n), y.chunk(n))))
        out.append((result.loss.item(), result.grad_norm.item(), result.extra["mtp_loss"].item()))
    return out
