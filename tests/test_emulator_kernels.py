"""End-to-end kernels on the NKI emulator: matmul, row softmax, in-place HBM updates, torch I/O, LNC2,
trace counts and the backend shim."""

from __future__ import annotations

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import torch

from nki_kernels import emulator as emu
from nki_kernels.emulator import TensorSpec, nki, run
from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import language as nl
from tests.numerics import FP32_MATMUL_ATOL

pytestmark = pytest.mark.emulator


# Written only from the NKI 0.6 docs: matmul into PSUM, copy to SBUF, DMA to HBM.
@nki.jit
def matmul_kernel(lhsT, rhs):
    """lhsT [K, M], rhs [K, N] in HBM -> out [M, N] = lhsT.T @ rhs (fp32), K tiled by 128."""
    K, M = lhsT.shape
    _, N = rhs.shape
    out = nl.ndarray((M, N), nl.float32, buffer=nl.shared_hbm)
    ps = nl.ndarray((M, N), nl.float32, buffer=nl.psum)
    for k in range(K // 128):
        a = nl.ndarray((128, M), lhsT.dtype, buffer=nl.sbuf)
        b = nl.ndarray((128, N), rhs.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=a, src=lhsT[k * 128 : (k + 1) * 128, :])
        nisa.dma_copy(dst=b, src=rhs[k * 128 : (k + 1) * 128, :])
        nisa.nc_matmul(ps, a, b, accumulate=(k > 0))
    res = nl.ndarray((M, N), nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(res, ps)
    nisa.dma_copy(dst=out, src=res)
    return out


@nki.jit
def softmax_kernel(x):
    """Row softmax of x [R, C] (R multiple of 128) in fp32 math, output in x.dtype."""
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    P = 128
    for i in range(x.shape[0] // P):
        t = nl.load(x[i * P : (i + 1) * P, :])
        neg_max = nl.ndarray((P, 1), nl.float32)
        nisa.tensor_reduce(neg_max, nl.maximum, t, axis=1, negate=True)
        e = nl.ndarray(t.shape, nl.float32)
        s = nl.ndarray((P, 1), nl.float32)
        nisa.activation(e, nl.exp, t, bias=neg_max, reduce_op=nl.add, reduce_res=s,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)  # fmt: skip
        r = nl.ndarray((P, 1), nl.float32)
        nisa.reciprocal(r, s)
        o = nl.ndarray(t.shape, x.dtype)
        nisa.tensor_scalar(o, e, nl.multiply, r)
        nl.store(out[i * P : (i + 1) * P, :], o)
    return out


def test_matmul_kernel_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((256, 128)).astype(np.float32)
    b = rng.standard_normal((256, 512)).astype(np.float32)
    out = matmul_kernel(a, b)
    ref = a.astype(np.float64).T @ b.astype(np.float64)
    # measured 3.3e-05; FP32_MATMUL_ATOL = 2 x the fp32 matmul baseline (numpy, K=256) vs float64
    np.testing.assert_allclose(out, ref, rtol=0, atol=FP32_MATMUL_ATOL, equal_nan=False)


def test_matmul_kernel_bf16_inputs() -> None:
    rng = np.random.default_rng(1)
    a = rng.standard_normal((128, 64)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((128, 256)).astype(ml_dtypes.bfloat16)
    out = matmul_kernel(a, b)
    ref = a.astype(np.float64).T @ b.astype(np.float64)  # exact products of the bf16 inputs
    np.testing.assert_allclose(
        out, ref, rtol=0, atol=FP32_MATMUL_ATOL, equal_nan=False
    )  # fp32 accumulation; measured 6.9e-06


def test_softmax_kernel_matches_numpy() -> None:
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((256, 300)) * 3).astype(np.float32)
    out = softmax_kernel(x)
    e = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True))
    ref = e / e.sum(axis=1, keepdims=True)
    # fp32 exp/sum/reciprocal vs float64: measured 1.7e-07 abs, 1.2e-06 rel (~10 ulps); rtol 1e-5 ~84 ulps
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-7, equal_nan=False)


def test_torch_in_torch_out_bf16() -> None:
    x = torch.randn(128, 64, dtype=torch.bfloat16)
    out = softmax_kernel(x)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.shape == x.shape
    ref = torch.softmax(x.double(), dim=-1)
    # bf16 output rounding: relative error <= 2^-8 of each value.
    assert torch.all((out.double() - ref).abs() <= ref.abs() * 2**-8 + 1e-12)


@nki.jit
def scale_in_place(buf, row):
    """buf [R, C] HBM: buf[row, :] *= 2 in place (like a KV-cache write into an input)."""
    t = nl.ndarray((1, buf.shape[1]), buf.dtype, buffer=nl.sbuf)
    nisa.dma_copy(t, buf[row : row + 1, :])
    nisa.tensor_scalar(t, t, nl.multiply, 2.0)
    nisa.dma_copy(buf[row : row + 1, :], t)


@pytest.mark.parametrize("kind", ["numpy", "torch", "torch_noncontig", "numpy_noncontig"])
def test_in_place_input_update_visible(kind: str) -> None:
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    if kind == "numpy":
        buf = base.copy()
    elif kind == "numpy_noncontig":
        buf = np.asfortranarray(base.copy())
    elif kind == "torch":
        buf = torch.from_numpy(base.copy())
    else:
        buf = torch.from_numpy(base.copy().T.copy()).T  # non-contiguous view
    scale_in_place(buf, 1)
    got = buf.numpy() if isinstance(buf, torch.Tensor) else buf
    want = base.copy()
    want[1] *= 2
    np.testing.assert_array_equal(np.asarray(got), want)


