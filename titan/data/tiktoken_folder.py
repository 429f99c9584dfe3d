"""A Hugging Face folder whose tokenizer is a tiktoken ranks file beside a Python tokenizer class,
as Kimi K2 ships it: ``tiktoken.model`` (the BPE ranks), ``tokenization_kimi.py`` (its class states
the pre-tokenizer split as ``pat_str`` and the number of reserved special ids) and
``tokenizer_config.json`` (``auto_map`` naming that class, the special tokens by id in
``added_tokens_decoder``, ``bos_token`` / ``eos_token``).

The class file is read, never run: its ``pat_str`` (a string, or ``"|".join([...])`` of strings)
and ``num_reserved_special_tokens`` are taken from the syntax tree. The special tokens take the ids
right after the ranks, named as added_tokens_decoder names them and ``<|reserved_token_{id}|>``
otherwise, as Kimi's class does. titan.data.tokenizer.TikTokenizer encodes and decodes with them.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path

from titan.errors import TitanError

RANKS_FILE = "tiktoken.model"
_RESERVED = 256  # Kimi's num_reserved_special_tokens when the class file does not say


def _class_attrs(source: Path, cls: str) -> dict[str, object]:
    """Literal class attributes of ``cls`` in ``source``: strings, ints, and "sep".join of strings."""
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"))
    except (OSError, SyntaxError) as e:
        raise TitanError(f"{source}: cannot read the tokenizer class ({e})") from None
    node = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls), None)
    if node is None:
        raise TitanError(f"{source} defines no class {cls} (tokenizer_config.json's auto_map names it)")
    attrs: dict[str, object] = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
            continue
        value = stmt.value
        try:
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "join":
                sep = ast.literal_eval(value.func.value)  # type: ignore[arg-type]
                attrs[stmt.targets[0].id] = sep.join(ast.literal_eval(value.args[0]))
            else:
                attrs[stmt.targets[0].id] = ast.literal_eval(value)
        except (ValueError, TypeError, IndexError, AttributeError):
            continue  # not a literal: not one of the attributes read here
    return attrs


@dataclass(frozen=True)
class TikTokenFolder:
    """What the folder says beside its ranks file: the split pattern and the special tokens."""

    ranks: Path
    pattern: str
    reserved: int
    named: dict[int, str]
    bos: str
    eos: str

    def special_tokens(self, n_ranks: int) -> dict[str, int]:
        """Special token -> id, the ids right after the ``n_ranks`` ranks (and any named past them)."""
        ids = sorted(set(range(n_ranks, n_ranks + self.reserved)) | {i for i in self.named if i >= n_ranks})
        return {self.named.get(i, f"<|reserved_token_{i}|>"): i for i in ids}


def _token(config: dict, kind: str) -> str:
    token = config.get(kind)
    token = token.get("content") if isinstance(token, dict) else token
    if not isinstance(token, str):
        raise TitanError(f"tokenizer_config.json: no {kind}")
    return token


def read_tiktoken_folder(folder: str | Path) -> TikTokenFolder:
    """The tokenizer of a folder laid out like Kimi K2's (see the module docstring)."""
    folder = Path(folder)
    config_file = folder / "tokenizer_config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise TitanError(f"{config_file}: needed beside {RANKS_FILE} ({e})") from None
    entry = ((config.get("auto_map") or {}).get("AutoTokenizer") or [None])[0]
    if not isinstance(entry, str) or "." not in entry:
        raise TitanError(f"{config_file}: auto_map.AutoTokenizer must name the tokenizer class file (module.Class)")
    module, cls = entry.rsplit(".", 1)
    attrs = _class_attrs(folder / f"{module}.py", cls)
    pattern = attrs.get("pat_str")
    if not isinstance(pattern, str):
        raise TitanError(f"{folder / f'{module}.py'}: class {cls} states no literal pat_str (the split pattern)")
    reserved = attrs.get("num_reserved_special_tokens", _RESERVED)
    named = {int(i): t["content"] for i, t in (config.get("added_tokens_decoder") or {}).items()}
    bos, eos = _token(config, "bos_token"), _token(config, "eos_token")
    return TikTokenFolder(folder / RANKS_FILE, pattern, int(reserved), named, bos, eos)  # type: ignore[arg-type]


__all__ = ["RANKS_FILE", "TikTokenFolder", "read_tiktoken_folder"]
