"""Imports run one way: face (nki_ardiff) -> algorithm (rolling_forcing, sharding) -> ops (nki_kernels)
-> kernels / references. Every import statement of every module is read (function-level ones too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> packages it must never import
FORBIDDEN = {
    "rolling_forcing": {"nki_ardiff", "sharding", "perf"},
    "sharding": {"nki_ardiff", "perf"},
    "nki_kernels": {"nki_ardiff", "rolling_forcing", "sharding", "perf"},
    "reference": {"nki_ardiff", "rolling_forcing", "sharding", "perf", "nki_kernels"},
    "perf": {"nki_ardiff"},
}

# file -> the forbidden packages it may import, and why (each a deliberate, named exception)
EXCEPTIONS = {
    "perf/bench_integrations.py": (
        {"nki_ardiff"},
        "measures nki_ardiff.integrations (the model developers' processor) itself; nothing imports it",
    ),
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_runs_back_up(package: str) -> None:
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        hit = _imports(path) & FORBIDDEN[package]
        hit -= EXCEPTIONS.get(str(path.relative_to(ROOT)), (set(), ""))[0]
        if hit:
            bad.append(f"{path.relative_to(ROOT)} imports {sorted(hit)}")
    assert not bad, "\n".join(bad)


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from nki_ardiff.cli import app\n    return app\n")
    assert "nki_ardiff" in _imports(f)


def test_the_exceptions_stay_leaves() -> None:
    """An excepted file may reach up only because no package module imports it (the edge cannot spread)."""
    for name in EXCEPTIONS:
        mod = name.removesuffix(".py").replace("/", ".")
        users = [
            str(p.relative_to(ROOT))
            for pkg in FORBIDDEN
            for p in sorted((ROOT / pkg).rglob("*.py"))
            if mod in p.read_text() and str(p.relative_to(ROOT)) != name
        ]
        assert (ROOT / name).is_file() and not users, (name, users)
