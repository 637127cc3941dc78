"""The one shared benchmark runner: a row schema, JSONL output and an aligned table.

Every benchmark script in ``perf/`` builds :class:`BenchRow` objects (usually through :func:`run_case`),
appends them with :func:`append_rows` to ``perf/results/<name>.jsonl`` and prints them with
:func:`print_table`.  Each row says whether its figures are ``measured`` (CPU wall clock, counts) or
``modelled`` (the trn2 cost model); a failed case is a row with ``status="error"`` and a message, never a
silent skip.

Row schema (JSON object per line)::

    op, variant, config (dict), kind ("measured" | "modelled"), status ("ok" | "error"), message,
    latency_us, bytes, hbm_bytes, hbm_bytes_min, descriptors, tensore_util, fps, memory_bytes,
    extra (dict), git_sha, command, timestamp
"""

from __future__ import annotations

import json
import math
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import IO, Any, Literal, Protocol

__all__ = [
    "KINDS",
    "STATUSES",
    "FIGURES",
    "BenchRow",
    "ProfileLike",
    "git_sha",
    "current_command",
    "portable_command",
    "results_path",
    "append_rows",
    "read_rows",
    "format_table",
    "print_table",
    "figures_from_profile",
    "run_case",
    "time_call",
]

Kind = Literal["measured", "modelled"]
"""Where a row's figures come from: CPU wall clock / counts, or the trn2 cost model."""
Status = Literal["ok", "error"]
KINDS: tuple[Kind, ...] = ("measured", "modelled")
STATUSES: tuple[Status, ...] = ("ok", "error")
#: Optional figure fields of a row, in table order.
FIGURES = (
    "latency_us",
    "bytes",
    "hbm_bytes",
    "hbm_bytes_min",
    "descriptors",
    "tensore_util",
    "fps",
    "memory_bytes",
)
RESULTS_DIR = Path(__file__).resolve().parent / "results"


@lru_cache(maxsize=8)
def _git_sha(cwd: str) -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    sha = out.stdout.strip()
    return sha or "unknown"


def git_sha(cwd: str | Path | None = None) -> str:
    """Short sha of ``HEAD`` of the repository containing ``cwd`` (default: this package), or
    ``"unknown"`` when git is missing or ``cwd`` is not in a repository."""
    return _git_sha(str(cwd if cwd is not None else Path(__file__).resolve().parent))


def portable_command(argv: Sequence[str], cwd: Path, with_interpreter: bool) -> str:
    """``argv`` as a command line that names no machine path: the interpreter (``argv[0]`` when
    ``with_interpreter``) is written ``python``, and an absolute argument under ``cwd`` (a script or file
    given by full path) is written relative to it. E.g. ``["/opt/venv/bin/python", "-m", "perf.bench_kernels",
    "--no-save"]`` -> ``python -m perf.bench_kernels --no-save``."""
    args = [str(a) for a in argv]
    out = ["python"] + (args[1:] if with_interpreter else args)
    for i, a in enumerate(out[1:], 1):
        p = Path(a)
        if p.is_absolute() and p.is_relative_to(cwd):
            out[i] = str(p.relative_to(cwd))
    return shlex.join(out)


