"""Tokenizers: tiktoken (Llama 3), sentencepiece (Llama 2) and Hugging Face tokenizer.json.

`build_tokenizer(path)` picks the format from the file's content (both tiktoken and sentencepiece
files are commonly called `tokenizer.model`); `build_tokenizer("")` returns the small tokenizer
shipped in titan/data/assets, built by scripts/build_tokenizer.py.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from pathlib import Path

from titan.data.tiktoken_folder import RANKS_FILE, TikTokenFolder, read_tiktoken_folder
from titan.errors import TitanError

__all__ = [
    "DEFAULT_TOKENIZER_PATH",
    "HFTokenizer",
    "LLAMA3_PAT_STR",
    "SentencePieceTokenizer",
    "TikTokenizer",
    "Tokenizer",
    "build_tokenizer",
    "llama3_special_tokens",
]

DEFAULT_TOKENIZER_PATH = Path(__file__).resolve().parent / "assets" / "tokenizer.model"

# Llama 3's pre-tokenizer split: contractions, letter runs, numbers of 1-3 digits, punctuation
# runs, newlines and whitespace. The shipped tokenizer is trained with the same pattern.
LLAMA3_PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NUM_LLAMA3_SPECIAL_TOKENS = 256

# tiktoken's Rust core works on one string at a time and can be very slow on huge inputs and on
# long runs without whitespace (the regex backtracks); same limits as Meta's reference.
_MAX_ENCODE_CHARS = 400_000
_MAX_RUN_CHARS = 25_000
_RUN_RE = re.compile(r"\s+|\S+")

_DOWNLOAD_HINT = (
    "download one with `python scripts/download_tokenizer.py --repo_id "
    "meta-llama/Meta-Llama-3.1-8B --tokenizer_path original --hf_token ...` or leave "
    "model.tokenizer_path empty for the shipped tokenizer"
)
_FORMATS = (
    "tiktoken BPE ranks file (Llama 3 tokenizer.model), sentencepiece .model (Llama 2), "
    "or Hugging Face tokenizer.json (or a folder containing it)"
)


def llama3_special_tokens() -> list[str]:
    """The 256 special tokens of Llama 3.1, in id order (id = number of BPE ranks + index)."""
    named = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|step_id|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    ]
    reserved = [f"<|reserved_special_token_{2 + i}|>" for i in range(NUM_LLAMA3_SPECIAL_TOKENS - len(named))]
    return named + reserved


class Tokenizer(ABC):
    """What the data pipeline and generation need from a tokenizer."""

    vocab_size: int  # ids incl. special tokens; the model's embedding must be at least this big
    bos_id: int
    eos_id: int
    pad_id: int = -1  # -1: the tokenizer defines no padding token
    path: str = ""

    @abstractmethod
    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        """Token ids of `text`; special-token text inside it is encoded as ordinary text."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` (special tokens render as their text)."""

    def _wrap(self, ids: list[int], bos: bool, eos: bool) -> list[int]:
        if bos:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(path={self.path!r}, vocab_size={self.vocab_size}, "
            f"bos_id={self.bos_id}, eos_id={self.eos_id}, pad_id={self.pad_id})"
        )


def _split_long(text: str) -> Iterator[str]:
    """Pieces of `text` small enough for tiktoken: at most _MAX_ENCODE_CHARS each, and no run of
    whitespace or of non-whitespace longer than _MAX_RUN_CHARS. Cuts only change token boundaries
    at the cut, never the decoded text."""
    for start in range(0, len(text), _MAX_ENCODE_CHARS):
        chunk = text[start : start + _MAX_ENCODE_CHARS]
        if len(chunk) <= _MAX_RUN_CHARS:  # no run can be too long: skip the scan
            yield chunk
            continue
        piece_start = 0
        for m in _RUN_RE.finditer(chunk):
            run_start, run_end = m.span()
            if run_end - run_start <= _MAX_RUN_CHARS:
                continue
            if run_start > piece_start:
                yield chunk[piece_start:run_start]
            for s in range(run_start, run_end, _MAX_RUN_CHARS):
                yield chunk[s : min(s + _MAX_RUN_CHARS, run_end)]
            piece_start = run_end
        if piece_start < len(chunk):
            yield chunk[piece_start:]


_REMOTE_PREFIXES = ("gs://", "az://", "http://", "https://")


def _is_remote(path: str | Path) -> bool:
    return str(path).startswith(_REMOTE_PREFIXES)


