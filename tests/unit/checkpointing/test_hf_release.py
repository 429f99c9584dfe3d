"""Hugging Face folders as they sit on disk load with transformers' logits (1e-4, fp32): what
save_pretrained writes for every family, and the release layouts (FP8 DeepSeek-V3 and Kimi K2 with
their multi-token-prediction layer, MXFP4 gpt-oss) dequantized as transformers dequantizes them;
through load_model (generation's loader, initial_load_in_hf's reader) and convert_hf.py from_hf.
Exports write the release's layout in bf16 and reload in transformers."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.helpers import hf_release as H
from tests.helpers.runs import script_module
from titan.checkpointing.hf import load_hf, read_hf_config, save_hf
from titan.checkpointing.hf_folder import HFFolder
from titan.checkpointing.hf_quant import dequantize_fp8, dequantize_mxfp4
from titan.errors import TitanError
from titan.tools.generate import load_model

TOKENS = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(1))
RELEASES = {
    "deepseek_v3_fp8": (H.deepseek_release, "deepseek_v3"),
    "kimi_k2_fp8": (lambda p: H.deepseek_release(p, kimi=True), "deepseek_v3"),
    "gpt_oss_mxfp4": (H.gpt_oss_release, "gpt_oss"),
}
PER_EXPERT = ("deepseek_v3", "qwen3_moe")  # the families whose releases store one key per expert
FUSED = ("gpt_oss", "llama4")  # ... and those whose releases fuse them


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        out = model(TOKENS)
    return out.logits if hasattr(out, "logits") else out


def _keys(folder: Path) -> set[str]:
    keys: set[str] = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as fh:
            keys |= set(fh.keys())
    return keys


def _check_loads(folder: Path, family: str, tmp_path: Path) -> torch.nn.Module:
    """load_model and convert_hf.py from_hf + load_model give transformers' logits; returns the model."""
    ref = _logits(H.load_transformers(folder, family))
    model = load_model(folder, max_seq_len=64, device=torch.device("cpu"))
    torch.testing.assert_close(_logits(model), ref, atol=1e-4, rtol=1e-4)
    # float32: a dequantized weight is kept in the release's torch_dtype (bf16) unless --dtype says
    assert script_module("convert_hf").main(["from_hf", str(folder), str(tmp_path / "dcp"), "--dtype", "float32"]) == 0
    converted = load_model(tmp_path / "dcp", max_seq_len=64, device=torch.device("cpu"))
    torch.testing.assert_close(_logits(converted), ref, atol=1e-4, rtol=1e-4)
    return model


