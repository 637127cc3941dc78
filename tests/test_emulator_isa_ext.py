"""NKI 0.6 ISA names added to the emulator, each against the numpy formula of its docstring
(aws-neuron/aws-neuron-sdk ``nki/api/nki/isa/__init__.py``), with the engine its trace record carries."""

from __future__ import annotations

import numpy as np
import pytest

from nki_kernels import emulator as emu
from nki_kernels.emulator import TensorSpec, run
from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import language as nl
from tests.emulator_helpers import to_hbm, to_sbuf

pytestmark = pytest.mark.emulator
FP32_TOL = 2.0**-20  # fp32 math vs a float64 reference over short (<= 512-term) sums: a few ulps of fp32


def _engine(tr, op):
    (eng,) = {r.engine for r, _ in tr.entries() if r.op == op}
    return eng


def test_bn_stats_and_bn_aggr_give_mean_and_population_variance() -> None:
    rng = np.random.default_rng(0)
    x = (3.0 + 2.0 * rng.standard_normal((64, 1000))).astype(np.float32)

    def k(x):
        xs = to_sbuf(x)
        stats = nl.ndarray(
            (64, 2, 6), nl.float32, buffer=nl.sbuf
        )  # two bn_stats tiles of <= 512 side by side
        nisa.bn_stats(stats[:, 0, :], xs[:, 0:500])
        nisa.bn_stats(stats[:, 1, :], xs[:, 500:1000])
        mv = nl.ndarray((64, 2), nl.float32, buffer=nl.sbuf)
        nisa.bn_aggr(mv, stats)
        return to_hbm(stats), to_hbm(mv)

    (stats, mv), tr = run(k, x)
    x64 = x.astype(np.float64)
    for t, lo in ((0, 0), (1, 500)):
        for half, col in ((x64[:, lo : lo + 500 : 2], 0), (x64[:, lo + 1 : lo + 500 : 2], 3)):
            assert (stats[:, t, col] == half.shape[1]).all()
            np.testing.assert_allclose(
                stats[:, t, col + 1], half.mean(1), rtol=FP32_TOL * 100, atol=1e-6, equal_nan=False
            )
            m2 = ((half - half.mean(1, keepdims=True)) ** 2).sum(1)
            np.testing.assert_allclose(stats[:, t, col + 2], m2, rtol=1e-5, equal_nan=False)
    np.testing.assert_allclose(mv[:, 0], x64.mean(1), rtol=1e-5, equal_nan=False)
    np.testing.assert_allclose(mv[:, 1], x64.var(1), rtol=1e-5, equal_nan=False)
    assert _engine(tr, "bn_stats") == _engine(tr, "bn_aggr") == "vector"


def test_bn_stats_odd_size_and_limits() -> None:
    x = np.arange(7, dtype=np.float32).reshape(1, 7) * np.ones((4, 1), np.float32)

    def k(x):
        st = nl.ndarray((4, 6), nl.float32, buffer=nl.sbuf)
        nisa.bn_stats(st, to_sbuf(x))
        return to_hbm(st)

    st, _ = run(k, x)
    # even elements 0, 2, 4, 6: count 4, mean 3, M2 = 9+1+1+9 = 20; odd 1, 3, 5: count 3, mean 3, M2 = 8
    np.testing.assert_array_equal(st[0], [4, 3, 20, 3, 3, 8])

    def too_big():
        nisa.bn_stats(nl.ndarray((4, 6), nl.float32), nl.ndarray((4, 513), nl.float32))

    with pytest.raises(emu.ShapeMismatchError, match=r"\[bn-stats-fmax\].*513.*512"):
        run(too_big, trace_only=True)


@pytest.mark.parametrize(
    ("reverse0", "reverse1"), [(False, False), (True, False), (False, True), (True, True)]
)
def test_tensor_tensor_scan_matches_the_docstring_loop(reverse0: bool, reverse1: bool) -> None:
    rng = np.random.default_rng(1)
    a = rng.uniform(0.5, 1.0, (8, 40)).astype(np.float32)
    b = rng.standard_normal((8, 40)).astype(np.float32)
    init = rng.standard_normal((8, 1)).astype(np.float32)

    def k(a, b, init):
        dst = nl.ndarray(a.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor_scan(
            dst, to_sbuf(a), to_sbuf(b), to_sbuf(init), nl.subtract, nl.subtract, reverse0, reverse1
        )
        return to_hbm(dst)

    out, tr = run(k, a, b, init)

    def op0(d0, r):  # data0 is the lhs of op0 unless reverse0
        return r - d0 if reverse0 else d0 - r

    def op1(x, d1):  # data1 is the rhs of op1 unless reverse1
        return d1 - x if reverse1 else x - d1

    ref = np.empty((8, 40))
    prev = init[:, 0].astype(np.float64)
    for i in range(40):
        prev = op1(op0(a[:, i].astype(np.float64), prev), b[:, i])
        ref[:, i] = prev
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5, equal_nan=False)
    assert _engine(tr, "tensor_tensor_scan") == "vector"


