"""Schedule semantics of the cost model v2 (nki_kernels.emulator.cost.schedule) on synthetic event
streams built from the event-log contract: ``(record, reads, writes)`` with
``Region(space, buf, p0, p1, b0, b1)``.  Every expected makespan is computed by hand from the documented
rules (docs/cost_model.md) and the instruction prices, which tests/test_cost.py pins separately.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from nki_kernels.emulator.cost import (
    Trn2CostParams,
    dma_record_cost,
    instruction_ns,
    profile,
    schedule_events,
)
from nki_kernels.emulator.trace import Region, Trace, TraceRecord
from tests.test_cost import dma, elementwise, matmul

P = Trn2CostParams()
SYNC = P.sync_ns  # 33 ns per cross-engine dependency (one semaphore instruction, CS149-PROF)
MM = 522 / 2.4  # bf16 128x128x512 matmul
EV = (512 + 141) / 0.96  # [128,512] fp32 PSUM -> SBUF on VectorE


class EventTrace(Trace):
    """A Trace carrying a hand-built event log (as ``Trace(keep_events=True)`` will)."""

    def __init__(self, events: list[tuple[TraceRecord, tuple[Region, ...], tuple[Region, ...]]]) -> None:
        super().__init__(kernel_name="synthetic")
        self.synthetic = events
        for rec, _, _ in events:
            self.add(rec)

    @property
    def events_available(self) -> bool:
        return True

    def iter_events(self) -> Iterator[tuple[TraceRecord, tuple[Region, ...], tuple[Region, ...]]]:
        return iter(self.synthetic)


def sb(buf: int, b0: int = 0, b1: int = 1024, p0: int = 0, p1: int = 128) -> Region:
    return Region("sbuf", buf, p0, p1, b0, b1)


def ps(buf: int, b0: int = 0, b1: int = 2048) -> Region:
    return Region("psum", buf, 0, 128, b0, b1)


def hbm(buf: int, b0: int = 0, b1: int = 1 << 20) -> Region:
    return Region("hbm", buf, 0, 0, b0, b1)


EVICT = elementwise("tensor_copy", "vector", 512, ("bfloat16", "float32"), ("sbuf", "psum"))


def run(events: list[Any], params: Trn2CostParams = P) -> Any:
    return schedule_events(events, params)


def test_program_order_on_one_engine() -> None:
    """Two independent matmuls on TensorE run back to back (no sync within an engine)."""
    r = run([(matmul(), (sb(1), sb(2)), (ps(10),)), (matmul(), (sb(3), sb(4)), (ps(11),))])
    assert r.makespan_ns == pytest.approx(2 * MM)
    assert r.dependencies == 0


def test_independent_engines_overlap() -> None:
    """No shared region: TensorE and VectorE run concurrently; makespan = the longer one."""
    r = run([(matmul(), (sb(1), sb(2)), (ps(10),)), (EVICT, (ps(11),), (sb(5),))])
    assert r.makespan_ns == pytest.approx(max(MM, EV))


def test_raw_cross_engine_adds_sync() -> None:
    """RAW through PSUM: the eviction starts when the matmul ends, plus one semaphore sync."""
    r = run([(matmul(), (sb(1), sb(2)), (ps(10),)), (EVICT, (ps(10),), (sb(5),))])
    assert r.makespan_ns == pytest.approx(MM + SYNC + EV)
    assert r.dependencies == 1 and r.cross_engine_dependencies == 1
    assert r.critical_path_ns == pytest.approx({"tensor": MM, "sync": SYNC, "vector": EV})
    assert r.critical_engines == ("vector", "tensor")


def test_raw_needs_overlapping_partitions_and_bytes() -> None:
    """Same buffer, disjoint bytes (or disjoint partitions): no dependency."""
    bytes_apart = run(
        [(matmul(), (sb(1), sb(2)), (ps(10, 0, 1024),)), (EVICT, (ps(10, 1024, 2048),), (sb(5),))]
    )
    assert bytes_apart.makespan_ns == pytest.approx(max(MM, EV)) and bytes_apart.dependencies == 0
    parts_apart = run(
        [
            (matmul(), (sb(1),), (sb(9, p0=0, p1=64),)),
            (EVICT, (sb(9, p0=64, p1=128),), (sb(5),)),
        ]
    )
    assert parts_apart.dependencies == 0


def test_raw_same_engine_has_no_sync() -> None:
    """A dependency inside one engine costs no semaphore: the engine order already covers it."""
    r = run([(EVICT, (ps(10),), (sb(5),)), (EVICT, (sb(5),), (sb(6),))])
    assert r.makespan_ns == pytest.approx(2 * EV)
    assert r.dependencies == 1 and r.cross_engine_dependencies == 0


def test_war_waits_for_earlier_readers() -> None:
    """WAR: a DMA overwriting a tile the VectorE is still reading moves its data after that read ends
    (+ sync); its descriptors issue meanwhile.  DMA end = max(issue, read end + sync) + data / 16 engines
    (128 partitions) + completion."""
    load = dma(1024)
    c = dma_record_cost(load)
    r = run([(EVICT, (ps(10), sb(7)), (sb(5),)), (load, (hbm(1),), (sb(7),))])
    assert c.issue_ns < EV + SYNC
    expect = EV + SYNC + c.data_ns / 16 + P.dma_completion_ns
    assert r.makespan_ns == pytest.approx(expect)
    # without the read, the DMA is independent of the copy
    free = run([(EVICT, (ps(10),), (sb(5),)), (load, (hbm(1),), (sb(7),))])
    assert free.makespan_ns == pytest.approx(max(EV, c.issue_ns + c.data_ns / 16))


def test_waw_orders_writes() -> None:
    """Two writes of the same region keep their order (the second waits for the first + sync)."""
    r = run([(matmul(), (sb(1), sb(2)), (ps(10),)), (EVICT, (sb(3),), (ps(10),))])
    assert r.makespan_ns == pytest.approx(MM + SYNC + EV)


def test_dma_issue_is_serial_and_data_overlaps() -> None:
    """Independent tiny DMAs: one issue lane (fitted), dma_issue_ns each; the last one's data follows its
    issue."""
    tiny = dma(4, parts=1)
    c = dma_record_cost(tiny)
    evs = [(tiny, (hbm(1, 4 * i, 4 * i + 4),), (sb(100 + i, 0, 4, 0, 1),)) for i in range(3)]
    r = run(evs)
    # one partition -> one engine: the data lasts data_ns on it
    assert r.makespan_ns == pytest.approx(3 * c.issue_ns + c.data_ns)
    assert r.engine_busy_ns["dma_issue"] == pytest.approx(3 * c.issue_ns)


def test_dma_pool_throughput_bounds_big_transfers() -> None:
    """Large independent DMAs are bound by the 16-engine pool: sum(data) / 16 after the first issue."""
    big = dma(4096)
    c = dma_record_cost(big)
    assert c.data_ns / 16 > c.issue_ns
    evs = [(big, (hbm(1, i << 19, (i + 1) << 19),), (sb(200 + i, 0, 4096),)) for i in range(10)]
    r = run(evs)
    assert r.makespan_ns == pytest.approx(c.issue_ns + 10 * c.data_ns / 16)


def test_tensor_throttled_after_idle_gap() -> None:
    """A matmul waiting > 500 ns for its DMA input runs 2.7x longer (NAD-BOUNDS); fed, it does not."""
    load = dma(1024)
    c = dma_record_cost(load)
    arrive = c.issue_ns + c.data_ns / 16
    assert arrive + SYNC >= P.tensor_throttle_gap_ns
    r = run([(load, (hbm(1),), (sb(1),)), (matmul(), (sb(1), sb(2)), (ps(10),))])
    assert r.makespan_ns == pytest.approx(arrive + SYNC + 2.7 * MM)
    assert r.throttled_tensor_instructions == 1
    fed = run([(matmul(), (sb(3), sb(2)), (ps(10),))])
    assert fed.makespan_ns == pytest.approx(MM) and fed.throttled_tensor_instructions == 0


def test_vector_gpsimd_contention() -> None:
    """The part of a GpSimd instruction overlapping VectorE's busy time runs 1.5x longer."""
    iota = elementwise("iota", "gpsimd", 512, ("int32",), ("sbuf",))
    g = instruction_ns(iota)
    r = run([(EVICT, (ps(10),), (sb(5),)), (iota, (), (sb(6),))])
    overlap = min(EV, g)
    assert r.makespan_ns == pytest.approx(max(EV, g + 0.5 * overlap))
    none = run([(EVICT, (ps(10),), (sb(5),)), (iota, (), (sb(6),))], replace(P, vector_gpsimd_contention=1.0))
    assert none.makespan_ns == pytest.approx(max(EV, g))


