"""Docs stay true: the config reference is regenerated from the dataclasses, and every option a
guide names exists."""

import re
import subprocess
import sys
from pathlib import Path

from titan.config.dialect_keys import SAME_KEYS
from titan.config.dialect_rules import RULES
from titan.config.manager import section_fields, sections

REPO = Path(__file__).resolve().parents[2]
# `--section.key` or `section.key` inside backticks in the guides and the README.
# Not followed by another dotted part (`model.embed_tokens.weight` is a tensor name).
OPTION_RE = re.compile(r"`(?:--)?([a-z_]+)\.([a-z0-9_]+)(?![.\w])")
FILE_SUFFIXES = {"safetensors", "json", "toml", "pth", "pt", "bin", "model", "md", "py", "sh"}


def test_config_reference_is_current():
    out = subprocess.run(
        [sys.executable, "scripts/generate_config_reference.py", "--check"], cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr


def test_guides_name_only_existing_options():
    secs = sections()
    bad = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for section, key in OPTION_RE.findall(doc.read_text()):
            torchtitan = any(k.startswith(f"{section}.{key}") for k in (*RULES, *SAME_KEYS))  # its spellings load too
            known = section not in secs or key in section_fields(secs[section])
            if not known and key not in FILE_SUFFIXES and not torchtitan:
                bad.append(f"{doc.name}: {section}.{key}")
    assert not bad, bad


def test_readme_links_resolve():
    text = (REPO / "README.md").read_text()
    missing = [link for link in re.findall(r"\]\(((?:docs|examples)/[^)#]+)", text) if not (REPO / link).exists()]
    assert not missing, missing
