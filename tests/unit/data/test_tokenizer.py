from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path

import pytest

from titan.data.tokenizer import (
    DEFAULT_TOKENIZER_PATH,
    HFTokenizer,
    SentencePieceTokenizer,
    TikTokenizer,
    Tokenizer,
    _split_long,
    build_tokenizer,
    llama3_special_tokens,
)
from titan.errors import TitanError

REPO_ROOT = Path(__file__).resolve().parents[3]

# Whitespace runs, CRLF, tabs, non-Latin scripts, emoji, combining marks,
# special-token text.
TRICKY = (
    "Hello world,\nthe king  \t said: 'Don't!'\r\n\n\n    indented\tcode()  \n"
    "ünïcødé café 日本語のテキスト 🎉👩‍👩‍👧 e\u0301 1234567 <|end_of_text|> <s>  "
)


def _roundtrip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids[1:-1]) == text


# --- shipped default ------------------------------------------------------------------------


def test_shipped_tokenizer() -> None:
    tok = build_tokenizer("")
    assert isinstance(tok, TikTokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (2048, 1792, 1793, -1)
    assert tok.vocab_size <= 2048  # the debug model's embedding size
    assert DEFAULT_TOKENIZER_PATH.stat().st_size < 300_000
    for text in (TRICKY, "", " ", "\n", "a" * 1000):
        _roundtrip(tok, text)
    assert tok.encode("", bos=False, eos=False) == []
    # Special-token text inside a document is ordinary text, never a control token.
    assert tok.eos_id not in tok.encode("<|end_of_text|>", bos=False, eos=False)
    # It learned the corpus: Python docs compress well.
    doc = "The for statement is used to iterate over the elements of a sequence."
    assert len(tok.encode(doc, bos=False, eos=False)) < len(doc) / 2.5


@pytest.mark.skipif(
    sys.version_info[:2] != (3, 11),
    reason="the shipped asset was built from Python 3.11's pydoc_data.topics",
)
def test_build_script_reproduces_shipped_asset(tmp_path: Path) -> None:
    out = tmp_path / "tokenizer.model"
    subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "build_tokenizer.py"), "--output", str(out)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    assert out.read_bytes() == DEFAULT_TOKENIZER_PATH.read_bytes()


# --- tiktoken (Llama 3) -----------------------------------------------------------------------


def test_tiktoken_matches_tiktoken_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shipped ranks file (Meta's Llama 3 tokenizer.model format) through titan and through
    tiktoken directly with Llama 3's pattern and special tokens: the same ids."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    path = DEFAULT_TOKENIZER_PATH
    tok = build_tokenizer(str(path))
    assert isinstance(tok, TikTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1792, 1793, 1792 + 256)
    assert tok.special_tokens["<|eot_id|>"] == 1792 + 9
    _roundtrip(tok, TRICKY)

    # Reference ids straight from tiktoken (no titan code): same ranks, Llama 3's pattern.
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # tiktoken caches by path otherwise
    ref = tiktoken.Encoding(
        name="ref",
        pat_str=r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        mergeable_ranks=load_tiktoken_bpe(str(path)),
        special_tokens={t: 1792 + i for i, t in enumerate(llama3_special_tokens())},
    )
    for text in ("Hello world,\nthe king", "To be, or not to be: that is the question.", TRICKY):
        expected = ref.encode(text, disallowed_special=())
        assert tok.encode(text, bos=False, eos=False) == expected
        assert tok.encode(text, bos=True, eos=True) == [1792, *expected, 1793]


def test_tiktoken_long_input_is_chunked() -> None:
    # tiktoken's regex can take very long on huge inputs or runs without whitespace: what reaches
    # it must be small pieces (checked on the calls themselves, not on the machine's speed)
    tok = build_tokenizer("")
    pieces: list[str] = []

    class Recording:
        def __init__(self, model):
            self.model = model

        def encode(self, text, **kw):
            pieces.append(text)
            return self.model.encode(text, **kw)

        def decode(self, ids):
            return self.model.decode(ids)

    tok.model = Recording(tok.model)
    text = "x" * 600_000 + " word" * 50_000 + "\n" * 60_000 + "é" * 100_000
    assert len(text) > 1_000_000
    ids = tok.encode(text, bos=False, eos=False)
    assert tok.decode(ids) == text and "".join(pieces) == text and len(pieces) > 1
    assert max(len(p) for p in pieces) <= 400_000
    assert max(len(p) for p in pieces if not p.strip() or " " not in p) <= 25_000


def test_tiktoken_loader_local_is_uncached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # tiktoken's loader caches by path string: a local file must be read fresh (offline, no copy)
    cache = tmp_path / "cache"
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    path = tmp_path / "tokenizer.model"
    path.write_bytes(DEFAULT_TOKENIZER_PATH.read_bytes())
    assert build_tokenizer(str(path)).vocab_size == 2048
    a, b = (base64.b64encode(t).decode() for t in (b"a", b"b"))
    path.write_text(f"{a} 0\n{b} 1\n")  # rewritten in place
    assert build_tokenizer(str(path)).vocab_size == 2 + 256
    assert not cache.exists()
    assert os.environ["TIKTOKEN_CACHE_DIR"] == str(cache)  # restored


def test_tiktoken_remote_path_goes_through_blobfile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import blobfile

    read = []
    monkeypatch.setattr(blobfile, "read_bytes", lambda p: read.append(p) or DEFAULT_TOKENIZER_PATH.read_bytes())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "cache"))
    tok = build_tokenizer("gs://bucket/llama3/tokenizer.model")
    assert read == ["gs://bucket/llama3/tokenizer.model"]
    assert isinstance(tok, TikTokenizer) and tok.vocab_size == 2048
    assert tok.encode("hello", bos=False, eos=False) == build_tokenizer("").encode("hello", bos=False, eos=False)
    build_tokenizer("gs://bucket/llama3/tokenizer.model")
    assert len(read) == 1  # remote reads use tiktoken's cache


