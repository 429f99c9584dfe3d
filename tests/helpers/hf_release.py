"""Hugging Face folders on disk, as the loader meets them: transformers' save_pretrained of a tiny
random model of every family, and hand-built release layouts at small shapes with the releases' key
names, dtypes and quantization metadata (FP8 DeepSeek-V3 and Kimi K2 with their multi-token-prediction
layer, gpt-oss's MXFP4 experts). The quantizers here are the releases' recipes written out for the
tests (amax / 448 block scales; e2m1 values with a power-of-two scale per 32), not titan's code."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

FP8_MAX = 448.0
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
VOCAB = 2048  # titan's shipped tokenizer: the training tests read the default corpus with it

_DS: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
    n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=24, qk_rope_head_dim=8,
    qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=64,
    rms_norm_eps=1e-6, rope_theta=10000.0,
    rope_scaling={"type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                  "mscale_all_dim": 1.0, "original_max_position_embeddings": 16},
)  # fmt: skip
# Kimi K2's config.json values at small widths: 384 -> 8 experts, one group, one dense block first.
_KIMI: dict[str, Any] = dict(
    _DS, vocab_size=512, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8, n_group=1, topk_group=1,
    routed_scaling_factor=2.827, rope_theta=50000.0, num_experts_per_tok=2,
    rope_scaling={"type": "yarn", "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0,
                  "mscale_all_dim": 1.0, "original_max_position_embeddings": 16},
)  # fmt: skip
_GPT_OSS: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_local_experts=4,
    num_experts_per_tok=2, head_dim=16, num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
    max_position_embeddings=64,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 16, "rope_theta": 150000.0},
)  # fmt: skip
_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip
# family -> (transformers class, config class, config): what save_pretrained writes for each.
SAVE_PRETRAINED: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(_COMMON, tie_word_embeddings=True)),
    "llama4": ("Llama4ForCausalLM", "Llama4TextConfig", dict(
        _COMMON, intermediate_size=32, intermediate_size_mlp=96, num_local_experts=4, head_dim=16,
        interleave_moe_layer_step=1, attention_chunk_size=16)),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(_COMMON, head_dim=16, tie_word_embeddings=True)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        _COMMON, head_dim=16, num_experts=4, moe_intermediate_size=32, num_experts_per_tok=2, norm_topk_prob=True)),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", _DS),
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig", _GPT_OSS),
}  # fmt: skip


def random_hf(family: str, seed: int = 0, config: dict[str, Any] | None = None) -> Any:
    """A transformers model of ``family`` with random O(1)-logit weights (fp32, eager attention)."""
    cls, config_cls, values = SAVE_PRETRAINED[family]
    hf_config = getattr(transformers, config_cls)(**(config or values))
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, cls)(hf_config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "bias" in name or "sinks" in name else 0.08))
    return model


def save_pretrained_folder(family: str, path: Path, seed: int = 0) -> None:
    random_hf(family, seed).save_pretrained(path)


def load_transformers(path: Path, family: str) -> Any:
    """transformers' own load of a folder (dequantizing on CPU), fp32, eager attention. transformers
    5.24 has no model_type kimi_k2 (Kimi K2 ships remote code for it): its DeepseekV3ForCausalLM
    reads the folder with the config's model_type read as deepseek_v3, so that its per-expert keys
    are fused as for DeepSeek-V3."""
    cls = getattr(transformers, SAVE_PRETRAINED[family][0])
    kwargs: dict[str, Any] = {}
    if json.loads((path / "config.json").read_text())["model_type"] == "kimi_k2":
        config = transformers.DeepseekV3Config.from_pretrained(path)
        config.model_type = "deepseek_v3"
        kwargs["config"] = config
    return cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager", **kwargs).eval()


def quantize_fp8(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's block recipe: scale_inv = amax / 448 per block (partial blocks at the edges)."""
    rows, cols = w.shape
    rb, cb = -(-rows // block), -(-cols // block)
    padded = torch.zeros(rb * block, cb * block)
    padded[:rows, :cols] = w.float()
    tiles = padded.view(rb, block, cb, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (tiles / scale[:, None, :, None]).reshape(rb * block, cb * block)[:rows, :cols]
    return q.to(torch.float8_e4m3fn), scale.float()


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, cols] -> (blocks [..., rows, cols / 32, 16] uint8, scales [..., rows, cols / 32]
    uint8): the nearest e2m1 value after a power-of-two scale per 32 values (low nibble first)."""
    groups = w.float().unflatten(-1, (-1, 32))
    exp = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exp)[..., None]
    idx = (scaled[..., None] - E2M1).abs().argmin(-1).to(torch.uint8)
    packed = idx[..., 0::2] | (idx[..., 1::2] << 4)
    return packed.contiguous(), (exp + 127).to(torch.uint8)


def _write(path: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any], files: int = 2) -> None:
    """safetensors files (``files`` of them, with an index) and config.json, as a release is laid out."""
    path.mkdir(parents=True, exist_ok=True)
    keys = sorted(tensors)
    per = math.ceil(len(keys) / files)
    weight_map = {}
    for i in range(files):
        name = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        part = {k: tensors[k].contiguous() for k in keys[i * per : (i + 1) * per]}
        save_file(part, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": weight_map}  # fmt: skip
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (path / "config.json").write_text(json.dumps(config, indent=2))


def _saved(model: Any, path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """What save_pretrained writes (its on-disk key layout and config.json), read back."""
    model.save_pretrained(path / ".plain")
    with safe_open(str(path / ".plain/model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    config = json.loads((path / ".plain/config.json").read_text())
    for f in (path / ".plain").iterdir():
        f.unlink()
    (path / ".plain").rmdir()
    return tensors, config


def _fp8_quantized(key: str) -> bool:
    """The linears DeepSeek-V3 and Kimi K2 store in FP8: not the embeddings, head, norms or router."""
    return key.endswith("proj.weight") or key.endswith("proj_with_mqa.weight")


def deepseek_release(path: Path, kimi: bool = False, seed: int = 0) -> None:
    """DeepSeek-V3's (or Kimi K2's) release layout: one key per expert, FP8 e4m3 linears with float32
    weight_scale_inv blocks (128 x 128 for Kimi as released, 32 x 32 here for DeepSeek-V3 so that its
    small matrices hold several blocks), bf16 elsewhere, and the MTP layer at index num_hidden_layers."""
    values = _KIMI if kimi else _DS
    block = 128 if kimi else 32
    model = random_hf("deepseek_v3", seed, values)
    tensors, config = _saved(model, path)
    n = values["num_hidden_layers"]
    last = f"model.layers.{n - 1}."
    mtp = {f"model.layers.{n}." + k.removeprefix(last): v for k, v in tensors.items() if k.startswith(last)}
    dim, vocab, g = values["hidden_size"], values["vocab_size"], torch.Generator().manual_seed(seed + 1)
    extra = {
        "embed_tokens.weight": (vocab, dim), "enorm.weight": (dim,), "hnorm.weight": (dim,),
        "eh_proj.weight": (dim, 2 * dim), "shared_head.norm.weight": (dim,), "shared_head.head.weight": (vocab, dim),
    }  # fmt: skip
    for name, shape in extra.items():
        mtp[f"model.layers.{n}.{name}"] = torch.randn(shape, generator=g) * 0.05
    out: dict[str, torch.Tensor] = {}
    for key, value in {**tensors, **mtp}.items():
        if _fp8_quantized(key):
            out[key], out[key.removesuffix(".weight") + ".weight_scale_inv"] = quantize_fp8(value, block)
        else:
            out[key] = value.to(torch.float32 if "e_score_correction_bias" in key else torch.bfloat16)
    config.update(
        architectures=["DeepseekV3ForCausalLM"], torch_dtype="bfloat16", num_nextn_predict_layers=1,
        topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1, ep_size=1, aux_loss_alpha=0.001,
        seq_aux=True, rope_scaling=values["rope_scaling"], rope_theta=values["rope_theta"],
        quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                             "weight_block_size": [block, block]},
        auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                  "AutoModel": "modeling_deepseek.DeepseekV3Model",
                  "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    )  # fmt: skip
    config.pop("rope_parameters", None)
    if kimi:
        config.update(model_type="kimi_k2", bos_token_id=values["vocab_size"] - 256,
                      eos_token_id=values["vocab_size"] - 255)  # fmt: skip
        kimi_tokenizer(path)
    _write(path, out, config)


KIMI_PARTS = (
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
)
KIMI_PATTERN = "|".join(KIMI_PARTS)


def kimi_tokenizer(path: Path) -> None:
    """Kimi K2's tokenizer files at a small size: tiktoken.model (the 256 bytes as ranks), a
    tokenization_kimi.py whose class states the split pattern as Kimi's does, tokenizer_config.json
    with the special tokens after the ranks ([BOS] first, then [EOS])."""
    import base64

    path.mkdir(parents=True, exist_ok=True)
    (path / "tiktoken.model").write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
    parts = ",\n".join(f'            r"""{p}"""' for p in KIMI_PARTS)  # as Kimi's file spells them
    (path / "tokenization_kimi.py").write_text(
        "import tiktoken\n\n\nclass TikTokenTokenizer:\n    num_reserved_special_tokens = 256\n\n"
        f'    pat_str = "|".join(\n        [\n{parts},\n        ]\n    )\n'
    )
    specials = {"256": "[BOS]", "257": "[EOS]", "258": "<|im_end|>", "259": "<|im_user|>"}
    config = {
        "added_tokens_decoder": {i: {"content": t, "special": True} for i, t in specials.items()},
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "tokenizer_class": "TikTokenTokenizer",
    }  # fmt: skip
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def gpt_oss_release(path: Path, seed: int = 0) -> None:
    """gpt-oss's release layout: experts' gate_up_proj / down_proj as MXFP4 ``*_blocks`` / ``*_scales``
    in the stored orientation ([E, out, in / 32, 16]), biases and everything else bf16."""
    model = random_hf("gpt_oss", seed)
    tensors, config = _saved(model, path)
    out: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[key + "_blocks"], out[key + "_scales"] = quantize_mxfp4(value.transpose(-2, -1))
        else:
            out[key] = value.to(torch.bfloat16)
    config.update(
        torch_dtype="bfloat16",
        quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
    )  # fmt: skip
    _write(path, out, config)
