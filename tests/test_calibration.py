"""Tests of the trn2 calibration suite (perf/calibration): kernel values vs numpy at small shapes (real
values on the emulator), the harness' rows and methods, one cheap full-shape point through cost model v1,
and the published traffic of the matmul re-implementations."""

from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np
import pytest

from nki_kernels import emulator as emu
from nki_kernels.emulator import cost
from perf.calibration import harness, report
from perf.calibration import kernels_matmul as km
from perf.calibration import kernels_small as ks
from perf.calibration.points import POINTS, KernelRun, Point, Source
from perf.runner import BenchRow

BF16 = ml_dtypes.bfloat16
RNG = np.random.default_rng(1234)


def _mm_inputs(K: int, M: int, N: int, dt: type) -> tuple[np.ndarray, np.ndarray]:
    return RNG.standard_normal((K, M)).astype(dt), RNG.standard_normal((K, N)).astype(dt)


def _assert_matmul(
    out: np.ndarray, a: np.ndarray, b: np.ndarray, out_dtype: type, scale: float = 1.0
) -> None:
    """``out ~= scale * a.T @ b`` (float64 reference).  Tolerance: fp32 accumulation, |err| <= K * 2^-24
    * (|a|.T @ |b|) (standard summation bound), plus the rounding of the output dtype: half an ulp,
    2^-9 relative for bf16, 2^-24 for fp32 (doubled for margin)."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    ref = scale * (a64.T @ b64)
    bound = scale * a.shape[0] * 2.0**-24 * (np.abs(a64).T @ np.abs(b64))
    rel = 2.0**-8 if out_dtype is BF16 else 2.0**-23
    err = np.abs(np.asarray(out, dtype=np.float64) - ref)
    assert np.all(err <= bound + rel * np.abs(ref)), float(np.max(err - bound - rel * np.abs(ref)))


@pytest.mark.parametrize(
    ("fn", "shape", "dt", "kw"),
    [
        (km.agentic_v0_kernel, (256, 256, 2048), BF16, {}),
        (km.agentic_v0_kernel, (256, 256, 1024), BF16, {"lhst_loads": 8}),
        (km.agentic_v1_kernel, (256, 256, 1024), BF16, {"bm": 2, "bn": 2}),
        (km.agentic_v2_kernel, (384, 256, 1024), BF16, {"bm": 2, "bn": 2}),
        (km.sdk_tiled_kernel, (256, 256, 1024), np.float32, {}),
        (km.sdk_hoisted_kernel, (256, 256, 1024), np.float32, {}),
        (km.sdk_blocked_mn_kernel, (256, 256, 1024), np.float32, {}),
        (km.sdk_blocked_mnk_kernel, (512, 256, 1024), np.float32, {"bm": 1, "bn": 1, "bk": 2}),
    ],
)
def test_matmul_kernels_match_numpy(fn, shape, dt, kw) -> None:
    K, M, N = shape
    a, b = _mm_inputs(K, M, N, dt)
    out, _ = emu.run(fn, a, b, **kw)
    _assert_matmul(out, a, b, dt)


def test_mixed_tiles_sections_match_numpy() -> None:
    a, b = _mm_inputs(128, 128, 512, BF16)
    out, trace = emu.run(km.mixed_tiles_kernel, a, b, reps=3)
    out = np.asarray(out, dtype=np.float64)
    for s, (_, k, m, n) in enumerate(km.MIXED_SECTIONS):
        block = out[128 * s : 128 * s + m, 0:n]
        _assert_matmul(block, a[0:k, 0:m], b[0:k, 0:n], BF16, scale=3.0)
    assert trace.count(op="nc_matmul") == 12


def test_cs149_kernels_match_numpy() -> None:
    a = RNG.standard_normal(2048).astype(np.float32)
    b = RNG.standard_normal(2048).astype(np.float32)
    for rc in (1, 64, 128):
        out, _ = emu.run(ks.vector_add_tiled_kernel, a, b, row_chunk=rc)
        np.testing.assert_array_equal(out, a + b)  # one fp32 add: exact vs numpy's fp32 add
    for fd in (2, 16):
        out, _ = emu.run(ks.vector_add_stream_kernel, a, b, free_dim=fd)
        np.testing.assert_array_equal(np.asarray(out).reshape(-1), a + b)
    x = RNG.standard_normal((256, 384)).astype(np.float32)
    for eng in ("scalar", "vector"):
        out, tr = emu.run(ks.matrix_transpose_kernel, x, copy_engine=eng)
        np.testing.assert_array_equal(out, x.T)  # data movement only: bit exact
        assert tr.count(op="tensor_copy", engine=eng) == 6


def test_agentic_transpose_kernel_matches_numpy() -> None:
    a = RNG.standard_normal((256, 384)).astype(BF16)  # A[M, K]
    b = RNG.standard_normal((384, 1024)).astype(BF16)
    out, tr = emu.run(km.agentic_transpose_kernel, a, b, transpose_lhs=True)
    _assert_matmul(out, np.ascontiguousarray(a.T), b, BF16)  # the transposes move bf16 values exactly
    assert tr.count(op="nc_transpose") == tr.count(op="nc_matmul") == 2 * 2 * 3
    out, tr = emu.run(km.agentic_transpose_kernel, np.ascontiguousarray(a.T), b, transpose_lhs=False)
    _assert_matmul(out, np.ascontiguousarray(a.T), b, BF16)
    assert tr.count(op="nc_transpose") == 0 and tr.count(op="nc_matmul") == 12


def test_new_points_trace_the_published_profile_counts() -> None:
    """Trace facts of the re-implementations against the counters the sources publish: the CS149
    profiles' dma_transfer_count, dma_transfer_total_bytes, hbm_read/write_bytes and instruction counts
    (their transpose profile counts 129 transfers and 8,454,144 B: one 64 KiB transfer more than the
    kernel's 128), and the agentic investigation's 1,024 TRANSPOSE + 1,024 REGULAR MATMULs (V0)."""
    pts = {q.name: q for q in POINTS}
    for name, dmas in (("cs149p_stream_fd1k", 6), ("cs149p_stream_fd2k", 3)):
        prof = cost.profile(harness.capture_trace(pts[name].runs[0]))
        assert prof.num_dma == dmas
        assert (prof.dma_bytes, prof.hbm_bytes_read, prof.hbm_bytes_written) == (
            3_072_000,
            2_048_000,
            1_024_000,
        )
    tr = harness.capture_trace(pts["cs149p_transpose"].runs[0])
    prof = cost.profile(tr)
    assert prof.num_dma == 129 - 1 and prof.dma_bytes == 8_454_144 - 65_536
    assert tr.count(op="nc_transpose") == 64 and tr.count(op="tensor_copy", engine="scalar") == 64
    v0 = harness.capture_trace(pts["agentic_tp_v0"].runs[0])
    v1 = harness.capture_trace(pts["agentic_tp_v1"].runs[0])
    assert v0.count(op="nc_transpose") == v0.count(op="nc_matmul") == 1024
    assert v1.count(op="nc_transpose") == 0 and v1.count(op="nc_matmul") == 1024
    assert {p.dge_mode for p in POINTS if p.source.repo == "rishic3/asst4-trainium2"} == {"none"}


def test_point_params_apply_the_stated_dge_mode() -> None:
    pts = {q.name: q for q in POINTS}
    assert harness.point_params(pts["cs149_transpose"], None) is None
    got = harness.point_params(pts["cs149p_transpose"], cost.Trn2CostParams(dma_issue_ns=700.0))
    assert got.default_dge_mode == "none" and got.dma_issue_ns == 700.0
    assert harness.point_params(pts["cs149p_transpose"], None).default_dge_mode == "none"
    assert harness.point_params(pts["cs149p_transpose"], "other model") == "other model"
    # the same trace priced with static descriptors: the issue price is dge_none_issue_ns
    p = cost.Trn2CostParams()
    run = pts["cs149p_transpose"].runs[0]
    assert run == pts["cs149_transpose"].runs[0]
    none = cost.profile(harness.capture_trace(run), harness.point_params(pts["cs149p_transpose"], p))
    assert none.dma_issue_ns == pytest.approx(128 * p.dge_none_issue_ns)


def test_micro_kernels_match_numpy() -> None:
    a, b = _mm_inputs(128, 128, 512, BF16)
    out, tr = emu.run(ks.matmul_chain_kernel, a, b, reps=4)
    _assert_matmul(out, a, b, BF16, scale=4.0)
    assert tr.count(op="nc_matmul") == 4
    x = RNG.standard_normal((128, 512)).astype(np.float32)
    out, tr = emu.run(ks.psum_evict_kernel, x, reps=3, out_dtype=BF16)
    np.testing.assert_array_equal(np.asarray(out), x.astype(BF16))  # one fp32->bf16 rounding (RNE)
    assert tr.count(op="tensor_copy", engine="vector") == 3
    y = RNG.standard_normal((128, 128)).astype(np.float32)
    out, tr = emu.run(ks.psum_evict_kernel, y, reps=2, engine="scalar")
    np.testing.assert_array_equal(out, y)
    assert tr.count(op="tensor_copy", engine="scalar") == 3  # 1 into PSUM + 2 evictions
    out, tr = emu.run(ks.pe_transpose_kernel, y, reps=3)
    np.testing.assert_array_equal(out, y.T)
    assert tr.count(op="nc_transpose", engine="tensor") == 3
    v = RNG.standard_normal(9).astype(np.float32)
    out, tr = emu.run(ks.dma_pairs_kernel, v, reps=5)
    np.testing.assert_array_equal(out, v[:5])
    assert tr.count(engine="dma") == 10


def test_dma_pattern_kernel_copies_and_descriptors() -> None:
    x = RNG.standard_normal((128, 64)).astype(BF16)
    pattern = (("load", 1, 8), ("load", 2, 16), ("store", 1, 16), ("store", 1, 8))
    out, tr = emu.run(ks.dma_pattern_kernel, x, pattern, reps=1)
    out = np.asarray(out)
    # loads: x[:, 0:8], x[:, 8:24], x[:, 24:40]; stores: last 16-wide load (x[:, 24:40]) -> out[:, 0:16],
    # then its first 8 columns -> out[:, 16:24]
    np.testing.assert_array_equal(out[:, 0:16], x[:, 24:40])
    np.testing.assert_array_equal(out[:, 16:24], x[:, 24:32])
    hist = tr.descriptor_histogram()
    assert hist == {16: 128 * 2, 32: 128 * 3}  # 8 and 16 bf16 per partition = 16 B and 32 B runs


def test_kernels_reject_bad_inputs() -> None:
    a, b = _mm_inputs(128, 128, 512, BF16)
    with pytest.raises(ValueError, match="M=128 must be a multiple of 1024"):
        emu.run(km.agentic_v1_kernel, a, b)
    with pytest.raises(ValueError, match="row_chunk"):
        emu.run(ks.vector_add_tiled_kernel, np.zeros(100, np.float32), np.zeros(100, np.float32), row_chunk=3)
    with pytest.raises(ValueError, match="reps must be an int >= 1"):
        emu.run(ks.matmul_chain_kernel, a, b, reps=0)
    with pytest.raises(ValueError, match="no earlier load"):
        emu.run(ks.dma_pattern_kernel, np.zeros((128, 8), np.float32), (("store", 1, 4),))


def test_v0_lhst_groups() -> None:
    assert km.v0_lhst_groups(8, 3) == [0, 3, 6]
    assert km.v0_lhst_groups(8, 8) == list(range(8))
    assert km.v0_lhst_groups(8, 1) == [0]
    assert km.v0_lhst_groups(5, 9) == list(range(5))
    with pytest.raises(ValueError, match="n_tiles"):
        km.v0_lhst_groups(0, 1)


def test_full_shape_matmul_traffic_matches_published() -> None:
    """Trace-only at the published 4096^3 shape: V0's DMA traffic is the profiled 1,207,697,408 B within
    0.03 % (the lhsT 3x reload model); V1 and V2 move 201,326,592 B, the published 151.9 GB/s x 1,325 us
    and 245.8 GB/s x 819 us within 0.2 % (the rates are rounded to 4 digits)."""
    v0 = cost.profile(harness.capture_trace(POINTS[0].runs[0]))
    assert abs(v0.dma_bytes / 1_207_697_408 - 1) < 3e-4
    assert v0.instructions["tensor"] == 32 * 8 * 32
    for p, rate, active in ((POINTS[1], 151.9e9, 1325e-6), (POINTS[2], 245.8e9, 819e-6)):
        prof = cost.profile(harness.capture_trace(p.runs[0]))
        assert prof.dma_bytes == 201_326_592
        assert abs(prof.dma_bytes / (rate * active) - 1) < 2e-3


def test_capture_trace_is_cached_and_keep_events_plumbed() -> None:
    run = KernelRun("vector_add_stream", (((25600,), "float32"), ((25600,), "float32")), (("free_dim", 200),))
    t1 = harness.capture_trace(run)
    assert harness.capture_trace(run) is t1
    assert t1.count(engine="dma") == 3 and t1.count(op="tensor_tensor") == 1
    with_events = harness.capture_trace(run, keep_events=True)
    assert with_events.events_available and not t1.events_available
    assert sum(1 for _ in with_events.iter_events()) == with_events.num_instructions == t1.num_instructions
    with pytest.raises(KeyError, match="unknown kernel"):
        harness.capture_trace(KernelRun("nope", ()))


def test_cheap_point_full_shape_isolates_dma_costs() -> None:
    """The dma_pairs point at full shape through cost model v2's bound model (no event log): the slope
    per DMA is the v2 issue price (dma_issue_ns / dma_issue_lanes) and the intercept the fixed per-kernel
    time plus the exposed first load and last store issue (kernel_fixed_ns + 2 x (dma_issue_ns +
    dma_completion_ns)): the methods isolate exactly the quantity they name."""
    p = cost.Trn2CostParams()
    pts = {q.name: q for q in POINTS}
    issue_us, bn = harness.modelled_us(pts["dma_issue"])
    fixed_us, _ = harness.modelled_us(pts["fixed_idle"])
    assert bn == "dma"
    assert issue_us == pytest.approx(p.dma_issue_ns / p.dma_issue_lanes / 1e3, rel=1e-9)
    # fixed_idle's source profiled static descriptors (--disable-dge): the prebuilt-descriptor issue price
    assert pts["fixed_idle"].dge_mode == "none"
    exposed = 2 * (p.dge_none_issue_ns + p.dma_completion_ns)
    assert fixed_us == pytest.approx((p.kernel_fixed_ns + exposed) / 1e3, rel=1e-9)


class _FakeTrace:
    def __init__(self, run: KernelRun) -> None:
        self.run = run


def test_calibration_rows_one_per_point_with_published_figure(monkeypatch: pytest.MonkeyPatch) -> None:
    """Harness logic on a synthetic model (no tracing): latency = 1000 ns + 250 ns * count."""
    monkeypatch.setattr(harness, "capture_trace", lambda run, keep_events=False: _FakeTrace(run))

    def model(trace: _FakeTrace, params: object) -> tuple[float, str]:
        assert params == "P"
        return 1000.0 + 250.0 * trace.run.count, "tensor"

    rows = harness.calibration_rows("P", model=model)
    assert [r.name for r in rows] == [p.name for p in POINTS]
    assert len({r.name for r in rows}) == len(POINTS) == 29
    for r, p in zip(rows, POINTS):
        assert (r.measured_lo_us, r.measured_hi_us) == p.measured_us
        assert r.source_url.startswith("https://github.com/") and p.source.commit[:7] in r.source_url
        assert r.published and r.quantity and p.how
        want = {"latency": (1000 + 250 * p.runs[0].count) / 1e3, "slope": 0.25 * p.units, "intercept": 1.0}
        assert r.modelled_us == pytest.approx(want[p.method])
        assert r.ratio == pytest.approx(r.modelled_us / math.sqrt(p.measured_us[0] * p.measured_us[1]))


def test_geo_stats_and_worst_rows() -> None:
    ratios = [0.5, 2.0, 1.1, 0.9, 3.0]
    gm, gsd = harness.geo_stats(ratios)
    logs = np.log(ratios)
    assert gm == pytest.approx(float(np.exp(logs.mean())))
    assert gsd == pytest.approx(float(np.exp(logs.std())))
    assert harness.geo_stats([1.3, 1.3]) == pytest.approx((1.3, 1.0))
    with pytest.raises(ValueError, match="positive"):
        harness.geo_stats([1.0, 0.0])
    rows = [_row(f"p{i}", r) for i, r in enumerate(ratios)]
    assert [r.name for r in harness.worst_rows(rows, 2)] == ["p4", "p0"]


def _row(name: str, ratio: float) -> harness.CalibrationRow:
    return harness.CalibrationRow(
        name=name, kernel="k", group="A", source="s", source_url="https://github.com/x", shape="s",
        quantity="q", published="p", measured_lo_us=10.0, measured_hi_us=10.0, modelled_us=10.0 * ratio,
        ratio=ratio, bottleneck="dma", method="latency",
    )  # fmt: skip


def test_report_rows_table_and_png(tmp_path) -> None:
    rows = [_row("a", 0.5), _row("b", 1.2)]
    brs = report.to_bench_rows(rows, "v1", 1.5)
    assert all(isinstance(b, BenchRow) and b.kind == "modelled" for b in brs)
    d = json.loads(brs[0].to_json())
    assert d["latency_us"] == 5.0 and d["extra"]["measured_trn2_lo_us"] == 10.0
    assert d["extra"]["measured_label"].startswith("published trn2 measurement")
    text = report.format_rows(rows)
    assert "0.50" in text and "1.20" in text
    assert "geometric mean 0.775" in report.summary_lines(rows)[0]
    png = report.write_png(rows, tmp_path / "c.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_point_validation() -> None:
    src = Source("o/r", "f.md", "abc")
    run = KernelRun("dma_pairs", ())
    with pytest.raises(ValueError, match="lo <= hi"):
        Point("x", "k", src, "s", (2.0, 1.0), "p", "q", "latency", (run,))
    with pytest.raises(ValueError, match="needs 2 run"):
        Point("x", "k", src, "s", (1.0, 1.0), "p", "q", "slope", (run,))
    with pytest.raises(ValueError, match="different counts"):
        Point("x", "k", src, "s", (1.0, 1.0), "p", "q", "intercept", (run, run))
    with pytest.raises(ValueError, match="dge_mode"):
        Point("x", "k", src, "s", (1.0, 1.0), "p", "q", "latency", (run,), dge_mode="static")


def test_cli_prints_table_without_writing(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    from perf.calibration.__main__ import main

    assert main(["--no-write", "--results-dir", str(tmp_path), "--only", "cs149_stream_fd200"]) == 0
    out = capsys.readouterr().out
    assert "PUBLISHED trn2 measurement" in out and "cs149_stream_fd200" in out and "geometric SD" in out
    assert not list(tmp_path.iterdir())
    with pytest.raises(SystemExit):
        main(["--no-write", "--only", "no_such_point"])
