"""``nisa.dma_compute`` and ``nisa.local_gather`` against hand-computed / numpy references, and their rules
(NKI 0.6 docstrings; ``local_gather``'s reference is the numpy semantics of its documented example)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from nki_kernels import emulator as emu
from nki_kernels.emulator import TensorSpec, run
from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import language as nl
from tests.emulator_helpers import to_hbm

pytestmark = pytest.mark.emulator


# ------------------------------------------------------------------------------------------- dma_compute
def test_dma_compute_sums_in_fp32_and_casts_once():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 32)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((64, 32)).astype(np.float32)
    c = rng.standard_normal((64, 32)).astype(np.float32)

    def k(a, b, c):
        bs = nl.ndarray((64, 32), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(bs, b)
        d = nl.ndarray((64, 32), nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_compute(d, [a, bs, c], nl.add, scales=[1.0, 1.0, 1.0])
        return to_hbm(d)

    out, tr = run(k, a, b, c)
    ref = ((a.astype(np.float32) + b) + c).astype(ml_dtypes.bfloat16)  # fp32 sum, one rounding to bf16
    np.testing.assert_array_equal(out, ref)
    (rec, n), *_ = tr.select(op="dma_compute")
    assert n == 1 and rec.engine == "dma" and rec.bytes_read == 64 * 32 * (2 + 4 + 4)


def _rmw_kernel(table, rows, vals, mode):
    """gather: d(SBUF) = vals + table[rows]; scatter: table[rows] += vals (returns table)."""
    idx = nl.ndarray((3, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(idx, rows)
    v = nl.ndarray((3, 4), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(v, vals)
    view = table.ap([[4, 3], [1, 4]], offset=0, vector_offset=idx, indirect_dim=0)
    if mode == "gather":
        nisa.dma_compute(v, [view, v], nl.add)
        return to_hbm(v)
    nisa.dma_compute(view, [view, v], nl.add)
    return table


def test_dma_compute_gather_and_scatter_read_modify_write():
    table = np.arange(6 * 4, dtype=np.float32).reshape(6, 4)
    vals = np.full((3, 4), 100.0, np.float32)
    rows = np.array([[5], [0], [3]], np.int32)
    got, _ = run(_rmw_kernel, table, rows, vals, "gather")
    np.testing.assert_array_equal(got, table[[5, 0, 3]] + 100)
    t2 = table.copy()
    got, _ = run(_rmw_kernel, t2, rows, vals, "scatter")
    ref = table.copy()
    ref[[5, 0, 3]] += 100
    np.testing.assert_array_equal(got, ref)


def test_dma_compute_rules():
    def k(a, op, scales, nsrc, unique):
        t = nl.ndarray((8, 8), nl.float32, buffer=nl.sbuf)
        nisa.dma_compute(t, [a] * nsrc, op, scales=scales, unique_indices=unique)

    spec = TensorSpec((8, 8), "float32")
    with pytest.raises(ValueError, match=r"\[dma-compute-op\].*nl.add"):
        run(k, spec, nl.multiply, None, 2, True, trace_only=True)
    with pytest.raises(ValueError, match=r"\[dma-compute-scales\]"):
        run(k, spec, nl.add, [1.0, 2.0], 2, True, trace_only=True)
    with pytest.raises(emu.ShapeMismatchError, match=r"\[dma-compute-srcs\] dma_compute: at most 16"):
        run(k, spec, nl.add, None, 17, True, trace_only=True)
    run(k, spec, nl.add, None, 16, True, trace_only=True)  # 16 is allowed

    def k2(a):
        p = nl.ndarray((8, 8), nl.float32, buffer=nl.psum)
        t = nl.ndarray((8, 8), nl.float32, buffer=nl.sbuf)
        nisa.dma_compute(t, [a, p], nl.add)

    with pytest.raises(emu.MemorySpaceError, match=r"srcs\[1\].*PSUM"):
        run(k2, spec, trace_only=True)

    def k3(a):
        t = nl.ndarray((8, 4), nl.float32, buffer=nl.sbuf)
        nisa.dma_compute(t, [a], nl.add)

    with pytest.raises(emu.ShapeMismatchError, match=r"\[dma-size\]"):
        run(k3, spec, trace_only=True)

    def k4(table, rows, unique, nsrc):
        idx = nl.ndarray((3, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(idx, rows)
        v = nl.ndarray((3, 4), nl.float32, buffer=nl.sbuf)
        view = table.ap([[4, 3], [1, 4]], offset=0, vector_offset=idx, indirect_dim=0)
        nisa.dma_compute(v, [view, v, v][:nsrc], nl.add, unique_indices=unique)

    tab, rows = TensorSpec((6, 4), "float32"), TensorSpec((3, 1), "int32")
    with pytest.raises(ValueError, match=r"\[dma-compute-rmw\].*unique_indices must be True"):
        run(k4, tab, rows, False, 2, trace_only=True)
    with pytest.raises(emu.ShapeMismatchError, match=r"\[dma-compute-rmw\].*exactly 2 srcs"):
        run(k4, tab, rows, True, 3, trace_only=True)


# ------------------------------------------------------------------------------------------ local_gather
def _lg_kernel(src, index, n, nv, out_free):
    s = nl.ndarray(src.shape, src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(s, src)
    ix = nl.ndarray(index.shape, index.dtype, buffer=nl.sbuf)
    nisa.dma_copy(ix, index)
    d = nl.ndarray((src.shape[0], out_free), src.dtype, buffer=nl.sbuf)
    nisa.local_gather(d, s, ix, num_elem_per_idx=n, num_valid_indices=nv)
    return to_hbm(d)


def test_local_gather_matches_the_documented_numpy_semantics():
    rng = np.random.default_rng(3)
    src = (rng.random((32, 64, 2)) * 100).astype(np.float32)  # 2 GpSimd cores
    per_core = rng.integers(0, 64, size=(16, 3)).astype(np.uint16)  # element-pair index per core
    index = np.tile(per_core, (2, 1))
    n, nv = 2, 40
    out, tr = run(_lg_kernel, src, (index * n).astype(np.uint16), n, nv, nv * n)
    ref = np.empty((32, nv, n), np.float32)
    for c in range(2):
        rows = slice(16 * c, 16 * c + 16)
        ids = index[rows].flatten(order="F")[:nv]
        ref[rows] = np.take(src[rows], ids, axis=1)
    np.testing.assert_array_equal(out, ref.reshape(32, nv * n))
    assert next(iter(tr.select(op="local_gather")))[0].engine == "gpsimd"


def test_local_gather_rules():
    src16 = TensorSpec((16, 64), "float32")
    idx = TensorSpec((16, 2), "uint16")
    with pytest.raises(ValueError, match=r"num_elem_per_idx must be one of"):
        run(_lg_kernel, src16, idx, 3, None, 96, trace_only=True)
    with pytest.raises(ValueError, match=r"num_valid_indices 33 must be in \[1, 32\]"):
        run(_lg_kernel, src16, idx, 1, 33, 33, trace_only=True)
    with pytest.raises(emu.DtypeError, match=r"index must be uint16"):
        run(_lg_kernel, src16, TensorSpec((16, 2), "uint32"), 1, None, 32, trace_only=True)
    with pytest.raises(emu.ShapeMismatchError, match=r"multiple of 16"):
        run(_lg_kernel, TensorSpec((24, 64), "float32"), TensorSpec((24, 2), "uint16"), 1, None, 48,
            trace_only=True)  # fmt: skip
    with pytest.raises(emu.ShapeMismatchError, match=r"must hold 32 x 1"):
        run(_lg_kernel, src16, idx, 1, None, 31, trace_only=True)
    with pytest.raises(emu.OutOfBoundsError, match=r"index 64 \+ 1 elements passes the 64"):
        run(_lg_kernel, np.zeros((16, 64), np.float32), np.full((16, 2), 64, np.uint16), 1, None, 32)