def current_command() -> str:
    """The command line of this process, interpreter and ``-m`` included, without machine paths
    (:func:`portable_command`): what a result row records so another checkout can rerun it."""
    orig = getattr(sys, "orig_argv", None)
    return portable_command(orig or sys.argv, Path.cwd(), with_interpreter=bool(orig))


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class BenchRow:
    """One benchmark result.

    Attributes:
        op: op or pipeline stage, e.g. ``"rope3d"``, ``"attention"``, ``"window"``.
        variant: implementation variant, e.g. ``"nki"``, ``"naive_stride2"``, ``"reference"``.
        config: shape/config as a JSON-serialisable dict, e.g. ``{"L": 23400, "H": 12, "D": 128}``.
        kind: ``"measured"`` (CPU wall clock, counts) or ``"modelled"`` (trn2 cost model).
        status: ``"ok"`` or ``"error"``; an error row carries ``message`` and no figures are trusted.
        latency_us, bytes, hbm_bytes, hbm_bytes_min, descriptors, tensore_util (0..1), fps, memory_bytes:
            optional figures (``None`` = not applicable).
        extra: further named figures (JSON-serialisable).
        git_sha, command, timestamp: provenance, filled automatically.
    """

    op: str
    variant: str
    config: Mapping[str, Any]
    kind: Kind
    status: Status = "ok"
    message: str = ""
    latency_us: float | None = None
    bytes: int | None = None
    hbm_bytes: int | None = None
    hbm_bytes_min: int | None = None
    descriptors: int | None = None
    tensore_util: float | None = None
    fps: float | None = None
    memory_bytes: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    git_sha: str = field(default_factory=git_sha)
    command: str = field(default_factory=current_command)
    timestamp: str = field(default_factory=_now)

    def __post_init__(self) -> None:
        if not isinstance(self.op, str) or not self.op:
            raise ValueError(f"BenchRow.op must be a non-empty str, got {self.op!r}")
        if not isinstance(self.variant, str):
            raise TypeError(f"BenchRow.variant must be a str, got {type(self.variant).__name__}")
        if self.kind not in KINDS:
            raise ValueError(f"BenchRow.kind must be one of {KINDS}, got {self.kind!r}")
        if self.status not in STATUSES:
            raise ValueError(f"BenchRow.status must be one of {STATUSES}, got {self.status!r}")
        if self.status == "error" and not self.message:
            raise ValueError("BenchRow.message must explain an error row (status='error')")
        if not isinstance(self.config, Mapping):
            raise TypeError(f"BenchRow.config must be a mapping, got {type(self.config).__name__}")
        for name in FIGURES:
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise TypeError(f"BenchRow.{name} must be a number or None, got {v!r}")
            if isinstance(v, float) and math.isnan(v):
                raise ValueError(f"BenchRow.{name} is NaN; use None for 'not applicable'")
        for name in ("config", "extra"):
            try:
                json.dumps(getattr(self, name))
            except (TypeError, ValueError) as exc:
                raise TypeError(f"BenchRow.{name} must be JSON-serialisable: {exc}") from exc

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["config"] = dict(self.config)
        d["extra"] = dict(self.extra)
        return d

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BenchRow:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"BenchRow.from_dict: unknown keys {sorted(unknown)}")
        return cls(**dict(d))


def results_path(name: str, results_dir: str | Path | None = None) -> Path:
    """``perf/results/<name>.jsonl`` (or under ``results_dir``)."""
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"results_path: name must be a plain file stem, got {name!r}")
    return Path(results_dir if results_dir is not None else RESULTS_DIR) / f"{name}.jsonl"


