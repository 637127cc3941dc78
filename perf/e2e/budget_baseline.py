"""Before and after: the per-chunk budget's groups at the baseline the real-time work started from and now.

The baseline is read from the tracked ``perf/results/e2e.jsonl`` (rows appended by every
``python -m perf.e2e --save``): the two ``e2e_chunk`` rows of the merged forward (variants
``merged/pessimistic`` and ``merged/optimistic``) whose ``git_sha`` starts with :data:`BASELINE_SHA`; each
row's ``extra.groups_ms`` holds the per-group ms per chunk.  The "now" figures come from the current
:class:`~perf.e2e.chunk.ChunkModel` (:meth:`~perf.e2e.chunk.ChunkModel.by_group`), never from the jsonl.
All figures are *modelled* (trn2 cost model over emulator traces), at both ends of the parameter ranges.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from perf.e2e.chunk import ChunkModel
from perf.e2e.components import GROUPS

if TYPE_CHECKING:
    from perf.e2e.run import E2EResult

__all__ = [
    "BASELINE_SHA",
    "BASELINE_JSONL",
    "Baseline",
    "BeforeAfterRow",
    "read_baseline",
    "before_after_rows",
    "before_after_table",
    "before_after_lines",
]

BASELINE_SHA = "d031b26"
"""Git sha prefix of the ``python -m perf.e2e --save`` run the real-time work started from (2026-12-02):
its merged forward was modelled at 1,018.7 / 814.7 ms per chunk, 11.78-14.73 fps (pessimistic /
optimistic end), Wan2.1-1.3B 480x832 on 8 cores, TP4xSP2."""

BASELINE_JSONL = Path(__file__).resolve().parents[1] / "results" / "e2e.jsonl"
"""The tracked results file holding the baseline rows (``perf/results/e2e.jsonl``)."""

ENDS = ("pessimistic", "optimistic")
_SHA = re.compile(r"[0-9a-f]{4,40}")
_REL = 1e-9  # float64 summation of ~11 group figures; a real mismatch is whole components (>> 1e-9)


@dataclass(frozen=True)
class Baseline:
    """The baseline merged chunk at both ends.

    ``groups_ms[end][group]``: ms per chunk of each group with a non-zero time (an absent group cost 0);
    ``chunk_ms[end]`` / ``fps[end]``: the row's chunk time (ms) and fps; ``config``: the rows' config
    (``preset``, ``height``, ``width``, ``cores``, ``plan``); ``git_sha`` / ``timestamp``: the run's."""

    git_sha: str
    timestamp: str
    variant: str
    config: Mapping[str, Any]
    groups_ms: Mapping[str, Mapping[str, float]]
    chunk_ms: Mapping[str, float]
    fps: Mapping[str, float]


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise FileNotFoundError(
            f"read_baseline: path {str(path)!r} is not a file (the perf.e2e results jsonl)"
        )
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"read_baseline: {path}:{i} is not a JSON row ({e})") from e
    return out


def _groups(row: Mapping[str, Any], where: str) -> dict[str, float]:
    g = (row.get("extra") or {}).get("groups_ms")
    if not isinstance(g, dict) or not g:
        raise ValueError(f"read_baseline: {where} has no extra.groups_ms (per-group ms per chunk)")
    bad = {k: v for k, v in g.items() if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0}
    if bad:
        raise ValueError(f"read_baseline: {where} extra.groups_ms must be finite ms >= 0, got {bad}")
    total, chunk_ms = sum(g.values()), row["latency_us"] / 1e3
    if not math.isclose(total, chunk_ms, rel_tol=_REL):
        raise ValueError(
            f"read_baseline: {where} extra.groups_ms add up to {total:.6f} ms, not the row's chunk "
            f"{chunk_ms:.6f} ms (latency_us / 1e3)"
        )
    return {k: float(v) for k, v in g.items()}


