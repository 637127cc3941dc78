"""Mutation check: apply each curated mutant (tools/mutants.py) to a scratch copy of the tree, run the
tests it names, and report killed / survived / stale. Not part of CI; run with ``make mutate``.

The working tree is never modified: the committed tree (``git archive <rev>``, default HEAD) is extracted
once into a temporary directory, each mutant gets its own copy of it, and pytest runs there with
``PYTHONPATH`` pointing at the copy. Results:

* ``killed``  the mutant's tests failed (or errored, or exceeded the timeout) while they pass unmutated;
* ``survived`` the tests passed with the bug in place;
* ``stale``   the snippet was not found exactly once: an error in the list (never counted as killed);
* ``equivalent`` mutants are listed with their reason and not run.

A baseline run of every named test file on the unmutated copy must pass first (else the check aborts).
Kill rate = killed / (killed + survived). Exit status 0 only if the rate meets ``--target`` (default 0.95)
and nothing is stale.

Usage: ``python -m tools.mutate [--jobs 2] [--only NAME ...] [--rev HEAD] [--markdown FILE]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tools.mutants import MUTANTS, Mutant

MAX_JOBS = 2
"""At most two workers: the suite already shares two cores."""


@dataclass(frozen=True)
class Result:
    mutant: Mutant
    status: str  # killed | survived | stale | equivalent
    seconds: float
    detail: str = ""


def _repo_root() -> Path:
    out = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def _extract(rev: str, root: Path, dst: Path) -> None:
    """The tree of ``rev`` (not the working tree) into ``dst``."""
    dst.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(root), "archive", rev], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dst)], input=archive.stdout, check=True)


def _pytest(tree: Path, tests: tuple[str, ...], timeout_s: float) -> tuple[int, str]:
    env = dict(
        os.environ,
        PYTHONPATH=str(tree),
        OMP_NUM_THREADS="1",
        PYTHONDONTWRITEBYTECODE="1",
        HYPOTHESIS_PROFILE="mutate",  # tests/conftest.py: CI examples, no shrinking of a failure
    )
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    try:
        p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return -1, f"timeout after {timeout_s:.0f} s"
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    failed = [ln for ln in lines if ln.startswith(("FAILED ", "ERROR "))]
    if failed:  # the first failing test's node id (without the message)
        return p.returncode, failed[0].split(" ", 1)[1].split(" - ")[0].removeprefix("tests/")
    return p.returncode, (lines[-1] if lines else "")[:160]


def apply_mutant(tree: Path, m: Mutant) -> str | None:
    """Apply ``m`` inside ``tree``; return an error message if its snippet does not occur exactly once."""
    path = tree / m.path
    if not path.is_file():
        return f"file {m.path} not found"
    text = path.read_text()
    n = text.count(m.original)
    if n != 1:
        return f"snippet found {n} times in {m.path} (must be exactly once)"
    path.write_text(text.replace(m.original, m.replacement))
    return None


def run_mutant(base: Path, work: Path, m: Mutant, timeout_s: float) -> Result:
    if m.equivalent:
        return Result(m, "equivalent", 0.0, m.equivalent)
    t0 = time.perf_counter()
    tree = work / m.name
    shutil.copytree(base, tree)
    try:
        err = apply_mutant(tree, m)
        if err:
            return Result(m, "stale", 0.0, err)
        code, detail = _pytest(tree, m.tests, timeout_s)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    secs = time.perf_counter() - t0
    if code == 0:
        return Result(m, "survived", secs, detail)
    if code == 5:  # no tests collected: the entry is wrong, not the code
        return Result(m, "stale", secs, "no tests collected: " + detail)
    return Result(m, "killed", secs, detail)


def table(results: list[Result]) -> str:
    """Markdown: mutant, file, result, the first failing test (killed) or the reason, the bug's effect."""
    rows = ["| mutant | file | result | caught by / note | bug's effect |", "|---|---|---|---|---|"]
    for r in results:
        note = f"`{r.detail}`" if r.status == "killed" else r.detail
        rows.append(f"| {r.mutant.name} | {r.mutant.path} | {r.status} | {note} | {r.mutant.effect} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=MAX_JOBS, help=f"parallel workers (1..{MAX_JOBS})")
    ap.add_argument("--only", nargs="*", default=None, help="run only these mutant names")
    ap.add_argument("--rev", default="HEAD", help="git revision to mutate (default HEAD)")
    ap.add_argument(
        "--timeout", type=float, default=900.0, help="seconds per mutant before it counts as killed"
    )
    ap.add_argument("--target", type=float, default=0.95, help="required kill rate")
    ap.add_argument("--markdown", type=Path, default=None, help="also write the result table here")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated baseline run")
    args = ap.parse_args(argv)
    if not 1 <= args.jobs <= MAX_JOBS:
        ap.error(f"--jobs must be in [1, {MAX_JOBS}], got {args.jobs}")
    mutants = list(MUTANTS)
    if args.only:
        unknown = set(args.only) - {m.name for m in MUTANTS}
        if unknown:
            ap.error(f"unknown mutant names: {sorted(unknown)}")
        mutants = [m for m in MUTANTS if m.name in args.only]
    names = [m.name for m in MUTANTS]
    if len(set(names)) != len(names):
        raise SystemExit("tools/mutants.py: duplicate mutant names")

    root = _repo_root()
    with tempfile.TemporaryDirectory(prefix="mutate-") as tmp:
        work = Path(tmp)
        base = work / "_base"
        _extract(args.rev, root, base)
        if not args.no_baseline:
            files = tuple(sorted({t for m in mutants if not m.equivalent for t in m.tests}))
            t0 = time.perf_counter()
            code, detail = _pytest(base, files, args.timeout * 4)
            print(f"baseline ({len(files)} test files, unmutated {args.rev}): exit {code} in "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip
            if code != 0:
                print(f"baseline fails, mutation results would be meaningless: {detail}")
                return 2
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = [pool.submit(run_mutant, base, work, m, args.timeout) for m in mutants]
            results = []
            for f in futures:
                r = f.result()
                results.append(r)
                m = r.mutant
                print(f"{r.status:10s} {r.seconds:5.0f} s  {m.name:24s} {m.path}  {r.detail}", flush=True)
    killed = sum(r.status == "killed" for r in results)
    survived = [r for r in results if r.status == "survived"]
    stale = [r for r in results if r.status == "stale"]
    equivalent = [r for r in results if r.status == "equivalent"]
    scored = killed + len(survived)
    rate = killed / scored if scored else 0.0
    text = table(results)
    print("\n" + text + "\n")
    print(f"kill rate {killed}/{scored} = {100 * rate:.1f} % (target {100 * args.target:.0f} %); "
          f"{len(equivalent)} equivalent (not run), {len(stale)} stale")  # fmt: skip
    for r in survived:
        print(f"SURVIVED {r.mutant.name} ({r.mutant.path}): {r.mutant.effect}")
    for r in stale:
        print(f"STALE    {r.mutant.name} ({r.mutant.path}): {r.detail}")
    if args.markdown:
        args.markdown.write_text(text + f"\n\nkill rate {killed}/{scored} = {100 * rate:.1f} %\n")
    return 0 if rate >= args.target and not stale else 1


if __name__ == "__main__":
    sys.exit(main())
