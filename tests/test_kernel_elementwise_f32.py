"""Wan's fp32 residual stream and the FFN activation on the NKI emulator against reference.elementwise:
adaln_norm_modulate with an fp32 x and a bf16 output (the branch input), gate_residual with an fp32 x and a
bf16 branch y, gelu_tanh; their one-pass HBM traffic, SBUF limits and validation. Tolerances:
tests/numerics.py (2 x the reference's own error in the mixed dtypes + the floor of the output dtype)."""

from __future__ import annotations

import pytest
import torch

from nki_kernels import ops
from nki_kernels.elementwise import (
    CHUNK,
    SBUF_BUDGET,
    adaln_norm_modulate_emulated,
    adaln_norm_modulate_kernel,
    frame_tiles,
    gate_residual_emulated,
    gate_residual_kernel,
    gelu_tanh_emulated,
    gelu_tanh_kernel,
    max_features,
    tile_bytes,
)
from nki_kernels.emulator import TensorSpec, run
from reference.elementwise import adaln_norm_modulate as ref_adaln
from reference.elementwise import gate_residual as ref_gate
from reference.elementwise import gelu_tanh as ref_gelu
from tests.numerics import assert_within, max_abs_err, reference_error

pytestmark = pytest.mark.emulator

BF, F32 = torch.bfloat16, torch.float32

# (B, L, C, F, lnc): 150-token frames (a 128 tile + a 22 tail), C not a multiple of 512, C < 128 with
# per-token rows, LNC2 over 3 frames, a single short frame with C = 1030 (512 + 512 + 6)
CASES = [
    (2, 300, 640, 2, 1),
    (1, 12, 96, 12, 1),
    (2, 390, 520, 3, 2),
    (1, 7, 1030, 1, 1),
]


def _gen(*key: int) -> torch.Generator:
    return torch.Generator().manual_seed(sum(k * 1000**i for i, k in enumerate(key)))


def _mod(b: int, f: int, c: int, g: torch.Generator, std: float) -> torch.Tensor:
    return torch.randn(b, f, c, generator=g, dtype=torch.float64) * std


@pytest.mark.parametrize(("b", "length", "c", "f", "lnc"), CASES)
def test_adaln_fp32_in_bf16_out_matches_reference(b, length, c, f, lnc) -> None:
    """fp32 x and fp32 modulation (Wan's autocast(float32) block), bf16 out: the reference's own error is
    that of its fp32 run rounded once to bf16, against the float64 baseline."""
    g = _gen(b, length, c, 1)
    x = torch.randn(b, length, c, generator=g, dtype=torch.float64) * 3.0 + 1.5
    shift, scale = _mod(b, f, c, g, 0.5), _mod(b, f, c, g, 0.5)
    base = ref_adaln(x, shift, scale, 1e-6)
    low = ref_adaln(x.float(), shift.float(), scale.float(), 1e-6, out_dtype=BF)
    out = adaln_norm_modulate_emulated(x.float(), shift.float(), scale.float(), 1e-6, lnc=lnc, out_dtype=BF)
    assert out.dtype == BF and out.shape == x.shape
    assert_within(out, base, BF, max_abs_err(low, base), what=f"adaln fp32->bf16 {b}x{length}x{c} F={f}")


def test_adaln_bf16_in_fp32_out_matches_reference() -> None:
    """Wan's first block: the patch embedding's bf16 tokens under fp32 modulation, an fp32 result."""
    g = _gen(5)
    x = (torch.randn(2, 300, 640, generator=g, dtype=torch.float64) * 2.0).to(BF).double()
    shift, scale = _mod(2, 2, 640, g, 0.5), _mod(2, 2, 640, g, 0.5)
    base = ref_adaln(x, shift, scale, 1e-6)
    low = ref_adaln(x.to(BF), shift.float(), scale.float(), 1e-6, out_dtype=F32)
    out = adaln_norm_modulate_emulated(x.to(BF), shift.float(), scale.float(), 1e-6, out_dtype=F32)
    assert out.dtype == F32
    assert_within(out, base, F32, max_abs_err(low, base), what="adaln bf16->fp32")