def test_programs_on_separate_cores_run_in_parallel() -> None:
    a = matmul(pid=0)
    b = matmul(pid=1)
    evs = [(a, (sb(1),), (ps(10),)), (b, (sb(2),), (ps(11),))]
    assert schedule_events(evs, P, cores=2).makespan_ns == pytest.approx(MM)
    assert schedule_events(evs, P, cores=1).makespan_ns == pytest.approx(2 * MM)
    with pytest.raises(ValueError, match="cores"):
        schedule_events(evs, P, cores=0)


def test_profile_uses_the_schedule_when_events_exist() -> None:
    """latency = makespan + fixed; the bound and serial figures are reported beside it."""
    t = EventTrace([(matmul(), (sb(1), sb(2)), (ps(10),)), (EVICT, (ps(10),), (sb(5),))])
    prof = profile(t)
    assert prof.model == "schedule"
    assert prof.schedule_ns == pytest.approx(MM + SYNC + EV)
    assert prof.latency_ns == pytest.approx(MM + SYNC + EV + P.kernel_fixed_ns)
    assert prof.bound_ns == pytest.approx(EV + P.kernel_fixed_ns)  # busiest engine + fixed (no DMA)
    assert prof.bound_ns <= prof.latency_ns <= prof.serial_ns
    assert prof.critical_engines == ("vector", "tensor") and prof.bottleneck == "vector"
    assert not any("bound model" in n for n in prof.notes)
    assert profile(t, schedule=False).model == "bound"


