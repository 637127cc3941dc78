"""Every emulated op against an independent numpy formula (hypothesis over shapes and dtypes).

Engine numerics: inputs up-cast to fp32, math in fp32, one round-to-nearest-even cast to dst dtype.  The
references below compute the same formula with numpy in fp32 (fp64 for matmul/reductions) and cast
with ml_dtypes, so elementwise results must match exactly or to the stated tolerance.
"""

from __future__ import annotations

import math
import warnings

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nki_kernels.emulator import EmulatorWarning, run
from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import language as nl
from tests.numerics import FP32_MATMUL_ATOL

pytestmark = pytest.mark.emulator
SETTINGS = settings(max_examples=20, deadline=None)

NP = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
FLOAT_DT = st.sampled_from(["float32", "bfloat16", "float16"])
parts = st.integers(1, 128)
free = st.integers(1, 64)


def rnd(shape, dtype, seed, lo=-2.0, hi=2.0):
    r = np.random.default_rng(seed)
    return r.uniform(lo, hi, size=shape).astype(np.float32).astype(NP[dtype])


def cast(x, dtype):
    return np.asarray(x, dtype=np.float32).astype(NP[dtype])


def sb(x_hbm):
    """DMA an HBM input into a fresh SBUF tile of the same shape."""
    t = nl.ndarray(x_hbm.shape, x_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(t, x_hbm)
    return t


def out_of(t):
    o = nl.ndarray(t.shape, t.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(o, t)
    return o


BINOPS = {
    "add": (nl.add, np.add),
    "subtract": (nl.subtract, np.subtract),
    "multiply": (nl.multiply, np.multiply),
    "maximum": (nl.maximum, np.maximum),
    "minimum": (nl.minimum, np.minimum),
    "greater_equal": (nl.greater_equal, lambda a, b: (a >= b).astype(np.float32)),
}


@SETTINGS
@given(
    p=parts, f=free, din=FLOAT_DT, dout=FLOAT_DT, op=st.sampled_from(sorted(BINOPS)), seed=st.integers(0, 99)
)
def test_tensor_tensor(p, f, din, dout, op, seed):
    a, b = rnd((p, f), din, seed), rnd((p, f), din, seed + 1)
    nlop, npop = BINOPS[op]

    def k(x, y):
        d = nl.ndarray((p, f), dout, buffer=nl.sbuf)
        nisa.tensor_tensor(d, sb(x), sb(y), nlop)
        return out_of(d)

    got, tr = run(k, a, b)
    want = cast(npop(a.astype(np.float32), b.astype(np.float32)), dout)
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))
    assert tr.count(op="tensor_tensor", engine="vector") == 1


@SETTINGS
@given(
    p=parts,
    f=free,
    dt=FLOAT_DT,
    vec=st.booleans(),
    rev=st.booleans(),
    two=st.booleans(),
    seed=st.integers(0, 99),
)
def test_tensor_scalar(p, f, dt, vec, rev, two, seed):
    a = rnd((p, f), dt, seed)
    v = rnd((p, 1), "float32", seed + 7)

    def k(x, s):
        d = nl.ndarray((p, f), dt, buffer=nl.sbuf)
        operand0 = sb(s) if vec else 1.5
        if two:
            nisa.tensor_scalar(d, sb(x), nl.subtract, operand0, reverse0=rev, op1=nl.multiply, operand1=-0.5)
        else:
            nisa.tensor_scalar(d, sb(x), nl.subtract, operand0, reverse0=rev)
        return out_of(d)

    got, _ = run(k, a, v)
    o = v if vec else np.float32(1.5)
    x = a.astype(np.float32)
    r = (o - x) if rev else (x - o)
    if two:
        r = r * np.float32(-0.5)
    np.testing.assert_array_equal(got.astype(np.float32), cast(r, dt).astype(np.float32))