def test_adaln_fp32_stream_keeps_a_large_mean() -> None:
    """The reason for an fp32 residual stream: mean 1000, std 1. A kernel that read x as bf16 (ulp 4 at
    1000) would be off by O(1) after normalising; the fp32 path stays within the bf16 output rule."""
    g = _gen(7)
    x = torch.randn(1, 130, 1024, generator=g, dtype=torch.float64) + 1000.0
    shift, scale = _mod(1, 1, 1024, g, 0.5), _mod(1, 1, 1024, g, 0.5)
    base = ref_adaln(x, shift, scale, 1e-6)
    low = ref_adaln(x.float(), shift.float(), scale.float(), 1e-6, out_dtype=BF)
    out = adaln_norm_modulate_emulated(x.float(), shift.float(), scale.float(), 1e-6, out_dtype=BF)
    assert_within(out, base, BF, max_abs_err(low, base), what="adaln fp32 mean 1000")


def test_adaln_fp32_rounds_once_under_cancellation() -> None:
    """Every token of a frame holds the same row, so ``xn`` is one row per frame and ``shift = -xn (1 +
    scale) + delta`` cancels the ~100-sized product down to ``delta`` ~ 1: a kernel that rounded ``1 +
    scale``, ``shift`` or the product to bf16 (bf16 ulp at 100: 0.5) is off by ~0.2 where the bf16 output
    rule allows ~0.02."""
    g = _gen(13)
    b, f, tpf, c = 1, 3, 50, 640
    v = torch.randn(b, f, 1, c, generator=g, dtype=torch.float64) * 2.0 + 0.5
    x = v.expand(b, f, tpf, c).reshape(b, f * tpf, c).contiguous()
    scale = 99.0 + torch.randn(b, f, c, generator=g, dtype=torch.float64) * 3.0
    xn = ref_adaln(x, torch.zeros(b, f, c, dtype=torch.float64), torch.zeros(b, f, c, dtype=torch.float64))
    xn_rows = xn.view(b, f, tpf, c)[:, :, 0]
    shift = -xn_rows * (1 + scale) + torch.randn(b, f, c, generator=g, dtype=torch.float64)
    base = ref_adaln(x, shift, scale, 1e-6)
    assert base.abs().max() < 6.0  # the cancellation holds
    low = ref_adaln(x.float(), shift.float(), scale.float(), 1e-6, out_dtype=BF)
    out = adaln_norm_modulate_emulated(x.float(), shift.float(), scale.float(), 1e-6, out_dtype=BF)
    assert_within(out, base, BF, max_abs_err(low, base), what="adaln fp32->bf16 under cancellation")


@pytest.mark.parametrize(("b", "length", "c", "f", "lnc"), CASES)
def test_gate_residual_fp32_x_bf16_y_matches_reference(b, length, c, f, lnc) -> None:
    """x fp32, y bf16 (exact: drawn in bf16), gate fp32: ``x + fp32(gate * y)`` as Wan's autocast(float32)
    residual; the tolerance is the fp32 one (a gate or sum rounded to bf16 is ~1e-3 off)."""
    g = _gen(b, length, c, 2)
    x = torch.randn(b, length, c, generator=g, dtype=torch.float64)
    y = torch.randn(b, length, c, generator=g, dtype=torch.float64).to(BF).double()
    gate = _mod(b, f, c, g, 0.7)
    base = ref_gate(x, y, gate)
    low = ref_gate(x.float(), y.to(BF), gate.float())
    out = gate_residual_emulated(x.float(), y.to(BF), gate.float(), lnc=lnc)
    assert out.dtype == F32 and out.shape == x.shape
    assert_within(out, base, F32, max_abs_err(low, base), what=f"gate fp32+bf16 {b}x{length}x{c} F={f}")