def test_many_accesses_to_one_buffer_stay_bounded() -> None:
    """Bookkeeping: 2,000 reads of disjoint slices of one tile, then a write of the whole tile waits
    for all of them (merged entries stay conservative: never earlier than the true WAR time)."""
    evs: list[Any] = [
        (
            elementwise("tensor_copy", "vector", 512, ("float32",) * 2, ("sbuf",) * 2),
            (sb(1, 4 * i, 4 * i + 4),),
            (sb(2 + i),),
        )
        for i in range(2000)
    ]
    one = instruction_ns(evs[0][0])
    evs.append((matmul(), (sb(9),), (sb(1, 0, 8000),)))
    r = run(evs)
    assert r.makespan_ns == pytest.approx(2000 * one + SYNC + 2.7 * MM)


def test_two_issue_lanes_halve_the_issue_time() -> None:
    """With dma_issue_lanes=2 (the two hwdge blocks documented in DGE) independent tiny DMAs issue two at
    a time: the 4th DMA's issue ends at 2 x issue; it waits for the 3rd's pool slot (data / 16) and lasts
    data on its one engine."""
    tiny = dma(4, parts=1)
    c = dma_record_cost(tiny)
    evs = [(tiny, (hbm(1, 4 * i, 4 * i + 4),), (sb(100 + i, 0, 4, 0, 1),)) for i in range(4)]
    r = run(evs, replace(P, dma_issue_lanes=2))
    assert r.makespan_ns == pytest.approx(2 * c.issue_ns + c.data_ns / 16 + c.data_ns)


def test_dma_issue_overlaps_its_wait_but_swdge_does_not() -> None:
    """hwdge: a store whose input is late issues its descriptors while waiting (end = ready + data);
    swdge generates them on GpSimd only after the input exists (end = ready + issue + data)."""
    store = dma(1024, direction="sbuf->hbm")
    c = dma_record_cost(store)
    evs = [(EVICT, (ps(10),), (sb(5),)), (store, (sb(5),), (hbm(2),))]
    assert c.issue_ns < EV + SYNC
    assert run(evs).makespan_ns == pytest.approx(EV + SYNC + c.data_ns / 16)
    sw = dma(1024, direction="sbuf->hbm", dge="swdge")
    csw = dma_record_cost(sw)
    r = run([(EVICT, (ps(10),), (sb(5),)), (sw, (sb(5),), (hbm(2),))])
    assert r.makespan_ns == pytest.approx(EV + SYNC + csw.issue_ns + csw.data_ns / 16)
    assert r.engine_busy_ns["gpsimd"] == pytest.approx(csw.issue_ns)