ACTS = {
    "exp": (nl.exp, np.exp),
    "tanh": (nl.tanh, np.tanh),
    "sigmoid": (nl.sigmoid, lambda x: 1 / (1 + np.exp(-x))),
    "silu": (nl.silu, lambda x: x / (1 + np.exp(-x))),
    "gelu_apprx_tanh": (
        nl.gelu_apprx_tanh,
        lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))),
    ),
    "square": (nl.square, np.square),
    "relu": (nl.relu, lambda x: np.maximum(x, 0)),
    "copy": (nl.copy, lambda x: x),
}


@SETTINGS
@given(
    p=parts, f=free, dt=FLOAT_DT, op=st.sampled_from(sorted(ACTS)), seed=st.integers(0, 99), red=st.booleans()
)
def test_activation(p, f, dt, op, seed, red):
    a = rnd((p, f), dt, seed)
    bias = rnd((p, 1), "float32", seed + 3)
    nlop, npop = ACTS[op]

    def k(x, b):
        d = nl.ndarray((p, f), dt, buffer=nl.sbuf)
        if red:
            rr = nl.ndarray((p, 1), nl.float32, buffer=nl.sbuf)
            nisa.activation(d, nlop, sb(x), bias=sb(b), scale=0.75, reduce_op=nl.add, reduce_res=rr,
                            reduce_cmd=nisa.reduce_cmd.reset_reduce)  # fmt: skip
            return out_of(d), out_of(rr)
        nisa.activation(d, nlop, sb(x), bias=sb(b), scale=0.75)
        return out_of(d)

    got, tr = run(k, a, bias)
    y = npop(a.astype(np.float64) * 0.75 + bias.astype(np.float64))
    # fp32 engine math vs fp64 formula: a few fp32 ulps, then one rounding to dt (tol = half a dt ulp for
    # bf16/fp16). fp32 measured 1.8e-07 abs (<= 6% of the allowance) over 20 hypothesis examples
    tol = {"float32": 1e-6, "bfloat16": 2**-8, "float16": 2**-11}[dt]
    g = got[0] if red else got
    np.testing.assert_allclose(g.astype(np.float64), y, rtol=tol, atol=1e-6, equal_nan=False)
    if red:
        # fp32 row sum of <= 512 terms vs float64-summed rows: measured 1.5e-05 abs at |sum| <= 113 (8e-06
        # rel, reordered fp32 sum); rtol 1e-5 is the fp32 reordering allowance, atol 1e-5 for sums near 0
        np.testing.assert_allclose(
            got[1][:, 0], y.astype(np.float32).sum(axis=1), rtol=1e-5, atol=1e-5, equal_nan=False
        )
    assert tr.count(op="activation", engine="scalar") == 1


def test_activation_reduce_cmd_accumulates_across_calls():
    a = rnd((4, 8), "float32", 0)

    def k(x):
        t = sb(x)
        d = nl.ndarray((4, 8), nl.float32)
        rr = nl.ndarray((4, 1), nl.float32)
        nisa.activation(
            d, nl.copy, t, reduce_op=nl.add, reduce_res=rr, reduce_cmd=nisa.reduce_cmd.reset_reduce
        )
        nisa.activation(d, nl.copy, t, reduce_op=nl.add, reduce_res=rr, reduce_cmd=nisa.reduce_cmd.reduce)
        return out_of(rr)

    got, _ = run(k, a)
    np.testing.assert_allclose(
        got[:, 0], 2 * a.sum(axis=1), rtol=1e-6, equal_nan=False
    )  # measured 0.0 (same fp32 sums)