def append_rows(
    rows: Iterable[BenchRow], name_or_path: str | Path, *, results_dir: str | Path | None = None
) -> Path:
    """Append ``rows`` as JSON lines and return the file written.

    ``name_or_path``: a plain name (``"kernels"`` -> ``perf/results/kernels.jsonl``, or under
    ``results_dir``) or a :class:`~pathlib.Path` / a string ending in ``.jsonl``.
    """
    if isinstance(name_or_path, Path) or str(name_or_path).endswith(".jsonl"):
        path = Path(name_or_path)
    else:
        path = results_path(str(name_or_path), results_dir)
    rows = list(rows)
    for r in rows:
        if not isinstance(r, BenchRow):
            raise TypeError(f"append_rows: rows must be BenchRow, got {type(r).__name__}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as fh:
        for r in rows:
            fh.write(r.to_json() + "\n")
    return path


def read_rows(path: str | Path) -> list[BenchRow]:
    """Rows of a JSONL file written by :func:`append_rows`."""
    out = []
    with Path(path).open(encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if line.strip():
                try:
                    out.append(BenchRow.from_dict(json.loads(line)))
                except (ValueError, TypeError) as exc:
                    raise ValueError(f"read_rows: {path}:{i}: {exc}") from exc
    return out


def _fmt(name: str, v: Any) -> str:
    if v is None:
        return "-"
    if name == "tensore_util":
        return f"{100 * v:.1f}%"
    if name == "latency_us" or name == "fps":
        return f"{v:,.3f}" if abs(v) < 1000 else f"{v:,.1f}"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _config_str(cfg: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in cfg.items())


def format_table(rows: Sequence[BenchRow], *, max_message: int = 60) -> str:
    """Aligned text table: op, variant, kind, status, config, the figures any row has, message."""
    rows = list(rows)
    if not rows:
        return "(no rows)"
    figs = [f for f in FIGURES if any(getattr(r, f) is not None for r in rows)]
    header = ["op", "variant", "kind", "status", "config", *figs]
    has_msg = any(r.message for r in rows)
    if has_msg:
        header.append("message")
    body = []
    for r in rows:
        cells = [r.op, r.variant, r.kind, r.status, _config_str(r.config)]
        cells += [_fmt(f, getattr(r, f)) for f in figs]
        if has_msg:
            msg = r.message.replace("\n", " ")
            cells.append(msg if len(msg) <= max_message else msg[: max_message - 3] + "...")
        body.append(cells)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    numeric = {i for i, h in enumerate(header) if h in FIGURES}

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    out = [line(header), line(["-" * w for w in widths])]
    out += [line(c) for c in body]
    kinds = sorted({r.kind for r in rows})
    out.append(
        f"kind: measured = CPU wall clock / counts; modelled = trn2 cost model (not a measurement). "
        f"rows: {len(rows)} ({', '.join(kinds)}); errors: {sum(r.status == 'error' for r in rows)}"
    )
    return "\n".join(out)


def print_table(rows: Sequence[BenchRow], file: IO[str] | None = None) -> None:
    """Print :func:`format_table` to ``file`` (default stdout)."""
    print(format_table(rows), file=file if file is not None else sys.stdout)


class ProfileLike(Protocol):
    """What :func:`figures_from_profile` reads from a ``KernelProfile`` (nki_kernels.emulator.cost)."""

    @property
    def latency_ns(self) -> float: ...

    @property
    def dma_bytes(self) -> int: ...

    @property
    def num_descriptors(self) -> int: ...

    @property
    def tensore_util(self) -> float: ...

    @property
    def dma_bound_ns(self) -> float: ...

    @property
    def bottleneck(self) -> str: ...

    @property
    def tensor_flops(self) -> int: ...

    @property
    def hbm_bytes(self) -> int: ...


def figures_from_profile(prof: ProfileLike, hbm_bytes_min: int | None = None) -> dict[str, Any]:
    """Row figures from a modelled ``KernelProfile``: latency, bytes, HBM bytes, descriptors, TensorE
    utilisation, plus ``extra`` = DMA bound, bottleneck engine and TensorE FLOPs."""
    return {
        "latency_us": prof.latency_ns / 1e3,
        "bytes": prof.dma_bytes,
        "hbm_bytes": prof.hbm_bytes,
        "hbm_bytes_min": hbm_bytes_min,
        "descriptors": prof.num_descriptors,
        "tensore_util": prof.tensore_util,
        "extra": {
            "dma_bound_us": prof.dma_bound_ns / 1e3,
            "bottleneck": prof.bottleneck,
            "tensor_flops": prof.tensor_flops,
        },
    }


def _figures(result: Any) -> dict[str, Any]:
    if result is None:
        return {}
    if hasattr(result, "latency_ns") and hasattr(result, "dma_bound_ns"):
        return figures_from_profile(result)
    if isinstance(result, Mapping):
        return dict(result)
    raise TypeError(
        f"run_case: fn must return a mapping of figures, a KernelProfile or None, got {type(result).__name__}"
    )


def run_case(
    fn: Callable[[], Any],
    *,
    op: str,
    variant: str,
    config: Mapping[str, Any],
    kind: Kind,
) -> BenchRow:
    """Run one benchmark case and return its row; an exception becomes a ``status="error"`` row.

    ``fn()`` returns a mapping of figures (keys from :data:`FIGURES`; other keys go to ``extra``; an
    ``"extra"`` mapping is merged), a ``KernelProfile`` (converted by :func:`figures_from_profile`) or
    ``None``.  ``kind`` must say whether the figures are ``"measured"`` or ``"modelled"``.
    """
    if kind not in KINDS:
        raise ValueError(f"run_case: kind must be one of {KINDS}, got {kind!r}")
    try:
        figs = _figures(fn())
        extra = dict(figs.pop("extra", {}) or {})
        known = {k: figs.pop(k) for k in list(figs) if k in FIGURES}
        extra.update(figs)
        return BenchRow(op=op, variant=variant, config=dict(config), kind=kind, extra=extra, **known)
    except Exception as exc:  # a failed case is a row, never a silent skip
        tb = traceback.extract_tb(exc.__traceback__)
        where = f" at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""
        return BenchRow(
            op=op,
            variant=variant,
            config=dict(config),
            kind=kind,
            status="error",
            message=f"{type(exc).__name__}: {exc}{where}",
        )


def time_call(fn: Callable[[], Any], *, repeat: int = 3, warmup: int = 1) -> float:
    """Median CPU wall-clock time of ``fn()`` in microseconds (a *measured* figure) over ``repeat`` runs
    after ``warmup`` untimed runs."""
    if repeat < 1 or warmup < 0:
        raise ValueError(f"time_call: repeat must be >= 1 and warmup >= 0, got {repeat}, {warmup}")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)
