"""Every dependency rule of the cost model's schedule (``nki_kernels.emulator.cost.schedule``), one test per
hazard kind: RAW, WAR and WAW, on chip (SBUF / PSUM) and through HBM, with the earlier access still in the
bookkeeping as it was and after it has been merged into a bounding entry (:data:`MAX_ENTRIES`).

Each case is a hand-built event list (the event-log contract, as in tests/test_cost_schedule.py): a SLOW
access of a region, then (for the merged cases) more short accesses of disjoint slices of the same buffer
than the bookkeeping keeps, the slow one first, in the middle or last of the oldest, merged, half or just
after it (:data:`PLACES`), then the access that the hazard orders after the slow one. Expected start times
follow from the documented rules (docs/cost_model.md, the module docstring) and the instruction prices
(tests/test_cost.py pins those):

* on chip: the slow access runs on ScalarE from 0 for ``SLOW_NS``; the last access runs on GpSimd (idle
  until then), so it starts exactly at ``SLOW_NS + sync`` (a dependency between engines costs one
  semaphore) -- and at 0 when its region is disjoint (the control that shows the hazard sets the time);
* through HBM (one core, one issue lane, DMA completion 0): DMA ``i`` issues in ``[i, i+1) x issue``; the
  slow DMA moves one partition's 2 MiB on one engine, so it ends at ``(m + 1) x issue + data``; the last
  DMA's descriptors issue meanwhile and its data starts when the slow one ends (no sync: both on the DMA
  engine), so it starts at ``that end - issue`` and ends ``data`` later. WAW through HBM is documented as
  not tracked (HBM regions are bounding boxes): two stores of the same bytes are not ordered.
"""

from __future__ import annotations

from typing import Any

import pytest

from nki_kernels.emulator.cost import Trn2CostParams, dma_record_cost, instruction_ns, schedule_events
from nki_kernels.emulator.cost.schedule import MAX_ENTRIES
from nki_kernels.emulator.trace import Region
from tests.test_cost import dma, elementwise

P = Trn2CostParams()
SYNC = P.sync_ns
assert P.dma_issue_lanes == 1 and P.dma_completion_ns == 0.0 and P.engine_in_order  # the rules used here

SLOW = elementwise("activation", "scalar", 65536, ("float32",) * 2, ("sbuf",) * 2)
FAST = elementwise("tensor_copy", "vector", 64, ("float32",) * 2, ("sbuf",) * 2)
LAST = elementwise("tensor_copy", "gpsimd", 64, ("float32",) * 2, ("sbuf",) * 2)
SLOW_NS, FAST_NS = instruction_ns(SLOW), instruction_ns(FAST)
N_MERGED = MAX_ENTRIES + 4  # accesses of the buffer before the last one: the oldest half gets merged
HALF = (MAX_ENTRIES + 1) // 2  # the first merge (at MAX_ENTRIES + 1 entries) merges entries [0, HALF)
# where the slow access sits: alone (kept as it was), or among N_MERGED: first, in the middle or last of
# the merged half, or the first entry the merge keeps
PLACES = {"kept": None, "merged-first": 0, "merged-middle": 10, "merged-last": HALF - 1, "after-merge": HALF}
X = 1  # the shared buffer

BIG_LOAD, BIG_STORE = dma(1 << 21, parts=1), dma(1 << 21, parts=1, direction="sbuf->hbm")
TINY_LOAD, TINY_STORE = dma(4, parts=1), dma(4, parts=1, direction="sbuf->hbm")
ISSUE = dma_record_cost(TINY_LOAD).issue_ns
HBM_SLICE = 1 << 22  # bytes per HBM slice (bounding regions only: the schedule reads no record bytes)


def _onchip(space: str, axis: str, i: int) -> Region:
    """Slice ``i`` of buffer X: 4 bytes of every partition (``bytes``) or partition i (``partitions``)."""
    if axis == "bytes":
        return Region(space, X, 0, 128, 4 * i, 4 * i + 4)
    return Region(space, X, i, i + 1, 0, 4)


def _private(i: int) -> Region:
    return Region("sbuf", 1000 + i, 0, 128, 0, 1024)


def _access(
    rec: Any, kind_side: str, region: Region, i: int
) -> tuple[Any, tuple[Region, ...], tuple[Region, ...]]:
    """``rec`` reading (``r``) or writing (``w``) ``region``; its other operand is private to it."""
    if kind_side == "r":
        return (rec, (region,), (_private(i),))
    return (rec, (_private(i),), (region,))


SIDES = {"RAW": ("w", "r"), "WAR": ("r", "w"), "WAW": ("w", "w")}  # (earlier access, later access)


def _place(place: str) -> tuple[int, int]:
    """(accesses before the last one, index of the slow one)."""
    m = PLACES[place]
    return (1, 0) if m is None else (N_MERGED, m)