def test_range_select_and_select_reduce_formulas() -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((16, 64)).astype(np.float32)
    lo = rng.integers(0, 30, (16, 1)).astype(np.float32)
    hi = lo + rng.integers(1, 30, (16, 1)).astype(np.float32)
    pred = (rng.random((16, 64)) < 0.3).astype(np.uint8)

    def k(x, lo, hi, pred):
        xs = to_sbuf(x)
        sel = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        red = nl.ndarray((16, 1), nl.float32, buffer=nl.sbuf)
        nisa.range_select(
            sel, xs, nl.greater_equal, nl.less, to_sbuf(lo), to_sbuf(hi), reduce_res=red, range_start=5
        )
        sel2 = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        red2 = nl.ndarray((16, 1), nl.float32, buffer=nl.sbuf)
        nisa.select_reduce(
            sel2, to_sbuf(pred), xs, -7.0, reduce_res=red2, reduce_cmd=nisa.reduce_cmd.reset_reduce
        )
        return to_hbm(sel), to_hbm(red), to_hbm(sel2), to_hbm(red2)

    (sel, red, sel2, red2), tr = run(k, x, lo, hi, pred)
    idx = 5 + np.arange(64, dtype=np.float32)[None, :]
    ref = np.where((idx >= lo) & (idx < hi), x, np.finfo(np.float32).min)
    np.testing.assert_array_equal(sel, ref)
    np.testing.assert_array_equal(red[:, 0], ref.max(1))
    ref2 = np.where(pred != 0, x, np.float32(-7.0))
    np.testing.assert_array_equal(sel2, ref2)
    np.testing.assert_array_equal(red2[:, 0], ref2.max(1))
    assert _engine(tr, "range_select") == _engine(tr, "select_reduce") == "vector"

    def bad_fill():
        t = nl.ndarray((16, 64), nl.float32)
        b = nl.ndarray((16, 1), nl.float32)
        nisa.range_select(t, t, nl.less, nl.less, b, b, on_false_value=0.0)

    with pytest.raises(ValueError, match="on_false_value must be FP32_MIN"):
        run(bad_fill, trace_only=True)


def test_max8_find_index8_and_match_replace8() -> None:
    rng = np.random.default_rng(3)
    x = rng.permutation(np.arange(128 * 50, dtype=np.float32)).reshape(128, 50)

    def k(x):
        xs = to_sbuf(x)
        top = nl.ndarray((128, 8), nl.float32, buffer=nl.sbuf)
        nisa.max8(top, xs)
        idx = nl.ndarray((128, 8), nl.uint32, buffer=nl.sbuf)
        nisa.nc_find_index8(idx, xs, top)
        return to_hbm(top), to_hbm(idx)

    (top, idx), tr = run(k, x)
    ref = -np.sort(-x, axis=1)[:, :8]
    np.testing.assert_array_equal(top, ref)
    np.testing.assert_array_equal(np.take_along_axis(x, idx.astype(np.int64), axis=1), ref)
    assert _engine(tr, "max8") == _engine(tr, "nc_find_index8") == "vector"

    # the docstring's duplicate example: find_index8 pairs duplicates in ascending order, match_replace8
    # in descending order; a missing val gives all ones
    data = np.array([[1, 2, 3, 4, 8, 8, 8, 8, 8, 8, 8]], np.float32)
    vals = np.array([[3, 8, 8, 8, 8, 8, 8, 8]], np.float32)
    vals_missing = np.array([[3, 9, 8, 1, 2, 4, 8, 8]], np.float32)

    def k2(data, vals, vals_missing):
        ds = to_sbuf(data)
        i1 = nl.ndarray((1, 8), nl.uint32, buffer=nl.sbuf)
        nisa.nc_find_index8(i1, ds, to_sbuf(vals))
        i2 = nl.ndarray((1, 8), nl.uint32, buffer=nl.sbuf)
        rep = nl.ndarray((1, 11), nl.float32, buffer=nl.sbuf)
        nisa.nc_match_replace8(rep, ds, to_sbuf(vals), -1.0, dst_idx=i2)
        i3 = nl.ndarray((1, 8), nl.uint16, buffer=nl.sbuf)
        nisa.nc_find_index8(i3, ds, to_sbuf(vals_missing))
        return to_hbm(i1), to_hbm(i2), to_hbm(rep), to_hbm(i3)

    (i1, i2, rep, i3), _ = run(k2, data, vals, vals_missing)
    np.testing.assert_array_equal(i1[0], [2, 4, 5, 6, 7, 8, 9, 10])
    np.testing.assert_array_equal(i2[0], [2, 10, 9, 8, 7, 6, 5, 4])
    np.testing.assert_array_equal(rep[0], [1, 2, -1, 4, -1, -1, -1, -1, -1, -1, -1])
    np.testing.assert_array_equal(i3[0], [2, 0xFFFF, 4, 0, 1, 3, 5, 6])