def _check_export(model: torch.nn.Module, family: str, out: Path) -> None:
    """A bf16 export in the release layout reloads in transformers with the bf16 model's logits."""
    args = model.model_args  # type: ignore[attr-defined]
    save_hf(model.state_dict(), args, out, dtype=torch.bfloat16)
    keys = _keys(out)
    fused = any(k.endswith("experts.gate_up_proj") for k in keys)
    per_expert = any(".experts.0.gate_proj.weight" in k for k in keys)
    assert (per_expert, fused) == (family in PER_EXPERT, family in FUSED), sorted(keys)[:8]
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and "quantization_config" not in config
    with torch.no_grad():  # the weights the export holds
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))
    torch.testing.assert_close(_logits(H.load_transformers(out, family)), _logits(model), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", list(H.SAVE_PRETRAINED))
def test_save_pretrained_folders_load_and_export(family: str, tmp_path: Path) -> None:
    H.save_pretrained_folder(family, tmp_path / "hf")
    if family in PER_EXPERT:
        assert any(".mlp.experts.0.gate_proj.weight" in k for k in _keys(tmp_path / "hf"))
    model = _check_loads(tmp_path / "hf", family, tmp_path)
    _check_export(model, family, tmp_path / "out")


@pytest.mark.parametrize("release", list(RELEASES))
def test_release_folders_load_dequantized_and_export(release: str, tmp_path: Path, caplog) -> None:
    make, family = RELEASES[release]
    make(tmp_path / "hf")
    with caplog.at_level(logging.INFO, logger="titan"):
        model = _check_loads(tmp_path / "hf", family, tmp_path)
    if family == "deepseek_v3":  # the MTP layer (index num_hidden_layers) is skipped, said once per load
        said = [r.message for r in caplog.records if "multi-token prediction" in r.message]
        assert len(said) == 2 and "layer(s) [2]" in said[0], said  # load_model and from_hf
    _check_export(model, family, tmp_path / "out")


def test_fp8_blocks_partial_and_row_sliced_as_deepseek_reference() -> None:
    """Block (i // 128, j // 128) scales element (i, j), partial edge blocks included; a rank's
    row slice with its scale rows gives the same rows; transformers' own dequantization agrees
    where its block (derived from the scale grid) is the real one."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    g = torch.Generator().manual_seed(0)
    w = torch.randn(576, 300, generator=g)
    q, s = H.quantize_fp8(w, 128)
    expected = q.float() * s.repeat_interleave(128, 0)[:576].repeat_interleave(128, 1)[:, :300]
    full = dequantize_fp8(q, s, (128, 128))
    assert torch.equal(full, expected)
    assert torch.equal(dequantize_fp8(q[200:450], s[1:4], (128, 128), row_offset=200), expected[200:450])
    q2, s2 = H.quantize_fp8(torch.randn(256, 384, generator=g), 128)
    transformers_dq = Fp8Dequantize(None)._dequantize_one(q2, s2, output_dtype=torch.float32)
    assert torch.equal(dequantize_fp8(q2, s2, (128, 128)), transformers_dq)


def test_mxfp4_matches_transformers_dequantization() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = H.quantize_mxfp4(torch.randn(3, 40, 64, generator=torch.Generator().manual_seed(0)))
    ours = dequantize_mxfp4(blocks, scales)
    assert ours.shape == (3, 64, 40)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(ours.to(dtype), convert_moe_packed_tensors(blocks, scales, dtype=dtype))


def test_unknown_quantization_is_refused_in_one_line(tmp_path: Path) -> None:
    H.save_pretrained_folder("llama", tmp_path / "hf")
    config = json.loads((tmp_path / "hf/config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    (tmp_path / "hf/config.json").write_text(json.dumps(config))
    with pytest.raises(TitanError, match="quant_method 'compressed-tensors' is not supported") as e:
        read_hf_config(tmp_path / "hf")
    assert "\n" not in str(e.value)
    assert script_module("convert_hf").main(["from_hf", str(tmp_path / "hf"), str(tmp_path / "dcp")]) == 1
    assert not (tmp_path / "dcp").exists()


def test_a_per_expert_folder_missing_an_expert_is_refused(tmp_path: Path) -> None:
    H.save_pretrained_folder("qwen3_moe", tmp_path / "hf")
    f = tmp_path / "hf/model.safetensors"
    with safe_open(str(f), framework="pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys() if "experts.2.up_proj" not in k}
    from safetensors.torch import save_file

    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(TitanError, match=r"mlp.experts.2.up_proj.weight is missing \(4 experts found\)"):
        load_hf(tmp_path / "hf")


def test_reads_are_counted_and_partial(tmp_path: Path) -> None:
    H.deepseek_release(tmp_path / "hf")
    folder = HFFolder(tmp_path / "hf")
    key = "model.layers.1.mlp.experts.gate_up_proj"
    assert folder.shape(key) == (4, 64, 64)
    two = folder.read(key, (1, 3))
    assert torch.equal(two, folder.read(key)[1:3])
    assert folder.tensors_read == 2 * 2 * 2 + 4 * 2 * 2  # 2 experts x (gate, up) x (weight, scale), then all 4


def test_a_tied_training_checkpoint_exports_tied(tmp_path: Path) -> None:
    """qwen3's debug flavor ties its output to its embedding; its DCP checkpoint holds the one tensor
    under both names, and the export says tie_word_embeddings with no lm_head.weight."""
    from titan.checkpointing.hf import dcp_model_args, export_dcp_to_hf
    from titan.checkpointing.states import dcp_call
    from titan.models import get_flavor, get_model_spec
    from titan.models.qwen3.model import Qwen3Transformer

    args = get_flavor(get_model_spec("qwen3"), "debugmodel")
    assert args.tie_embeddings
    torch.manual_seed(0)
    model = Qwen3Transformer(args)
    model.init_weights()
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    state = model.state_dict()
    assert "output.weight" in state
    dcp_call(dcp_save, {"model": state}, checkpoint_id=str(tmp_path / "step-1"))
    exported = dcp_model_args(tmp_path / "step-1", "qwen3", "debugmodel")
    assert exported.tie_embeddings
    export_dcp_to_hf(tmp_path / "step-1", tmp_path / "hf", exported)
    assert json.loads((tmp_path / "hf/config.json").read_text())["tie_word_embeddings"] is True
    assert "lm_head.weight" not in _keys(tmp_path / "hf")
    back, _ = load_hf(tmp_path / "hf")
    assert torch.equal(back["output.weight"], state["tok_embeddings.weight"])