def read_baseline(
    path: Path = BASELINE_JSONL, sha_prefix: str = BASELINE_SHA, variant: str = "merged"
) -> Baseline:
    """The ``e2e_chunk`` rows ``{variant}/pessimistic`` and ``{variant}/optimistic`` of ``path`` whose
    ``git_sha`` starts with ``sha_prefix`` (4-40 lowercase hex digits).

    Raises ``FileNotFoundError`` when ``path`` is not a file and ``ValueError`` when: ``sha_prefix`` is not
    hex; a row is absent at either end (the message names the sha, the variant and the path); several rows
    with that prefix disagree at one end (the run was saved twice with different figures, or the prefix is
    ambiguous); a row is not ``kind: modelled, status: ok``; its ``extra.groups_ms`` is missing, negative
    or does not add up to its chunk (``latency_us``); the two ends' configs differ."""
    if not isinstance(sha_prefix, str) or not _SHA.fullmatch(sha_prefix):
        raise ValueError(f"read_baseline: sha_prefix must be 4-40 lowercase hex digits, got {sha_prefix!r}")
    rows = _rows(Path(path))
    found: dict[str, dict[str, Any]] = {}
    for end in ENDS:
        name = f"{variant}/{end}"
        hits = [
            r
            for r in rows
            if r.get("op") == "e2e_chunk"
            and r.get("variant") == name
            and str(r.get("git_sha", "")).startswith(sha_prefix)
        ]
        if not hits:
            raise ValueError(
                f"read_baseline: no e2e_chunk row {name!r} with git_sha starting {sha_prefix!r} in {path}"
            )
        first = hits[0]
        key = ("git_sha", "latency_us", "fps", "config")
        for h in hits[1:]:
            g_h, g_first = (
                (h.get("extra") or {}).get("groups_ms"),
                (first.get("extra") or {}).get("groups_ms"),
            )
            if any(h.get(k) != first.get(k) for k in key) or g_h != g_first:
                shas = sorted({str(x.get("git_sha")) for x in hits})
                raise ValueError(
                    f"read_baseline: {len(hits)} different e2e_chunk rows {name!r} with git_sha starting "
                    f"{sha_prefix!r} in {path} (shas {shas}); pass a longer sha_prefix"
                )
        if first.get("kind") != "modelled" or first.get("status") != "ok":
            raise ValueError(
                f"read_baseline: row {name!r} at {first.get('git_sha')} must be kind 'modelled', status 'ok'"
                f" (got {first.get('kind')!r}, {first.get('status')!r})"
            )
        found[end] = first
    p, o = found["pessimistic"], found["optimistic"]
    if p.get("config") != o.get("config"):
        raise ValueError(
            f"read_baseline: the two ends' configs differ: {p.get('config')} vs {o.get('config')}"
        )
    return Baseline(
        git_sha=str(p["git_sha"]),
        timestamp=str(p.get("timestamp", "")),
        variant=variant,
        config=dict(p["config"]),
        groups_ms={e: _groups(r, f"row {variant}/{e} at {r['git_sha']}") for e, r in found.items()},
        chunk_ms={e: r["latency_us"] / 1e3 for e, r in found.items()},
        fps={e: float(r["fps"]) for e, r in found.items()},
    )


@dataclass(frozen=True)
class BeforeAfterRow:
    """One group's ms per chunk at the baseline (``before_*``) and now (``now_*``), both ends."""

    group: str
    before_pess: float
    before_opt: float
    now_pess: float
    now_opt: float

    @property
    def change_pess(self) -> float:
        return self.now_pess - self.before_pess

    @property
    def change_opt(self) -> float:
        return self.now_opt - self.before_opt


def _now_ms(cm: ChunkModel) -> dict[str, float]:
    return {k: v * 1e3 for k, v in cm.by_group().items()}


def before_after_rows(base: Baseline, opt: ChunkModel, pess: ChunkModel) -> list[BeforeAfterRow]:
    """One row per group present at the baseline or now (a group absent on one side costs 0 there),
    sorted by the baseline's pessimistic ms (largest first; groups new since then last, by their ms now).
    ``opt`` / ``pess``: the current chunk of ``base.variant`` at its optimistic / pessimistic end; raises
    ``ValueError`` when they are not."""
    for cm, end in ((opt, "optimistic"), (pess, "pessimistic")):
        if cm.end != end or cm.variant != base.variant:
            raise ValueError(
                f"before_after_rows: expected the {base.variant!r} chunk at the {end} end, got "
                f"{cm.variant!r} at {cm.end!r}"
            )
    now = {"pessimistic": _now_ms(pess), "optimistic": _now_ms(opt)}
    names = set(base.groups_ms["pessimistic"]) | set(base.groups_ms["optimistic"]) | set(now["pessimistic"])
    names |= set(now["optimistic"])
    rows = [
        BeforeAfterRow(
            g,
            base.groups_ms["pessimistic"].get(g, 0.0),
            base.groups_ms["optimistic"].get(g, 0.0),
            now["pessimistic"].get(g, 0.0),
            now["optimistic"].get(g, 0.0),
        )
        for g in names
    ]
    order = {g: i for i, g in enumerate(GROUPS)}
    return sorted(rows, key=lambda r: (-r.before_pess, -r.now_pess, order.get(r.group, len(order)), r.group))