def test_nc_stream_shuffle_within_quadrants_and_broadcast() -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((64, 8)).astype(np.float32)
    mask = list(rng.permutation(32))
    mask[5] = 255  # partition 5 of each quadrant keeps dst's old value

    def k(x):
        xs = to_sbuf(x)
        dst = nl.ndarray((64, 8), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst, 9.0)
        nisa.nc_stream_shuffle(dst, xs, mask)
        row = nl.ndarray((32, 8), nl.float32, buffer=nl.sbuf)
        nisa.nc_stream_shuffle(row, xs[0:1, :], [0] * 32)  # broadcast partition 0 to 32 partitions
        return to_hbm(dst), to_hbm(row)

    (dst, row), tr = run(k, x)
    ref = np.empty_like(x)
    for j in range(64):
        q, i = divmod(j, 32)
        ref[j] = 9.0 if mask[i] == 255 else x[32 * q + mask[i]]
    np.testing.assert_array_equal(dst, ref)
    np.testing.assert_array_equal(row, np.broadcast_to(x[0], (32, 8)))
    assert _engine(tr, "nc_stream_shuffle") == "vector"


def test_sendrecv_and_core_barrier_trace_on_lnc2() -> None:
    def k(h):
        src = nl.ndarray((128, 64), nl.bfloat16, buffer=nl.sbuf)
        dst = nl.ndarray((128, 64), nl.bfloat16, buffer=nl.sbuf)
        me = nl.program_id(0)
        nisa.sendrecv(src, dst, send_to_rank=1 - me, recv_from_rank=1 - me, pipe_id=0)
        shared = nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.core_barrier(shared, (0, 1))

    _, tr = run(k, TensorSpec((1,), "float32"), lnc=2, trace_only=True)
    recs = {r.op: r for r, _ in tr.entries()}
    assert recs["sendrecv"].engine == "dma" and recs["sendrecv"].direction == "sbuf->sbuf"
    assert recs["sendrecv"].bytes_read == 128 * 64 * 2
    assert recs["core_barrier"].engine == "gpsimd" and recs["core_barrier"].free_elems == 0
    assert tr.count(op="sendrecv") == 2 and tr.count(op="core_barrier") == 2  # one per core
    # values crossing the cores: tests/test_emulator_lnc.py
    with pytest.raises(emu.LaunchError, match=r"\[lnc\] sendrecv is only allowed with LNC enabled"):
        run(k, TensorSpec((1,), "float32"), trace_only=True)


def test_isa_constants_module_path() -> None:
    from nki_kernels.emulator.isa.constants import dge_mode, oob_mode

    assert oob_mode is nisa.oob_mode and dge_mode is nisa.dge_mode