@SETTINGS
@given(
    p=parts, f1=st.integers(1, 8), f2=st.integers(1, 16), dt=FLOAT_DT,
    op=st.sampled_from(["add", "maximum", "minimum", "multiply"]), both=st.booleans(), neg=st.booleans(),
    seed=st.integers(0, 99),
)  # fmt: skip
def test_tensor_reduce(p, f1, f2, dt, op, both, neg, seed):
    a = rnd((p, f1, f2), dt, seed, 0.5, 1.5)
    nlop = {"add": nl.add, "maximum": nl.maximum, "minimum": nl.minimum, "multiply": nl.multiply}[op]
    npop = {"add": np.sum, "maximum": np.max, "minimum": np.min, "multiply": np.prod}[op]
    axis = (1, 2) if both else 2
    shape = (p, 1) if both else (p, f1)

    def k(x):
        d = nl.ndarray(shape, nl.float32)
        nisa.tensor_reduce(d, nlop, sb(x), axis=axis, negate=neg)
        return out_of(d)

    got, _ = run(k, a)
    want = npop(a.astype(np.float64), axis=axis).reshape(shape) * (-1 if neg else 1)
    # fp32 reduction of <= 128 terms in [0.5, 1.5] vs float64: measured 1.4e-07 rel (20 examples)
    np.testing.assert_allclose(got, want, rtol=1e-5, equal_nan=False)


@SETTINGS
@given(
    k_=st.integers(1, 128), m=st.integers(1, 128), n=st.integers(1, 512),
    dt=st.sampled_from(["float32", "bfloat16", "float16"]), seed=st.integers(0, 99),
)  # fmt: skip
def test_nc_matmul(k_, m, n, dt, seed):
    a, b = rnd((k_, m), dt, seed), rnd((k_, n), dt, seed + 1)

    def k(x, y):
        ps = nl.ndarray((m, n), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(ps, sb(x), sb(y))
        s = nl.ndarray((m, n), nl.float32)
        nisa.tensor_copy(s, ps)
        return out_of(s)

    got, tr = run(k, a, b)
    want = a.astype(np.float64).T @ b.astype(np.float64)
    # fp32 accumulation, K <= 128: measured 2.8e-05 abs (20 examples), within FP32_MATMUL_ATOL alone
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=FP32_MATMUL_ATOL, equal_nan=False)
    ((rec, _),) = tr.select(op="nc_matmul")
    assert rec.meta_dict()["K"] == k_ and rec.meta_dict()["M"] == m and rec.meta_dict()["N"] == n
    assert rec.flops == 2 * k_ * m * n and rec.engine == "tensor"


def test_nc_matmul_accumulate_semantics():
    a = rnd((8, 4), "float32", 0)
    b = rnd((8, 16), "float32", 1)
    ab = a.T @ b

    def k(x, y, mode):
        xs, ys = sb(x), sb(y)
        ps = nl.ndarray((4, 16), nl.float32, buffer=nl.psum)
        if mode == "none":
            nisa.nc_matmul(ps, xs, ys)  # first write overwrites (NaN sentinel gone)
            nisa.nc_matmul(ps, xs, ys)  # later writes accumulate
            nisa.nc_matmul(ps[:, 0:8], xs, ys[:, 0:8])  # per-element state: also accumulates
        elif mode == "false":
            nisa.nc_matmul(ps, xs, ys)
            nisa.nc_matmul(ps, xs, ys, accumulate=False)
        elif mode == "reset":
            nisa.nc_matmul(ps, xs, ys)
            nisa.memset(ps, 0.0)  # a non-matmul write resets the 'written by matmul' state
            nisa.nc_matmul(ps, xs, ys)
        s = nl.ndarray((4, 16), nl.float32)
        nisa.tensor_copy(s, ps)
        return out_of(s)

    got, _ = run(k, a, b, "none")
    want = 2 * ab
    want[:, :8] += ab[:, :8]
    # the three checks below measured 0.0 (the same fp32 products accumulated in the same order)
    np.testing.assert_allclose(got, want, rtol=1e-6, equal_nan=False)
    got, _ = run(k, a, b, "false")
    np.testing.assert_allclose(got, ab, rtol=1e-6, equal_nan=False)
    got, _ = run(k, a, b, "reset")
    np.testing.assert_allclose(got, ab, rtol=1e-6, equal_nan=False)


