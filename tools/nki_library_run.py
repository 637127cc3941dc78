"""Run aws-neuron/nki-library's own kernel tests, unchanged, on this project's NKI emulator; print a table.

Usage (the checkout stays outside this repository)::

    python -m tools.nki_library_run /path/to/nki-library [test files or dirs ...] [--timeout S] [-k EXPR]
        [--json out.jsonl]

Without paths it runs every file under ``test/integration/nkilib/core``.  Each test file runs in its own
subprocess (``pytest --test-mode simulation`` in the checkout, with :mod:`tools.nki_library_shims` installed:
the suite's own simulation path, its inputs, torch references and tolerances).  The suite's own simulation
rule skips cases whose names hold a large shape (``NKILIB_SIMULATION_RUN_ALL=1`` runs them).

Per family (test file) the table gives: ``cases`` collected, ``skipped`` by the suite, ``run``,
``unchanged`` (the kernel went through the emulator: no emulator refusal and no missing API),
``matched`` (pytest passed: outputs within the suite's tolerance of its torch reference, or a negative test
that failed as it expects), and the reasons of the rest: ``refused`` (an emulator hardware-rule error, by
rule tag), ``mismatch`` (outputs differ), ``error`` (anything else: missing API, harness).

Needs ``allpairspy`` (the suite's pairwise case generator: ``pip install allpairspy``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
_TAG = re.compile(r"\[([a-z0-9-]+)\]")


# in-process side: a pytest plugin recording each case's outcome -------------------------------------------
class _Recorder:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.rows: list[dict[str, Any]] = []

    def pytest_addhooks(self, pluginmanager: Any) -> None:
        class _XdistSpecs:  # the suite's conftest implements an xdist hook; accept it without xdist
            def pytest_configure_node(self, node: Any) -> None: ...

        if not pluginmanager.has_plugin("xdist"):
            pluginmanager.add_hookspecs(_XdistSpecs)

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.when == "call" or (report.when == "setup" and not report.passed):
            row: dict[str, Any] = {"id": report.nodeid, "outcome": report.outcome}
            if report.failed:
                row.update(_classify(report))
            elif report.skipped:
                row["reason"] = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""
            self._add(row)

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:  # a test file that does not import counts as one errored case
            msg = str(report.longrepr).strip().splitlines()
            self._add({"id": report.nodeid, "outcome": "failed", "kind": "error",
                       "message": "collection: " + (msg[-1] if msg else "")[:380]})  # fmt: skip

    def _add(self, row: dict[str, Any]) -> None:
        """Append at once, so the finished cases of a file that times out are kept."""
        self.rows.append(row)
        with self.out.open("a") as f:
            f.write(json.dumps(row) + "\n")


def _classify(report: Any) -> dict[str, Any]:
    """A failed case's kind: ``refused`` (an emulator rule error, with its tag), ``mismatch`` (numerics) or
    ``error``."""
    text = str(report.longrepr)
    exc = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    msg = exc.message if exc is not None else text[-400:]
    emu = re.search(r"nki_kernels\.emulator\.errors\.(\w+)|(\w+Error): \[([a-z0-9-]+)\]", text)
    if "nki_kernels.emulator.errors." in msg or (emu and _TAG.search(msg)):
        tag = _TAG.search(msg)
        return {"kind": "refused", "tag": tag.group(1) if tag else "?", "message": msg[:400]}
    if "Regex pattern did not match" in msg:  # a negative case whose expected error did not come
        return {"kind": "error", "message": msg[:400]}
    if re.search(
        r"mismatch|not close|allclose|Mismatched elements|exceeds tolerance|Validation failed", text, re.I
    ):
        return {"kind": "mismatch", "message": msg[:400]}
    return {"kind": "error", "message": msg[:400]}


def _run_in_process(checkout: Path, out: Path, pytest_args: list[str]) -> int:
    sys.path.insert(0, str(_REPO))
    from tools import nki_library_shims

    nki_library_shims.install()
    sys.path[:0] = [str(checkout), str(checkout / "src")]
    os.chdir(checkout)
    import pytest

    # The suite's simulation path never compiles, yet Orchestrator.execute reads ``self._compiled_kernel``
    # after inference (set only by compilation): give the class that attribute's "no compiled kernel" value.
    from test.utils import test_orchestrator

    if not hasattr(test_orchestrator.Orchestrator, "_compiled_kernel"):
        test_orchestrator.Orchestrator._compiled_kernel = None

    args = [*pytest_args, "--test-mode", "simulation", "-p", "no:cacheprovider", "-q", "--no-header",
            "--output-directory", str(out.parent / "artifacts"), "-o", "log_level=WARNING"]  # fmt: skip
    return int(pytest.main(args, plugins=[_Recorder(out)]))


# driver side -------------------------------------------------------------------------------------------
def _family(nodeid: str) -> str:
    path = nodeid.split("::")[0]
    path = path.split("integration/nkilib/", 1)[-1]
    return path.removesuffix(".py").replace("/test_", "/")


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-family counts from the recorded rows (see the module docstring for the columns)."""
    fam: dict[str, Counter] = defaultdict(Counter)
    tags: dict[str, Counter] = defaultdict(Counter)
    for r in rows:
        c = fam[_family(r["id"])]
        c["cases"] += 1
        if r["outcome"] == "skipped":
            c["skipped"] += 1
            continue
        c["run"] += 1
        if r["outcome"] == "passed":
            c["unchanged"] += 1
            c["matched"] += 1
        elif r.get("kind") == "mismatch":
            c["unchanged"] += 1
            c["mismatch"] += 1
        else:
            c[r.get("kind", "error")] += 1
            if r.get("kind") == "refused":
                tags[_family(r["id"])][r.get("tag", "?")] += 1
    table = []
    for f in sorted(fam):
        c = fam[f]
        table.append({"family": f, **{k: c[k] for k in ("cases", "skipped", "run", "unchanged", "matched",
                                                         "mismatch", "refused", "error")},
                      "refused_by": dict(tags[f])})  # fmt: skip
    return table