@nki.jit
def lnc_kernel(x):
    """Each logical core doubles its half of the rows of x [256, 64] into a shared output."""
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    pid = nl.program_id(0)
    n = nl.num_programs()
    rows = x.shape[0] // n
    t = nl.load(x[pid * rows : (pid + 1) * rows, :])
    o = nl.ndarray(t.shape, x.dtype)
    nisa.tensor_scalar(o, t, nl.multiply, 2.0)
    nl.store(out[pid * rows : (pid + 1) * rows, :], o)
    return out


def test_lnc2_programs_share_output() -> None:
    x = np.random.default_rng(3).standard_normal((256, 64)).astype(np.float32)
    out, trace = run(lnc_kernel[2], x)
    np.testing.assert_array_equal(out, 2 * x)
    assert {r.program_id for r, _ in trace.entries()} == {0, 1}
    assert trace.count(op="dma_copy") == 4
    out1 = lnc_kernel(x[:128])
    np.testing.assert_array_equal(out1, 2 * x[:128])


@pytest.mark.parametrize("lnc", [0, 3, 8])
def test_bad_lnc_raises(lnc: int) -> None:
    with pytest.raises(emu.LaunchError, match="lnc must be 1 or 2"):
        lnc_kernel[lnc]


@nki.jit
def copy_tile(x):
    t = nl.ndarray((128, 512), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(t, x[0:128, 0:512])
    return t


def test_trace_row_contiguous_dma_descriptors() -> None:
    _, trace = run(copy_tile, TensorSpec((256, 2048), "bfloat16"), trace_only=True)
    ((rec, n),) = trace.select(op="dma_copy")
    assert n == 1
    assert rec.descriptors == ((1024, 128),)
    assert rec.num_descriptors == 128
    assert rec.direction == "hbm->sbuf" and rec.bytes_read == 128 * 512 * 2


@nki.jit
def gather_stride2(x):
    t = nl.ndarray((1, 256), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(t, x[0:1, 0:512:2])
    return t


def test_trace_stride2_gather_one_descriptor_per_element() -> None:
    x = np.arange(1024, dtype=np.float32).reshape(2, 512).astype(ml_dtypes.bfloat16)
    _, trace = run(gather_stride2, x)
    ((rec, _),) = trace.select(op="dma_copy")
    assert rec.descriptors == ((2, 256),)


@nki.jit
def hbm_to_hbm(x):
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(out, x)
    return out


def test_trace_contiguous_hbm_copy_is_one_run() -> None:
    x = np.ones((128, 1024), dtype=np.float16)  # 256 KiB
    out, trace = run(hbm_to_hbm, x)
    np.testing.assert_array_equal(out, x)
    ((rec, _),) = trace.select(op="dma_copy")
    assert rec.descriptors == ((256 * 1024, 1),)
    assert rec.direction == "hbm->hbm"


def test_trace_deterministic_and_aggregated() -> None:
    spec = TensorSpec((1024, 256), "float32")
    _, t1 = run(softmax_kernel, spec, trace_only=True)
    _, t2 = run(softmax_kernel, spec, trace_only=True)
    assert t1.counts == t2.counts
    assert t1.num_instructions == 8 * 6  # 8 row tiles x (load, reduce, activation, reciprocal, scalar, store)
    assert t1.count(op="activation", engine="scalar") == 8
    assert len(t1.counts) == 6  # identical tiles aggregate into one record each


def test_trace_only_outputs_are_specs_and_rules_still_apply() -> None:
    out, _ = run(softmax_kernel, TensorSpec((256, 300), "bfloat16"), trace_only=True)
    assert out == TensorSpec((256, 300), "bfloat16")
    with pytest.raises(emu.LaunchError, match="trace_only=True"):
        run(softmax_kernel, TensorSpec((256, 300), "bfloat16"))


def test_backend_name_prints_emulator() -> None:
    env = dict(os.environ)
    env.pop("NKI_ARDIFF_BACKEND", None)
    out = subprocess.run(
        [sys.executable, "-c", "from nki_kernels._nki import backend_name; print(backend_name())"],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == "emulator"


def test_keep_order_lists_every_instruction_in_program_order() -> None:
    _, trace = run(softmax_kernel, TensorSpec((256, 64), "float32"), trace_only=True, keep_order=True)
    assert [r.op for r in trace.order] == [
        "dma_copy", "tensor_reduce", "activation", "reciprocal", "tensor_scalar", "dma_copy",
    ] * 2  # fmt: skip
    assert len(trace.order) == trace.num_instructions


def test_hwconfig_is_frozen_and_validated() -> None:
    hw = emu.HwConfig()
    assert hw.psum_bytes_per_partition == 16 * 1024 and hw.psum_bank_fmax == 512
    with pytest.raises(Exception, match="cannot assign"):
        hw.pmax = 64  # type: ignore[misc]
    with pytest.raises(ValueError, match="sbuf_bytes_per_partition"):
        emu.HwConfig(sbuf_bytes_per_partition=0)
