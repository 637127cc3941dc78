"""The FP8 linear op set: nki_kernels.linear_fp8 on the NKI emulator against reference.linear.linear_fp8,
the reference's quantisers, the tile plan, the kernel's structure (double-row matmuls) and the op's
validation.

Tolerance (kernel vs reference): the reference reproduces the quantisation bit for bit (same fp32
operations: absmax, the two divisions, the product, round-to-nearest-even to e4m3), and the fp8 x fp8
products are exact in fp32, so the only difference is the order of the fp32 accumulation over K (PSUM
per 256-row double-row matmul vs torch's GEMM).  Its bound is ``gamma = K * 2**-24 * sum_k |q_x q_w|``
(scaled by ``x_scale * w_scale``); the final rounding to the output dtype may then differ by one ulp of
the result: ``|out - ref| <= 2 * gamma + ulp(ref)``.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from nki_kernels import ops
from nki_kernels.emulator import TensorSpec, run
from nki_kernels.emulator.cost import is_double_row
from nki_kernels.linear_fp8 import (
    PANEL_MAX,
    PMAX,
    SBUF_BUDGET,
    W_BUDGET,
    _fixed_bytes,
    linear_fp8_emulated,
    linear_fp8_kernel,
    max_k,
    plan_tiles_fp8,
)
from reference.linear import (
    AMAX_FLOOR,
    E4M3_MAX,
    linear_fp8,
    quantize_activation_fp8,
    quantize_weight_fp8,
)

pytestmark = pytest.mark.emulator


def _ulp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mant = 7 if dtype == torch.bfloat16 else 23
    a = v.abs().clamp_min(2.0**-100)
    return torch.exp2(torch.floor(torch.log2(a)) - mant)


def _assert_matches(out: torch.Tensor, x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, b, what: str):
    ref = linear_fp8(x, wq, ws, b)
    assert out.dtype == ref.dtype and out.shape == ref.shape, what
    xq, xs = quantize_activation_fp8(x)
    k = x.shape[-1]
    gamma = (xq.float().abs() @ wq.float().abs()) * xs.unsqueeze(-1) * ws * (k * 2.0**-24)
    tol = 2 * gamma + _ulp(ref.float(), x.dtype)
    err = (out.float() - ref.float()).abs()
    assert torch.isfinite(out.float()).all(), what
    bad = err > tol
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} elements beyond tolerance, worst {float((err - tol).max())}"
    )


def _inputs(m: int, k: int, n: int, bias: bool, seed: int, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(k, n, generator=g) / math.sqrt(k)
    b = torch.randn(n, generator=g) if bias else None
    wq, ws = quantize_weight_fp8(w)
    return x, wq, ws, b


# (M, K, N, bias, lnc): tails in every dim; K > 2048 (quantised in chunks) with an odd full k-tile and a
# partial tail; three 128-row tiles with a 4-row tail (the activation pipeline's buffer reuse); several
# m-blocks whose q^T is prepared during the previous block (M > bm); LNC2; N < 128; K < 128.
CASES = [
    (200, 300, 130, True, 1),
    (260, 256, 512, False, 1),
    (5, 7, 3, True, 1),
    (300, 2300, 200, True, 1),
    (1100, 384, 600, True, 2),
    (2100, 130, 60, False, 1),
]


@pytest.mark.parametrize(("m", "k", "n", "bias", "lnc"), CASES)
def test_linear_fp8_kernel_matches_reference(m, k, n, bias, lnc) -> None:
    x, wq, ws, b = _inputs(m, k, n, bias, seed=m + k + n)
    out = linear_fp8_emulated(x, wq, ws, b, lnc=lnc)
    _assert_matches(out, x, wq, ws, b, f"linear_fp8 {m}x{k}x{n} bias={bias} lnc={lnc}")


def test_linear_fp8_kernel_fp32_rows_with_zero_and_outlier() -> None:
    """fp32 activations; an all-zero row (AMAX_FLOOR: zeros, not NaN), a row with one large outlier and a
    row of tiny values (e4m3 subnormals after scaling)."""
    x, wq, ws, b = _inputs(130, 200, 70, True, seed=3, dtype=torch.float32)
    x[0] = 0
    x[1, 5] = 1e4
    x[2] *= 1e-20
    out = linear_fp8_emulated(x, wq, ws, b)
    _assert_matches(out, x, wq, ws, b, "fp32 rows")
    assert torch.equal(out[0], b), "an all-zero row gives the bias"


@pytest.mark.slow
def test_linear_fp8_kernel_large_k_one_set() -> None:
    """K = 20,000: one q^T set (the next block prepared after the last panel), 128-column panels."""
    x, wq, ws, b = _inputs(300, 20000, 150, True, seed=9)
    bm, nb, sets, _ = plan_tiles_fp8(300, 20000, 150, 2)
    assert sets == 1 and bm < 300
    out = linear_fp8_emulated(x, wq, ws, b)
    _assert_matches(out, x, wq, ws, b, "K=20000")


# ---------------------------------------------------------------------------------------- reference


def test_e4m3fn_carries_neuron_e4m3_values() -> None:
    """torch's float8_e4m3fn cast equals ml_dtypes' float8_e4m3 (NeuronCore-v3's e4m3, max 240) on
    [-240, 240], ties and subnormals included: the reference's carrier type is exact."""
    rng = np.random.default_rng(0)
    grid = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3).astype(np.float32)
    grid = np.sort(grid[np.isfinite(grid)])
    mids = ((grid[1:] + grid[:-1]) / 2).astype(np.float32)
    v = np.concatenate([rng.uniform(-240, 240, 20000), rng.uniform(-0.03, 0.03, 20000)]).astype(np.float32)
    v = np.concatenate([v, grid, mids])
    a = v.astype(ml_dtypes.float8_e4m3).astype(np.float32)
    b = torch.from_numpy(v).to(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(a, b)
    assert grid.max() == E4M3_MAX


def test_quantize_weight_fp8_per_column() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 40, generator=g) * torch.logspace(-3, 2, 40)
    w[:, 7] = 0
    wq, ws = quantize_weight_fp8(w)
    assert wq.dtype == torch.float8_e4m3fn and ws.dtype == torch.float32 and ws.shape == (40,)
    assert torch.equal(wq.float().abs().amax(0)[torch.arange(40) != 7], torch.full((39,), E4M3_MAX))
    assert ws[7] == AMAX_FLOOR / E4M3_MAX and (wq[:, 7].float() == 0).all()
    # e4m3 rounding: at most half a step (2**-4 relative in the normal range, 2**-10 absolute below 2**-6)
    deq = wq.float() * ws
    step = torch.maximum(w.abs() / ws * 2.0**-4, torch.tensor(2.0**-10)) * ws
    assert ((deq - w).abs() <= step * 1.0001).all()
    with pytest.raises(ValueError, match="weight_t must be a floating-point"):
        quantize_weight_fp8(torch.zeros(3, dtype=torch.float32))


