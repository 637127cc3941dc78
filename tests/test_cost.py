"""Tests of the trn2 cost model v2's pricing rules and bound model (nki_kernels.emulator.cost).

Expected values are computed here from the formulas documented in docs/cost_model.md (v2) and the
parameter defaults, independently of the implementation.  Traces are built by hand from TraceRecord.
Schedule semantics: tests/test_cost_schedule.py; calibration bands: tests/test_cost_calibration.py.
"""

from __future__ import annotations

import json
import math
from dataclasses import fields, replace

import numpy as np
import pytest

from nki_kernels.emulator.cost import (
    DMA_EFFICIENCY_POINTS,
    KernelProfile,
    Trn2CostParams,
    dma_efficiency,
    dma_record_cost,
    instruction_cycles,
    instruction_ns,
    profile,
    profile_range,
    queued_gbps,
    split_descriptors,
)
from nki_kernels.emulator.trace import Trace, TraceRecord

P = Trn2CostParams()


# ------------------------------------------------------------------------------------------ builders
def matmul(k: int = 128, m: int = 128, n: int = 512, dtype: str = "bfloat16", pid: int = 0) -> TraceRecord:
    return TraceRecord(
        op="nc_matmul",
        engine="tensor",
        shapes=((m, n), (k, m), (k, n)),
        dtypes=("float32", dtype, dtype),
        buffers=("psum", "sbuf", "sbuf"),
        partitions=k,
        free_elems=n,
        flops=2 * k * m * n,
        program_id=pid,
        meta=(("K", k), ("M", m), ("N", n)),
    )