@pytest.mark.parametrize("dtype", [BF, F32])
@pytest.mark.parametrize(("shape", "lnc"), [((2, 130, 4701), 1), ((1, 5, 40), 1), ((1, 300, 9217), 2)])
def test_gelu_tanh_kernel_matches_reference(shape, lnc, dtype) -> None:
    """Row tails (130 = 128 + 2, 5, 300 = 2 x 128 + 44), column tiles with a short last one (4701 = 2351 +
    2350, 9217 = 2 x 3073 + 3071), LNC2; values out to |x| ~ 12 so both tanh tails and the cubic term
    matter."""
    g = _gen(*shape, 3)
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * 3.0
    ref_err, base = reference_error(ref_gelu, [x], dtype)
    out = gelu_tanh_emulated(x.to(dtype), lnc=lnc)
    assert out.dtype == dtype and out.shape == x.shape
    assert_within(out, base, dtype, ref_err, what=f"gelu_tanh {shape} lnc={lnc}")


def test_gelu_reference_is_torchs_tanh_gelu() -> None:
    """The reference is Wan's ``nn.GELU(approximate="tanh")`` (independently: the closed form)."""
    x = torch.linspace(-8, 8, 1001, dtype=torch.float64)
    closed = 0.5 * x * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (x + 0.044715 * x**3)))
    assert torch.allclose(ref_gelu(x), closed, rtol=0, atol=1e-15)
    assert torch.equal(ref_gelu(x.to(BF)), torch.nn.GELU(approximate="tanh")(x.to(BF)))