def test_quantize_activation_fp8_matches_definition() -> None:
    x = torch.randn(64, 100, dtype=torch.float64).to(torch.bfloat16)
    xq, xs = quantize_activation_fp8(x)
    amax = x.float().abs().amax(-1)
    assert torch.equal(xs, amax / 240)
    assert torch.equal(xq.float().abs().amax(-1), torch.full((64,), 240.0))
    # the quantisation error is within half an e4m3 step of x * 240 / amax
    y = x.float() * (240 / amax).unsqueeze(-1)
    step = torch.maximum(y.abs() * 2.0**-4, torch.tensor(2.0**-10))
    assert ((xq.float() - y).abs() <= step * 1.0001).all()


# ---------------------------------------------------------------------------------------- plan, trace


@pytest.mark.parametrize("k", [1, 300, 1536, 2048, 4096, 8960, 12000, 20000])
@pytest.mark.parametrize("itemsize", [2, 4])
def test_plan_fits_sbuf(k: int, itemsize: int) -> None:
    bm, nb, sets, xb = plan_tiles_fp8(3510, k, 8960, itemsize)
    kt = math.ceil(k / PMAX)
    assert 2 * kt * nb <= W_BUDGET and nb in (128, 256, 512) and bm % PMAX == 0 and xb in (1, 2)
    assert _fixed_bytes(k, nb, xb, itemsize) + sets * bm * (kt + 1) <= SBUF_BUDGET
    if k <= 8960 and itemsize == 2:
        # 512-column panels (512 B weight descriptors) and two sets of >= 384 tokens at Wan's bf16 shapes
        assert nb == PANEL_MAX and sets == 2 and bm >= 384


def test_max_k_is_the_ops_limit() -> None:
    assert max_k(2) == ops.LINEAR_FP8_MAX_K[torch.bfloat16]
    assert max_k(4) == ops.LINEAR_FP8_MAX_K[torch.float32]
    plan_tiles_fp8(128, max_k(2), 128, 2)
    with pytest.raises(ValueError, match="too large"):
        plan_tiles_fp8(128, max_k(2) + PMAX, 128, 2)