def test_collectives_one_rank_values_and_multi_rank_traces() -> None:
    from nki_kernels.emulator import nki

    ncc = nki.collectives
    x = np.arange(24, dtype=np.float32).reshape(4, 6)

    def k(x, groups, gather_rows):
        g = ncc.ReplicaGroup(groups)
        red = nl.ndarray((4, 6), nl.float32, buffer=nl.shared_hbm)
        ncc.all_reduce([x], [red], g, nl.add)
        gat = nl.ndarray((gather_rows, 6), nl.float32, buffer=nl.shared_hbm)
        ncc.all_gather([x], [gat], g, 0)
        return red, gat

    (red, gat), tr = run(k, x, [[0], [1]], 4)  # rank 0 alone in its list: the collective is a copy
    np.testing.assert_array_equal(red, x)
    np.testing.assert_array_equal(gat, x)
    assert _engine(tr, "all_reduce") == "dma"
    _, tr2 = run(k, TensorSpec((4, 6), "float32"), [[0, 1, 2, 3]], 16, trace_only=True)
    meta = {r.op: r.meta_dict() for r, _ in tr2.entries() if r.op in ("all_reduce", "all_gather")}
    assert meta["all_reduce"]["ranks"] == 4 and meta["all_reduce"]["alu"] == "add"
    assert meta["all_gather"]["ranks"] == 4 and meta["all_gather"]["dim"] == 0
    with pytest.raises(emu.LaunchError, match=r"\[collective-ranks\] all_reduce: a 4-rank collective"):
        run(k, x, [[0, 1, 2, 3]], 16)
    with pytest.raises(emu.ShapeMismatchError, match=r"\[collective-shape\] all_gather: dst\[8, 6\]"):
        run(k, TensorSpec((4, 6), "float32"), [[0, 1, 2, 3]], 8, trace_only=True)
    with pytest.raises(ValueError, match="disjoint"):
        ncc.ReplicaGroup([[0, 1], [1, 2]])
    assert int(ncc.rank_id()) == 0 and nki.dtype is str


def test_tensor_scalar_cumulative_follows_the_pseudocode() -> None:
    rng = np.random.default_rng(5)
    x = rng.uniform(-1, 1, (8, 30)).astype(np.float32)
    start = rng.uniform(-1, 1, (8, 1)).astype(np.float32)

    def k(x, start):
        xs = to_sbuf(x)
        a = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar_cumulative(a, xs, nl.multiply, nl.add, 2.0)  # reset_reduce: running sum of 2x
        b = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar_cumulative(b, xs, nl.add, nl.maximum, 0.5, reduce_cmd=nisa.reduce_cmd.reduce)
        c = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar_cumulative(c, xs, nl.subtract, nl.subtract, 0.25, imm1=to_sbuf(start),
                                      reduce_cmd=nisa.reduce_cmd.load_reduce)  # fmt: skip
        return to_hbm(a), to_hbm(b), to_hbm(c)

    (a, b, c), tr = run(k, x, start)
    x64 = x.astype(np.float64)
    ref_a = np.cumsum(2 * x64, axis=1)
    np.testing.assert_allclose(a, ref_a, rtol=1e-5, atol=1e-5, equal_nan=False)
    # reduce: carries the register left by the previous instruction (the last running sum)
    ref_b = np.maximum.accumulate(np.concatenate([ref_a[:, -1:], x64 + 0.5], axis=1), axis=1)[:, 1:]
    np.testing.assert_allclose(b, ref_b, rtol=1e-6, equal_nan=False)
    reg = start[:, 0].astype(np.float64)  # load_reduce: starts from imm1; reg = (x - 0.25) - reg
    ref_c = np.empty_like(x64)
    for i in range(30):
        reg = (x64[:, i] - 0.25) - reg
        ref_c[:, i] = reg
    np.testing.assert_allclose(c, ref_c, rtol=1e-5, atol=1e-5, equal_nan=False)
    assert _engine(tr, "tensor_scalar_cumulative") == "vector"


def test_nc_n_gather_and_nonzero_with_count() -> None:
    rng = np.random.default_rng(6)
    data = rng.standard_normal((32, 4, 10)).astype(np.float32)
    idx = rng.integers(0, 40, (32, 7)).astype(np.uint32)
    src = (rng.random((32, 12)) < 0.3).astype(np.float32)

    def k(data, idx, src):
        g = nl.ndarray((32, 7), nl.float32, buffer=nl.sbuf)
        nisa.nc_n_gather(g, to_sbuf(data), to_sbuf(idx))
        nz = nl.ndarray((32, 13), nl.int32, buffer=nl.sbuf)
        nisa.memset(nz, 7)
        nisa.nonzero_with_count(nz, to_sbuf(src), index_offset=16, padding_val=-1)
        return to_hbm(g), to_hbm(nz)

    (g, nz), tr = run(k, data, idx, src)
    np.testing.assert_array_equal(g, np.take_along_axis(data.reshape(32, 40), idx.astype(np.int64), axis=1))
    for p in range(32):
        if p % 16:
            assert (nz[p] == 7).all()  # only the first partition of each GpSimd core is written
            continue
        hits = np.flatnonzero(src[p]) + 16
        want = np.concatenate([hits, np.full(12 - hits.size, -1), [hits.size]])
        np.testing.assert_array_equal(nz[p], want)
    assert _engine(tr, "nc_n_gather") == _engine(tr, "nonzero_with_count") == "gpsimd"