def _hbm_bytes(tr) -> int:
    return sum((r.bytes_read + r.bytes_written) // 2 * n for r, n in tr.entries() if r.engine == "dma")


@pytest.mark.parametrize("kernel", ["adaln", "gate", "gelu"])
def test_one_pass_over_hbm(kernel: str) -> None:
    """fp32 x read once (4 B), the bf16 branch once (2 B), one fp32 row per frame; one DMA per operand per
    tile (GELU: 128 rows x 4,480 columns at the FFN width)."""
    n, c, g = 2 * 1560, 1536, 2
    ntiles = len(frame_tiles(n, g))
    x32, x16 = TensorSpec((n, c), "float32"), TensorSpec((n, c), "bfloat16")
    rows = TensorSpec((g, c), "float32")
    if kernel == "adaln":
        _, tr = run(adaln_norm_modulate_kernel, x32, rows, rows, 1e-6, "bfloat16", trace_only=True)
        want_bytes, want_dma = n * c * (4 + 2) + 2 * g * c * 4, 2 * ntiles + 2 * g
    elif kernel == "gate":
        _, tr = run(gate_residual_kernel, x32, x16, rows, trace_only=True)
        want_bytes, want_dma = n * c * (4 + 2 + 4) + g * c * 4, 3 * ntiles + g
    else:
        h = TensorSpec((300, 8960), "bfloat16")
        _, tr = run(gelu_tanh_kernel, h, trace_only=True)
        want_bytes, want_dma = 2 * 300 * 8960 * 2, 2 * 3 * 2  # 3 row tiles x 2 column tiles of 4,480
    assert _hbm_bytes(tr) == want_bytes
    assert tr.count("dma_copy") == want_dma


@pytest.mark.parametrize(("isz", "osz"), [(4, 2), (2, 4)])
def test_mixed_dtype_limits_fit_the_sbuf_budget(isz: int, osz: int) -> None:
    c = max_features(isz, osz)
    assert c % CHUNK == 0 and tile_bytes(c, isz, osz) <= SBUF_BUDGET < tile_bytes(c + CHUNK, isz, osz)
    assert c == ops.ELEMENTWISE_MAX_C[F32]  # the op's rule for a mix: the fp32 limit
    assert tile_bytes(c, isz, osz) > tile_bytes(c, isz)  # the separate output tiles are counted


def test_ops_mixed_dtypes_and_gelu_on_both_backends() -> None:
    g = _gen(9)
    x = torch.randn(2, 70, 200, generator=g, dtype=torch.float64)
    y = torch.randn(2, 70, 200, generator=g, dtype=torch.float64).to(BF).double()
    m5 = torch.randn(2, 5, 200, generator=g, dtype=torch.float64) * 0.5
    m = torch.randn(2, 200, generator=g, dtype=torch.float64) * 0.5  # [B, C]
    s, t = m5.float(), -m5.float()
    checks = [
        ("adaln", lambda be: ops.adaln_norm_modulate(x.float(), s, t, 1e-5, BF, backend=be),
         ref_adaln(x, m5, -m5, 1e-5), ref_adaln(x.float(), s, t, 1e-5, BF), BF),
        ("gate", lambda be: ops.gate_residual(x.float(), y.to(BF), m.float(), backend=be),
         ref_gate(x, y, m), ref_gate(x.float(), y.to(BF), m.float()), F32),
        ("gelu", lambda be: ops.gelu_tanh(x.to(BF), backend=be),
         ref_gelu(x.to(BF).double()), ref_gelu(x.to(BF)), BF),
    ]  # fmt: skip
    for what, fn, base, low, dt in checks:
        for be in ("reference", "emulator"):
            out = fn(be)
            assert out.dtype == dt and out.shape == x.shape
            assert_within(out, base, dt, max_abs_err(low, base), what=f"{what} on {be}")
    assert ops.has_kernel("gelu_tanh", "emulator")


_X = torch.zeros(2, 6, 8)
_M = torch.zeros(2, 3, 8)


@pytest.mark.parametrize(
    ("fn", "args", "kwargs", "err", "match"),
    [
        (ops.adaln_norm_modulate, (_X, _M, _M), {"out_dtype": torch.float16}, TypeError, "out_dtype must be"),
        (ops.adaln_norm_modulate, (_X, _M, _M, 1e-6, "bf16"), {}, TypeError, "out_dtype must be"),
        (
            ops.adaln_norm_modulate,
            (torch.zeros(1, 2, 2561), torch.zeros(1, 2561), torch.zeros(1, 2561)),
            {"out_dtype": BF},
            ValueError,
            "at most C=2560 for torch.float32 with out_dtype torch.bfloat16",
        ),
        (ops.gate_residual, (_X.to(BF), _X, _M), {}, TypeError, "y dtype torch.float32 must match x dtype"),
        (ops.gelu_tanh, (torch.zeros(6, 8),), {}, ValueError, r"x must be \[B, L, C\]"),
        (ops.gelu_tanh, (_X.to(torch.float16),), {}, TypeError, "x must be torch.bfloat16"),
        (ops.gelu_tanh, (torch.zeros(2, 0, 8),), {}, ValueError, "every size >= 1"),
        (ops.gelu_tanh, (_X.transpose(1, 2),), {}, ValueError, "x must be contiguous"),
    ],
)
def test_new_arguments_reject_bad_input(fn, args, kwargs, err, match) -> None:
    with pytest.raises(err, match=match):
        fn(*args, **kwargs, backend="reference")


def test_gelu_takes_ffn_widths_beyond_the_norm_limit() -> None:
    """Wan's FFN hidden width 8,960 exceeds the normalising kernels' 4,608 limit; GELU tiles columns."""
    x = torch.randn(1, 3, 8960, generator=_gen(4)).to(BF)
    ref_err, base = reference_error(ref_gelu, [x.double()], BF)
    assert_within(ops.gelu_tanh(x, backend="emulator"), base, BF, ref_err, what="gelu C=8960")


def test_kernel_rejects_a_bad_mix() -> None:
    with pytest.raises(ValueError, match="y dtype"):
        run(gate_residual_kernel, TensorSpec((4, 8), "bfloat16"), TensorSpec((4, 8), "float32"),
            TensorSpec((1, 8), "float32"), trace_only=True)  # fmt: skip
    with pytest.raises(ValueError, match="out_dtype must be"):
        run(adaln_norm_modulate_kernel, TensorSpec((4, 8), "float32"), TensorSpec((1, 8), "float32"),
            TensorSpec((1, 8), "float32"), 1e-6, "float16", trace_only=True)  # fmt: skip
