"""``nisa.quantize_mx`` / ``nisa.nc_matmul_mx`` (NKI 0.6 docstrings, mxfp-matmul deep dive; docs/emulator.md).

Refused on trn2 (NeuronCore-v3: no MX instructions there); on ``HwConfig(nc_version=4)``: quantize's scales
and fp8 values against the documented formula computed by hand, and quantize -> matmul against the exact fp32
product of the source values (chosen so that MX quantization is lossless), plus the shape/tiling rules.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from nki_kernels import emulator as emu
from nki_kernels.emulator import HwConfig, TensorSpec, run
from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import language as nl
from tests.emulator_helpers import to_hbm

pytestmark = pytest.mark.emulator

V4 = HwConfig(nc_version=4)


def _quantize(x, dt):
    """x: HBM [P, 4F] bf16 -> (dst raw uint32 [P, F], scales [rows, F] uint8)."""
    p, f4 = x.shape
    s = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(s, x)
    d = nl.ndarray((p, f4 // 4), dt, buffer=nl.sbuf)
    rows = p // 8 if p <= 32 else p
    sc = nl.ndarray((rows, f4 // 4), nl.uint8, buffer=nl.sbuf)
    nisa.memset(sc, 0)
    nisa.quantize_mx(d, s, sc)
    return to_hbm(d.view(nl.uint32)), to_hbm(sc)


def test_mx_instructions_are_refused_on_trn2():
    with pytest.raises(
        emu.LaunchError, match=r"\[nc-version\] quantize_mx is available only on NeuronCore-v4"
    ):
        run(_quantize, TensorSpec((32, 16), "bfloat16"), nl.float8_e4m3fn_x4, trace_only=True)


def test_quantize_mx_scales_and_values_by_hand():
    x = np.zeros((32, 8), np.float32)
    x[0:8, 0:4] = 0.5  # group (0, 0): amax 0.5 -> floor(log2) = -1
    x[3, 2] = 3.0  # amax 3 -> floor(log2 3) = 1; e4m3fn Emax 8: X = 2**(1 - 7) = 2**-6
    x[8:16, 4:8] = -40.0  # group (1, 1): amax 40 -> 5; X = 2**-2
    # group (2, *) and (3, *) and (0, 1), (1, 0) all zero: X = 2**-127
    (d, sc), _ = run(_quantize, x.astype(ml_dtypes.bfloat16), nl.float8_e4m3fn_x4, hw=V4)
    assert sc.shape == (4, 2)
    np.testing.assert_array_equal(sc, np.array([[127 - 6, 0], [0, 127 - 2], [0, 0], [0, 0]], np.uint8))
    q = (
        np.asarray(d)
        .astype("<u4")
        .view(np.uint8)
        .view(ml_dtypes.float8_e4m3fn)
        .astype(np.float32)
        .reshape(32, 8)
    )
    ref = np.zeros((32, 8), np.float32)
    ref[0:8, 0:4] = 0.5 * 64  # 32
    ref[3, 2] = 3.0 * 64  # 192
    ref[8:16, 4:8] = -40.0 * 4  # -160
    np.testing.assert_array_equal(q, ref)


def _qmm(xs, xm, dst_dtype):
    """Quantize stationary xs [P, 4M] and moving xm [P, 4N] (bf16 HBM) to e4m3fn x4, then nc_matmul_mx."""
    p = xs.shape[0]
    tiles = []
    for x in (xs, xm):
        s = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(s, x)
        d = nl.ndarray((p, x.shape[1] // 4), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        sc = nl.ndarray((p if p > 32 else p // 8, x.shape[1] // 4), nl.uint8, buffer=nl.sbuf)
        nisa.memset(sc, 0)
        nisa.quantize_mx(d, s, sc)
        tiles.append((d, sc))
    (ds, ss), (dm, sm) = tiles
    ps = nl.ndarray((xs.shape[1] // 4, xm.shape[1] // 4), dst_dtype, buffer=nl.psum)
    nisa.nc_matmul_mx(ps, ds, dm, ss, sm)
    o = nl.ndarray(ps.shape, nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(o, ps)
    return to_hbm(o)


@pytest.mark.parametrize("p", [32, 64])
def test_quantize_then_matmul_mx_equals_the_exact_product(p):
    rng = np.random.default_rng(p)
    m, n = 8, 16
    xs = rng.integers(-15, 16, size=(p, 4 * m)).astype(np.float32)
    xm = rng.integers(-15, 16, size=(p, 4 * n)).astype(np.float32)
    for x in (xs, xm):  # every 8 x 4 group holds a 15: scale 2**(3 - 7), values * 16 exact in e4m3fn
        x[0::8, 0::4] = 15.0
    xs[8:16] *= 4  # groups with other scales (powers of two keep the quantization exact)
    xm[:, 4:8] *= 8
    out, tr = run(_qmm, xs.astype(ml_dtypes.bfloat16), xm.astype(ml_dtypes.bfloat16), nl.float32, hw=V4)
    # contraction over partitions and the 4 lanes: lane i of x4 column m is source column 4m + i
    ref = np.einsum("pmi,pni->mn", xs.reshape(p, m, 4), xm.reshape(p, n, 4))
    np.testing.assert_array_equal(out, ref)  # small integers: exact in fp32
    rec = next(iter(tr.select(op="nc_matmul_mx")))[0]
    assert rec.engine == "tensor" and rec.flops == 2 * 4 * p * m * n


def test_nc_matmul_mx_rules():
    def k(p_s, p_m, m, tile_position, tile_size):
        s = nl.ndarray((p_s, m), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        v = nl.ndarray((p_m, 16), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        ss = nl.ndarray((p_s if p_s > 32 else p_s // 8, m), nl.uint8, buffer=nl.sbuf)
        sm = nl.ndarray((p_m if p_m > 32 else p_m // 8, 16), nl.uint8, buffer=nl.sbuf)
        ps = nl.ndarray((m, 16), nl.float32, buffer=nl.psum)
        nisa.nc_matmul_mx(ps, s, v, ss, sm, tile_position=tile_position, tile_size=tile_size)

    run(k, 32, 32, 8, (32, 0), (32, 128), hw=V4, trace_only=True)  # a legal row tile
    with pytest.raises(emu.MatmulTileError, match=r"\[matmul-contraction\]"):
        run(k, 32, 64, 8, None, None, hw=V4, trace_only=True)
    with pytest.raises(emu.MatmulTileError, match=r"\[matmul-stationary\].*must be even"):
        run(k, 32, 32, 7, None, None, hw=V4, trace_only=True)
    with pytest.raises(emu.MatmulTileError, match=r"\[mx-tiling\].*both be set"):
        run(k, 32, 32, 8, (0, 0), None, hw=V4, trace_only=True)
    with pytest.raises(emu.MatmulTileError, match=r"\[mx-tiling\].*start_row a multiple of 64"):
        run(k, 32, 32, 8, (32, 0), (64, 128), hw=V4, trace_only=True)
    with pytest.raises(emu.MatmulTileError, match=r"stationary partitions 64 exceed the row tile 32"):
        run(k, 64, 64, 8, (0, 0), (32, 128), hw=V4, trace_only=True)
    with pytest.raises(emu.LaunchError, match=r"\[nc-version\] nc_matmul_mx"):
        run(k, 32, 32, 8, None, None, trace_only=True)


def test_quantize_mx_scales_of_more_than_32_partitions_sit_on_each_quadrants_first_4_partitions():
    x = np.zeros((64, 4), np.float32)
    for g in range(8):  # group g (partitions 8g..8g+7): amax 2**g -> scale byte 127 + g - 7
        x[8 * g, 0] = 2.0**g
    (_, sc), _ = run(_quantize, x.astype(ml_dtypes.bfloat16), nl.float8_e4m3fn_x4, hw=V4)
    ref = np.zeros((64, 1), np.uint8)  # untouched rows keep the memset 0
    for g in range(8):
        ref[32 * (g // 4) + g % 4, 0] = 127 + g - 7
    np.testing.assert_array_equal(sc, ref)