def test_reordering_engines_fill_idle_gaps() -> None:
    """engine_in_order=False (the optimistic end): an independent VectorE copy issued after one that waits
    for a matmul runs in the idle gap before it; in program order it waits behind it."""
    evs = [
        (matmul(), (sb(1), sb(2)), (ps(10),)),
        (EVICT, (ps(10),), (sb(5),)),
        (EVICT, (ps(11),), (sb(6),)),
    ]
    assert run(evs).makespan_ns == pytest.approx(MM + SYNC + 2 * EV)
    assert MM + SYNC < EV  # the gap before the dependent copy is too short for the independent one...
    assert run(evs, replace(P, engine_in_order=False)).makespan_ns == pytest.approx(EV + MM + SYNC + EV)
    short = elementwise("tensor_copy", "vector", 64, ("float32",) * 2, ("sbuf",) * 2)  # ...a short one fits
    sh = instruction_ns(short)
    assert sh <= MM + SYNC
    evs2 = [*evs[:2], (short, (sb(3),), (sb(6),))]
    assert run(evs2).makespan_ns == pytest.approx(MM + SYNC + EV + sh)
    assert run(evs2, replace(P, engine_in_order=False)).makespan_ns == pytest.approx(MM + SYNC + EV)


@pytest.mark.emulator
def test_schedule_of_an_emulated_kernel_by_hand() -> None:
    """The emulator's event log of a tiny matmul kernel, scheduled, equals the hand-computed timeline:
    load A (issue, then data / 16 on the pool), load B (issued after A on the one lane), the matmul after
    both (+ sync, throttled: TensorE idle since 0 > 500 ns), the PSUM eviction (+ sync), the store (issued
    early on the lane, data after the eviction + sync); latency = makespan + fixed."""
    import numpy as np

    from nki_kernels.emulator import isa as nisa
    from nki_kernels.emulator import language as nl
    from nki_kernels.emulator import run as emu_run

    def mm(a_t, b):  # type: ignore[no-untyped-def]
        k, m = a_t.shape
        n = b.shape[1]
        out = nl.ndarray((m, n), dtype=nl.float32, buffer=nl.shared_hbm)
        at = nl.ndarray((k, m), dtype=a_t.dtype, buffer=nl.sbuf)
        bt = nl.ndarray((k, n), dtype=b.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=at, src=a_t)
        nisa.dma_copy(dst=bt, src=b)
        ps_t = nl.ndarray((m, n), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps_t, stationary=at, moving=bt)
        o = nl.ndarray((m, n), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=o, src=ps_t)
        nisa.dma_copy(dst=out, src=o)
        return out

    a = np.zeros((128, 128), dtype=np.float32)
    b = np.zeros((128, 512), dtype=np.float32)
    _, trace = emu_run(mm, a, b, keep_events=True)
    prof = profile(trace)
    assert prof.model == "schedule"
    issue = P.dma_issue_ns
    da = dma_record_cost(next(r for r, _ in trace.entries() if r.engine == "dma" and r.free_elems == 128))
    db = dma_record_cost(next(r for r, _ in trace.entries() if r.engine == "dma" and r.free_elems == 512))
    assert da.descriptors == ((512, 128),) and db.descriptors == ((2048, 128),)
    assert issue + da.data_ns / 16 <= 2 * issue  # A's data is off the pool before B's starts
    end_b = 2 * issue + db.data_ns / 16
    mm_ns = 2.7 * (4 * 512 + 10) / 2.4  # fp32 matmul, throttled
    ev_ns = (512 + 141) / 0.96  # fp32 PSUM -> SBUF on VectorE
    makespan = end_b + SYNC + mm_ns + SYNC + ev_ns + SYNC + db.data_ns / 16  # store: same bytes as B
    assert prof.schedule_ns == pytest.approx(makespan)
    assert prof.latency_ns == pytest.approx(makespan + P.kernel_fixed_ns)
    assert prof.throttled_tensor_instructions == 1
    assert set(prof.critical_engines) == {"tensor", "vector", "dma"}
    assert prof.latency_ns <= prof.serial_ns