def _num(x: float, sign: bool, digits: int) -> str:
    if sign and round(x, digits) == 0:
        return f"{0:.{digits}f}"  # no change at this precision: neither "+0.00" nor "-0.00"
    return f"{x:+,.{digits}f}" if sign else f"{x:,.{digits}f}"


def _pair(p: float, o: float, sign: bool = False, digits: int = 2) -> str:
    return f"{_num(p, sign, digits)} / {_num(o, sign, digits)}"


def before_after_table(base: Baseline, opt: ChunkModel, pess: ChunkModel) -> list[str]:
    """Markdown table: group | before | now | change (ms per chunk, ``pessimistic / optimistic``), then the
    whole chunk (ms) and its fps.  Change = now - before (negative: faster now)."""
    rows = before_after_rows(base, opt, pess)
    out = ["| group | before | now | change |", "|---|---|---|---|"]
    for r in rows:
        out.append(
            f"| {r.group} | {_pair(r.before_pess, r.before_opt)} | {_pair(r.now_pess, r.now_opt)} | "
            f"{_pair(r.change_pess, r.change_opt, sign=True)} |"
        )
    bp, bo = base.chunk_ms["pessimistic"], base.chunk_ms["optimistic"]
    np_, no = pess.chunk_s * 1e3, opt.chunk_s * 1e3
    change = _pair(np_ - bp, no - bo, sign=True)
    out.append(f"| **chunk** | **{_pair(bp, bo)}** | **{_pair(np_, no)}** | **{change}** |")
    fb = (base.fps["pessimistic"], base.fps["optimistic"])
    fn = (pess.fps, opt.fps)
    out.append(f"| fps | {_pair(*fb)} | {_pair(*fn)} | {_pair(fn[0] - fb[0], fn[1] - fb[1], sign=True)} |")
    return out


def before_after_lines(
    r: E2EResult, path: Path = BASELINE_JSONL, sha_prefix: str = BASELINE_SHA
) -> list[str]:
    """The report's and the terminal's lines: a title, the provenance and :func:`before_after_table` for
    the merged chunk of ``r``.  When ``r`` is another configuration than the baseline (preset, height,
    width, cores, plan or frames per chunk) the table is replaced by one line saying so (the groups would
    not be comparable).  Raises as :func:`read_baseline` when the baseline rows are absent."""
    base = read_baseline(path, sha_prefix, "merged")
    pess, opt = r.chunk("merged", "pessimistic"), r.chunk("merged", "optimistic")
    title = "Before and after (modelled, merged forward, per chunk, ms pessimistic / optimistic)"
    cfg = {"preset": r.model.name, "height": r.height, "width": r.width, "cores": pess.cores}
    cfg["plan"] = pess.plan_name
    frames_then = base.fps["pessimistic"] * base.chunk_ms["pessimistic"] / 1e3
    if cfg != dict(base.config) or round(frames_then) != pess.video_frames:
        return [
            "",
            f"{title}: not shown, the baseline ({base.git_sha}: {dict(base.config)}, {frames_then:.0f} "
            f"frames per chunk) is another configuration than this run ({cfg}, {pess.video_frames} frames).",
        ]
    return [
        "",
        f"{title}: before = the `python -m perf.e2e --save` run at git {base.git_sha} ({base.timestamp}; "
        "the figures the real-time work started from, rows `e2e_chunk` merged/pessimistic and "
        "merged/optimistic of `perf/results/e2e.jsonl`), now = this run's chunk model; change = now - "
        "before.",
        "",
        *before_after_table(base, opt, pess),
    ]
