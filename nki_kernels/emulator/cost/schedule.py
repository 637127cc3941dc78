"""Dependency-aware schedule of an ordered event log (the cost model v2's latency; all **modelled**).

Input: ``(record, reads, writes)`` events in program order (``Trace.iter_events()``, the event log of
docs/emulator.md): ``Region(space, buf, p0, p1, b0, b1)`` tuples name the partitions and bytes of
each storage an instruction reads and writes.

Rules (per core; program ``pid`` runs on core ``pid % cores``):

* **Program order per engine.**  TensorE, VectorE, ScalarE and GpSimdE each run their instructions in
  program order, back to back (``engine_in_order``, nominal).  At the range's optimistic end
  (``engine_in_order=False``: the compiler reorders independent instructions) an instruction takes the
  earliest idle gap of its engine at or after its inputs are ready.  DMAs go round-robin onto ``DMA_QUEUES``
  (16) FIFO queues (DMA-OV: a transfer uses one queue; FIFO within a queue).
* **RAW**: an instruction starts after every earlier write overlapping a region it reads has finished;
  **WAR / WAW**: an instruction that writes a region starts after every earlier read or write of an
  overlapping region has finished.  Overlap = same ``(space, buf)``, overlapping partitions AND bytes
  (an HBM region's partitions are ``[0, 1)``; allocation ids are unique per launch across spaces).  WAW
  through HBM is not tracked (HBM regions are bounding boxes: strided stores into one tensor would falsely
  overlap).
* **Sync**: a dependency between two different engines (or cores) adds ``sync_ns``.
* **DMA**: the issue (``DmaRecordCost.issue_ns``, descriptor generation) takes the earliest gap of
  ``dma_issue_lanes`` shared issue lanes once its queue is free; the data phase starts when the issue is
  done AND its dependencies are satisfied (the queue entry waits on its semaphore), takes the earliest
  gap of the 16-engine DMA pool for ``data_ns / 16`` (throughput) and lasts ``data_ns / engines_used``
  (latency); ``dma_completion_ns`` later its consumers may start.  swdge generates its descriptors on
  GpSimd, in GpSimd's program order and after the dependencies (an indirect DMA needs its offsets).
* **TensorE throttling**: a TensorE instruction that starts ``>= tensor_throttle_gap_ns`` after the
  previous one ended (or after time 0) runs ``tensor_throttle_factor`` times longer.
* **VectorE/GpSimd contention**: the part of a VectorE (GpSimd) instruction that overlaps the other
  engine's busy time runs ``vector_gpsimd_contention`` times longer.

Bookkeeping per storage is two short lists (recent writes, recent reads); an access fully covered by a
later write (or a read by a later same-engine read) is dropped, and a list longer than :data:`MAX_ENTRIES`
has its oldest entries merged into one conservative bounding entry, so memory and time stay linear in events.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..trace import TraceRecord
from .compute import instruction_ns
from .dma import DmaRecordCost, dma_record_cost
from .params import DEFAULT, Trn2CostParams

__all__ = ["DMA_QUEUES", "MAX_ENTRIES", "ScheduleResult", "schedule_events"]

DMA_QUEUES = 16  # DMA-OV: 16 queues per engine
MAX_ENTRIES = 48
_ENGINES = ("tensor", "vector", "scalar", "gpsimd", "dma")
_ENG_IDX = {e: i for i, e in enumerate(_ENGINES)}
_NE = len(_ENGINES)


@dataclass(frozen=True)
class ScheduleResult:
    """Outcome of :func:`schedule_events` (times in ns, **modelled**, without the fixed per-kernel time).

    ``engine_busy_ns``: per engine, the busiest core's busy time as scheduled (throttling and contention
    included; ``dma`` = the DMA pool's data time, ``dma_issue`` = issue lane time).
    ``critical_path_ns``: the makespan split over the last-finishing instruction's chain of binding
    constraints: per engine its instructions' time, ``"sync"`` the semaphore costs and DMA completion
    waits on it.  ``critical_engines``: the engines on that path, largest share first.
    """

    makespan_ns: float
    per_core_makespan_ns: tuple[float, ...]
    engine_busy_ns: dict[str, float]
    critical_path_ns: dict[str, float]
    critical_engines: tuple[str, ...]
    events: int
    dependencies: int
    cross_engine_dependencies: int
    throttled_tensor_instructions: int
    timeline: tuple[Any, ...] | None = None  # (start, end, pred, engine index) arrays when asked for


class _Lane:
    """A resource that serves requests in the earliest gap at or after their ready time.

    Only the latest 512 busy intervals are kept; older ones are forgotten and nothing may start before
    the end of the last forgotten one (``floor``), so a late request never double-books old time.
    """

    __slots__ = ("starts", "ends", "floor")

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.floor = 0.0

    def earliest(self, ready: float, dur: float) -> tuple[float, int]:
        """Earliest start >= ``ready`` of a gap of ``dur`` (and the insertion index), without reserving."""
        starts, ends = self.starts, self.ends
        t = ready if ready > self.floor else self.floor
        i = bisect.bisect_right(ends, t)
        n = len(starts)
        while i < n and starts[i] < t + dur:
            if ends[i] > t:
                t = ends[i]
            i += 1
        return t, i

    def reserve(self, ready: float, dur: float) -> float:
        """Reserve the earliest gap of ``dur`` at or after ``ready``; return its start."""
        t, i = self.earliest(ready, dur)
        if dur > 0:
            self.starts.insert(i, t)
            self.ends.insert(i, t + dur)
            if len(self.starts) > 512:
                self.floor = max(self.floor, self.ends[255])
                del self.starts[:256], self.ends[:256]
        return t


def schedule_events(
    events: Iterable[tuple[TraceRecord, tuple[Any, ...], tuple[Any, ...]]],
    params: Trn2CostParams | None = None,
    cores: int = 1,
    dma_cost: Callable[[TraceRecord], DmaRecordCost] | None = None,
    keep_timeline: bool = False,
) -> ScheduleResult:
    """Schedule ``events`` (program order) per the module rules and return the :class:`ScheduleResult`.

    ``dma_cost`` overrides the DMA pricing (default :func:`~.dma.dma_record_cost` with ``params``).
    ``keep_timeline`` keeps every event's ``(start, end, binding predecessor, engine index)`` arrays in
    ``ScheduleResult.timeline`` (engine index into ``tensor, vector, scalar, gpsimd, dma``).
    Raises ``ValueError`` for ``cores < 1`` or a record of an unknown engine.
    """
    p = params or DEFAULT
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
        raise ValueError(f"schedule_events: cores must be an int >= 1, got {cores!r}")
    sync = p.sync_ns
    gap_thr = p.tensor_throttle_gap_ns
    throttle = p.tensor_throttle_factor
    contention = p.vector_gpsimd_contention
    completion = p.dma_completion_ns
    ne = p.dma_engines
    price_dma = dma_cost or (lambda r: dma_record_cost(r, p))
    in_order = p.engine_in_order

    free = [0.0] * (cores * _NE)  # engine free time per (core, engine)
    last = [-1] * (cores * _NE)  # last event index per (core, engine)
    busy = [0.0] * (cores * _NE)
    issue_busy = [0.0] * cores
    tensor_seen = [False] * cores
    lanes = [[_Lane() for _ in range(p.dma_issue_lanes)] for _ in range(cores)]
    pools = [_Lane() for _ in range(cores)]
    elanes = [_Lane() for _ in range(cores * _NE)]  # per (core, engine) when engines may reorder
    queue_free = [[0.0] * DMA_QUEUES for _ in range(cores)]
    queue_last = [[-1] * DMA_QUEUES for _ in range(cores)]
    queue_rr = [0] * cores
    # keyed by allocation id: unique per launch across spaces (event-log contract), so (space, buf) == buf
    table_r: dict[int, list[tuple[int, int, int, int, float, int, int]]] = {}
    table_w: dict[int, list[tuple[int, int, int, int, float, int, int]]] = {}
    price: dict[int, Any] = {}
    keep: list[TraceRecord] = []  # keeps priced records alive so id() stays unique

    t_start = array("d")
    t_end = array("d")
    pred = array("q")
    eng_of = array("b")
    deps = cross = throttled = 0
    idx = best_idx = -1
    best_end = 0.0
    core_end = [0.0] * cores

    for rec, reads, writes in events:
        idx += 1
        pc = price.get(id(rec))
        if pc is None:
            if rec.engine == "dma":
                pc = (price_dma(rec), 4, rec.program_id % cores)
            elif rec.engine in _ENG_IDX:
                pc = (instruction_ns(rec, p), _ENG_IDX[rec.engine], rec.program_id % cores)
            else:
                raise ValueError(f"schedule_events: unknown engine {rec.engine!r} in {rec.op}")
            price[id(rec)] = pc
            keep.append(rec)
        c: Any = pc[0]  # DmaRecordCost for a DMA, else the instruction's ns
        e = pc[1]
        core = pc[2]
        me = core * _NE + e
        # ---- dependencies through regions: RAW (reads vs writes), WAR + WAW (writes vs both)
        ready = 0.0
        dep_src = -1
        for r in reads:
            lst = table_w.get(r[1])
            if not lst:
                continue
            p0, p1, b0, b1 = r[2], r[3], r[4], r[5]
            if p1 <= p0:
                p1 = p0 + 1
            for q0, q1, c0, c1, end, eng, src in lst:
                if c0 < b1 and b0 < c1 and q0 < p1 and p0 < q1:
                    deps += 1
                    if eng != me:
                        cross += 1
                        end += sync
                    if end > ready:
                        ready, dep_src = end, src
        for r in writes:
            key = r[1]
            p0, p1, b0, b1 = r[2], r[3], r[4], r[5]
            if p1 <= p0:
                p1 = p0 + 1
            # WAW through HBM is not tracked: HBM regions are bounding boxes, so strided stores into one
            # tensor would all "overlap"; the compiler orders only true overlaps and kernels rarely
            # overwrite HBM bytes they just wrote.  RAW and WAR through HBM are kept.
            for lst in (table_r.get(key), table_w.get(key) if r[0] != "hbm" else None):
                if not lst:
                    continue
                covered = False
                for q0, q1, c0, c1, end, eng, src in lst:
                    if c0 < b1 and b0 < c1 and q0 < p1 and p0 < q1:
                        deps += 1
                        if eng != me:
                            cross += 1
                            end += sync
                        if end > ready:
                            ready, dep_src = end, src
                        if b0 <= c0 and c1 <= b1 and p0 <= q0 and q1 <= p1:
                            covered = True
                if covered:  # accesses this write covers are ordered before it: it dominates them
                    if len(lst) == 1:
                        lst.clear()
                    else:
                        lst[:] = [
                            x for x in lst if not (b0 <= x[2] and x[3] <= b1 and p0 <= x[0] and x[1] <= p1)
                        ]
        # ---- timing
        if e == 4:  # DMA
            q = queue_rr[core]
            queue_rr[core] = (q + 1) % DMA_QUEUES
            start = queue_free[core][q]
            pr = queue_last[core][q]
            if c.mode == "swdge":  # descriptors generated on GpSimd in its program order, after the deps
                g = core * _NE + 3  # (an indirect DMA's offsets must have been written)
                if ready > start:
                    start, pr = ready, dep_src
                if free[g] > start:
                    start, pr = free[g], last[g]
                free[g] = start + c.issue_ns
                last[g] = idx
                busy[g] += c.issue_ns
            else:  # hwdge / prebuilt: descriptors issue in queue order; the data phase waits for the deps
                lane_list = lanes[core]
                best = lane_list[0]
                if len(lane_list) > 1:
                    best = min(lane_list, key=lambda ln: ln.earliest(start, c.issue_ns)[0])
                t = best.reserve(start, c.issue_ns)
                if t > start:
                    start, pr = t, last[me]
                issue_busy[core] += c.issue_ns
            issued = start + c.issue_ns
            if ready > issued:  # the data waits for its inputs / for readers of its destination
                start, pr, issued = ready - c.issue_ns, dep_src, ready
            # engines used: min(16, ceil(P / 8)) of the record (an indirect DMA's index tile is no guide)
            d0 = pools[core].reserve(issued, c.data_ns / ne)
            end = d0 + c.data_ns / max(c.engines_used, 1) + completion
            busy[me] += c.data_ns / ne
            queue_free[core][q] = start + c.issue_ns
            queue_last[core][q] = idx
            last[me] = idx
        else:
            start = ready
            pr = dep_src
            dur = c
            if in_order:
                if free[me] >= start:
                    start, pr = free[me], last[me]
                prev_end = free[me]
            else:  # the compiler may hoist it into an earlier idle gap of its engine
                ln = elanes[me]
                t, i = ln.earliest(ready, dur)
                if t > start:
                    start, pr = t, last[me]
                prev_end = ln.ends[i - 1] if i > 0 else 0.0
            if e == 0:
                if not tensor_seen[core]:
                    prev_end = 0.0
                if start - prev_end >= gap_thr:
                    dur *= throttle
                    throttled += 1
                    if not in_order:
                        start = max(start, elanes[me].earliest(start, dur)[0])
                tensor_seen[core] = True
            elif e in (1, 3) and contention != 1.0:
                other = free[core * _NE + (4 - e)]  # vector(1) <-> gpsimd(3)
                if other > start:
                    dur += (min(other, start + dur) - start) * (contention - 1.0)
            end = start + dur
            if not in_order:
                elanes[me].reserve(start, dur)
            if end > free[me]:
                free[me] = end
            last[me] = idx
            busy[me] += dur
        if end > core_end[core]:
            core_end[core] = end
        if end > best_end:
            best_end, best_idx = end, idx
        t_start.append(start)
        t_end.append(end)
        pred.append(pr)
        eng_of.append(e)
        # ---- record this access
        for r in reads:
            key = r[1]
            p0, p1, b0, b1 = r[2], r[3], r[4], r[5]
            if p1 <= p0:
                p1 = p0 + 1
            ent = (p0, p1, b0, b1, end, me, idx)
            lst = table_r.get(key)
            if not lst:
                table_r[key] = [ent]
                continue
            prev = lst[-1]
            if prev[5] == me and p0 <= prev[0] and prev[1] <= p1 and b0 <= prev[2] and prev[3] <= b1:
                lst[-1] = ent  # same engine re-reads (a superset of) the last read: it dominates
            else:
                lst.append(ent)
                if len(lst) > MAX_ENTRIES:
                    _merge_oldest(lst)
        for r in writes:
            key = r[1]
            p0, p1, b0, b1 = r[2], r[3], r[4], r[5]
            if p1 <= p0:
                p1 = p0 + 1
            ent = (p0, p1, b0, b1, end, me, idx)
            lst = table_w.get(key)
            if lst is None:
                table_w[key] = [ent]
                continue
            lst.append(ent)
            if len(lst) > MAX_ENTRIES:
                _merge_oldest(lst)

    n = idx + 1
    makespan = max(core_end)
    crit: dict[str, float] = {}
    i = best_idx
    while i >= 0:
        name = _ENGINES[eng_of[i]]
        crit[name] = crit.get(name, 0.0) + t_end[i] - t_start[i]
        j = pred[i]
        gap = t_start[i] - (t_end[j] if j >= 0 else 0.0)
        if gap > 0:
            crit["sync"] = crit.get("sync", 0.0) + gap
        i = j
    busy_max = {name: max(busy[c * _NE + k] for c in range(cores)) for k, name in enumerate(_ENGINES)}
    busy_max["dma_issue"] = max(issue_busy)
    engines = tuple(
        k
        for k, _ in sorted(((k, v) for k, v in crit.items() if k != "sync" and v > 0), key=lambda kv: -kv[1])
    )
    return ScheduleResult(
        makespan_ns=makespan,
        per_core_makespan_ns=tuple(core_end),
        engine_busy_ns=busy_max,
        critical_path_ns=crit,
        critical_engines=engines,
        events=n,
        dependencies=deps,
        cross_engine_dependencies=cross,
        throttled_tensor_instructions=throttled,
        timeline=(t_start, t_end, pred, eng_of) if keep_timeline else None,
    )


def _merge_oldest(lst: list[tuple[int, int, int, int, float, int, int]]) -> None:
    """Merge the oldest half of ``lst`` into one bounding entry with the latest end (conservative)."""
    k = len(lst) // 2
    old = lst[:k]
    best = max(old, key=lambda x: x[4])
    merged = (
        min(x[0] for x in old),
        max(x[1] for x in old),
        min(x[2] for x in old),
        max(x[3] for x in old),
        best[4],
        best[5],
        best[6],
    )
    lst[:k] = [merged]
