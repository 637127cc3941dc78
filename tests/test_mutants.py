"""The mutation list stays usable (tools/mutants.py, run by ``make mutate``, not in CI): every snippet
still occurs exactly once in this tree, every named test file exists, and the runner reports a snippet that
does not match as stale instead of applying it. A failure here names the entry to update after code moved.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tools.mutants import MUTANTS, Mutant
from tools.mutate import apply_mutant

ROOT = Path(__file__).resolve().parents[1]


def test_every_mutant_applies_exactly_once_and_names_existing_tests() -> None:
    problems = []
    for m in MUTANTS:
        n = (ROOT / m.path).read_text().count(m.original) if (ROOT / m.path).is_file() else -1
        if n != 1:
            problems.append(f"{m.name}: snippet found {n} times in {m.path}")
        if m.original == m.replacement:
            problems.append(f"{m.name}: replacement equals the original")
        problems += [
            f"{m.name}: no test file {t}" for t in m.tests if not (ROOT / t.split("::")[0]).is_file()
        ]
        if not m.effect:
            problems.append(f"{m.name}: no effect description")
    assert not problems, "update tools/mutants.py:\n" + "\n".join(problems)


def test_list_size_spread_and_unique_names() -> None:
    names = [m.name for m in MUTANTS]
    assert len(set(names)) == len(names)
    live = [m for m in MUTANTS if not m.equivalent]
    assert len(live) >= 40
    packages = Counter(m.path.split("/")[0] for m in live)
    assert set(packages) >= {"nki_kernels", "reference", "rolling_forcing", "sharding", "perf"}
    assert any(m.path.startswith("nki_kernels/emulator/") for m in live)


@pytest.mark.parametrize(
    ("text", "stale"), [("a = 1\nb = 2\n", False), ("b = 2\n", True), ("a = 1\na = 1\n", True)]
)
def test_apply_mutant_rejects_missing_or_ambiguous_snippets(tmp_path: Path, text: str, stale: bool) -> None:
    (tmp_path / "m.py").write_text(text)
    err = apply_mutant(tmp_path, Mutant("x", "m.py", "a = 1", "a = 2", ("t.py",), "a is 2"))
    if stale:
        assert err is not None and "exactly once" in err
        assert (tmp_path / "m.py").read_text() == text  # untouched
    else:
        assert err is None and (tmp_path / "m.py").read_text() == "a = 2\nb = 2\n"