def test_trace_uses_double_row_matmuls() -> None:
    """Every full k-tile pair is one double-row fp8 matmul; an odd tile and the tail are plain fp8 ones;
    one transpose per 128x128 piece of x, one weight DMA for the full k-tiles of each panel."""
    m, k, n = 300, 1000, 700  # kfull = 7 (3 pairs + 1), tail 104; 3 row tiles; 2 panels
    specs = (
        TensorSpec((m, k), ml_dtypes.bfloat16),
        TensorSpec((k, n), ml_dtypes.float8_e4m3),
        TensorSpec((n,), "float32"),
        TensorSpec((n,), "float32"),
    )
    _, trace = run(linear_fp8_kernel, *specs, trace_only=True)
    mm = trace.select(op="nc_matmul")
    dr = sum(c for r, c in mm if is_double_row(r))
    plain = sum(c for r, c in mm if not is_double_row(r))
    tiles = 3 * 2
    assert dr == tiles * 3 and plain == tiles * 2
    assert all(d.startswith("float8") for r, _ in mm for d in r.dtypes[1:])
    tp = trace.count(op="nc_transpose")
    assert tp == 3 * 8


# ---------------------------------------------------------------------------------------- op


def test_op_dispatch_matches_reference() -> None:
    x, wq, ws, b = _inputs(70, 96, 40, True, seed=5)
    x3 = x.reshape(2, 35, 96)
    ref = ops.linear_fp8(x3, wq, ws, b, backend="reference")
    emu = ops.linear_fp8(x3, wq, ws, b, backend="emulator")
    assert ref.shape == (2, 35, 40) and emu.dtype == torch.bfloat16
    _assert_matches(emu.reshape(70, 40), x, wq, ws, b, "op emulator")
    assert torch.equal(ref.reshape(70, 40), linear_fp8(x, wq, ws, b))


def test_op_rejects_bad_input() -> None:
    x, wq, ws, b = _inputs(8, 16, 12, True, seed=0)
    with pytest.raises(TypeError, match="weight_q must be torch.float8_e4m3fn"):
        ops.linear_fp8(x, wq.float(), ws, b)
    with pytest.raises(TypeError, match="weight_q must be torch.float8_e4m3fn"):
        ops.linear_fp8(x, wq.to(torch.float8_e5m2), ws, b)
    with pytest.raises(ValueError, match=r"w_scale must be \[N\] with N=12"):
        ops.linear_fp8(x, wq, ws[:5], b)
    with pytest.raises(ValueError, match=r"w_scale must be \[N\] with N=12"):
        ops.linear_fp8(x, wq, ws.reshape(1, 12), b)
    with pytest.raises(TypeError, match="w_scale must be torch.float32"):
        ops.linear_fp8(x, wq, ws.bfloat16(), b)
    with pytest.raises(ValueError, match="w_scale must be finite and > 0"):
        ops.linear_fp8(x, wq, ws * 0, b)
    big = wq.clone()
    big[0, 0] = 448.0
    with pytest.raises(ValueError, match="beyond \\+-240"):
        ops.linear_fp8(x, big, ws, b)
    with pytest.raises(ValueError, match="must match weight_q rows"):
        ops.linear_fp8(x[:, :15].contiguous(), wq, ws, b)
    with pytest.raises(ValueError, match=r"bias must be \[N\] with N=12"):
        ops.linear_fp8(x, wq, ws, b[:3])
    with pytest.raises(TypeError, match="x must be torch.bfloat16 or torch.float32"):
        ops.linear_fp8(x.half(), wq, ws, b)
    with pytest.raises(ValueError, match="weight_q must be a contiguous"):
        ops.linear_fp8(x, wq.t(), ws, b)


def test_op_weight_range_edge_is_e4m3_240() -> None:
    """The edge exactly: +-240 (NeuronCore-v3 e4m3's largest finite value) is accepted, the next
    float8_e4m3fn values above it (256, -256) and NaN are refused, also as the only bad element."""
    x, wq, ws, b = _inputs(8, 16, 12, True, seed=1)
    for ok in (240.0, -240.0):
        w = wq.clone()
        w[3, 5] = ok
        out = ops.linear_fp8(x, w, ws, b, backend="reference")
        assert bool(torch.isfinite(out).all())
    above = torch.tensor([240.0], dtype=torch.float32).to(torch.float8_e4m3fn).view(torch.uint8) + 1
    assert float(above.view(torch.float8_e4m3fn).float()) == 256.0  # the next representable value
    for bad in (256.0, -256.0, float("nan")):
        w = wq.clone()
        w[7, 11] = bad
        with pytest.raises(ValueError, match=r"weight_q holds values beyond \+-240 \(or NaN\)"):
            ops.linear_fp8(x, w, ws, b, backend="reference")