def format_table(table: list[dict[str, Any]]) -> str:
    """Markdown table of :func:`summarize`'s rows plus a total row."""
    cols = ("cases", "skipped", "run", "unchanged", "matched", "mismatch", "refused", "error")
    lines = ["| family | " + " | ".join(cols) + " | refused by rule |", "|---" * (len(cols) + 2) + "|"]
    tot: Counter = Counter()
    for r in table:
        tot.update({k: r[k] for k in cols})
        why = ", ".join(f"`{t}` {n}" for t, n in sorted(r["refused_by"].items()))
        lines.append(f"| {r['family']} | " + " | ".join(str(r[k]) for k in cols) + f" | {why} |")
    lines.append("| **total** | " + " | ".join(str(tot[k]) for k in cols) + " | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkout", type=Path, help="path of a checkout of github.com/aws-neuron/nki-library")
    ap.add_argument("paths", nargs="*", help="test files/dirs inside the checkout (default: test/integration/"
                    "nkilib/core, one subprocess per file)")  # fmt: skip
    ap.add_argument("-k", default=None, help="pytest -k expression")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per test file (default 1800)")
    ap.add_argument("--json", type=Path, default=None, help="also write every case's row here (jsonl)")
    ap.add_argument("--_inproc", type=Path, default=None, help=argparse.SUPPRESS)
    a, extra = ap.parse_known_args(argv)
    checkout = a.checkout.resolve()
    if not (checkout / "test" / "conftest.py").is_file() or not (checkout / "src" / "nkilib_src").is_dir():
        ap.error(
            f"checkout: {checkout} is not an nki-library checkout (needs test/conftest.py and src/nkilib_src)"
        )
    if a._inproc is not None:
        return _run_in_process(checkout, a._inproc, a.paths + (["-k", a.k] if a.k else []) + extra)
    paths = a.paths or ["test/integration/nkilib/core"]
    files: list[str] = []
    for p in paths:
        q = checkout / p
        if q.is_dir():
            files += sorted(str(f.relative_to(checkout)) for f in q.rglob("test_*.py"))
        elif q.is_file():
            files.append(p)
        else:
            ap.error(f"paths: {p} is not a file or directory of the checkout")
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, f in enumerate(files):
            out = Path(tmp) / f"rows{i}.jsonl"
            cmd = [sys.executable, "-m", "tools.nki_library_run", str(checkout), f, "--_inproc", str(out)]
            cmd += (["-k", a.k] if a.k else []) + extra
            try:
                subprocess.run(cmd, cwd=_REPO, timeout=a.timeout, capture_output=True, check=False)
            except subprocess.TimeoutExpired:
                print(
                    f"{f}: timed out after {a.timeout:.0f} s (its finished cases are kept)", file=sys.stderr
                )
            if out.is_file():
                rows += [json.loads(line) for line in out.read_text().splitlines()]
            else:
                print(f"{f}: no case recorded (collection failed?)", file=sys.stderr)
    if a.json is not None:
        a.json.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(format_table(summarize(rows)))
    for n in notes:
        print(f"* {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