def _onchip_events(kind: str, space: str, axis: str, place: str, last_slice: int) -> list[Any]:
    first, second = SIDES[kind]
    n, m = _place(place)
    evs = []
    for i in range(n):
        rec = SLOW if i == m else FAST
        evs.append(_access(rec, first, _onchip(space, axis, i), i))
    evs.append(_access(LAST, second, _onchip(space, axis, last_slice), n))
    return evs


def _timeline(evs: list[Any], cores: int = 1) -> tuple[list[float], list[float], Any]:
    r = schedule_events(evs, P, cores=cores, keep_timeline=True)
    assert r.timeline is not None
    return list(r.timeline[0]), list(r.timeline[1]), r


@pytest.mark.parametrize("place", list(PLACES))
@pytest.mark.parametrize(
    ("space", "axis"), [("sbuf", "bytes"), ("sbuf", "partitions"), ("psum", "bytes")], ids=str
)
@pytest.mark.parametrize("kind", ["RAW", "WAR", "WAW"])
def test_onchip_hazard_orders_the_later_access(kind: str, space: str, axis: str, place: str) -> None:
    n, m = _place(place)
    assert n == 1 or n > MAX_ENTRIES  # merged places: the bookkeeping must merge
    assert n * FAST_NS < SLOW_NS  # the slow access ends last: only its entry can hold the last one back
    start, end, r = _timeline(_onchip_events(kind, space, axis, place, last_slice=m))
    assert end[m] == pytest.approx(SLOW_NS) and start[m] == 0.0
    assert start[-1] == pytest.approx(SLOW_NS + SYNC), f"{kind} after the slow access + one semaphore"
    # control: the same events, the last access on a slice nobody touched -> no hazard, it starts at 0
    free_start, _, free = _timeline(_onchip_events(kind, space, axis, place, last_slice=n + 20))
    assert free_start[-1] == 0.0
    assert r.dependencies > free.dependencies


def _hbm(i: int) -> Region:
    return Region("hbm", X, 0, 0, i * HBM_SLICE, (i + 1) * HBM_SLICE)


def _hbm_events(kind: str, place: str, last_buf: int = X) -> tuple[list[Any], Any, Any]:
    """Slow/tiny DMAs on slices of HBM tensor X, then the last DMA on slice m (of ``last_buf``)."""
    first, second = SIDES[kind]
    big, tiny = (BIG_STORE, TINY_STORE) if first == "w" else (BIG_LOAD, TINY_LOAD)
    last = TINY_STORE if second == "w" else TINY_LOAD
    n, m = _place(place)
    evs = [_access(big if i == m else tiny, first, _hbm(i), i) for i in range(n)]
    region = Region("hbm", last_buf, 0, 0, m * HBM_SLICE, (m + 1) * HBM_SLICE)
    evs.append(_access(last, second, region, n))
    return evs, dma_record_cost(big), dma_record_cost(last)


@pytest.mark.parametrize("place", list(PLACES))
@pytest.mark.parametrize("kind", ["RAW", "WAR"])
def test_hbm_hazard_orders_the_later_dma(kind: str, place: str) -> None:
    _, m = _place(place)
    evs, big, last = _hbm_events(kind, place)
    assert big.engines_used == 1 and last.issue_ns == ISSUE and big.issue_ns == ISSUE
    start, end, _ = _timeline(evs)
    slow_end = (m + 1) * ISSUE + big.data_ns  # issued after m tiny DMAs, data on one engine
    assert end[m] == pytest.approx(slow_end)
    assert slow_end > len(evs) * ISSUE + last.data_ns  # it would otherwise be long done
    assert start[-1] == pytest.approx(slow_end - last.issue_ns), (
        f"{kind} through HBM: data after the slow DMA"
    )
    assert end[-1] == pytest.approx(slow_end + last.data_ns / last.engines_used)
    # control: the same DMA on another HBM tensor is done long before the slow one (it waits only for its
    # issue and a DMA pool slot: the slow DMA holds the pool for data / 16)
    free_evs, _, _ = _hbm_events(kind, place, last_buf=X + 1)
    _, free_end, _ = _timeline(free_evs)
    assert free_end[-1] <= len(evs) * ISSUE + big.data_ns / 16 + len(evs) * last.data_ns < slow_end


def test_hbm_raw_across_cores_adds_the_semaphore() -> None:
    """The store on core 0, the load of its bytes on core 1 (its own issue lane and DMA pool): the load's
    data starts at the store's end + one sync."""
    store, load = BIG_STORE, dma(4, parts=1, pid=1)
    evs = [_access(store, "w", _hbm(0), 0), _access(load, "r", _hbm(0), 1)]
    start, end, _ = _timeline(evs, cores=2)
    cs, cl = dma_record_cost(store), dma_record_cost(load)
    assert end[0] == pytest.approx(ISSUE + cs.data_ns)
    assert start[1] == pytest.approx(end[0] + SYNC - cl.issue_ns)
    assert end[1] == pytest.approx(end[0] + SYNC + cl.data_ns)


