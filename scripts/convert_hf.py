"""Move model weights (llama3, llama4, ...) between titan DCP folders, Hugging Face folders and single torch.save files.

    # titan checkpoint (a training step-N folder or a model-only one) -> HF folder
    python scripts/convert_hf.py to_hf outputs/checkpoint/step-1000 hf_out --flavor 8B --dtype bfloat16
    # HF folder (config.json + *.safetensors) -> model-only DCP folder for initial_load_path
    python scripts/convert_hf.py from_hf Meta-Llama-3.1-8B dcp_out
    # DCP <-> one torch.save file (torch.distributed.checkpoint.format_utils)
    python scripts/convert_hf.py dcp_to_torch dcp_out model.pt [--all_state]
    python scripts/convert_hf.py torch_to_dcp model.pt dcp_out

to_hf exports the model the run trained: model_args.json in the DCP folder (written by titan's
converters), else the run's config.json saved in the step folder (its model name, flavor and
[model] shape overrides), else --model and --flavor (vocab size, layer count and tied embeddings are
then read off the tensors). The family comes from the folder (model_args.json, the saved config,
config.json's model_type); --model is needed only where the folder records none. Output is written
to a temporary folder beside the target and renamed at the end: a refused or failed conversion
leaves nothing behind, and an existing non-empty folder is never overwritten.
Errors print one line and exit with status 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from titan.checkpointing import hf as hf_io  # noqa: E402
from titan.checkpointing import model_dcp as dcp_io  # noqa: E402
from titan.errors import TitanError  # noqa: E402
from titan.parallel.fsdp import DTYPES  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    to_hf = sub.add_parser("to_hf", help="titan DCP folder -> Hugging Face folder")
    to_hf.add_argument("dcp_dir")
    to_hf.add_argument("hf_dir")
    to_hf.add_argument("--model", default=None, help="model family ([model] name), only where the folder records none")
    to_hf.add_argument(
        "--flavor", default=None, help="model flavor, only where the folder has no model_args.json or run config"
    )
    to_hf.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast (default: keep the saved dtype)")
    to_hf.add_argument("--max_shard_gb", type=float, default=5.0, help="largest safetensors file, GiB")
    to_hf.add_argument(
        "--drop_routing_bias",
        action="store_true",
        help="export an MoE model whose HF format has no routing bias (llama4, qwen3 MoE, gpt_oss) without"
        " the bias its balancing trained: the export then picks experts by the router alone",
    )
    from_hf = sub.add_parser("from_hf", help="Hugging Face folder -> model-only titan DCP folder")
    from_hf.add_argument("hf_dir")
    from_hf.add_argument("dcp_dir")
    from_hf.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast (default: keep the saved dtype)")
    from_hf.add_argument(
        "--mtp_depth",
        type=int,
        default=0,
        help="multi-token-prediction layers to convert (DeepSeek-V3's layer num_hidden_layers on), for a"
        " run with model.mtp_depth this large; default 0: skipped",
    )
    to_torch = sub.add_parser("dcp_to_torch", help="DCP folder -> one torch.save file")
    to_torch.add_argument("dcp_dir")
    to_torch.add_argument("torch_file")
    to_torch.add_argument(
        "--all_state",
        action="store_true",
        help="keep everything (optimizer, dataloader, ...), not only the model tensors",
    )
    from_torch = sub.add_parser("torch_to_dcp", help="torch.save file -> DCP folder")
    from_torch.add_argument("torch_file")
    from_torch.add_argument("dcp_dir")
    a = p.parse_args(argv)
    try:
        if a.cmd == "to_hf":
            args = hf_io.dcp_model_args(a.dcp_dir, a.model, a.flavor)
            dtype = DTYPES[a.dtype] if a.dtype else None
            hf_io.export_dcp_to_hf(a.dcp_dir, a.hf_dir, args, int(a.max_shard_gb * 1024**3), dtype, a.drop_routing_bias)
            print(f"wrote {a.hf_dir} (config.json, safetensors shards, {hf_io.INDEX_FILE})")
        elif a.cmd == "from_hf":
            args = hf_io.import_hf_to_dcp(a.hf_dir, a.dcp_dir, DTYPES[a.dtype] if a.dtype else None, a.mtp_depth)
            print(f"wrote {a.dcp_dir}: {args.n_layers} layers, dim {args.dim}")
        elif a.cmd == "dcp_to_torch":
            dcp_io.dcp_to_torch_file(a.dcp_dir, a.torch_file, model_only=not a.all_state)
            print(f"wrote {a.torch_file}")
        else:
            dcp_io.torch_file_to_dcp(a.torch_file, a.dcp_dir)
            print(f"wrote {a.dcp_dir}")
    except TitanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