def test_nc_matmul_accumulate_true_on_unwritten_psum_warns():
    def k(x):
        xs = sb(x)
        ps = nl.ndarray((4, 4), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(ps, xs, xs, accumulate=True)

    with pytest.warns(EmulatorWarning, match="never written by a matmul"):
        run(k, rnd((4, 4), "float32", 0))


@SETTINGS
@given(p=st.integers(1, 128), f=st.integers(1, 128), dt=FLOAT_DT, seed=st.integers(0, 99))
def test_nc_transpose_pe(p, f, dt, seed):
    a = rnd((p, f), dt, seed)

    def k(x):
        ps = nl.ndarray((f, p), dt, buffer=nl.psum)
        nisa.nc_transpose(ps, sb(x))
        s = nl.ndarray((f, p), dt)
        nisa.tensor_copy(s, ps)
        return out_of(s)

    got, tr = run(k, a)
    np.testing.assert_array_equal(got, a.T)
    assert tr.count(op="nc_transpose", engine="tensor") == 1


@SETTINGS
@given(p=st.integers(1, 32), f=st.integers(1, 32), seed=st.integers(0, 99))
def test_nc_transpose_vector(p, f, seed):
    a = rnd((p, f), "float32", seed)

    def k(x):
        s = nl.ndarray((f, p), nl.float32)
        nisa.nc_transpose(s, sb(x), engine=nisa.engine.vector)
        return out_of(s)

    got, tr = run(k, a)
    np.testing.assert_array_equal(got, a.T)
    assert tr.count(op="nc_transpose", engine="vector") == 1


@SETTINGS
@given(m=st.integers(1, 128), n=st.integers(1, 64), seed=st.integers(0, 99))
def test_dma_transpose_2d_hwdge_and_load_transpose2d(m, n, seed):
    """2-D hwdge form: src [16, m] -> dst [m, 16]; nl.load_transpose2d takes any row count (compiler)."""
    a = rnd((16, m), "bfloat16", seed)
    b = rnd((n, m), "float16", seed + 1)

    def k(x, y):
        t = nl.ndarray((m, 16), x.dtype)
        nisa.dma_transpose(t, x)
        t2 = nl.load_transpose2d(y)
        return out_of(t), out_of(t2)

    (g1, g2), tr = run(k, a, b)
    np.testing.assert_array_equal(g1, a.T)
    np.testing.assert_array_equal(g2, b.T)
    assert tr.count(op="dma_transpose") == 2


@SETTINGS
@given(
    a0=st.sampled_from([1, 2, 4, 8, 16]),
    mult=st.integers(1, 4),
    c=st.integers(1, 128),
    sbuf_src=st.booleans(),
    seed=st.integers(0, 99),
)
def test_dma_transpose_3d_legal_forms(a0, mult, c, sbuf_src, seed):
    """3-D (2, 1, 0): src [A, B, C] -> dst [C, B, A], A in {1,2,4,8,16}, (A*B) % 16 == 0, from HBM or SBUF."""
    b0 = (16 // a0) * mult
    x = rnd((a0, b0, c), "bfloat16", seed)

    def k(src):
        s = sb(src) if sbuf_src else src
        t = nl.ndarray((c, b0, a0), src.dtype)
        nisa.dma_transpose(t, s, axes=(2, 1, 0), dge_mode=nisa.dge_mode.hwdge)
        return out_of(t)

    got, tr = run(k, x)
    np.testing.assert_array_equal(got, np.transpose(x, (2, 1, 0)))
    assert tr.count(op="dma_transpose") == 1


@SETTINGS
@given(d1=st.integers(1, 4), d2=st.integers(1, 4), c=st.integers(1, 64), seed=st.integers(0, 99))
def test_dma_transpose_4d_and_row_permuted_hbm_view(d1, d2, c, seed):
    """4-D (3, 1, 2, 0) and the 128-row transpose as one 3-D hwdge DMA of a row-permuted HBM view."""
    x = rnd((16, d1, 16 * d2, c), "bfloat16", seed)
    y = rnd((128, c), "bfloat16", seed + 1)

    def k(src, rows):
        t = nl.ndarray((c, d1, 16 * d2, 16), src.dtype)
        nisa.dma_transpose(t, src, axes=(3, 1, 2, 0))
        u = nl.ndarray((c, 128), rows.dtype)
        # src[a, b, :] = rows[b*16 + a, :]  ->  dst[:, b, a] = column b*16 + a: the plain transpose
        view = rows.reshape_dim(0, (8, 16)).permute((1, 0, 2))
        nisa.dma_transpose(u.reshape_dim(1, (8, 16)), view, axes=(2, 1, 0))
        return out_of(t), out_of(u)

    (g1, g2), _ = run(k, x, y)
    np.testing.assert_array_equal(g1, np.transpose(x, (3, 1, 2, 0)))
    np.testing.assert_array_equal(g2, y.T)


def test_dma_transpose_gather_and_oob_skip():
    """Indirect (gather) transpose: rows picked by uint32 SBUF indices; oob_mode=skip leaves the skipped
    rows' dst columns unchanged; a scalar runtime offset out of range drops the whole transfer."""
    rng = np.random.default_rng(0)
    src = rng.standard_normal((64, 32)).astype(ml_dtypes.bfloat16)
    idx = np.array([[5], [63], [0], [70], [12], [1], [2], [3], [4], [6], [7], [8], [9], [10], [11], [13]],
                   dtype=np.uint32)  # fmt: skip

    def k(s, ix):
        i_sb = sb(ix)
        t = nl.ndarray((32, 16), s.dtype)
        nisa.memset(t, 0.0)
        view = s.ap([[32, 16], [1, 32]], vector_offset=i_sb, indirect_dim=0)
        nisa.dma_transpose(t, view, axes=(1, 0), oob_mode=nisa.oob_mode.skip)
        off = nl.ndarray((1, 1), nl.int32)
        nisa.memset(off, 100)
        u = nl.ndarray((32, 16), s.dtype)
        nisa.memset(u, 1.0)
        sview = s.ap([[32, 16], [1, 32]], scalar_offset=off, indirect_dim=0)
        nisa.dma_transpose(u, sview, axes=(1, 0), oob_mode=nisa.oob_mode.skip)
        return out_of(t), out_of(u)

    (g, u), _ = run(k, src, idx)
    want = np.zeros((32, 16), np.float32)
    for j, r in enumerate(idx[:, 0]):
        if r < 64:
            want[:, j] = src[r].astype(np.float32)
    np.testing.assert_array_equal(g.astype(np.float32), want)
    np.testing.assert_array_equal(u.astype(np.float32), np.ones((32, 16), np.float32))


@SETTINGS
@given(k_=st.integers(1, 128), m=st.integers(1, 128), dt=st.sampled_from(["bfloat16", "float32"]),
       seed=st.integers(0, 99))  # fmt: skip
def test_nc_matmul_transpose_mode_is_bit_exact(k_, m, dt, seed):
    """is_transpose=True with an identity moving: dst = stationary.T bit for bit (NaN/Inf kept)."""
    x = rnd((k_, m), dt, seed)
    x[0, 0] = np.nan
    if k_ > 1:
        x[1, 0] = np.inf
    eye = np.eye(k_, dtype=np.float32).astype(x.dtype)

    def k(a, e):
        ps = nl.ndarray((m, k_), a.dtype, buffer=nl.psum)
        nisa.nc_matmul(ps, sb(a), sb(e), is_transpose=True)
        res = nl.ndarray((m, k_), a.dtype)
        nisa.tensor_copy(res, ps)
        return out_of(res)

    got, tr = run(k, x, eye)
    np.testing.assert_array_equal(got.view(np.uint16 if dt == "bfloat16" else np.uint32),
                                  x.T.view(np.uint16 if dt == "bfloat16" else np.uint32))  # fmt: skip
    assert tr.count(op="nc_matmul") == 1


@SETTINGS
@given(p=parts, f=free, din=FLOAT_DT, dout=st.sampled_from(["float32", "bfloat16", "int32", "int8", "uint8"]),
       seed=st.integers(0, 99))  # fmt: skip
def test_tensor_copy_and_dma_casts(p, f, din, dout, seed):
    a = rnd((p, f), din, seed, -300, 300)

    def k(x):
        t = sb(x)
        d = nl.ndarray((p, f), dout)
        nisa.tensor_copy(d, t)
        h = nl.ndarray((p, f), dout, buffer=nl.shared_hbm)
        nisa.dma_copy(h, x)  # DMA cast HBM -> HBM through fp32
        return out_of(d), h

    (g1, g2), _ = run(k, a)
    x = a.astype(np.float32)
    if dout.startswith(("int", "uint")):
        info = np.iinfo(np.dtype(dout))
        want = np.clip(np.rint(x), info.min, info.max).astype(dout)  # round half to even, saturate
    else:
        want = cast(x, dout)
    np.testing.assert_array_equal(g1, want)
    np.testing.assert_array_equal(g2, want)


def test_fp32_to_int_rounds_half_even_and_saturates():
    a = np.array([[0.5, 1.5, 2.5, -0.5, -1.5, 1e10, -1e10, 127.5]], dtype=np.float32)

    def k(x):
        d = nl.ndarray(x.shape, nl.int8)
        nisa.tensor_copy(d, sb(x))
        return out_of(d)

    got, _ = run(k, a)
    np.testing.assert_array_equal(got[0], np.array([0, 2, 2, 0, -2, 127, -128, 127], dtype=np.int8))


@SETTINGS
@given(p=parts, f=free, dt=FLOAT_DT, seed=st.integers(0, 99))
def test_scalar_tensor_tensor_and_reciprocal(p, f, dt, seed):
    a, b = rnd((p, f), dt, seed), rnd((p, f), dt, seed + 1)
    s = rnd((p, 1), "float32", seed + 2, 0.5, 2.0)

    def k(x, y, sc):
        d = nl.ndarray((p, f), dt)
        nisa.scalar_tensor_tensor(d, sb(x), nl.multiply, sb(sc), nl.add, sb(y))
        r = nl.ndarray((p, 1), nl.float32)
        nisa.reciprocal(r, sb(sc))
        return out_of(d), out_of(r)

    (g, r), _ = run(k, a, b, s)
    want = cast(a.astype(np.float32) * s + b.astype(np.float32), dt)
    np.testing.assert_array_equal(g.astype(np.float32), want.astype(np.float32))
    np.testing.assert_array_equal(r, (np.float32(1) / s))


@SETTINGS
@given(p=parts, n1=st.integers(1, 8), n2=st.integers(1, 16), s1=st.integers(-5, 5), s2=st.integers(-5, 5),
       cm=st.integers(-3, 3), off=st.integers(-50, 50))  # fmt: skip
def test_iota_and_affine_select(p, n1, n2, s1, s2, cm, off):
    ones = np.ones((p, n1 * n2), np.float32)

    def k(o):
        it = nl.ndarray((p, n1, n2), nl.int32)
        nisa.iota(it, [[s1, n1], [s2, n2]], offset=off, channel_multiplier=cm)
        sel = nl.ndarray((p, n1 * n2), nl.float32)
        nisa.affine_select(sel, [[s1, n1], [s2, n2]], cm, sb(o), -9.0, cmp_op=nl.greater_equal, offset=off)
        return out_of(it), out_of(sel)

    (g_it, g_sel), tr = run(k, ones)
    pp = np.arange(p)[:, None, None]
    i = np.arange(n1)[None, :, None]
    j = np.arange(n2)[None, None, :]
    val = off + pp * cm + i * s1 + j * s2
    np.testing.assert_array_equal(g_it, val)
    np.testing.assert_array_equal(g_sel, np.where(val >= 0, 1.0, -9.0).reshape(p, -1))
    assert tr.count(engine="gpsimd") == 2


@SETTINGS
@given(p=parts, f=free, dt=st.sampled_from(["float32", "bfloat16", "int32"]), v=st.integers(-100, 100))
def test_memset_and_nl_creation(p, f, dt, v):
    def k():
        t = nl.ndarray((p, f), dt)
        nisa.memset(t, v if dt == "int32" else float(v))
        z = nl.zeros((p, f), dt)
        fl = nl.full((p, f), 3, dt)
        return out_of(t), out_of(z), out_of(fl)

    (a, z, fl), _ = run(k)
    np.testing.assert_array_equal(a.astype(np.float64), np.full((p, f), v, np.float64))
    assert not z.astype(np.float64).any()
    np.testing.assert_array_equal(fl.astype(np.float64), 3.0)


def test_fresh_allocations_hold_sentinels():
    def k():
        return out_of(nl.ndarray((2, 3), nl.bfloat16)), out_of(nl.ndarray((2, 3), nl.int32))

    (f, i), _ = run(k)
    assert np.isnan(f.astype(np.float32)).all()
    assert (i == 4).all()


@SETTINGS
@given(p=parts, f=free, seed=st.integers(0, 99))
def test_nl_wrappers(p, f, seed):
    a, b = rnd((p, f), "float32", seed), rnd((p, f), "float32", seed + 1)
    c = rnd((p, 1), "float32", seed + 2)

    def k(x, y, z):
        xs, ys, zs = sb(x), sb(y), sb(z)
        return (
            out_of(nl.add(xs, ys)), out_of(nl.multiply(xs, zs)), out_of(nl.subtract(2.0, xs)),
            out_of(nl.exp(xs)), out_of(nl.sum(xs, axis=1)), out_of(nl.max(xs, axis=1, keepdims=True)),
            out_of(nl.mean(xs, axis=1)), out_of(nl.negative(xs)), out_of(nl.softmax(xs, axis=1)),
        )  # fmt: skip

    outs, _ = run(k, a, b, c)
    x = a.astype(np.float64)
    e = np.exp(x - x.max(1, keepdims=True))
    wants = [a + b, a * c, 2.0 - a, np.exp(x), x.sum(1, keepdims=True), x.max(1, keepdims=True),
             x.mean(1, keepdims=True), -a, e / e.sum(1, keepdims=True)]  # fmt: skip
    # fp32 ops vs float64 formulas, a few fp32 ulps: measured 3.2e-06 abs on |out| <= 33, i.e. <= 53% of
    # the allowance (20 examples); rtol 2e-6 ~ 17 ulps
    for g, w in zip(outs, wants):
        np.testing.assert_allclose(g.astype(np.float64), w, rtol=2e-6, atol=1e-6, equal_nan=False)


@SETTINGS
@given(k_=st.integers(1, 128), m=st.integers(1, 128), n=st.integers(1, 512), seed=st.integers(0, 99))
def test_nl_matmul_and_transpose(k_, m, n, seed):
    a, b = rnd((k_, m), "float32", seed), rnd((k_, n), "float32", seed + 1)

    def k(x, y):
        ps = nl.matmul(sb(x), sb(y), transpose_x=True)
        s = nl.ndarray(ps.shape, nl.float32)
        nisa.tensor_copy(s, ps)
        tp = nl.transpose(sb(x))
        s2 = nl.ndarray(tp.shape, nl.float32)
        nisa.tensor_copy(s2, tp)
        return out_of(s), out_of(s2)

    (g, gt), _ = run(k, a, b)
    # fp32 accumulation, K <= 128: measured 2.5e-05 abs (20 examples)
    np.testing.assert_allclose(
        g, a.astype(np.float64).T @ b, rtol=1e-5, atol=FP32_MATMUL_ATOL, equal_nan=False
    )
    np.testing.assert_array_equal(gt, a.T)


def test_trace_only_does_no_arithmetic_but_counts():
    from nki_kernels.emulator import TensorSpec

    def k(x):
        return out_of(nl.exp(sb(x)))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, tr = run(k, TensorSpec((128, 64), "bfloat16"), trace_only=True)
    assert tr.count(op="dma_copy") == 2 and tr.count(op="activation") == 1
