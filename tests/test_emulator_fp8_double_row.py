"""FP8 double-row matmul (``nc_matmul(perf_mode=matmul_perf_mode.double_row)``), per the NKI 0.6 docstring and
the trn2 architecture guide: stationary ``[128, 2, 128]`` x moving ``[128, 2, 512]`` fp8 tiles contract over
K = 256 (partition dim x a first free dim of 2) into a ``[128, 512]`` fp32 PSUM tile."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from nki_kernels import emulator as emu
from nki_kernels.emulator import HwConfig, TensorSpec, run
from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import language as nl

pytestmark = pytest.mark.emulator

DOUBLE = nisa.matmul_perf_mode.double_row


def _kernel(sdt: str, mdt: str, **kw):
    def k(a, b):  # fp32 HBM in, cast to fp8 by the DMA (through fp32, round to nearest even)
        kp, _, m = a.shape
        n = b.shape[2]
        sa = nl.ndarray(a.shape, sdt, buffer=nl.sbuf)
        sb = nl.ndarray(b.shape, mdt, buffer=nl.sbuf)
        nisa.dma_copy(dst=sa, src=a)
        nisa.dma_copy(dst=sb, src=b)
        ps = nl.ndarray((m, n), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(
            ps, sa, sb, perf_mode=kw.get("perf_mode", DOUBLE), is_transpose=kw.get("is_transpose", False)
        )
        res = nl.ndarray((m, n), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(res, ps)
        out = nl.ndarray((m, n), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=res)
        return out

    return k


@pytest.mark.parametrize(
    ("sdt", "mdt", "np_s", "np_m"),
    [
        ("float8_e4m3", "float8_e4m3", ml_dtypes.float8_e4m3, ml_dtypes.float8_e4m3),
        ("float8_e4m3", "float8_e5m2", ml_dtypes.float8_e4m3, ml_dtypes.float8_e5m2),  # formats may differ
    ],
)
def test_double_row_contracts_k_256_like_numpy(sdt, mdt, np_s, np_m) -> None:
    rng = np.random.default_rng(3)
    a = rng.standard_normal((128, 2, 128)).astype(np.float32)
    b = rng.standard_normal((128, 2, 512)).astype(np.float32)
    out, tr = run(_kernel(sdt, mdt), a, b)
    # reference: fp8-rounded operands (ml_dtypes), K = 256 contraction over (partition, pair) in float64
    a8 = a.astype(np_s).astype(np.float64).reshape(256, 128)
    b8 = b.astype(np_m).astype(np.float64).reshape(256, 512)
    ref = a8.T @ b8
    # fp32 accumulation of 256 exact products (fp8 x fp8 fits in fp32): |err| <= 256 * 2^-24 * (|a|^T |b|)
    bound = 256 * 2.0**-24 * (np.abs(a8).T @ np.abs(b8))
    err = np.abs(np.asarray(out, np.float64) - ref)
    assert (err <= bound).all(), float((err - bound).max())
    assert np.abs(ref).max() > 10  # a real product, not zeros
    (rec,) = [r for r, _ in tr.entries() if r.op == "nc_matmul"]
    meta = rec.meta_dict()
    assert meta["perf_mode"] == "double_row" and (meta["K"], meta["M"], meta["N"]) == (256, 128, 512)
    assert rec.flops == 2 * 256 * 128 * 512


def test_double_row_traces_in_trace_only_mode_and_smaller_tiles() -> None:
    _, tr = run(_kernel("float8_e5m2", "float8_e5m2"), TensorSpec((64, 2, 32), "float32"),
                TensorSpec((64, 2, 100), "float32"), trace_only=True)  # fmt: skip
    (rec,) = [r for r, _ in tr.entries() if r.op == "nc_matmul"]
    assert (rec.meta_dict()["K"], rec.meta_dict()["M"], rec.meta_dict()["N"]) == (128, 32, 100)


@pytest.mark.parametrize(
    ("args", "kw", "hw", "err", "pattern"),
    [
        (((128, 2, 128), (128, 2, 512), "bfloat16", "bfloat16"), {}, None, emu.DtypeError,
         r"\[matmul-double-row\].*stationary in \['float8_e4m3', 'float8_e5m2'\], got bfloat16"),
        (((128, 4, 64), (128, 4, 128), "float8_e4m3", "float8_e4m3"), {}, None, emu.MatmulTileError,
         r"\[matmul-double-row\].*first free dim exactly 2.*stationary\[128, 4, 64\]"),
        (((128, 2, 128), (128, 2, 512), "float8_e4m3", "float8_e4m3"), {}, HwConfig(nc_version=2),
         emu.MatmulTileError, r"\[matmul-double-row\].*NeuronCore-v3\+"),
        (((128, 2, 128), (128, 2, 1024), "float8_e4m3", "float8_e4m3"), {}, None, emu.MatmulTileError,
         r"\[matmul-moving\].*1024"),
        (((128, 2, 128), (128, 2, 512), "float8_e4m3", "float8_e4m3"), {"perf_mode": "double_row"}, None,
         TypeError, r"perf_mode must be an nisa.matmul_perf_mode member"),
    ],
)  # fmt: skip
def test_double_row_rules(args, kw, hw, err, pattern) -> None:
    s_shape, m_shape, sdt, mdt = args
    with pytest.raises(err, match=pattern):
        run(_kernel(sdt, mdt, **kw), TensorSpec(s_shape, "float32"), TensorSpec(m_shape, "float32"),
            trace_only=True, hw=hw)  # fmt: skip


def test_without_double_row_the_3d_fp8_tile_is_an_ordinary_k_128_matmul() -> None:
    """perf_mode none flattens the free dims: [128, 2, 64] is M = 128 (and [128, 2, 128] exceeds M <= 128)."""
    with pytest.raises(emu.MatmulTileError, match=r"\[matmul-stationary\].*256"):
        k = _kernel("float8_e4m3", "float8_e4m3", perf_mode=nisa.matmul_perf_mode.none)
        run(k, TensorSpec((128, 2, 128), "float32"), TensorSpec((128, 2, 512), "float32"), trace_only=True)


def test_double_row_is_priced_as_twice_the_flops_in_a_bf16_matmuls_time() -> None:
    """The trn2 guide: FP8 double-row does K = 256 (2x the FLOPs) in the cycles of a bf16 K = 128
    ``[128,128] x [128,512]`` matmul.  The emulator's record of the real instruction, priced by the cost
    model, must say exactly that (so the FP8 tile is both runnable and priced)."""
    from nki_kernels.emulator.cost import instruction_ns, profile

    def bf16_kernel(a, b):
        sa = nl.ndarray((128, 128), nl.bfloat16, buffer=nl.sbuf)
        sb = nl.ndarray((128, 512), nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=sa, src=a)
        nisa.dma_copy(dst=sb, src=b)
        ps = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(ps, sa, sb)
        out = nl.ndarray((128, 512), nl.float32, buffer=nl.shared_hbm)
        res = nl.ndarray((128, 512), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(res, ps)
        nisa.dma_copy(dst=out, src=res)
        return out

    _, tr8 = run(_kernel("float8_e4m3", "float8_e4m3"), TensorSpec((128, 2, 128)), TensorSpec((128, 2, 512)),
                 trace_only=True)  # fmt: skip
    _, tr16 = run(bf16_kernel, TensorSpec((128, 128)), TensorSpec((128, 512)), trace_only=True)
    ((mm8, _),) = tr8.select(op="nc_matmul")
    ((mm16, _),) = tr16.select(op="nc_matmul")
    assert mm8.flops == 2 * 256 * 128 * 512 == 2 * mm16.flops
    assert instruction_ns(mm8) == pytest.approx(instruction_ns(mm16), rel=1e-12)
    assert profile(tr8).tensor_flops == 2 * profile(tr16).tensor_flops
