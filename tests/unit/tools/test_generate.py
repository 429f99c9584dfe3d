"""Generation: KV cache == recompute == transformers' greedy decode; TP=2 (torchrun, gloo) == TP=1."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import cpu_env
from tests.helpers.tiny import random_model, small_args
from titan.checkpointing.hf import import_hf_to_dcp, read_hf_config, save_hf
from titan.errors import TitanError
from titan.tools.generate import generate, load_model, sample

REPO = Path(__file__).resolve().parents[3]
PROMPT = [5, 17, 99, 3, 64, 21, 8]
N_NEW = 12


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gen") / "hf"
    model = random_model(small_args(), seed=11)
    with torch.no_grad():  # sharp attention so that positions (RoPE, the cache) decide tokens
        for name, p in model.named_parameters():
            if ".wq." in name or ".wk." in name:
                p.mul_(4.0)
    save_hf(model.state_dict(), small_args(), folder)
    return folder


def _greedy(folder: Path, **kw) -> list[int]:
    model = load_model(folder, max_seq_len=64, device=torch.device("cpu"))
    return generate(model, PROMPT, N_NEW, **kw)[0]


@pytest.mark.slow
def test_kv_cache_and_recompute_match_transformers_greedy(hf_folder):
    transformers = pytest.importorskip("transformers")
    cached = _greedy(hf_folder)
    assert cached == _greedy(hf_folder, use_cache=False)
    assert cached == _greedy(hf_folder, pad_multiple=4)  # the TP padding is exact
    ref = transformers.LlamaForCausalLM.from_pretrained(str(hf_folder), torch_dtype=torch.float32).eval()
    out = ref.generate(
        torch.tensor([PROMPT]), max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False, pad_token_id=0
    )
    assert out[0, len(PROMPT) :].tolist() == cached
    assert len(set(cached)) > 2  # not a degenerate repeat of one token


def test_sampling_rules():
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9, -5.0]])
    assert sample(logits, 0.0, None, g).item() == 1
    assert sample(logits, 1.0, 1, g).item() == 1  # top-1 is greedy
    draws = {sample(logits, 5.0, 2, g).item() for _ in range(50)}
    assert draws == {1, 3}  # hot temperature, but only the two likeliest survive top-k
    a = [sample(logits, 1.0, None, torch.Generator().manual_seed(3)).item() for _ in range(2)]
    assert a[0] == a[1]


def test_bad_inputs_give_clear_errors(tmp_path, hf_folder):
    with pytest.raises(TitanError, match="neither a Hugging Face folder"):
        load_model(tmp_path, max_seq_len=8, device=torch.device("cpu"))
    model = load_model(hf_folder, max_seq_len=16, device=torch.device("cpu"))
    with pytest.raises(TitanError, match="exceeds the context 16"):
        generate(model, PROMPT, 20)
    with pytest.raises(TitanError, match="prompt is empty"):
        generate(model, [], 2)


@pytest.mark.slow
def test_tensor_parallel_2_ranks_gives_the_tp1_tokens(hf_folder, tmp_path):
    # TP=1 from the HF folder, TP=2 from its DCP conversion: DCP reshards into the TP DTensors
    # (the HF loader's shard-distributing path is checked on FSDP shards in test_hf_distributed).
    expected = _greedy(hf_folder)
    import_hf_to_dcp(hf_folder, tmp_path / "dcp")
    out = tmp_path / "tp2.json"
    env = cpu_env()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(REPO / "scripts/generate.py"),
        "--checkpoint",
        str(tmp_path / "dcp"),
        "--prompt_ids",
        ",".join(map(str, PROMPT)),
        "--max_new_tokens",
        str(N_NEW),
        "--ignore_eos",
        "--out_json",
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tokens/s (tp 2" in proc.stdout
    assert json.loads(out.read_text())["tokens"] == expected


def test_a_step_folder_is_read_as_to_hf_reads_it_without_flavor():
    """A training step folder names its model in the run's saved config: generation reads it the way
    scripts/convert_hf.py to_hf does (one function), with no --flavor, and refuses a contradicting one."""
    from titan.checkpointing.hf import dcp_model_args
    from titan.tools.generate import checkpoint_args

    step = REPO / "tests/fixtures/legacy_checkpoint/step-4"
    kind, args = checkpoint_args(step)
    assert kind == "dcp" and args == dcp_model_args(step) and (args.dim, args.n_layers) == (4, 1)
    with pytest.raises(TitanError, match="--flavor 8B disagrees"):
        checkpoint_args(step, flavor="8B")
    model = load_model(step, max_seq_len=8, device=torch.device("cpu"))
    assert model.model_args.dim == 4


def test_a_converted_folder_of_another_family_is_read_without_model(tmp_path):
    """from_hf's folder records its family in model_args.json: no --model needed, a wrong one refused
    in one line naming the folder (not the model_args.json fields of the family it is not)."""
    from titan.models.qwen3 import Qwen3ModelArgs, Qwen3Transformer
    from titan.tools.generate import checkpoint_args

    args = Qwen3ModelArgs(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=128, head_dim=8, hidden_dim=24)
    model = Qwen3Transformer(args)
    model.init_weights()
    save_hf(model.state_dict(), args, tmp_path / "hf")
    import_hf_to_dcp(tmp_path / "hf", tmp_path / "dcp")
    assert checkpoint_args(tmp_path / "dcp") == ("dcp", read_hf_config(tmp_path / "hf"))
    with pytest.raises(TitanError, match=r"--model llama3 disagrees with .*dcp, which holds a qwen3 model") as e:
        checkpoint_args(tmp_path / "dcp", model="llama3")
    assert "\n" not in str(e.value)
