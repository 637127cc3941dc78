"""DMA pricing of the trn2 cost model v2: descriptors, queued throughput, issue cost per DGE mode.

One DMA instruction costs (all **modelled**):

* an *issue* of ``dma_issue_ns`` (hwdge, and ``unknown`` = the compiler's choice), ``dge_none_issue_ns``
  (prebuilt descriptors) on the core's DMA issue lane(s), or ``swdge_issue_ns`` on GpSimd (software DGE,
  also forced by an indirect access);
* a *data* phase: each descriptor of ``s`` bytes occupies one of the 16 DMA engines for
  ``s / (queued_gbps(s) / 16)`` ns, where ``queued_gbps`` interpolates the measured per-core throughput
  with several DMAs queued (:data:`~.params.DMA_QUEUED_GBPS_POINTS`); ``dma_transpose`` divides the
  throughput by its (unmeasured, ranged) efficiency;
* a *completion* latency ``dma_completion_ns`` before a consumer may start.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from ..trace import TraceRecord
from .params import DEFAULT, Trn2CostParams

__all__ = [
    "DmaRecordCost",
    "dma_efficiency",
    "dma_mode",
    "dma_record_cost",
    "queued_gbps",
    "split_descriptors",
]

DIRECTIONS = ("hbm->sbuf", "sbuf->hbm", "hbm->hbm", "sbuf->sbuf")


def _interp_log2(x: float, pts: tuple[tuple[int, float], ...]) -> float:
    """Piecewise linear in log2(x) through ``pts``; proportional to x below the first point, flat above."""
    s0, v0 = pts[0]
    if x <= s0:
        return v0 * x / s0
    if x >= pts[-1][0]:
        return pts[-1][1]
    lx = math.log2(x)
    for (sa, va), (sb, vb) in zip(pts, pts[1:]):
        if sa <= x <= sb:
            t = (lx - math.log2(sa)) / (math.log2(sb) - math.log2(sa))
            return va + t * (vb - va)
    raise AssertionError("unreachable")  # pragma: no cover


def dma_efficiency(run_bytes: float, params: Trn2CostParams | None = None) -> float:
    """Published single-DMA efficiency (fraction of the plateau) at ``run_bytes`` bytes per partition.

    Piecewise linear in ``log2(run_bytes)`` through ``dma_efficiency_points``; below the first point the
    per-descriptor time is constant (efficiency proportional to size); flat above the last.  v2 does not
    charge this per descriptor (see :func:`queued_gbps`); it describes one DMA alone.
    """
    if run_bytes <= 0:
        raise ValueError(f"dma_efficiency: run_bytes must be > 0, got {run_bytes}")
    return _interp_log2(run_bytes, (params or DEFAULT).dma_efficiency_points)


def queued_gbps(run_bytes: float, params: Trn2CostParams | None = None) -> float:
    """Per-core DMA throughput (GB/s, 16 engines) for descriptors of ``run_bytes`` with DMAs queued.

    Piecewise linear in ``log2(run_bytes)`` through ``dma_queued_gbps_points``; below the first point the
    per-descriptor time is constant; flat above the last point.
    """
    if run_bytes <= 0:
        raise ValueError(f"queued_gbps: run_bytes must be > 0, got {run_bytes}")
    return _interp_log2(run_bytes, (params or DEFAULT).dma_queued_gbps_points)


def split_descriptors(
    descriptors: tuple[tuple[int, int], ...], max_bytes: int
) -> tuple[tuple[int, int], ...]:
    """Split runs longer than ``max_bytes`` into ``max_bytes`` chunks plus a remainder.

    ``descriptors`` is a histogram ``((run_bytes, count), ...)``; the result is a histogram sorted by size.
    """
    if max_bytes <= 0:
        raise ValueError(f"split_descriptors: max_bytes must be > 0, got {max_bytes}")
    out: Counter[int] = Counter()
    for size, count in descriptors:
        if size <= 0 or count < 0:
            raise ValueError(f"split_descriptors: bad descriptor entry (run_bytes={size}, count={count})")
        full, rem = divmod(size, max_bytes)
        if full:
            out[max_bytes] += full * count
        if rem:
            out[rem] += count
    return tuple(sorted((s, c) for s, c in out.items() if c))


@dataclass(frozen=True)
class DmaRecordCost:
    """Modelled cost of one DMA instruction (one issue of a DMA trace record)."""

    descriptors: tuple[tuple[int, int], ...]  # charged histogram after splitting
    data_ns: float  # sum of descriptor times (engine-ns), spread over ``engines_used`` engines
    engines_used: int
    mode: str  # "hwdge" | "swdge" | "none"
    issue_ns: float  # on the DMA issue lane (hwdge, none) or on GpSimd (swdge)
    hbm_read: int
    hbm_written: int
    bytes_moved: int

    @property
    def swdge_ns(self) -> float:
        """GpSimd time of the descriptor generation (swdge only)."""
        return self.issue_ns if self.mode == "swdge" else 0.0


def _on_chip_bytes(rec: TraceRecord) -> int:
    if rec.direction == "hbm->sbuf":
        return rec.bytes_written
    if rec.direction in ("sbuf->hbm", "sbuf->sbuf"):
        return rec.bytes_read
    return 0


def dma_mode(rec: TraceRecord, p: Trn2CostParams) -> str:
    """DGE mode of a DMA record: ``meta dge_mode``; ``swdge`` when ``meta indirect`` is present (software
    DGE is the only mode with gather/scatter, DGE); ``unknown`` -> ``default_dge_mode``."""
    meta = rec.meta_dict()
    default_mode = "swdge" if meta.get("indirect") is not None else p.default_dge_mode
    mode = str(meta.get("dge_mode", default_mode)).removeprefix("dge_mode.")
    if mode not in ("hwdge", "swdge", "none", "unknown"):
        raise ValueError(f"dma_record_cost: meta dge_mode must be hwdge/swdge/none/unknown, got {mode!r}")
    return p.default_dge_mode if mode == "unknown" else mode


def dma_record_cost(rec: TraceRecord, params: Trn2CostParams | None = None) -> DmaRecordCost:
    """Cost of one DMA instruction (see module docstring).

    Descriptors longer than ``max_descriptor_bytes``, or than the bytes one SBUF partition receives
    (a descriptor cannot span partitions), are split first.  A record without descriptors is charged one
    descriptor per partition.  ``data_ns = sum(count * s / (queued_gbps(s) / dma_engines))`` (divided by
    the transpose efficiency for ``dma_transpose``), spread over ``min(16, ceil(P / 8))`` engines (all 16
    for HBM->HBM).
    """
    p = params or DEFAULT
    if rec.engine != "dma":
        raise ValueError(f"dma_record_cost: record engine must be 'dma', got {rec.engine!r} (op {rec.op})")
    if rec.direction not in DIRECTIONS:
        raise ValueError(f"dma_record_cost: direction must be one of {DIRECTIONS}, got {rec.direction!r}")
    moved = max(rec.bytes_read, rec.bytes_written)
    descs = rec.descriptors
    if not descs and moved > 0:
        parts = max(rec.partitions, 1)
        per, rem = divmod(moved, parts)
        descs = ((per, parts),) if per else ()
        if rem:
            descs = (*descs, (rem, 1))
    cap = p.max_descriptor_bytes
    on_chip = _on_chip_bytes(rec)
    if rec.partitions > 0 and on_chip > 0:
        cap = min(cap, max(1, -(-on_chip // rec.partitions)))
    descs = split_descriptors(descs, cap) if descs else ()
    data = sum(c * s * p.dma_engines / queued_gbps(s, p) for s, c in descs)
    if rec.op == "dma_transpose":
        data /= (
            p.dma_transpose_sbuf_efficiency
            if rec.direction == "sbuf->sbuf"
            else p.dma_transpose_hbm_efficiency
        )
    if rec.partitions > 0:
        used = min(p.dma_engines, -(-rec.partitions // p.partitions_per_dma_engine))
    else:
        used = p.dma_engines
    mode = dma_mode(rec, p)
    issue = {"hwdge": p.dma_issue_ns, "swdge": p.swdge_issue_ns, "none": p.dge_none_issue_ns}[mode]
    hbm_r = rec.bytes_read if rec.direction in ("hbm->sbuf", "hbm->hbm") else 0
    hbm_w = rec.bytes_written if rec.direction in ("sbuf->hbm", "hbm->hbm") else 0
    return DmaRecordCost(
        descriptors=descs,
        data_ns=data,
        engines_used=used,
        mode=mode,
        issue_ns=issue,
        hbm_read=hbm_r,
        hbm_written=hbm_w,
        bytes_moved=moved,
    )