def dma(
    run: int,
    parts: int = 128,
    direction: str = "hbm->sbuf",
    runs_per_part: int = 1,
    op: str = "dma_copy",
    dge: str | None = None,
    pid: int = 0,
) -> TraceRecord:
    nbytes = parts * run * runs_per_part
    onchip = "sbuf"
    bufs = {"hbm->sbuf": (onchip, "hbm"), "sbuf->hbm": ("hbm", onchip), "hbm->hbm": ("hbm", "hbm")}[direction]
    return TraceRecord(
        op=op,
        engine="dma",
        shapes=((parts, run * runs_per_part // 2), (parts, run * runs_per_part // 2)),
        dtypes=("bfloat16", "bfloat16"),
        buffers=bufs,
        partitions=0 if direction == "hbm->hbm" else parts,
        free_elems=run * runs_per_part // 2,
        bytes_read=nbytes,
        bytes_written=nbytes,
        descriptors=((run, parts * runs_per_part),),
        direction=direction,
        program_id=pid,
        meta=(() if dge is None else (("dge_mode", dge),)),
    )


def elementwise(
    op: str,
    engine: str,
    n: int,
    dtypes: tuple[str, ...],
    buffers: tuple[str, ...],
    meta: tuple[tuple[str, object], ...] = (),
) -> TraceRecord:
    shapes = tuple((128, n) for _ in dtypes)
    return TraceRecord(
        op=op,
        engine=engine,
        shapes=shapes,
        dtypes=dtypes,
        buffers=buffers,
        partitions=128,
        free_elems=n,
        flops=128 * n,
        meta=meta,
    )


def trace_of(*items: tuple[TraceRecord, int], name: str = "t") -> Trace:
    t = Trace(kernel_name=name)
    for rec, n in items:
        t.add(rec, n)
    return t


FIXED = P.kernel_fixed_ns  # 12,850 ns (CS149 profiles: 12.4-13.3 us with every engine idle)
ISSUE = P.dma_issue_ns  # 510 ns per hwdge DMA (re-fitted across every default-compiled source)


def desc_ns(s: int) -> float:
    """Engine-ns of one s-byte descriptor: s * 16 engines / queued GB/s (documented v2 DMA formula)."""
    return s * 16 / queued_gbps(s)


# ------------------------------------------------------------------------------ per-instruction prices
def test_matmul_formulas() -> None:
    """ISA: max(min(64, M), N) cycles + 10 overhead; fp32 x4; K, M or N below 128 adds the fitted
    small-tile cycles (160); LoadStationary M/4 overlapped."""
    small = P.matmul_small_tile_cycles
    assert small == 160
    assert instruction_cycles(matmul(n=512)) == 512 + 10
    assert instruction_cycles(matmul(n=16)) == 64 + 10 + small
    assert instruction_cycles(matmul(m=32, n=16)) == 32 + 10 + small
    assert instruction_cycles(matmul(k=32, n=512)) == 512 + 10 + small
    assert instruction_cycles(matmul(n=512, dtype="float32")) == 4 * 512 + 10
    assert instruction_ns(matmul()) == pytest.approx(522 / 2.4)  # 217.5 ns: NAD-TE ~217 ns measured
    no_ls = replace(P, load_stationary_overlapped=False)
    assert instruction_cycles(matmul(n=512), no_ls) == 512 + 128 / 4 + 10


def test_matmul_dims_from_shapes_when_meta_missing() -> None:
    rec = replace(matmul(n=256), meta=())
    assert instruction_cycles(rec) == 256 + 10


def test_fp8_double_row_same_cycles_twice_the_flops() -> None:
    """TRN2-ARCH: [128,2,128] x [128,2,512] fp8 double-row does 2x the FLOPs of a bf16 K=128 matmul in
    the same cycles (512 + 10)."""
    fp8 = "float8_e4m3"
    rec = TraceRecord(
        op="nc_matmul",
        engine="tensor",
        shapes=((128, 512), (128, 2, 128), (128, 2, 512)),
        dtypes=("float32", fp8, fp8),
        buffers=("psum", "sbuf", "sbuf"),
        partitions=128,
        free_elems=1024,
        flops=2 * 256 * 128 * 512,
        meta=(("perf_mode", "double_row"),),
    )
    assert instruction_cycles(rec) == instruction_cycles(matmul()) == 522
    prof = profile(trace_of((rec, 100)))
    bf = profile(trace_of((matmul(), 100)))
    assert prof.tensor_flops == 2 * bf.tensor_flops
    assert prof.engine_busy_ns["tensor"] == pytest.approx(bf.engine_busy_ns["tensor"])
    # recognised from the shape alone (fp8 rank-3 stationary with 2 rows)
    assert instruction_cycles(replace(rec, meta=())) == 522


def test_transpose_cost_fp32_factor_and_not_counted_as_flops() -> None:
    """ISA: nc_transpose max(P, min(64, F)) + 10; fp32 x4 (CS149: fp32 128x128 ~219 ns); MFU excludes
    transposes."""
    tr = TraceRecord(
        op="nc_transpose",
        engine="tensor",
        shapes=((128, 128), (128, 128)),
        dtypes=("bfloat16", "bfloat16"),
        buffers=("psum", "sbuf"),
        partitions=128,
        free_elems=128,
        flops=0,
    )
    assert instruction_cycles(tr) == 128 + 10
    f32 = replace(tr, dtypes=("float32", "float32"))
    assert instruction_cycles(f32) == 4 * 128 + 10
    assert instruction_ns(f32) == pytest.approx(219, rel=0.01)  # published ~219 ns
    prof = profile(trace_of((tr, 4)))
    assert prof.tensor_flops == 0 and prof.tensore_util == 0.0
    assert prof.engine_busy_ns["tensor"] == pytest.approx(4 * 138 / 2.4)


def test_vector_perf_modes_and_psum_access() -> None:
    """TRN2-ARCH: x4 bf16 SBUF contiguous copy/tensor_scalar, x2 non-contiguous or a 2-byte PSUM source;
    an fp32 PSUM source gets no factor but the PSUM access (141 cycles): [128,512] fp32->bf16 eviction
    = (512 + 141) / 0.96 = 680 ns, inside the measured 672-688 ns (NAD-BOUNDS)."""
    bf = ("bfloat16", "bfloat16")
    assert instruction_cycles(elementwise("tensor_copy", "vector", 2048, bf, ("sbuf", "sbuf"))) == 512
    nc = elementwise("tensor_scalar", "vector", 2048, bf, ("sbuf", "sbuf"), meta=(("contiguous", False),))
    assert instruction_cycles(nc) == 1024
    ev = elementwise("tensor_copy", "vector", 512, ("bfloat16", "float32"), ("sbuf", "psum"))
    assert instruction_cycles(ev) == 512 + 141
    assert 672 <= instruction_ns(ev) <= 688
    ev_bf = elementwise("tensor_copy", "vector", 512, ("bfloat16", "bfloat16"), ("sbuf", "psum"))
    assert instruction_cycles(ev_bf) == 256 + 141
    assert (
        instruction_cycles(elementwise("tensor_copy", "vector", 512, ("float32",) * 2, ("sbuf",) * 2)) == 512
    )
    assert instruction_cycles(elementwise("tensor_copy", "vector", 128, bf, ("sbuf", "sbuf"))) == 64
    off = replace(P, vector_perf_mode=False)
    assert instruction_cycles(elementwise("tensor_copy", "vector", 2048, bf, ("sbuf", "sbuf")), off) == 2048


def test_vector_fp8_rate_is_a_range() -> None:
    """FP8 on VectorE: unmeasured; nominal/low = the BF16 performance-mode factor, high = the 4-byte rate."""
    f8 = ("float8_e4m3", "float8_e4m3")
    rec = elementwise("tensor_copy", "vector", 2048, f8, ("sbuf", "sbuf"))
    assert instruction_cycles(rec) == 2048 / 4
    assert instruction_cycles(rec, Trn2CostParams.low()) == 2048 / 4
    assert instruction_cycles(rec, Trn2CostParams.high()) == 2048


def test_vector_tensor_tensor_and_reduce() -> None:
    """ISA: tensor_tensor N if a PSUM input (+ PSUM access) or bf16 SBUF add/mul/sub, else 2N (bf16 SBUF
    halved again by v3 perf mode); tensor_reduce N, N/2 for bf16 add/max; reciprocal 8N."""
    f32 = ("float32",) * 3
    bf = ("bfloat16",) * 3
    tt = "tensor_tensor"
    assert instruction_cycles(elementwise(tt, "vector", 512, f32, ("sbuf",) * 3, (("op", "add"),))) == 1024
    psum_tt = elementwise(tt, "vector", 512, f32, ("sbuf", "psum", "sbuf"), (("op", "add"),))
    assert instruction_cycles(psum_tt) == 512 + 141
    assert instruction_cycles(elementwise(tt, "vector", 512, bf, ("sbuf",) * 3, (("op", "multiply"),))) == 256
    assert instruction_cycles(elementwise(tt, "vector", 512, bf, ("sbuf",) * 3, (("op", "divide"),))) == 512
    assert instruction_cycles(elementwise(tt, "vector", 512, bf, ("sbuf",) * 3, (("alu", "divide"),))) == 512
    ts = elementwise(
        "tensor_scalar", "vector", 256, ("float32",) * 2, ("sbuf",) * 2, (("alu", ("reciprocal", None)),)
    )
    assert instruction_cycles(ts) == 8 * 256
    red = TraceRecord(
        op="tensor_reduce",
        engine="vector",
        shapes=((128, 1), (128, 512)),
        dtypes=("bfloat16", "bfloat16"),
        buffers=("sbuf", "sbuf"),
        partitions=128,
        free_elems=512,
        meta=(("op", "max"),),
    )
    assert instruction_cycles(red) == 256
    assert instruction_cycles(replace(red, dtypes=("float32", "float32"))) == 512


def test_scalar_and_gpsimd_and_small_overhead() -> None:
    """ISA: activation max(64, N) (+64 reducing) (+137 PSUM access: [128,128] fp32 PSUM->SBUF =
    (128+137)/1.2 = 221 ns, CS149 ~221 ns); GpSimd 150 + N; +100 below 128 elements."""
    f32 = ("float32", "float32")
    act = elementwise("activation", "scalar", 512, f32, ("sbuf", "sbuf"))
    assert instruction_ns(act) == pytest.approx(512 / 1.2)
    assert instruction_cycles(replace(act, meta=(("reduce", True),))) == 512 + 64
    ev = elementwise("activation", "scalar", 128, f32, ("sbuf", "psum"))
    assert instruction_ns(ev) == pytest.approx(221, rel=0.005)
    assert instruction_cycles(elementwise("activation", "scalar", 1, f32, ("sbuf", "sbuf"))) == 64 + 100
    assert instruction_cycles(elementwise("iota", "gpsimd", 512, ("int32",), ("sbuf",))) == 150 + 512
    red3 = replace(act, shapes=((128, 512), (128, 512), (128, 1)), dtypes=f32 + ("float32",))
    assert instruction_cycles(red3) == 512 + 64
    assert instruction_cycles(act, replace(P, access_start_cycles=60)) == 512 + 60
    with pytest.raises(ValueError, match="compute engine"):
        instruction_cycles(dma(512))


# ---------------------------------------------------------------------------------------------- DMA
def test_queued_throughput_points_and_interpolation() -> None:
    """Measured queued throughput: 512 B 299, 1 KiB 259, 4 KiB 354 GB/s (CS149 / NAD-DMA); log2-linear
    between points, constant descriptor time below 32 B, flat above 32 KiB.  256 B is the per-descriptor
    time 4.7 ns + s / 23 B/ns on 16 engines (docs/cost_model.md section 2): 16 * 256 / (4.7 + 256/23)
    = 258.7 GB/s; below it the single-DMA curve's shape: 32 B = 258.7 * 0.014 / 0.10 = 36.2 GB/s."""
    assert queued_gbps(512) == 299.0 and queued_gbps(1024) == 259.0 and queued_gbps(4096) == 354.0
    assert queued_gbps(1536) == pytest.approx(259 + (244 - 259) * math.log2(1.5))
    at256 = 16 * 256 / (4.7 + 256 / 23)
    assert queued_gbps(256) == pytest.approx(at256, abs=0.05)
    assert queued_gbps(32) == pytest.approx(at256 * 0.014 / 0.10, abs=0.05)
    assert queued_gbps(16) == pytest.approx(queued_gbps(32) * 16 / 32)
    # pessimistic end: the slowest leave-one-source-out re-fit of the descriptor time, 61 ns
    hi = dict(Trn2CostParams.high().dma_queued_gbps_points)
    assert hi[256] == pytest.approx(16 * 256 / (61 + 256 / 23), abs=0.05) and hi[512] == 299.0
    assert queued_gbps(1 << 20) == 365.0
    with pytest.raises(ValueError, match="run_bytes"):
        queued_gbps(0)


def test_single_dma_efficiency_curve_kept_for_reference() -> None:
    for s, e in DMA_EFFICIENCY_POINTS:
        assert dma_efficiency(s) == pytest.approx(e)
    assert dma_efficiency(3072) == pytest.approx(0.81 + (0.97 - 0.81) * math.log2(1.5))


def test_split_descriptors() -> None:
    assert split_descriptors(((100_000, 2), (512, 3)), 32768) == ((512, 3), (1696, 2), (32768, 6))
    with pytest.raises(ValueError, match="max_bytes"):
        split_descriptors(((1, 1),), 0)


def test_dma_record_cost_formula() -> None:
    """data_ns = count * s * 16 / queued_gbps(s); a descriptor cannot span partitions; issue per mode."""
    rec = replace(dma(1024), descriptors=((128 * 1024, 1),))
    c = dma_record_cost(rec)
    assert c.descriptors == ((1024, 128),)
    assert c.data_ns == pytest.approx(128 * desc_ns(1024))
    assert c.engines_used == 16 and c.mode == "hwdge" and c.issue_ns == ISSUE
    hh = dma(100_000, parts=1, direction="hbm->hbm")
    assert dma_record_cost(hh).descriptors == ((1696, 1), (32768, 3))
    assert dma_record_cost(dma(64, dge="none")).issue_ns == P.dge_none_issue_ns
    sw = dma_record_cost(dma(64, dge="swdge"))
    assert sw.issue_ns == P.swdge_issue_ns and sw.swdge_ns == P.swdge_issue_ns
    indirect = dma_record_cost(replace(dma(64, parts=1), meta=(("indirect", 0),)))
    assert indirect.mode == "swdge"
    assert dma_record_cost(dma(64, dge="dge_mode.unknown")).mode == "hwdge"
    with pytest.raises(ValueError, match="dge_mode"):
        dma_record_cost(dma(64, dge="fast"))
    with pytest.raises(ValueError, match="direction"):
        dma_record_cost(replace(dma(2048), direction="up"))


def test_dma_transpose_efficiency_is_a_range() -> None:
    """SBUF->SBUF dma_transpose: no public trn2 timing; 'up to ~50%' (TRN2-ARCH) is the optimistic end,
    12.5% the pessimistic, nominal 25%; HBM->SBUF 90% / 45% / 64%."""
    sb = replace(dma(256), direction="sbuf->sbuf")
    base = dma_record_cost(sb).data_ns
    tr = replace(sb, op="dma_transpose")
    assert dma_record_cost(tr).data_ns == pytest.approx(base / 0.25)
    lo, hi = Trn2CostParams.low(), Trn2CostParams.high()  # each end's own copy price (256 B is ranged)
    assert dma_record_cost(tr, lo).data_ns == pytest.approx(dma_record_cost(sb, lo).data_ns / 0.5)
    assert dma_record_cost(tr, hi).data_ns == pytest.approx(dma_record_cost(sb, hi).data_ns / 0.125)
    hb = replace(dma(2048), op="dma_transpose")
    assert dma_record_cost(hb).data_ns == pytest.approx(dma_record_cost(dma(2048)).data_ns / 0.64)


# ------------------------------------------------------------------------------------- bound model
def test_bound_model_sums_known_parts() -> None:
    """A trace without an event log: the bound model (docs/cost_model.md): engine sums, DMA = max(data/16,
    issue, HBM), latency = max engine + exposed (first issue x2 with loads and stores) + fixed."""
    mm = matmul()
    act = elementwise("activation", "scalar", 512, ("float32", "float32"), ("sbuf", "psum"))
    tt = elementwise("tensor_tensor", "vector", 256, ("float32",) * 3, ("sbuf",) * 3, meta=(("op", "add"),))
    iota = elementwise("iota", "gpsimd", 64, ("int32",), ("sbuf",))
    load, store = dma(2048), dma(1024, direction="sbuf->hbm")
    t = trace_of((mm, 3), (act, 2), (tt, 5), (iota, 1), (load, 4), (store, 2))
    prof = profile(t)
    tensor = 3 * 522 / 2.4
    scalar = 2 * (512 + 137) / 1.2
    vector = 5 * 512 / 0.96
    gpsimd = (150 + 64 + 100) / 1.2
    extra = 0.5 * min(vector, gpsimd)  # contention 1.5 while both are busy
    data = (4 * 128 * desc_ns(2048) + 2 * 128 * desc_ns(1024)) / 16
    issue = 6 * ISSUE
    hbm = (4 * 128 * 2048 + 2 * 128 * 1024) / 725.0
    dma_t = max(data, issue, hbm)
    exposed = 2 * ISSUE
    assert dma_t > tensor  # DMA-starved TensorE: charged min(2.7 x tensor, DMA) (throttling)
    tensor = min(2.7 * tensor, dma_t)
    busy = prof.engine_busy_ns
    assert prof.model == "bound"
    assert busy["tensor"] == pytest.approx(tensor)
    assert busy["scalar"] == pytest.approx(scalar)
    assert busy["vector"] == pytest.approx(vector + extra)
    assert busy["gpsimd"] == pytest.approx(gpsimd + extra)
    assert busy["dma"] == pytest.approx(dma_t)
    lat = max(tensor, scalar, vector + extra, gpsimd + extra, dma_t) + exposed + FIXED
    assert prof.latency_ns == pytest.approx(lat) and prof.bound_ns == pytest.approx(lat)
    serial = tensor + scalar + vector + gpsimd + 2 * extra + dma_t + exposed + FIXED
    assert prof.serial_ns == pytest.approx(serial)
    assert prof.instructions == {"tensor": 3, "vector": 5, "scalar": 2, "gpsimd": 1, "dma": 6}
    assert prof.descriptor_histogram == {1024: 256, 2048: 512}
    assert prof.tensor_flops == 3 * 2 * 128 * 128 * 512


def test_bound_model_says_so_when_no_event_log() -> None:
    """No keep_events: the profile falls back to the bound model and says so (never silently)."""
    prof = profile(trace_of((matmul(), 10)))
    assert prof.model == "bound" and prof.schedule_ns is None
    assert any("bound model" in n and "keep_events" in n for n in prof.notes)
    assert "bound" in prof.table()
    with pytest.raises(ValueError, match="keep_events"):
        profile(trace_of((matmul(), 1)), schedule=True)


def test_dma_starved_tensore_is_throttled_in_the_bound_model() -> None:
    """NAD-BOUNDS: a DMA-starved TensorE runs up to 2.7x its rate; the bound model charges
    min(2.7 x tensor, DMA time)."""
    t = trace_of((matmul(), 10), (dma(256), 100))
    prof = profile(t)
    dma_t = prof.engine_busy_ns["dma"]
    assert prof.bottleneck == "dma"
    assert prof.engine_busy_ns["tensor"] == pytest.approx(min(10 * 522 / 2.4 * 2.7, dma_t))


def test_calibration_back_to_back_matmuls_98pct_of_active() -> None:
    """NAD-TE: 2,048 full back-to-back bf16 matmuls at 77.2 TF = 98% over TensorE-active time."""
    prof = profile(trace_of((matmul(), 2048)))
    assert prof.tensore_active_util == pytest.approx(77.2 / 78.6, abs=0.01)


def test_hbm_cap_binds_with_many_cores() -> None:
    """HW: ~725 GB/s per HBM stack shared by 2 cores; an HBM->HBM copy reads and writes HBM."""
    t = Trace()
    for pid in range(8):
        t.add(dma(32768, direction="hbm->hbm", pid=pid), 100)
    prof = profile(t, cores=8)
    assert prof.hbm_ns == pytest.approx(100 * 2 * 128 * 32768 / 362.5)
    assert prof.engine_busy_ns["dma"] == pytest.approx(prof.hbm_ns)


def test_programs_spread_over_cores() -> None:
    t = trace_of((matmul(pid=0), 100), (matmul(pid=1), 100))
    one, two = profile(t, cores=1), profile(t, cores=2)
    assert one.latency_ns == pytest.approx(200 * 522 / 2.4 + FIXED)
    assert two.latency_ns == pytest.approx(100 * 522 / 2.4 + FIXED)
    assert len(two.per_core_latency_ns) == 2


def test_profile_input_validation_and_empty_trace() -> None:
    with pytest.raises(TypeError, match="trace"):
        profile([])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cores"):
        profile(Trace(), cores=0)
    prof = profile(Trace(kernel_name="empty"))
    assert prof.latency_ns == FIXED and prof.bottleneck == "none"


def test_table_and_json() -> None:
    prof = profile(trace_of((matmul(), 8), (dma(4096), 4)))
    text = prof.table()
    assert "MODELLED" in text and "latency_us" in text and "bound_us" in text
    d = json.loads(prof.to_json())
    assert d["kind"] == "modelled" and d["model"] == "bound"
    assert d["latency_ns"] == pytest.approx(prof.latency_ns)
    assert d["descriptor_histogram"] == {"4096": 4 * 128}
    assert isinstance(prof, KernelProfile)


# ------------------------------------------------------------------------------------------- params
def test_every_param_names_its_source() -> None:
    """Every field cites a public source key, a fit to named points, or says it is unmeasured; every
    unmeasured field has a range."""
    from nki_kernels.emulator.cost import SOURCES

    src = Trn2CostParams.sources()
    assert set(src) == {f.name for f in fields(Trn2CostParams)}
    ranged = Trn2CostParams.ranges()
    for name, s in src.items():
        assert any(k in s for k in SOURCES) or "fitted to" in s or "unmeasured" in s, name
        assert "shared/" not in s, name
        if "unmeasured" in s:
            assert name in ranged, name


def test_ranges_low_high() -> None:
    """low() / high() put every ranged field at its optimistic / pessimistic end; profile_range gives
    low <= nominal <= high latency, both reported."""
    lo, hi = Trn2CostParams.low(), Trn2CostParams.high()
    for name, (a, b) in Trn2CostParams.ranges().items():
        assert getattr(lo, name) == a and getattr(hi, name) == b
    with pytest.raises(ValueError, match="which"):
        P.end("mid")
    t = trace_of(
        (matmul(), 10), (dma(256), 100), (replace(dma(256), op="dma_transpose", direction="sbuf->sbuf"), 50)
    )
    low, high = profile_range(t)
    nominal = profile(t)
    assert low.latency_ns <= nominal.latency_ns <= high.latency_ns
    assert low.latency_ns < high.latency_ns


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tensor_clock_ghz": 0.0}, "tensor_clock_ghz"),
        ({"dma_engines": -1}, "dma_engines"),
        ({"matmul_overhead_cycles": -1}, "matmul_overhead_cycles"),
        ({"dma_efficiency_points": ((64, 0.1), (32, 0.2))}, "strictly increasing"),
        ({"dma_efficiency_points": ((32, 0.1), (64, 1.5))}, r"\(0, 1\]"),
        ({"dma_queued_gbps_points": ((32, 0.0), (64, 1.5))}, "> 0"),
        ({"default_dge_mode": "auto"}, "default_dge_mode"),
        ({"dma_transpose_hbm_efficiency": 1.5}, "dma_transpose_hbm_efficiency"),
        ({"vector_gpsimd_contention": 0.5}, "contention"),
    ],
)
def test_param_validation(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Trn2CostParams(**kwargs)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------- emulator integration
@pytest.mark.emulator
def test_profile_of_an_emulated_kernel() -> None:
    """End to end: a matmul kernel run by the emulator; its trace is priced by the same formulas."""
    from nki_kernels.emulator import isa as nisa
    from nki_kernels.emulator import language as nl
    from nki_kernels.emulator import run

    def mm(a_t, b):
        k, m = a_t.shape
        n = b.shape[1]
        out = nl.ndarray((m, n), dtype=nl.float32, buffer=nl.shared_hbm)
        at = nl.ndarray((k, m), dtype=a_t.dtype, buffer=nl.sbuf)
        bt = nl.ndarray((k, n), dtype=b.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=at, src=a_t)
        nisa.dma_copy(dst=bt, src=b)
        ps = nl.ndarray((m, n), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=at, moving=bt)
        o = nl.ndarray((m, n), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=o, src=ps)
        nisa.dma_copy(dst=out, src=o)
        return out

    rng = np.random.default_rng(0)
    a = rng.random((128, 128), dtype=np.float32)
    b = rng.random((128, 512), dtype=np.float32)
    out, trace = run(mm, a, b)
    # Same fp32 products, different accumulation order (128 terms of [0, 1)): rtol 1e-5 is ~84 fp32 ulps.
    np.testing.assert_allclose(out, a.T @ b, rtol=1e-5, equal_nan=False)
    prof = profile(trace, schedule=False)
    data = (128 * desc_ns(512) + 2 * 128 * desc_ns(2048)) / 16
    tensor = (4 * 512 + 10) / 2.4  # fp32 matmul: 4x
    assert data > tensor  # DMA-bound: TensorE charged min(2.7 x tensor, DMA) (throttling)
    assert prof.engine_busy_ns["tensor"] == pytest.approx(min(2.7 * tensor, data))
    assert prof.engine_busy_ns["vector"] == pytest.approx((512 + 141) / 0.96)  # fp32 PSUM source
    assert prof.descriptor_histogram == {512: 128, 2048: 256}
    assert prof.dma_data_ns == pytest.approx(data)
    assert prof.latency_ns == pytest.approx(max(data, 3 * ISSUE) + 2 * ISSUE + FIXED)