def test_lane_never_double_books_forgotten_time() -> None:
    """The issue lane / DMA pool / reordering engines keep their latest 512 intervals; 2,000 independent
    matmuls on a reordering TensorE still take 2,000 x the matmul time (none lands in forgotten time)."""
    evs = [(matmul(), (sb(1), sb(2)), (ps(10 + i),)) for i in range(2000)]
    r = run(evs, replace(P, engine_in_order=False))
    assert r.makespan_ns == pytest.approx(2000 * MM)


def test_indirect_dma_index_tile_does_not_set_its_engines() -> None:
    """An indirect HBM->HBM DMA also reads its 1-partition index tile: its data still spreads over all 16
    engines (the record's partition count), it waits for the index (RAW) and generates its descriptors
    on GpSimd (swdge) after it."""
    big = replace(dma(32768, parts=128, direction="hbm->hbm"), meta=(("indirect", "scalar"),))
    c = dma_record_cost(big)
    assert c.mode == "swdge" and c.engines_used == 16
    idx = elementwise("tensor_scalar", "vector", 1, ("int32", "int32"), ("sbuf", "sbuf"))
    t_idx = instruction_ns(idx)
    r = run(
        [(idx, (sb(1, 0, 4, 0, 1),), (sb(2, 0, 4, 0, 1),)), (big, (hbm(3), sb(2, 0, 4, 0, 1)), (hbm(4),))]
    )
    assert r.makespan_ns == pytest.approx(t_idx + SYNC + c.issue_ns + c.data_ns / 16)


def test_war_survives_the_bookkeeping_merge() -> None:
    """WAR after MAX_ENTRIES: a slow early reader (GpSimd) of a tile, then more short VectorE reads of
    disjoint slices than the bookkeeping keeps, so the early read is merged into a bounding entry; a later
    write of the whole tile still waits for the slow read (its end is the merged entry's, + sync)."""
    from nki_kernels.emulator.cost.schedule import MAX_ENTRIES

    slow = elementwise("tensor_copy", "gpsimd", 65536, ("float32",) * 2, ("sbuf",) * 2)
    fast = elementwise("tensor_copy", "vector", 64, ("float32",) * 2, ("sbuf",) * 2)
    n = 2 * MAX_ENTRIES + 3
    evs: list[Any] = [(slow, (sb(1, 0, 4),), (sb(2),))]
    evs += [(fast, (sb(1, 4 * i + 4, 4 * i + 8),), (sb(100 + i),)) for i in range(n)]
    evs.append((EVICT, (ps(10),), (sb(1, 0, 8000),)))  # VectorE overwrites the whole tile
    g, f = instruction_ns(slow), instruction_ns(fast)
    assert g > n * f  # the slow read ends last: only its entry can hold the write back
    r = schedule_events(evs, P, keep_timeline=True)
    start = r.timeline[0][-1]
    assert start == pytest.approx(g + SYNC)  # GpSimd -> VectorE: one semaphore


def test_raw_through_hbm_orders_a_load_after_the_store() -> None:
    """RAW through HBM: a load (core 1) of bytes a store (core 0) just wrote waits for the store's end;
    a load of other HBM bytes runs beside the store (separate cores, separate DMA pools)."""
    store, load = dma(1 << 16, direction="sbuf->hbm"), dma(64, pid=1)  # a long store, a short load
    cl = dma_record_cost(load)

    def sched(load_buf: int) -> Any:
        evs = [(store, (sb(1),), (hbm(7, 0, 1 << 23),)), (load, (hbm(load_buf, 0, 8192),), (sb(2),))]
        return schedule_events(evs, P, cores=2, keep_timeline=True)

    dep, free = sched(7), sched(8)
    store_end = dep.timeline[1][0]
    assert dep.dependencies == 1 and free.dependencies == 0
    assert dep.timeline[1][1] >= store_end + cl.data_ns / 16  # the load's data after the store's end
    assert free.timeline[1][1] < store_end  # unordered: done long before the store
