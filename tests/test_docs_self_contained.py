"""The repository's docs, code and tests stand alone: no path into material outside the repository
(``shared/...``) and no reference to the project's issue tracker by number ("issue 4", "issue #2")."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUTSIDE = re.compile(r"(?<![\w/])(\.\./)?shared/(docs|nki)\b")
ISSUE_NUMBER = re.compile(r"\bissue (#\d+|\d+\b(?!\s*ns))", re.IGNORECASE)  # "issue 486 ns": a DMA cost


def _tracked_texts() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [
        ROOT / f for f in out.split() if f.endswith((".py", ".md", ".toml")) or f in ("Makefile", ".ci/run")
    ]


def _hits(pattern: re.Pattern[str]) -> list[str]:
    me = Path(__file__).resolve()
    hits = []
    for p in _tracked_texts():
        if p.resolve() == me or not p.exists():
            continue
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    return hits


def test_no_path_into_material_outside_the_repository() -> None:
    assert _hits(OUTSIDE) == []


def test_no_issue_numbers() -> None:
    assert _hits(ISSUE_NUMBER) == []


def test_patterns_catch_what_they_are_for() -> None:
    assert OUTSIDE.search("see ``shared/docs/rolling_forcing.md`` §3") and OUTSIDE.search("`../shared/nki/x`")
    assert not OUTSIDE.search("perf/shared/docs_x") and not OUTSIDE.search("nl.shared_hbm")
    assert (
        ISSUE_NUMBER.search("(issue 17)")
        and ISSUE_NUMBER.search("issue #2")
        and ISSUE_NUMBER.search("Issue 4's")
    )
    assert not ISSUE_NUMBER.search("issue 486 ns (hwdge)") and not ISSUE_NUMBER.search("it issues 8 DMAs")
