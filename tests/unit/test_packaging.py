"""Dependencies: every third-party import is declared in pyproject.toml, and importing torchao
through titan prints nothing, from every entry point. CI lints and type-checks before it tests,
with the tool versions pyproject.toml pins."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[2]
SOURCES = ["titan", "scripts", "examples", "tests", "train.py"]
# Modules imported by name (a string) rather than an import statement.
DYNAMIC = {"torchao"}  # titan.log.import_torchao("torchao.float8"), ("torchao.optim")
# Modules of optional extras that need hardware this machine lacks (not installed here), whose import
# name is not their distribution's: the distribution declared for them.
NOT_INSTALLED = {"fla": "fla-core"}  # [linear_attention]: flash-linear-attention's kernels (CUDA)


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    return {_normalize(re.match(r"[A-Za-z0-9_.\-]+", r).group(0)) for r in requirements}


def _imported_top_level() -> dict[str, str]:
    """Top-level module -> one file importing it (absolute imports outside the repo's own)."""
    local = {"titan", "tests", "scripts", "train"} | {p.stem for p in (REPO / "scripts").glob("*.py")}
    found: dict[str, str] = {m: "titan/log.py" for m in DYNAMIC}
    for source in SOURCES:
        path = REPO / source
        files = [path] if path.is_file() else sorted(path.rglob("*.py"))
        for file in files:
            for node in ast.walk(ast.parse(file.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in local and top != "__future__":
                        found.setdefault(top, str(file.relative_to(REPO)))
    return found


def test_every_import_is_declared():
    declared = _declared()
    distributions = packages_distributions()
    missing = []
    for module, where in sorted(_imported_top_level().items()):
        names = {_normalize(d) for d in distributions.get(module, [])} or {
            _normalize(NOT_INSTALLED.get(module, module))
        }
        if not names & declared:
            missing.append(f"{module} (imported in {where}; distribution {sorted(names)})")
    assert not missing, "imports not declared in pyproject.toml: " + "; ".join(missing)


@pytest.mark.slow
def test_torchao_import_prints_nothing():
    """titan's own torchao imports (float8, bf16 AdamW) without TORCHAO_FORCE_SKIP_LOADING_SO_FILES
    in the environment: no shared-library errors, no skip notice, no deprecation line. (A whole
    training run with float8 is checked in tests/unit/test_log.py.)"""
    env = {k: v for k, v in os.environ.items() if k != "TORCHAO_FORCE_SKIP_LOADING_SO_FILES"}
    code = (
        "import titan.training.optim as o; from titan.log import import_torchao;"
        " import_torchao('torchao.float8').convert_to_float8_training; o._bf16_sr_adamw()"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stderr == "", run.stderr


def _ci_commands() -> list[str]:
    lines = (REPO / ".ci" / "run").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def test_ci_checks_lint_and_types_before_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    test_command = re.search(r"^(python -m pytest .*?tests)\s+# everything, as CI runs it$", readme, re.M)
    assert test_command, "README.md lost its 'everything, as CI runs it' test command"
    commands = _ci_commands()
    assert commands[-1] == test_command.group(1), f".ci/run ends with {commands[-1]!r}, not the README's test command"
    checks = ["ruff check .", "ruff format --check .", "pyright"]
    missing = [c for c in checks if c not in commands]
    assert not missing, f".ci/run does not run {missing}"
    install = next(i for i, c in enumerate(commands) if "pip install" in c)
    assert install < min(commands.index(c) for c in checks), ".ci/run checks before installing the pinned tools"


def test_pre_commit_pins_the_ruff_of_the_dev_extra():
    dev = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    ruff_pin = next(r for r in dev if r.startswith("ruff=="))
    config = (REPO / ".pre-commit-config.yaml").read_text()
    rev = re.search(r"repo: https://github.com/astral-sh/ruff-pre-commit\n\s+rev: v([0-9.]+)", config)
    assert rev and rev.group(1) == ruff_pin.removeprefix("ruff=="), (rev and rev.group(1), ruff_pin)
    assert re.search(r"entry: pyright\n", config), "pre-commit lacks the pyright hook"
