"""The ordered event log (``keep_events=True``, ``Trace.iter_events``; contract in docs/emulator.md).

* A small kernel with a known read-after-write / write-after-read structure yields exactly the events
  (records in order, regions by hand from the tensors' layouts).
* Operand roles: matmul reads its PSUM destination only where it may accumulate; predicated copies merge
  into their destination; dtype views keep their allocation; indirect accesses cover the whole storage;
  shared HBM is "hbm"; LNC2 programs follow one another and share shared_hbm allocations.
* Trace-only runs (which skip checks and work through the ``_count_checked`` fast paths) log exactly the
  events of full-arithmetic runs of the project's kernels; ``keep_events=False`` records nothing more.
* Slow: >= 1 M events in bounded memory (*measured*: the log's arrays and the process's max RSS).
"""

from __future__ import annotations

import resource
import sys
import time

import ml_dtypes
import numpy as np
import pytest

from nki_kernels.attention import attention_kernel
from nki_kernels.emulator import TensorSpec, run
from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import language as nl
from nki_kernels.emulator.trace import Region
from nki_kernels.kv_cache import kv_cache_write_kernel
from nki_kernels.rope3d import rope3d_kernel

pytestmark = pytest.mark.emulator

F32 = 4


def _events(tr):
    return [(r.op, rd, wr) for r, rd, wr in tr.iter_events()]


def _sb(buf, p0, p1, b0, b1):
    return Region("sbuf", buf, p0, p1, b0, b1)


def _hbm(buf, b0, b1):
    return Region("hbm", buf, 0, 0, b0, b1)