def test_the_cost_model_prices_every_added_instruction() -> None:
    from nki_kernels.emulator import nki
    from nki_kernels.emulator.cost import instruction_ns, profile

    def k(h):
        x = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf)
        y = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf)
        c = nl.ndarray((128, 1), nl.float32, buffer=nl.sbuf)
        e8 = nl.ndarray((128, 8), nl.float32, buffer=nl.sbuf)
        nisa.bn_stats(nl.ndarray((128, 6), nl.float32, buffer=nl.sbuf), x)
        nisa.bn_aggr(nl.ndarray((128, 2), nl.float32, buffer=nl.sbuf), nl.ndarray((128, 6), nl.float32))
        nisa.tensor_tensor_scan(y, x, x, 0.0, nl.multiply, nl.add)
        nisa.tensor_scalar_cumulative(y, x, nl.add, nl.add, 1.0)
        nisa.range_select(y, x, nl.less, nl.less, c, c)
        nisa.select_reduce(y, nl.ndarray((128, 64), nl.uint8), x, 0.0)
        nisa.max8(e8, x)
        nisa.nc_find_index8(nl.ndarray((128, 8), nl.uint32, buffer=nl.sbuf), x, e8)
        nisa.nc_match_replace8(y, x, e8, 0.0)
        nisa.nc_stream_shuffle(y, x, list(range(32)))
        nisa.nc_n_gather(y, x, nl.ndarray((128, 64), nl.uint32, buffer=nl.sbuf))
        nisa.nonzero_with_count(nl.ndarray((128, 65), nl.int32, buffer=nl.sbuf), x)
        nisa.sendrecv(x, y, 1 - nl.program_id(0), 1 - nl.program_id(0), 0)
        nisa.core_barrier(h, (0, 1))
        g = nki.collectives.ReplicaGroup([[0, 1]])
        nki.collectives.all_reduce([h], [nl.ndarray(h.shape, h.dtype, buffer=nl.shared_hbm)], g, nl.add)

    _, tr = run(k, TensorSpec((128, 64), "float32"), lnc=2, trace_only=True)
    ops = {r.op for r, _ in tr.entries()}
    assert ops == {"bn_stats", "bn_aggr", "tensor_tensor_scan", "tensor_scalar_cumulative", "range_select",
                   "select_reduce", "max8", "nc_find_index8", "nc_match_replace8", "nc_stream_shuffle",
                   "nc_n_gather", "nonzero_with_count", "sendrecv", "core_barrier", "all_reduce"}  # fmt: skip
    for r, _ in tr.entries():
        if r.engine != "dma":
            assert instruction_ns(r) > 0, r.op
    prof = profile(tr, cores=2)
    assert prof.latency_ns > 0 and prof.dma_bytes >= 2 * 128 * 64 * 4  # sendrecv moves the tile on each core


def test_added_instructions_log_one_event_each_with_their_regions() -> None:
    """Every added instruction reports its accesses (``_use``): one event per issued instruction, reading
    its sources and writing its destination, so the schedule and last-use liveness see it."""
    rng = np.random.default_rng(7)
    data = rng.standard_normal((32, 40)).astype(np.float32)
    idx = rng.integers(0, 40, (32, 7)).astype(np.uint32)

    def k(data, idx):
        xs, ids = to_sbuf(data), to_sbuf(idx)
        st = nl.ndarray((32, 6), nl.float32, buffer=nl.sbuf)
        nisa.bn_stats(st, xs)
        g = nl.ndarray((32, 7), nl.float32, buffer=nl.sbuf)
        nisa.nc_n_gather(g, xs, ids)
        m8 = nl.ndarray((32, 8), nl.float32, buffer=nl.sbuf)
        nisa.max8(m8, xs)
        return to_hbm(st), to_hbm(g), to_hbm(m8)

    _, tr = run(k, data, idx, keep_events=True)
    events = list(tr.iter_events())
    assert len(events) == tr.num_instructions
    by_op = {rec.op: (reads, writes) for rec, reads, writes in events}
    for op, nreads in (("bn_stats", 1), ("nc_n_gather", 2), ("max8", 1)):
        reads, writes = by_op[op]
        assert len(reads) == nreads and len(writes) == 1, op
        assert all(r.space == "sbuf" for r in (*reads, *writes)), op
    # the gather reads the data tile the first DMA wrote and the index tile the second wrote
    dma_writes = [w[0].buf for rec, _, w in events if rec.op == "dma_copy"][:2]
    assert sorted(r.buf for r in by_op["nc_n_gather"][0]) == sorted(dma_writes)
