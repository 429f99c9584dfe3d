"""Generate text from a titan DCP checkpoint or a Hugging Face folder.

    python scripts/generate.py --checkpoint hf_out --prompt "The capital of France is"
    python scripts/generate.py --checkpoint outputs/checkpoint/step-1000 \
        --temperature 0.8 --top_k 50 --max_new_tokens 64
    # tensor parallel over 2 ranks (the training TP plan; gloo on CPU, nccl on GPUs)
    torchrun --nproc_per_node 2 scripts/generate.py --checkpoint hf_out --prompt "Hello"

temperature 0 (the default) is greedy. Prints the text and tokens/s (decode loop, rank 0).
Errors print one line and exit with status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from titan.errors import TitanError  # noqa: E402
from titan.parallel.fsdp import DTYPES  # noqa: E402
from titan.parallel.utils import destroy_distributed, init_distributed, pick_device, world_info  # noqa: E402


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="DCP folder (titan) or Hugging Face folder (config.json)")
    p.add_argument(
        "--model",
        default=None,
        help="model family, only for a DCP folder that records none (an HF folder's"
        " config.json, a converted folder's model_args.json and a step folder's run config say it)",
    )
    p.add_argument(
        "--flavor", default=None, help="model flavor, only for a DCP folder with no model_args.json or run config"
    )
    p.add_argument("--tokenizer", default="", help="tokenizer file (default: titan's shipped tokenizer)")
    p.add_argument("--prompt", default="", help="prompt text (encoded with a BOS token)")
    p.add_argument("--prompt_ids", default="", help="comma-separated token ids instead of --prompt")
    p.add_argument("--max_new_tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top_k", type=int, default=None, help="sample only among the k likeliest tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--no_kv_cache", action="store_true", help="recompute the whole prefix each step")
    p.add_argument("--ignore_eos", action="store_true", help="do not stop at the tokenizer's end-of-text token")
    p.add_argument("--out_json", default="", help="also write the token ids, text and tokens/s here (rank 0)")
    return p.parse_args(argv)


def run(a: argparse.Namespace) -> int:
    from titan.data.tokenizer import build_tokenizer
    from titan.tools.generate import generate, load_model

    rank, local_rank, world = world_info()
    tokenizer = build_tokenizer(a.tokenizer)
    if a.prompt_ids:
        try:
            prompt = [int(t) for t in a.prompt_ids.split(",")]
        except ValueError:
            raise TitanError(f"--prompt_ids must be comma-separated integers, got {a.prompt_ids!r}") from None
    else:
        prompt = tokenizer.encode(a.prompt, bos=True, eos=False)
    device = pick_device(local_rank)
    init_distributed(device, world)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",)) if world > 1 else None
    max_len = len(prompt) + a.max_new_tokens + world
    model = load_model(
        a.checkpoint,
        max_seq_len=max_len,
        device=device,
        dtype=DTYPES[a.dtype],
        flavor=a.flavor,
        tp_mesh=mesh,
        model=a.model,
    )
    if max(prompt) >= model.vocab_size:
        raise TitanError(f"prompt token id {max(prompt)} is outside the model's vocabulary ({model.vocab_size})")
    stop = set() if a.ignore_eos else {tokenizer.eos_id}
    new, tps = generate(
        model,
        prompt,
        a.max_new_tokens,
        temperature=a.temperature,
        top_k=a.top_k,
        seed=a.seed,
        stop_ids=stop,
        use_cache=not a.no_kv_cache,
        pad_multiple=world,
    )
    if rank == 0:
        text = tokenizer.decode([t for t in new if t < tokenizer.vocab_size])
        print(text)
        print(f"{len(new)} tokens, {tps:.1f} tokens/s (tp {world}, kv cache {not a.no_kv_cache}, {a.dtype})")
        if a.out_json:
            result = {"prompt": prompt, "tokens": new, "text": text, "tokens_per_s": tps}
            Path(a.out_json).write_text(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    try:
        return run(a)
    except TitanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        destroy_distributed()


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