def test_split_long_keeps_text_and_limits() -> None:
    text = "ab " * 200_000 + "y" * 70_000 + " \t" * 30_000 + "z"
    pieces = list(_split_long(text))
    assert "".join(pieces) == text
    assert all(len(p) <= 400_000 for p in pieces)
    for p in pieces:  # no whitespace / non-whitespace run over the limit
        run = 1
        for a, b in zip(p, p[1:]):
            run = run + 1 if a.isspace() == b.isspace() else 1
            assert run <= 25_000
    assert list(_split_long("short")) == ["short"]


# --- Hugging Face tokenizer.json ----------------------------------------------------------------


def test_hf_file_or_folder_with_config(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as HFTok

    path = _train_hf(tmp_path, with_config=True)
    ref = HFTok.from_file(str(path))
    for arg in (path, path.parent):  # the folder works too
        tok = build_tokenizer(str(arg))
        assert isinstance(tok, HFTokenizer)
        # bos/eos/pad from tokenizer_config.json next to it
        assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (ref.get_vocab_size(), 1, 0, 2)
    text = "Hello world,\nthe king"
    expected = ref.encode(text, add_special_tokens=False).ids
    assert tok.encode(text, bos=True, eos=True) == [1, *expected, 0]
    assert tok.decode(expected) == text


def _train_hf(tmp_path: Path, with_config: bool) -> Path:
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HFTok(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>", "<pad>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    hf.train_from_iterator([TRICKY, "the quick brown fox jumps over the lazy dog\n"] * 20, trainer)
    path = tmp_path / "tokenizer.json"
    hf.save(str(path))
    if with_config:
        (tmp_path / "tokenizer_config.json").write_text(
            '{"bos_token": {"content": "</s>"}, "eos_token": "<s>", "pad_token": "<pad>"}'
        )
    return path


def test_hf_trained_roundtrip(tmp_path: Path) -> None:
    tok = build_tokenizer(str(_train_hf(tmp_path, with_config=False)))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, -1)  # <s>, </s> fallbacks
    for text in (TRICKY, "  two spaces\n\nand newlines\t"):
        _roundtrip(tok, text)


def test_hf_config_overrides_specials(tmp_path: Path) -> None:
    tok = build_tokenizer(str(_train_hf(tmp_path, with_config=True)))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 0, 2)


# --- sentencepiece (Llama 2) --------------------------------------------------------------------


def test_sentencepiece_trained(tmp_path: Path) -> None:
    from pydoc_data.topics import topics

    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(topics[k] for k in sorted(topics)[:10]), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=400, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        minloglevel=2,
    )  # fmt: skip
    # Named tokenizer.model like a tiktoken file: the format must come from the content.
    path = tmp_path / "tokenizer.model"
    (tmp_path / "sp.model").rename(path)
    tok = build_tokenizer(str(path))
    assert isinstance(tok, SentencePieceTokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (400, 1, 2, -1)
    _roundtrip(tok, TRICKY)


# --- errors -------------------------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TitanError, match="download_tokenizer.py") as e:
        build_tokenizer(str(tmp_path / "nope" / "tokenizer.model"))
    assert "nope" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(TitanError, match="download_tokenizer.py"):
        build_tokenizer(str(tmp_path))  # a folder with no tokenizer in it


@pytest.mark.parametrize(
    "content",
    [bytes(range(256)) * 4, b"\x0a\xff\x00garbage protobuf", b"just some text\n", b""],
    ids=["binary", "bad-protobuf", "text", "empty"],
)
def test_garbage_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "tokenizer.model"
    path.write_bytes(content)
    with pytest.raises(TitanError) as e:
        build_tokenizer(str(path))
    msg = str(e.value)
    assert str(path) in msg and "\n" not in msg
    for fmt in ("tiktoken", "sentencepiece", "tokenizer.json"):
        assert fmt in msg


def test_bad_tiktoken_and_json(tmp_path: Path) -> None:
    bad_ranks = tmp_path / "ranks.model"
    a, b = (base64.b64encode(t).decode() for t in (b"a", b"b"))
    bad_ranks.write_text(f"{a} 0\n{b} 5\n")  # ranks must be 0..n-1
    with pytest.raises(TitanError, match="ranks"):
        build_tokenizer(str(bad_ranks))
    bad_json = tmp_path / "tokenizer.json"
    bad_json.write_text('{"not": "a tokenizer"}')
    with pytest.raises(TitanError, match="tokenizer.json"):
        build_tokenizer(str(bad_json))


# --- download script ----------------------------------------------------------------------------


def test_download_offline_fails_cleanly(tmp_path: Path) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    env.pop("HF_TOKEN", None)
    result = subprocess.run(
        [
            sys.executable, str(REPO_ROOT / "scripts" / "download_tokenizer.py"),
            "--repo_id", "meta-llama/Meta-Llama-3.1-8B", "--tokenizer_path", "original",
            "--hf_token", "hf_fake", "--local_dir", str(tmp_path / "out"),
        ],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    errors = result.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("error:") and "offline" in errors[0].lower()
