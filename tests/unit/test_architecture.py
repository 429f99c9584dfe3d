"""The layout keeps its floors (docs/architecture.md): read from the imports of every file in titan/.

Units are the top-level packages and modules of titan/. Each floor may import only from the floors
below it; the few upward imports that remain are listed here by file, so a new one fails the test.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "titan"

# Bottom to top; units on one floor do not import each other.
FLOORS = (
    ("errors", "log", "progress", "config"),
    ("data",),
    ("parallel",),
    ("models",),
    ("checkpointing",),
    ("ft",),  # replica groups through torchft
    ("training",),
    ("tools",),
    ("launch",),
    ("train",),  # titan/train.py: `python -m titan.train`, the entry point as a module
)
FLOOR = {unit: i for i, units in enumerate(FLOORS) for unit in units}
# Imports that go up a floor, by file; at most 3 may be allowed, and today none is.
UPWARD_ALLOWED: set[tuple[str, str]] = set()
MAX_LINES = 400


def _unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "titan" and len(parts) > 1 else None


def _imports(path: Path) -> set[str]:
    """Every titan name a file imports, at the top or inside functions (a function-level import only
    postpones a cycle: the two modules still need each other): `from titan.a import b` gives titan.a.b,
    a module or a name in titan.a."""
    package = list(path.relative_to(PKG.parent).parts[:-1])  # the package a relative import starts from
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m == "titan" or m.startswith("titan.")}


def _graph() -> dict[str, set[tuple[str, str]]]:
    """unit -> {(imported unit, importing file relative to titan/)}"""
    edges: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).as_posix()
        src = rel.split("/")[0].removesuffix(".py")
        for module in _imports(path):
            dst = _unit(module)
            if dst and dst != src and dst in FLOOR:
                edges[src].add((dst, rel))
    return edges


def _module(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_graph() -> dict[str, set[str]]:
    """module -> the titan modules it imports"""
    paths = {_module(p): p for p in PKG.rglob("*.py")}

    def resolve(name: str) -> str:  # the module itself, or the module a name is taken from
        while name not in paths:
            name = name.rpartition(".")[0]
        return name

    return {module: {resolve(m) for m in _imports(path)} - {module} for module, path in paths.items()}


def _assert_acyclic(graph: dict[str, set[str]]) -> None:
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(u: str, path: list[str]) -> None:
        state[u] = 1
        for v in sorted(graph.get(u, ())):
            assert state.get(v) != 1, "import cycle: " + " -> ".join(path[path.index(v) :] + [v])
            if v not in state:
                visit(v, path + [v])
        state[u] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_every_unit_has_a_floor():
    units = {p.name.removesuffix(".py") for p in PKG.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert units - {"__init__"} <= set(FLOOR), f"place these in FLOORS: {sorted(units - {'__init__'} - set(FLOOR))}"


def test_no_import_cycles():
    _assert_acyclic({u: {d for d, _ in e} for u, e in _graph().items()})


def test_no_import_cycles_between_modules():
    _assert_acyclic(_module_graph())


def test_imports_go_down_the_floors():
    upward = sorted(
        (rel, dst)
        for src, e in _graph().items()
        for dst, rel in e
        if FLOOR[dst] > FLOOR[src] and (rel, dst) not in UPWARD_ALLOWED
    )
    assert not upward, f"imports from a lower floor to a higher one: {upward}"
    assert len(UPWARD_ALLOWED) <= 3


def test_config_imports_only_errors():
    config = {dst for dst, _ in _graph().get("config", ())}
    assert config <= {"errors"}, f"titan/config imports {sorted(config)}"


def test_parallel_names_no_model():
    offenders = [
        p.relative_to(PKG).as_posix()
        for p in (PKG / "parallel").rglob("*.py")
        if "titan.models" in p.read_text() or "llama" in p.read_text().lower()
    ]
    assert not offenders, f"parallel/ holds mechanisms only; these name a model: {offenders}"


def test_model_files_import_no_torch_distributed():
    offenders = [
        p.relative_to(PKG).as_posix()
        for p in (PKG / "models").rglob("model.py")
        if "torch.distributed" in p.read_text()
    ]
    assert not offenders, offenders


def test_files_stay_small():
    lines = {p.relative_to(PKG).as_posix(): len(p.read_text().splitlines()) for p in PKG.rglob("*.py")}
    big = {name: n for name, n in lines.items() if n > MAX_LINES}
    assert not big, f"split these files (over {MAX_LINES} lines): {big}"
