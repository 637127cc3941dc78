"""The :class:`Mutant` record of tools/mutants.py and tools/mutants_demo.py (one realistic bug each)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    """A file, an *exact* snippet that must occur in it exactly once, its replacement, the tests that should
    notice, the bug's effect in one line; ``equivalent``: why no test can kill it (then it is not run)."""

    name: str
    path: str
    original: str
    replacement: str
    tests: tuple[str, ...]
    effect: str
    equivalent: str = ""
