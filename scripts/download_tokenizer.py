"""Download a tokenizer from the Hugging Face Hub for `--model.tokenizer_path`.

    python scripts/download_tokenizer.py --repo_id meta-llama/Meta-Llama-3.1-8B \
        --tokenizer_path original --hf_token hf_... --local_dir assets/tokenizer/

downloads `original/tokenizer.model` (Meta's tiktoken file) to
`assets/tokenizer/original/tokenizer.model`. Without `--tokenizer_path original` it fetches the
Hugging Face files (tokenizer.json, tokenizer_config.json, and tokenizer.model where the repo has
one, e.g. Llama 2's sentencepiece model). Llama repos are gated: accept the license on the model's
page first and pass a token (or set HF_TOKEN).

Errors print one line and exit with status 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

_META_FILES = ["tokenizer.model"]
_HF_FILES = ["tokenizer.json", "tokenizer_config.json", "tokenizer.model"]


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1


def download(repo_id: str, tokenizer_path: str, local_dir: str, hf_token: str | None, files: list[str]) -> list[Path]:
    """Download `files` from `repo_id`/`tokenizer_path`; files the repo lacks are skipped, as long
    as at least one arrives. Raises huggingface_hub's errors for everything else."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError
    from huggingface_hub.utils import disable_progress_bars

    if not sys.stderr.isatty():  # huggingface_hub draws its download bars everywhere otherwise
        disable_progress_bars()

    got: list[Path] = []
    missing: list[str] = []
    for name in files:
        try:
            path = hf_hub_download(
                repo_id=repo_id,
                filename=name,
                subfolder=tokenizer_path or None,
                local_dir=local_dir,
                token=hf_token,
            )
        except LocalEntryNotFoundError:
            raise  # offline or unreachable: not "file absent from the repo"
        except EntryNotFoundError:
            missing.append(name)
            continue
        got.append(Path(path))
    if not got:
        where = f"{repo_id}/{tokenizer_path}" if tokenizer_path else repo_id
        raise FileNotFoundError(f"none of {', '.join(missing)} exist in {where}")
    return got


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo_id", default="meta-llama/Meta-Llama-3.1-8B", help="hub repo")
    parser.add_argument(
        "--tokenizer_path", default="original",
        help="folder inside the repo ('original' holds Meta's tokenizer.model; '' the repo root)",
    )  # fmt: skip
    parser.add_argument("--hf_token", default=None, help="hub token (default: $HF_TOKEN / login)")
    parser.add_argument("--local_dir", default="assets/tokenizer/", help="where to save")
    parser.add_argument(
        "--files", nargs="+", default=None,
        help=f"files to fetch (default: {_META_FILES} for 'original', else {_HF_FILES})",
    )  # fmt: skip
    args = parser.parse_args(argv)
    token = args.hf_token or os.environ.get("HF_TOKEN") or None
    files = args.files or (_META_FILES if args.tokenizer_path.strip("/").endswith("original") else _HF_FILES)
    page = f"https://huggingface.co/{args.repo_id}"

    try:
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
        )
    except ImportError:
        return _fail("huggingface_hub is not installed: pip install huggingface_hub")

    # The hub logs a warning per network retry; one progress line and one error line read better.
    from huggingface_hub.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    print(f"downloading {', '.join(files)} from {args.repo_id} ...", flush=True)
    try:
        paths = download(args.repo_id, args.tokenizer_path, args.local_dir, token, files)
    except GatedRepoError:
        return _fail(f"{args.repo_id} is gated: accept its license at {page} and pass --hf_token")
    except RepositoryNotFoundError:
        return _fail(f"repo {args.repo_id} not found or not visible with this token (check --repo_id, --hf_token)")
    except LocalEntryNotFoundError:
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
        why = "HF_HUB_OFFLINE is set" if offline else "no network connection to the Hub"
        return _fail(f"cannot download from {args.repo_id}: {why}")
    except HfHubHTTPError as e:
        return _fail(f"download from {args.repo_id} failed: {str(e).splitlines()[0]}")
    except (OSError, ValueError) as e:  # network errors, bad repo ids, missing files
        first_line = str(e).splitlines()[0] if str(e) else repr(e)
        return _fail(f"download from {args.repo_id} failed: {first_line}")

    for p in paths:
        print(f"downloaded {p}")
    tok_file = next((p for p in paths if p.name != "tokenizer_config.json"), paths[0])
    print(f"use it with: --model.tokenizer_path {tok_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
