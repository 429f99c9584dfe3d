"""titan <-> Hugging Face: lossless round trips (memory, files, DCP) and logit parity with transformers."""

import json

import pytest
import torch

from tests.helpers.tiny import assert_bitwise, random_model, small_args
from titan.checkpointing.hf import export_dcp_to_hf, import_hf_to_dcp, load_hf, save_hf
from titan.checkpointing.model_dcp import read_model_tensors, save_model_dcp
from titan.errors import TitanError
from titan.models import get_model_spec
from titan.models.llama.model import Transformer, ffn_hidden_dim
from titan.models.llama.state_dict_adapter import args_to_hf_config, from_hf, hf_config_to_args, to_hf


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_round_trip_is_bitwise_through_memory_files_and_dcp(tmp_path, tied):
    args = small_args(tie_embeddings=tied)
    sd = random_model(args).state_dict()
    hf = to_hf(sd, args)
    assert ("lm_head.weight" in hf) != tied and "model.layers.1.self_attn.k_proj.weight" in hf
    # The RoPE permutation really moves rows (else the parity test below would prove nothing).
    assert not torch.equal(hf["model.layers.0.self_attn.q_proj.weight"], sd["layers.0.attention.wq.weight"])
    assert_bitwise(from_hf(hf, args), sd)

    # titan DCP -> HF folder (several shards) -> titan DCP, and HF folder -> memory.
    save_model_dcp(sd, args, tmp_path / "dcp")
    export_dcp_to_hf(tmp_path / "dcp", tmp_path / "hf", args, max_shard_bytes=40_000)
    index = json.loads((tmp_path / "hf/model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and files[-1] == f"model-{len(files):05d}-of-{len(files):05d}.safetensors"
    loaded, args2 = load_hf(tmp_path / "hf")
    assert_bitwise(loaded, sd)
    assert ffn_hidden_dim(args2) == ffn_hidden_dim(args) and args2.tie_embeddings == tied
    import_hf_to_dcp(tmp_path / "hf", tmp_path / "dcp2")
    assert_bitwise(read_model_tensors(tmp_path / "dcp2"), sd)

    # The in-memory writer too, with a dtype cast on the way out.
    save_hf(sd, args, tmp_path / "hf_bf16", dtype=torch.bfloat16)
    half, _ = load_hf(tmp_path / "hf_bf16")
    assert half["norm.weight"].dtype == torch.bfloat16
    assert json.loads((tmp_path / "hf_bf16/config.json").read_text())["torch_dtype"] == "bfloat16"


def test_an_absent_llama_field_takes_transformers_default():
    import dataclasses

    from transformers import LlamaConfig

    from titan.models.llama.hf_config import LLAMA_DEFAULTS

    declared = {f.name: f.default for f in dataclasses.fields(LlamaConfig)}
    assert {k: declared[k] for k in LLAMA_DEFAULTS} == dict(LLAMA_DEFAULTS)
    assert hf_config_to_args({"model_type": "llama"}) == hf_config_to_args(LlamaConfig().to_dict())


def test_config_round_trip_for_published_flavors():
    spec = get_model_spec("llama3")
    assert spec.state_dict_adapter.to_hf is to_hf
    for flavor in ("8B", "70B", "405B"):
        args = spec.flavors[flavor]
        cfg = args_to_hf_config(args)
        assert cfg["rope_parameters"]["rope_type"] == "llama3"
        back = hf_config_to_args(cfg)
        assert ffn_hidden_dim(back) == ffn_hidden_dim(args) == cfg["intermediate_size"]
        for f in (
            "dim",
            "n_layers",
            "n_heads",
            "kv_heads",
            "vocab_size",
            "rope_theta",
            "rope_scale_factor",
            "use_rope_scaling",
            "rope_original_max_position_embeddings",
            "norm_eps",
        ):
            assert getattr(back, f) == getattr(args, f), (flavor, f)
    assert hf_config_to_args(args_to_hf_config(small_args(ffn_dim_multiplier=1.3))).dim == 64


@pytest.mark.slow
def test_parity_with_transformers_llama(tmp_path):
    transformers = pytest.importorskip("transformers")
    args = small_args()
    model = random_model(args, seed=3)
    save_hf(model.state_dict(), args, tmp_path / "hf")
    ref = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens)
        theirs = ref(tokens).logits
    diff = (ours - theirs).abs().max().item()
    print(f"max |titan - transformers| logits: {diff:.2e}")
    assert diff < 1e-4, diff
    # The RoPE scaling is really in play: without it titan's logits move far more than the tolerance.
    unscaled = Transformer(small_args(use_rope_scaling=False)).eval()
    unscaled.load_state_dict(model.state_dict())
    with torch.no_grad():
        off = (unscaled(tokens) - theirs).abs().max().item()
    print(f"without RoPE scaling: {off:.2e}")
    assert off > 100 * max(diff, 1e-6)


def test_bad_hf_folders_give_clear_errors(tmp_path):
    with pytest.raises(TitanError, match="no config.json"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(args_to_hf_config(small_args())))
    with pytest.raises(TitanError, match="no model.safetensors"):
        load_hf(tmp_path)
    cfg = args_to_hf_config(small_args()) | {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}
    with pytest.raises(TitanError, match="rope_scaling.rope_type = 'yarn' is not supported"):
        hf_config_to_args(cfg)
    with pytest.raises(TitanError, match="attention_bias"):
        hf_config_to_args(args_to_hf_config(small_args()) | {"attention_bias": True})
    with pytest.raises(TitanError, match="no Hugging Face Llama equivalent"):
        to_hf({"layers.0.attention.bogus.weight": torch.zeros(1)}, small_args())
    sd = random_model(small_args()).state_dict()
    save_model_dcp(sd, small_args(), tmp_path / "dcp")
    with pytest.raises(TitanError, match="do not match the model args"):
        export_dcp_to_hf(tmp_path / "dcp", tmp_path / "out", small_args(n_layers=3))
    with pytest.raises(TitanError, match="not empty"):
        save_model_dcp(sd, small_args(), tmp_path / "dcp")


def test_from_hf_writes_nothing_for_a_folder_whose_tensors_contradict_config_json(tmp_path, capsys):
    """config.json without hidden_size means transformers' 4096: the script says so in one line,
    exits 1 and leaves no DCP folder (every family and field: tests/unit/models/test_hf_config_sweep.py)."""
    from scripts.convert_hf import main

    save_hf(random_model(small_args()).state_dict(), small_args(), tmp_path / "hf")
    config = json.loads((tmp_path / "hf/config.json").read_text())
    for key in ("hidden_size", "head_dim"):
        del config[key]
    (tmp_path / "hf/config.json").write_text(json.dumps(config))
    assert main(["from_hf", str(tmp_path / "hf"), str(tmp_path / "dcp")]) == 1
    err = capsys.readouterr().err.strip()
    assert "does not fit the model config.json describes" in err and "\n" not in err and not (tmp_path / "dcp").exists()
    assert not list(tmp_path.glob(".dcp*"))


@pytest.mark.slow
def test_convert_script_on_a_training_checkpoint_and_torch_save_round_trip(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    from scripts.convert_hf import main
    from titan.models.llama.args import get_model_args

    # A training checkpoint: model nested under "model." beside other state, no model_args.json.
    args = get_model_args("debugmodel", n_layers=2, vocab_size=256, max_seq_len=64)
    sd = random_model(args).state_dict()
    dcp.save({"model": sd, "step": torch.tensor(3)}, checkpoint_id=str(tmp_path / "step-3"))
    # nothing in the folder names its family: --model is asked for, not guessed
    assert main(["to_hf", str(tmp_path / "step-3"), str(tmp_path / "hf")]) == 1
    assert "records no model family (no model_args.json, no run config.json); pass --model" in capsys.readouterr().err
    assert main(["to_hf", str(tmp_path / "step-3"), str(tmp_path / "hf"), "--model", "llama3"]) == 1
    assert "pass --flavor" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
    assert (
        main(["to_hf", str(tmp_path / "step-3"), str(tmp_path / "hf"), "--model", "llama3", "--flavor", "debugmodel"])
        == 0
    )
    assert json.loads((tmp_path / "hf/config.json").read_text())["num_hidden_layers"] == 2
    assert main(["from_hf", str(tmp_path / "hf"), str(tmp_path / "dcp")]) == 0
    assert_bitwise(read_model_tensors(tmp_path / "dcp"), sd)

    assert main(["dcp_to_torch", str(tmp_path / "step-3"), str(tmp_path / "model.pt")]) == 0
    assert_bitwise(torch.load(tmp_path / "model.pt", weights_only=True), sd)  # model only, flat names
    assert main(["torch_to_dcp", str(tmp_path / "model.pt"), str(tmp_path / "dcp2")]) == 0
    assert_bitwise(read_model_tensors(tmp_path / "dcp2"), sd)
    assert main(["dcp_to_torch", str(tmp_path / "step-3"), str(tmp_path / "all.pt"), "--all_state"]) == 0
    assert torch.load(tmp_path / "all.pt", weights_only=True)["step"].item() == 3
    assert main(["torch_to_dcp", str(tmp_path / "missing.pt"), str(tmp_path / "dcp3")]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert main(["to_hf", str(tmp_path / "hf"), str(tmp_path / "hf2")]) == 1
    assert "a Hugging Face folder" in capsys.readouterr().err


def test_published_hf_configs_map_to_the_titan_flavors():
    llama31_8b = {  # meta-llama/Llama-3.1-8B config.json
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": 128256,
    }
    args, flavor = hf_config_to_args(llama31_8b), get_model_spec("llama3").flavors["8B"]
    for f in (
        "dim",
        "n_layers",
        "n_heads",
        "kv_heads",
        "vocab_size",
        "rope_theta",
        "use_rope_scaling",
        "rope_scale_factor",
        "rope_low_freq_factor",
        "rope_high_freq_factor",
        "norm_eps",
        "tie_embeddings",
    ):
        assert getattr(args, f) == getattr(flavor, f), f
    assert ffn_hidden_dim(args) == 14336
    # Llama 3.2 1B: tied embeddings, explicit head_dim, RoPE factor 32; transformers 5 style rope_parameters.
    llama32_1b = llama31_8b | {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_attention_heads": 32,
        "num_hidden_layers": 16,
        "head_dim": 64,
        "tie_word_embeddings": True,
        "rope_scaling": None,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    del llama32_1b["rope_theta"]
    small = hf_config_to_args(llama32_1b)
    assert (small.tie_embeddings, small.rope_scale_factor, small.rope_theta, ffn_hidden_dim(small)) == (
        True,
        32.0,
        500000.0,
        8192,
    )