def _load_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """BPE ranks through tiktoken's own loader: local files, gs:// and az:// (through blobfile),
    http(s). tiktoken caches what it reads under TIKTOKEN_CACHE_DIR keyed by the path *string*,
    which for a local file would serve a stale copy after the file is rewritten in place; so
    local files are read uncached (no cache write either: the shipped tokenizer stays offline
    and side-effect free) and only remote paths use tiktoken's cache."""
    import os

    from tiktoken.load import load_tiktoken_bpe

    saved = os.environ.get("TIKTOKEN_CACHE_DIR")
    if not _is_remote(path):
        os.environ["TIKTOKEN_CACHE_DIR"] = ""  # tiktoken: "" disables its cache
    try:
        ranks = load_tiktoken_bpe(path)
    except ValueError as e:  # tiktoken: "Error parsing line ... in PATH"
        raise TitanError(
            f"{path}: not a tiktoken ranks file (expected 'base64token rank' lines): {str(e).splitlines()[0]}"
        ) from None
    except Exception as e:  # network, credentials, missing remote object
        raise TitanError(
            f"cannot read tokenizer {path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from None
    finally:
        if not _is_remote(path):
            if saved is None:
                os.environ.pop("TIKTOKEN_CACHE_DIR", None)
            else:
                os.environ["TIKTOKEN_CACHE_DIR"] = saved
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TitanError(f"{path}: tiktoken ranks must be the distinct numbers 0..{len(ranks) - 1}")
    return ranks


class TikTokenizer(Tokenizer):
    """A tiktoken BPE ranks file with Llama 3's split regex and its 256 special tokens right after
    the ranks (BOS = <|begin_of_text|>, EOS = <|end_of_text|>), or with the pattern and special
    tokens a Kimi-style tokenizer folder states (``folder``: titan.data.tiktoken_folder)."""

    def __init__(self, path: str | Path, folder: TikTokenFolder | None = None):
        import tiktoken

        path = str(path)
        ranks = _load_tiktoken_ranks(path)
        n = len(ranks)
        if folder is None:
            self.special_tokens = {tok: n + i for i, tok in enumerate(llama3_special_tokens())}
            pattern, bos, eos = LLAMA3_PAT_STR, "<|begin_of_text|>", "<|end_of_text|>"
        else:
            self.special_tokens = folder.special_tokens(n)
            pattern, bos, eos = folder.pattern, folder.bos, folder.eos
            for token in (bos, eos):
                if token not in self.special_tokens:
                    raise TitanError(f"{path}: tokenizer_config.json names {token!r}, which is no special token")
        self.model = tiktoken.Encoding(
            name=path.rsplit("/", 1)[-1], pat_str=pattern, mergeable_ranks=ranks, special_tokens=self.special_tokens
        )
        self.path = path
        self.num_base_tokens = n
        self.vocab_size = max(self.special_tokens.values(), default=n - 1) + 1
        self.bos_id = self.special_tokens[bos]
        self.eos_id = self.special_tokens[eos]
        self.pad_id = -1

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        ids: list[int] = []
        for piece in _split_long(text):
            # disallowed_special=(): a document that contains "<|end_of_text|>" gets it as plain
            # text, so data can never inject control tokens.
            ids.extend(self.model.encode(piece, allowed_special=set(), disallowed_special=()))
        return self._wrap(ids, bos, eos)

    def decode(self, ids: Sequence[int]) -> str:
        return self.model.decode(list(ids))


class SentencePieceTokenizer(Tokenizer):
    """Llama 2 style sentencepiece model; BOS/EOS/PAD come from the model itself."""

    def __init__(self, path: str | Path):
        import sentencepiece as spm

        self.path = str(path)
        try:
            self.model = spm.SentencePieceProcessor(model_file=self.path)
        except (RuntimeError, OSError) as e:
            raise TitanError(f"{path}: unreadable tokenizer; accepted formats: {_FORMATS} ({e})") from None
        self.vocab_size = self.model.vocab_size()
        self.bos_id = self.model.bos_id()
        self.eos_id = self.model.eos_id()
        self.pad_id = self.model.pad_id()
        if self.bos_id < 0 or self.eos_id < 0:
            raise TitanError(f"{path}: sentencepiece model defines no BOS/EOS (bos_id/eos_id = -1)")

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        return self._wrap(list(self.model.encode(text)), bos, eos)

    def decode(self, ids: Sequence[int]) -> str:
        return self.model.decode(list(ids))


def _token_text(value: object) -> str | None:
    # tokenizer_config.json stores special tokens either as a string or as {"content": ...}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer(Tokenizer):
    """Hugging Face `tokenizers` tokenizer.json. BOS/EOS/PAD come from tokenizer_config.json next
    to it when present, else from well-known token names."""

    _FALLBACKS = {
        "bos": ("<|begin_of_text|>", "<s>", "<|endoftext|>"),
        "eos": ("<|end_of_text|>", "</s>", "<|endoftext|>"),
    }

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as _HFTok

        path = Path(path)
        self.path = str(path)
        try:
            self.model = _HFTok.from_file(self.path)
        except Exception as e:  # tokenizers raises a bare Exception for schema errors
            raise TitanError(f"{path}: not a valid Hugging Face tokenizer.json ({e})") from None
        config: dict = {}
        config_path = path.parent / "tokenizer_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise TitanError(f"{config_path}: invalid JSON ({e})") from None
        self.vocab_size = self.model.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._special_id(config, "bos")
        self.eos_id = self._special_id(config, "eos")
        pad = _token_text(config.get("pad_token"))
        pad_id = self.model.token_to_id(pad) if pad else None
        self.pad_id = -1 if pad_id is None else pad_id

    def _special_id(self, config: dict, kind: str) -> int:
        configured = _token_text(config.get(f"{kind}_token"))
        candidates = ((configured,) if configured else ()) + self._FALLBACKS[kind]
        for token in candidates:
            token_id = self.model.token_to_id(token)
            if token_id is not None:
                return token_id
        raise TitanError(
            f"{self.path}: no {kind.upper()} token found (tried {', '.join(candidates)}); "
            f"set {kind}_token in tokenizer_config.json next to it"
        )

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        # add_special_tokens=False: BOS/EOS are ours to add, not the post-processor's.
        return self._wrap(self.model.encode(text, add_special_tokens=False).ids, bos, eos)

    def decode(self, ids: Sequence[int]) -> str:
        return self.model.decode(list(ids), skip_special_tokens=False)


_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+={0,2} \d+\r?$")


def _sniff(path: Path) -> type[TikTokenizer] | type[SentencePieceTokenizer] | type[HFTokenizer] | None:
    """The tokenizer class for the file's content, or None when it is none of the formats."""
    with open(path, "rb") as f:
        head = f.read(4096)
    stripped = head.lstrip()
    if stripped.startswith(b"{"):
        return HFTokenizer
    first_line = head.split(b"\n", 1)[0]
    if _TIKTOKEN_LINE.match(first_line):
        return TikTokenizer
    # sentencepiece ModelProto: starts with field 1 (pieces), wire type 2 -> tag byte 0x0A.
    if head[:1] == b"\x0a":
        return SentencePieceTokenizer
    return None


def build_tokenizer(path: str | Path = "") -> Tokenizer:
    """Load the tokenizer at `path` (file or folder); "" gives the shipped default. A remote path
    (gs://, az:// through blobfile, or http(s)://) must be a tiktoken ranks file (Llama 3's
    tokenizer.model); download other formats first."""
    if not str(path):
        return TikTokenizer(DEFAULT_TOKENIZER_PATH)
    if _is_remote(path):
        return TikTokenizer(str(path))
    p = Path(path).expanduser()
    if p.is_dir():
        # A Hugging Face snapshot (torchtitan's model.hf_assets_path), or Meta's `original/` folder
        # inside one or on its own; Kimi K2's ships tiktoken ranks beside its tokenizer class.
        if (p / RANKS_FILE).is_file():
            return TikTokenizer(p / RANKS_FILE, read_tiktoken_folder(p))
        for name in ("tokenizer.json", "tokenizer.model", "original/tokenizer.model"):
            if (p / name).is_file():
                return build_tokenizer(p / name)
        raise TitanError(
            f"tokenizer folder {p} has no tokenizer.json, tokenizer.model, original/tokenizer.model or"
            f" tiktoken.model; {_DOWNLOAD_HINT}"
        )
    if not p.is_file():
        raise TitanError(f"tokenizer file {p} not found; {_DOWNLOAD_HINT}")
    cls = _sniff(p)
    if cls is None:
        raise TitanError(f"{p}: unknown tokenizer format; accepted formats: {_FORMATS}")
    return cls(p)