def _raw_war_kernel(a):
    """a: HBM [128, 64] fp32.  Buffers are numbered at first access: a=1, t=2, u=3, out=4."""
    t = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf)
    u = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf)
    out = nl.ndarray((128, 64), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(t, a)  # 0: writes t
    nisa.tensor_scalar(u, t, nl.multiply, 2.0)  # 1: RAW on t (event 0)
    nisa.tensor_copy(t[:, 0:32], u[:, 32:64])  # 2: RAW on u's upper half; WAR on t's lower half (event 1)
    nisa.activation(u[0:64, :], nl.exp, t[0:64, :], scale=t[0:64, 5:6])  # 3: scale operand is a read
    nisa.dma_copy(out[0:64, :], u[0:64, :])  # 4
    nisa.dma_copy(out[64:128, 0:32:2], u[64:128, 0:16])  # 5: strided HBM destination
    return out


def test_known_raw_war_structure_gives_exact_events():
    a = np.arange(128 * 64, dtype=np.float32).reshape(128, 64) / 1e4
    out, tr = run(_raw_war_kernel, a, keep_events=True, keep_order=True)
    row = 64 * F32  # bytes per partition of t and u
    assert _events(tr) == [
        ("dma_copy", (_hbm(1, 0, 128 * row),), (_sb(2, 0, 128, 0, row),)),
        ("tensor_scalar", (_sb(2, 0, 128, 0, row),), (_sb(3, 0, 128, 0, row),)),
        ("tensor_copy", (_sb(3, 0, 128, 32 * F32, row),), (_sb(2, 0, 128, 0, 32 * F32),)),
        ("activation", (_sb(2, 0, 64, 0, row), _sb(2, 0, 64, 5 * F32, 6 * F32)), (_sb(3, 0, 64, 0, row),)),
        ("dma_copy", (_sb(3, 0, 64, 0, row),), (_hbm(4, 0, 64 * row),)),
        # out[64:128, 0:32:2]: flat elements 64*64 .. 127*64+30
        ("dma_copy", (_sb(3, 64, 128, 0, 16 * F32),), (_hbm(4, 64 * row, (127 * 64 + 31) * F32),)),
    ]
    # the yielded records are the objects counted in the trace, in the order of trace.order
    assert [r for r, _, _ in tr.iter_events()] == tr.order
    counted = {id(r) for r in tr.counts}
    assert all(id(r) in counted for r, _, _ in tr.iter_events())
    assert len(tr.events) == tr.num_instructions == 6
    # and the kernel computed what it says (independent numpy reference)
    t = a.copy()
    u = 2 * a
    t[:, 0:32] = u[:, 32:64]
    u[0:64] = np.exp(t[0:64] * t[0:64, 5:6])
    ref = np.full((128, 64), np.nan, np.float32)
    ref[0:64] = u[0:64]
    ref[64:128, 0:32:2] = u[64:128, 0:16]
    # fp32 exp: numpy's own rounding, ~1 ulp. NaN in ref marks the emulator's unwritten-tile sentinel, which
    # must still be there: here NaN == NaN is the expected value (tests/numerics.py rule, docs/testing.md)
    np.testing.assert_allclose(out, ref, rtol=1e-6, equal_nan=True)


def _matmul_kernel(acc):
    a = nl.ndarray((128, 128), nl.bfloat16, buffer=nl.sbuf)
    b = nl.ndarray((128, 256), nl.bfloat16, buffer=nl.sbuf)
    ident = nl.ndarray((128, 128), nl.bfloat16, buffer=nl.sbuf)
    ps = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
    pt = nl.ndarray((128, 128), nl.bfloat16, buffer=nl.psum)
    nisa.memset(a, 1.0)  # buf 1
    nisa.memset(b, 1.0)  # buf 2
    nisa.iota(ident, [[0, 128]], 0, 0)  # buf 3 (values irrelevant in trace-only)
    nisa.nc_matmul(ps[:, 256:512], a, b, accumulate=acc)  # buf 4
    nisa.nc_matmul(pt, a, ident, is_transpose=True)  # buf 5
    return None


@pytest.mark.parametrize("acc", [False, True, None])
def test_matmul_reads_psum_dst_only_where_it_may_accumulate(acc):
    _, tr = run(_matmul_kernel, acc, trace_only=True, keep_events=True)
    ev = _events(tr)
    a, b, ident = _sb(1, 0, 128, 0, 256), _sb(2, 0, 128, 0, 512), _sb(3, 0, 128, 0, 256)
    dst = Region("psum", 4, 0, 128, 256 * F32, 512 * F32)
    assert ev[0] == ("memset", (), (a,))
    assert ev[1] == ("memset", (), (b,))
    assert ev[2] == ("iota", (), (ident,))
    assert ev[3] == ("nc_matmul", (a, b) + (() if acc is False else (dst,)), (dst,))
    # transpose mode is a pass-through: never reads its destination
    assert ev[4] == ("nc_matmul", (a, ident), (Region("psum", 5, 0, 128, 0, 256),))


def _roles_kernel(h, idx):
    """h: HBM [16, 64] fp32; idx: HBM [1, 1] int32 (a runtime row index)."""
    t = nl.ndarray((16, 64), nl.float32, buffer=nl.sbuf)
    p = nl.ndarray((16, 64), nl.float32, buffer=nl.sbuf)
    r = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(t, h)  # h=1, t=2
    nisa.memset(p, 1.0)  # p=3
    nisa.tensor_copy_predicated(t, p, p)  # reads src, predicate and dst (a merge)
    nisa.dma_copy(r, idx)  # idx=4, r=5
    row = nl.ndarray((1, 64), nl.float32, buffer=nl.sbuf)  # 6
    nisa.dma_copy(row, h.ap([[64, 1], [1, 64]], offset=0, scalar_offset=r, indirect_dim=0))  # indirect
    nisa.tensor_copy(t[0:1, 0:32].view(nl.bfloat16), row.view(nl.bfloat16)[:, 0:64])  # dtype views
    return t


def test_operand_roles_views_and_indirect_accesses():
    h = np.arange(16 * 64, dtype=np.float32).reshape(16, 64)
    _, tr = run(_roles_kernel, h, np.array([[3]], np.int32), keep_events=True)
    ev = _events(tr)
    t, p = _sb(2, 0, 16, 0, 256), _sb(3, 0, 16, 0, 256)
    assert ev[2] == ("tensor_copy_predicated", (p, p, t), (t,))
    assert ev[3] == ("dma_copy", (_hbm(4, 0, 4),), (_sb(5, 0, 1, 0, 4),))
    # a runtime-indexed source covers the whole storage of h; the index tile r is read too
    assert ev[4] == ("dma_copy", (_hbm(1, 0, 16 * 256), _sb(5, 0, 1, 0, 4)), (_sb(6, 0, 1, 0, 256),))
    # bf16 views of t and row keep their allocations and byte ranges
    assert ev[5] == ("tensor_copy", (_sb(6, 0, 1, 0, 128),), (_sb(2, 0, 1, 0, 128),))


def _lnc_kernel(a):
    out = nl.ndarray((2, 64), nl.float32, buffer=nl.shared_hbm)
    pid = nl.program_id(0)
    t = nl.ndarray((1, 64), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(t, a[pid : pid + 1, :])
    nisa.dma_copy(out[pid : pid + 1, :], t)
    return out


def test_lnc2_programs_in_order_and_shared_hbm_shared():
    a = np.ones((2, 64), np.float32)
    _, tr = run(_lnc_kernel, a, lnc=2, keep_events=True)
    ev = list(tr.iter_events())
    assert [r.program_id for r, _, _ in ev] == [0, 0, 1, 1]
    # program 1's out is program 0's out (one shared_hbm allocation); each program has its own tile
    assert ev[1][2] == (_hbm(3, 0, 256),)
    assert ev[3][2] == (_hbm(3, 256, 512),)
    assert ev[0][2][0].buf != ev[2][2][0].buf


def _bf16(rng, shape):
    return rng.standard_normal(shape).astype(np.float32).astype(ml_dtypes.bfloat16)


def _same_events(kernel, arrays, extra=(), lnc=1):
    specs = [TensorSpec(a.shape, a.dtype) for a in arrays]
    _, t_num = run(kernel, *arrays, *extra, lnc=lnc, keep_events=True)
    _, t_only = run(kernel, *specs, *extra, lnc=lnc, trace_only=True, keep_events=True)
    _, t_plain = run(kernel, *specs, *extra, lnc=lnc, trace_only=True)
    ev = list(t_only.iter_events())
    assert len(ev) == t_only.num_instructions > 0
    assert ev == list(t_num.iter_events())
    # keep_events=False: no log, and the very same counts
    assert not t_plain.events_available and t_only.events_available
    assert list(t_plain.entries()) == list(t_only.entries())
    return ev


@pytest.mark.parametrize("lnc", [1, 2])
def test_trace_only_fast_paths_log_the_events_of_full_runs(lnc):
    rng = np.random.default_rng(0)
    B, Lq, Lk, H, D = 1, 130, 700, 1, 64
    q, k, v = _bf16(rng, (B, Lq, H, D)), _bf16(rng, (B, Lk, H, D)), _bf16(rng, (B, Lk, H, D))
    ev = _same_events(attention_kernel, [q, k, v], (0.125, True), lnc=lnc)
    ops = {r.op for r, _, _ in ev}
    assert {"nc_matmul", "dma_copy", "activation", "tensor_copy"} <= ops
    L = 130
    x = [_bf16(rng, (1, L, 1, 128)) for _ in range(2)]
    tables = [rng.standard_normal((L, 64)).astype(np.float32) for _ in range(2)]
    _same_events(rope3d_kernel, x + tables, lnc=lnc)
    caches = [_bf16(rng, (1, 400, 1, 64)) for _ in range(2)]
    new = [_bf16(rng, (1, 100, 1, 64)) for _ in range(2)]
    _same_events(kv_cache_write_kernel, caches + new + [np.array([[2]], np.int32)], lnc=lnc)


def test_iter_events_without_log_raises():
    _, tr = run(_lnc_kernel, np.ones((2, 64), np.float32))
    assert not tr.events_available
    with pytest.raises(ValueError, match="keep_events=True"):
        next(tr.iter_events())


def _many_copies(n):
    a = nl.ndarray((128, 64), nl.bfloat16, buffer=nl.sbuf)
    b = nl.ndarray((128, 64), nl.bfloat16, buffer=nl.sbuf)
    for i in range(n):
        nisa.tensor_copy(b[:, i % 32 : i % 32 + 32], a[:, 0:32])
    return None


@pytest.mark.slow
def test_a_million_events_fit_in_bounded_memory():
    n = 1_000_000
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    _, tr = run(_many_copies, n, trace_only=True, keep_events=True)
    dt = time.perf_counter() - t0
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    log = tr.events
    held = sys.getsizeof(log.ev) + sys.getsizeof(log.rg) + sys.getsizeof(log.buf_space)
    assert len(log) == n
    print(
        f"\n[measured] {n} events: log arrays {log.nbytes() / 2**20:.1f} MiB "
        f"({log.nbytes() / n:.1f} B/event), {held / 2**20:.1f} MiB allocated; "
        f"max RSS grew {(rss1 - rss0) / 1024:.1f} MiB; {dt:.1f} s trace-only"
    )
    # 2 x 4 B per event + 2 regions x 4 x 4 B = 40 B/event (+ array over-allocation, at most 1/8):
    # 2 M events hold well under 100 MiB
    assert log.nbytes() < 40 * n + 64
    assert held < 1.2 * 40 * n
    first = next(tr.iter_events())
    assert first[1] == (_sb(1, 0, 128, 0, 64),) and first[2] == (_sb(2, 0, 128, 0, 64),)