@pytest.mark.parametrize("place", ["kept", "merged-middle"])
def test_waw_through_hbm_is_not_tracked(place: str) -> None:
    """Documented exemption: two stores of the same HBM bytes are not ordered, so the timeline equals that
    of a store into another tensor (and no dependency is counted)."""
    same, _, _ = _hbm_events("WAW", place)
    other, _, _ = _hbm_events("WAW", place, last_buf=X + 1)
    s0, e0, r0 = _timeline(same)
    s1, e1, r1 = _timeline(other)
    assert s0 == s1 and e0 == e1
    assert r0.dependencies == r1.dependencies == 0


def test_a_covering_write_drops_only_what_it_covers() -> None:
    """Bookkeeping: a write that covers an earlier read drops that read's entry (it is ordered after it);
    a read it does not cover stays. Slow ScalarE read of bytes [0, 4), fast VectorE read of [4, 8), a
    VectorE write of [4, 8) (covers the fast read only), then a GpSimd write of [0, 4): WAR on the slow
    read."""
    evs = [
        (SLOW, (Region("sbuf", X, 0, 128, 0, 4),), (_private(0),)),
        (FAST, (Region("sbuf", X, 0, 128, 4, 8),), (_private(1),)),
        (FAST, (_private(2),), (Region("sbuf", X, 0, 128, 4, 8),)),
        (LAST, (_private(3),), (Region("sbuf", X, 0, 128, 0, 4),)),
    ]
    start, _, _ = _timeline(evs)
    assert start[2] == pytest.approx(FAST_NS)  # behind the fast read on its own engine, no sync
    assert start[3] == pytest.approx(SLOW_NS + SYNC)


def test_a_partly_overlapping_write_drops_nothing() -> None:
    """A write overlapping (not covering) the one entry of a buffer waits for it and keeps it: a later
    write of the rest of that entry's bytes still waits for it. Slow read of [4, 12), VectorE write of
    [0, 8), GpSimd write of [8, 12)."""
    evs = [
        (SLOW, (Region("sbuf", X, 0, 128, 4, 12),), (_private(0),)),
        (FAST, (_private(1),), (Region("sbuf", X, 0, 128, 0, 8),)),
        (LAST, (_private(2),), (Region("sbuf", X, 0, 128, 8, 12),)),
    ]
    start, _, _ = _timeline(evs)
    assert start[1] == pytest.approx(SLOW_NS + SYNC) and start[2] == pytest.approx(SLOW_NS + SYNC)


def test_a_reread_on_another_engine_keeps_the_slower_read() -> None:
    """A read that covers the previous read of a buffer replaces its entry only on the same engine (whose
    program order ends it later). Slow ScalarE read of X, fast VectorE read of all of X, GpSimd write of
    X: WAR on the slow read, not only on the fast one."""
    whole = Region("sbuf", X, 0, 128, 0, 1024)
    evs = [
        (SLOW, (whole,), (_private(0),)),
        (FAST, (whole,), (_private(1),)),
        (LAST, (_private(2),), (whole,)),
    ]
    start, end, _ = _timeline(evs)
    assert end[1] == pytest.approx(FAST_NS)
    assert start[2] == pytest.approx(SLOW_NS + SYNC)


@pytest.mark.parametrize("producer", ["ready-during-issue", "ready-after-issue"])
def test_a_dma_data_phase_waits_for_its_issue_and_its_input(producer: str) -> None:
    """RAW into a DMA (a store of a tile an engine writes): its descriptors issue from 0, its data starts
    at the later of the issue's end and the input's end + sync. A fast producer is done during the issue
    (the data waits for the issue only), a slow one after it (the data waits for the input)."""
    rec, ns = (FAST, FAST_NS) if producer == "ready-during-issue" else (SLOW, SLOW_NS)
    tile = Region("sbuf", X, 0, 128, 0, 1024)
    c = dma_record_cost(TINY_STORE)
    evs = [(rec, (_private(0),), (tile,)), (TINY_STORE, (tile,), (_hbm(0),))]
    start, end, _ = _timeline(evs)
    data_start = max(c.issue_ns, ns + SYNC)
    assert (ns + SYNC < c.issue_ns) == (producer == "ready-during-issue")
    assert start[1] == pytest.approx(data_start - c.issue_ns)
    assert end[1] == pytest.approx(data_start + c.data_ns / c.engines_used)
