"""Multi-token prediction (titan/models/mtp.py) on DeepSeek-V3 and Qwen3.5 / Qwen3-Next: transformers'
own MTP module (``MtpModel``) from the same weights gives each depth's logits, the loss is the formula written out in
plain torch (tests/helpers/mtp.py), the chunked loss matches the full one with its gradients, an HF
folder with its MTP layers round-trips bitwise, and the counts, the window's end, documents and the
refusals are as documented."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from tests.helpers.deepseek import DSTEST
from tests.helpers.mtp import deepseek_mtp_folder, qwen_mtp_folder, reference_losses, transformers_logits
from titan.checkpointing.hf import load_hf, save_hf
from titan.config import load_config
from titan.errors import TitanError
from titan.models import get_model_spec, model_args_from_config
from titan.models.deepseek_v3.args import deepseek_v3_configs, get_nparams_and_flops
from titan.models.deepseek_v3.model import DeepSeekV3Transformer
from titan.models.documents import document_ids
from titan.models.mtp import mtp_labels, shift_left
from titan.models.qwen3_5 import Qwen35Transformer
from titan.training.flops import mtp_output_flops_per_token
from titan.training.loss import IGNORE_INDEX, TokenLoss, mtp_loss_of
from titan.training.plan import check_mtp

DEPTH = 2
REPO = Path(__file__).resolve().parents[3]


def _model(args, seed: int = 0) -> DeepSeekV3Transformer:
    model = DeepSeekV3Transformer(dataclasses.replace(args, max_seq_len=32))
    torch.manual_seed(seed)
    model.init_weights()
    return model


def _files(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def _convert_hf() -> Any:
    """scripts/convert_hf.py as a module (its main(argv) returns the exit code)."""
    spec = importlib.util.spec_from_file_location("convert_hf", REPO / "scripts/convert_hf.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> tuple[Path, object, object]:
    folder = tmp_path_factory.mktemp("mtp") / "release"
    model, mtp = deepseek_mtp_folder(folder, DEPTH)
    return folder, model, mtp


def test_shifted_tokens_and_labels_stop_at_the_window_and_the_document() -> None:
    x = torch.tensor([[10, 11, 2, 13, 14, 15]])  # 2 = EOS: documents [10 11 2] [13 14 15]
    docs = document_ids(x, eos_id=2)
    assert shift_left(x, 1, 0).tolist() == [[11, 2, 13, 14, 15, 0]]
    assert shift_left(x, 2, 0, docs).tolist() == [[2, 0, 0, 15, 0, 0]]
    labels = torch.tensor([[11, 2, 13, 14, 15, 16]])
    rows = mtp_labels(labels, 2, IGNORE_INDEX, docs)
    assert rows.shape == (1, 3, 6)
    assert rows[0, 1].tolist() == [2, 13, -100, 15, 16, -100]  # depth 1: token t + 2
    assert rows[0, 2].tolist() == [13, -100, -100, 16, -100, -100]


def test_depths_give_transformers_mtp_logits_and_the_written_out_loss(release) -> None:
    """Depth k's logits are transformers' MtpModel's (its layer fed the main model's final-normed
    hidden state, each depth the previous one's); the loss is main + weight x mean of the depths."""
    folder, hf, mtp = release
    state, args = load_hf(folder, torch.float32, mtp_depth=DEPTH)
    assert args.mtp_depth == DEPTH and {f"mtp.{k}.eh_proj.weight" for k in range(DEPTH)} <= set(state)
    model = DeepSeekV3Transformer(dataclasses.replace(args, max_seq_len=16))
    model.init_buffers(torch.device("cpu"))
    model.load_state_dict(state)
    tokens = torch.randint(0, args.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    want = transformers_logits(hf, mtp, x)
    got = model(x)
    assert got.shape[0] == (1 + DEPTH) * 2
    for k, logits in enumerate(want):
        torch.testing.assert_close(got[2 * k : 2 * (k + 1)], logits, atol=2e-5, rtol=1e-5)
    main, mtp_loss = reference_losses(want, y)
    n = (y != IGNORE_INDEX).sum()
    loss = TokenLoss(0, mtp_depth=DEPTH, mtp_weight=0.3)(got, mtp_labels(y, DEPTH, IGNORE_INDEX), 1 / n)
    torch.testing.assert_close(loss.detach(), main, atol=1e-5, rtol=1e-5)  # the value: the next-token loss
    torch.testing.assert_close(mtp_loss_of(loss), mtp_loss, atol=1e-5, rtol=1e-5)
    model.eval()  # validation: the main model only
    torch.testing.assert_close(model(x), want[0], atol=2e-5, rtol=1e-5)


def test_gradient_is_main_plus_weighted_mtp_and_chunks_match_the_full_logits() -> None:
    args = dataclasses.replace(DSTEST, mtp_depth=DEPTH)
    tokens = torch.randint(0, args.vocab_size, (2, 25), generator=torch.Generator().manual_seed(2))
    x, y = tokens[:, :-1], tokens[:, 1:]
    docs = document_ids(x, eos_id=5)
    labels = mtp_labels(y, DEPTH, IGNORE_INDEX, docs)
    n = (y != IGNORE_INDEX).sum()
    grads = {}
    for name, chunk in (("formula", 0), ("full", 0), ("chunked", 10)):
        model = _model(args)
        model.loss_owns_output = chunk > 0
        loss_fn = TokenLoss(chunk, mtp_depth=DEPTH, mtp_weight=0.3)
        loss_fn.bind([model])
        out = model(x)
        if name == "formula":  # by hand: main + 0.3 x mean over depths, all over the main token count
            rows = [out[2 * k : 2 * (k + 1)] for k in range(1 + DEPTH)]
            main, mtp = reference_losses(rows, y, docs)
            (main + 0.3 * mtp).backward()
            value = main
        else:
            loss = loss_fn(out, labels, 1 / n)
            loss.backward()
            value, mtp = loss.detach(), mtp_loss_of(loss)
        grads[name] = (value, mtp, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
    for name in ("full", "chunked"):
        assert torch.allclose(grads[name][0], grads["formula"][0], atol=1e-6)
        assert torch.allclose(grads[name][1], grads["formula"][1], atol=1e-6)
        assert grads[name][2].keys() == grads["formula"][2].keys()
        for key, g in grads["formula"][2].items():
            torch.testing.assert_close(grads[name][2][key], g, atol=1e-6, rtol=1e-5, msg=f"{name} {key}")
    assert any(k.startswith("mtp.1.") for k in grads["full"][2])  # every depth learns


def test_release_folder_round_trips_bitwise_with_its_mtp_layers(release, tmp_path, caplog) -> None:
    folder = release[0]
    state, args = load_hf(folder, mtp_depth=DEPTH)
    save_hf(state, args, tmp_path / "out")
    before, after = _files(folder), _files(tmp_path / "out")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)  # embed/head copies included
    assert json.loads((tmp_path / "out/config.json").read_text())["num_nextn_predict_layers"] == DEPTH
    # scripts/convert_hf.py: the release -> a model-only DCP folder with its MTP layers -> the release again
    script = _convert_hf()
    assert script.main(["from_hf", str(folder), str(tmp_path / "dcp"), "--mtp_depth", str(DEPTH)]) == 0
    assert script.main(["to_hf", str(tmp_path / "dcp"), str(tmp_path / "again")]) == 0
    again = _files(tmp_path / "again")
    assert again.keys() == before.keys() and all(torch.equal(before[k], again[k]) for k in before)
    with caplog.at_level(logging.INFO, logger="titan"):
        state, args = load_hf(folder, mtp_depth=0)
    assert args.mtp_depth == 0 and not any(k.startswith("mtp.") or k.startswith("layers.2.") for k in state)
    skips = [r.getMessage() for r in caplog.records if "not loading Hugging Face layer" in r.getMessage()]
    assert len(skips) == 1 and "[2, 3]" in skips[0] and "model.mtp_depth = 0" in skips[0], skips
    with pytest.raises(TitanError, match=r"model.mtp_depth = 3 needs 3 .* hold 2"):
        load_hf(folder, mtp_depth=3)


def test_init_counts_and_flops() -> None:
    """The main model's weights are those of the same seed without MTP; each depth adds one MoE
    block, eh_proj and three norms, and its FLOPs, one output projection more."""
    plain, mtp = _model(DSTEST), _model(dataclasses.replace(DSTEST, mtp_depth=DEPTH))
    ref = plain.state_dict()
    assert all(torch.equal(v, mtp.state_dict()[k]) for k, v in ref.items())
    block = sum(p.numel() for p in plain.layers["2"].parameters())
    dim, vocab = DSTEST.dim, DSTEST.vocab_size
    n0, f0 = get_nparams_and_flops(plain, 32)
    n1, f1 = get_nparams_and_flops(mtp, 32)
    assert n1 - n0 == DEPTH * (block + 2 * dim * dim + 3 * dim)
    assert mtp_output_flops_per_token(mtp) == 6 * DEPTH * vocab * dim and mtp_output_flops_per_token(plain) == 0
    assert f1 > f0
    with torch.device("meta"):
        big = DeepSeekV3Transformer(dataclasses.replace(deepseek_v3_configs["671B"], max_seq_len=8, mtp_depth=1))
    # The release's layer 61 by hand: MLA, two norms, 256 routed experts + a shared one, the router,
    # eh_proj and enorm / hnorm / shared_head.norm; with its copies of the embedding and head
    # (2 x 129280 x 7168) it is the "14B MTP module" of DeepSeek-V3's 685B.
    mla = 7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256 + 128 * 128 * 7168
    moe = 257 * 3 * 2048 * 7168 + 256 * 7168
    layer61 = mla + 2 * 7168 + moe + 7168 * 2 * 7168 + 3 * 7168
    assert layer61 == 11_610_067_968 and round((layer61 + 2 * 129280 * 7168) / 1e9) == 13
    assert sum(p.numel() for p in big.parameters()) == 671_026_404_352 + layer61


def test_refusals_name_the_key() -> None:
    base = ["--model.mtp_depth", "1"]
    with pytest.raises(TitanError, match=r"model.mtp_depth' got 1; valid: 0 \(model llama3 has no multi-token"):
        model_args_from_config(get_model_spec("llama3"), load_config(base).model)
    with pytest.raises(TitanError, match="model.mtp_depth"):
        load_config(["--model.mtp_depth", "-1"])
    with pytest.raises(TitanError, match="training.mtp_loss_weight"):
        load_config(["--training.mtp_loss_weight", "-0.1"])
    args = dataclasses.replace(DSTEST, mtp_depth=1)
    with pytest.raises(TitanError, match="context_parallel_degree to 1"):
        check_mtp(args, 2, 32)
    with pytest.raises(TitanError, match=r"valid: 0 .. training.seq_len - 1"):
        check_mtp(dataclasses.replace(args, mtp_depth=4), 1, 4)


@pytest.mark.slow
def test_memory_estimate_holds_the_mtp_parameters_and_activations() -> None:
    from tests.helpers.deepseek import dstest_flavor
    from titan.training.memory import estimate_memory

    flags = ["--model.name", "deepseek_v3", "--model.flavor", "dstest", "--training.seq_len", "32"]
    with dstest_flavor():
        plain = estimate_memory(load_config(flags), 1)
        mtp = estimate_memory(load_config([*flags, "--model.mtp_depth", "1"]), 1)
    block = sum(p.numel() for p in _model(DSTEST).layers["2"].parameters())
    assert mtp.params - plain.params == block + 2 * DSTEST.dim**2 + 3 * DSTEST.dim
    assert mtp.activation_bytes > plain.activation_bytes  # a block and a second set of logits


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"])
def test_qwen_mtp_head_gives_transformers_logits_and_round_trips(model_type: str, tmp_path: Path) -> None:
    """Qwen3.5 / Qwen3.5-MoE / Qwen3-Next: the releases' mtp.* head loads as depth 1 (a
    full-attention block, dense or MoE as the model, and (1 + weight) norms) with transformers'
    MtpModel's logits, and exports back bitwise with mtp_num_hidden_layers (Qwen3-Next also through
    scripts/convert_hf.py's model-only DCP folder)."""
    hf, mtp = qwen_mtp_folder(tmp_path / "hf", model_type)
    state, args = load_hf(tmp_path / "hf", torch.float32, mtp_depth=1)
    model = Qwen35Transformer(args)
    model.load_state_dict(state, strict=True)
    model.init_buffers()
    tokens = torch.randint(0, args.vocab_size, (2, 21), generator=torch.Generator().manual_seed(1))
    want = transformers_logits(hf, mtp, tokens[:, :-1])
    with torch.no_grad():
        got = model(tokens[:, :-1])
    for k, logits in enumerate(want):
        torch.testing.assert_close(got[2 * k : 2 * (k + 1)], logits, atol=5e-5, rtol=1e-5)
    save_hf(model.state_dict(), args, tmp_path / "out")
    before, after = _files(tmp_path / "hf"), _files(tmp_path / "out")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert json.loads((tmp_path / "out/config.json").read_text())["mtp_num_hidden_layers"] == 1
    if model_type == "qwen3_next":  # scripts/convert_hf.py both ways, through a model-only DCP folder
        script = _convert_hf()
        assert script.main(["from_hf", str(tmp_path / "hf"), str(tmp_path / "dcp"), "--mtp_depth", "1"]) == 0
        assert script.main(["to_hf", str(tmp_path / "dcp"), str(tmp_path / "again")]) == 0
        again = _files(tmp_path / "again")
        assert again.keys() == before.keys() and all(torch.equal(before[k], again[k]) for k in before)
    with pytest.raises(TitanError, match="one fusion"):
        save_hf(model.state_dict(), dataclasses.replace(args, mtp_depth=2), tmp_path / "two")


@pytest.mark.slow
def test_continued_pretraining_from_the_release_starts_at_transformers_losses(release, tmp_path) -> None:
    """checkpoint.initial_load_in_hf with model.mtp_depth: the first step's loss and MTP loss are
    transformers' (its model and MtpModel) on the same batch, by the written-out formula."""
    from titan.training.trainer import Trainer

    folder, hf, mtp = release
    flags = [
        "--job.config_file", str(REPO / "train_configs/debug_model.toml"), "--job.dump_folder", str(tmp_path),
        "--model.name", "deepseek_v3", "--model.mtp_depth", str(DEPTH), "--training.seq_len", "16",
        "--training.local_batch_size", "2", "--metrics.log_freq", "1", "--checkpoint.enable",
        "--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf",
        "--checkpoint.config_mismatch", "use_checkpoint", "--metrics.enable_tensorboard", "false",
    ]  # fmt: skip
    trainer = Trainer(load_config(flags))  # loads the folder's weights, its MTP layers included
    batch = trainer.next_microbatches()
    assert batch is not None
    result = trainer.train_step(batch)
    inputs, labels = batch[0]
    main, mtp_loss = reference_losses(transformers_logits(hf, mtp, inputs), labels)
    assert abs(result.loss.item() - main.item()) < 1e-4
    assert abs(result.extra["mtp_loss"].item() - mtp_loss.item()) < 1e-4
