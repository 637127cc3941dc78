"""The fused elementwise op sets: nki_kernels.elementwise (adaLN norm + modulation, gated residual) on the
NKI emulator against reference.elementwise, the tile plan, the kernels' HBM traffic (one pass) and the ops'
validation. Tolerances: tests/numerics.py (2 x the reference's own error in the dtype + the dtype floor)."""

from __future__ import annotations

import math

import pytest
import torch

from nki_kernels import ops
from nki_kernels.elementwise import (
    CHUNK,
    PMAX,
    SBUF_BUDGET,
    adaln_norm_modulate_emulated,
    adaln_norm_modulate_kernel,
    frame_tiles,
    gate_residual_emulated,
    gate_residual_kernel,
    max_features,
    rms_norm_emulated,
    tile_bytes,
)
from nki_kernels.emulator import TensorSpec, run
from reference.elementwise import adaln_norm_modulate as ref_adaln
from reference.elementwise import gate_residual as ref_gate
from reference.elementwise import rms_norm as ref_rms
from tests.numerics import assert_within, reference_error

pytestmark = pytest.mark.emulator

# (B, L, C, F, lnc): frames of 150 tokens (a 128-token tile + a 22-token tail), C not a multiple of 512
# (bn_stats chunks 512 + 128), C < 128, one frame per sample, per-token rows (F = L), LNC2 over 3 frames.
CASES = [
    (2, 300, 640, 2, 1),
    (1, 256, 1536, 1, 1),
    (1, 12, 96, 12, 1),
    (2, 390, 520, 3, 2),
    (1, 7, 1030, 1, 1),
]


def _mod(b: int, f: int, c: int, g: torch.Generator, std: float) -> torch.Tensor:
    return torch.randn(b, f, c, generator=g, dtype=torch.float64) * std


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("b", "length", "c", "f", "lnc"), CASES)
def test_adaln_kernel_matches_reference(b, length, c, f, lnc, dtype) -> None:
    g = torch.Generator().manual_seed(b * 1000 + length + c)
    # off-centre, non-unit data so the statistics matter; unit-scale output (|shift|, |scale| ~ 0.5)
    x = torch.randn(b, length, c, generator=g, dtype=torch.float64) * 3.0 + 1.5
    shift, scale = _mod(b, f, c, g, 0.5), _mod(b, f, c, g, 0.5)
    ref_err, base = reference_error(ref_adaln, [x, shift, scale], dtype, eps=1e-6)
    out = adaln_norm_modulate_emulated(x.to(dtype), shift.to(dtype), scale.to(dtype), 1e-6, lnc=lnc)
    assert out.dtype == dtype and out.shape == x.shape
    assert_within(out, base, dtype, ref_err, what=f"adaln {b}x{length}x{c} F={f} lnc={lnc}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("b", "length", "c", "f", "lnc"), CASES)
def test_gate_residual_kernel_matches_reference(b, length, c, f, lnc, dtype) -> None:
    g = torch.Generator().manual_seed(b * 2000 + length + c)
    x = torch.randn(b, length, c, generator=g, dtype=torch.float64)
    y = torch.randn(b, length, c, generator=g, dtype=torch.float64)
    gate = _mod(b, f, c, g, 0.7)
    ref_err, base = reference_error(ref_gate, [x, y, gate], dtype)
    out = gate_residual_emulated(x.to(dtype), y.to(dtype), gate.to(dtype), lnc=lnc)
    assert out.dtype == dtype and out.shape == x.shape
    assert_within(out, base, dtype, ref_err, what=f"gate_residual {b}x{length}x{c} F={f} lnc={lnc}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("b", "length", "c", "f", "lnc"), CASES)
def test_rms_norm_kernel_matches_reference(b, length, c, f, lnc, dtype) -> None:
    g = torch.Generator().manual_seed(b * 3000 + length + c)
    x = torch.randn(b, length, c, generator=g, dtype=torch.float64) * 2.0 + 0.5
    w = torch.randn(c, generator=g, dtype=torch.float64) * 0.3 + 1.0
    eps = 1e-2 if f == 1 else 1e-6  # a large eps once (per-sample cases), so dropping it fails
    ref_err, base = reference_error(ref_rms, [x, w], dtype, eps=eps)
    out = rms_norm_emulated(x.to(dtype), w.to(dtype), eps, lnc=lnc)
    assert out.dtype == dtype and out.shape == x.shape
    assert_within(out, base, dtype, ref_err, what=f"rms_norm {b}x{length}x{c} lnc={lnc} eps={eps}")


def test_adaln_statistics_survive_a_large_mean() -> None:
    """mean 1000, std 1 in fp32: a one-pass E[x^2] - mean^2 variance loses ~all digits (x^2 ~ 1e6 carries
    ~0.06 absolute fp32 error); bn_stats' per-chunk centred sums keep the fp32 rule."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, 130, 1024, generator=g, dtype=torch.float64) + 1000.0
    shift, scale = _mod(1, 1, 1024, g, 0.5), _mod(1, 1, 1024, g, 0.5)
    ref_err, base = reference_error(ref_adaln, [x, shift, scale], torch.float32, eps=1e-6)
    out = adaln_norm_modulate_emulated(x.float(), shift.float(), scale.float(), 1e-6)
    assert_within(out, base, torch.float32, ref_err, what="adaln mean 1000")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_adaln_eps_sets_the_scale_of_flat_rows(dtype) -> None:
    """Rows with variance ~1e-4 and eps = 1e-4: eps halves the normalised amplitude, so a kernel that drops
    or misplaces eps is off by ~30 % of unit-scale outputs."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1, 200, 768, generator=g, dtype=torch.float64) * 1e-2 + 0.25
    shift, scale = _mod(1, 2, 768, g, 0.5), _mod(1, 2, 768, g, 0.5)
    ref_err, base = reference_error(ref_adaln, [x, shift, scale], dtype, eps=1e-4)
    out = adaln_norm_modulate_emulated(x.to(dtype), shift.to(dtype), scale.to(dtype), 1e-4)
    assert_within(out, base, dtype, ref_err, what=f"adaln eps=1e-4 {dtype}")


def test_frame_tiles_never_straddle_a_frame() -> None:
    tiles = frame_tiles(2 * 1560, 2)
    assert len(tiles) == 2 * 13 and tiles[12] == (0, 1536, 24) and tiles[13] == (1, 1560, 128)
    for f, t0, rows in tiles:
        assert 1 <= rows <= PMAX and f * 1560 <= t0 and t0 + rows <= (f + 1) * 1560
    assert sum(r for _, _, r in tiles) == 3120
    for n, g in ((0, 1), (10, 3), (5, 0)):
        with pytest.raises(ValueError, match="equal frames"):
            frame_tiles(n, g)


@pytest.mark.parametrize("itemsize", [2, 4])
def test_max_features_fit_the_sbuf_budget(itemsize: int) -> None:
    c = max_features(itemsize)
    assert c % CHUNK == 0 and tile_bytes(c, itemsize) <= SBUF_BUDGET < tile_bytes(c + CHUNK, itemsize)
    assert ops.ELEMENTWISE_MAX_C[torch.bfloat16 if itemsize == 2 else torch.float32] == c
    assert c >= 1536  # Wan2.1-1.3B


def _hbm_bytes(tr) -> int:
    return sum((r.bytes_read + r.bytes_written) // 2 * n for r, n in tr.entries() if r.engine == "dma")


@pytest.mark.parametrize("kernel", ["adaln", "gate"])
def test_one_pass_over_hbm(kernel: str) -> None:
    """Every activation element crosses HBM once; the modulation costs one fp32 row per frame (C x 4 B),
    not a copy per partition; one DMA per operand per tile."""
    n, c, g = 2 * 1560, 1536, 2
    ntiles = len(frame_tiles(n, g))
    act = TensorSpec((n, c), "bfloat16")
    rows = TensorSpec((g, c), "float32")
    if kernel == "adaln":
        _, tr = run(adaln_norm_modulate_kernel, act, rows, rows, 1e-6, trace_only=True)
        want_bytes, want_dma, nrows = 2 * n * c * 2 + 2 * g * c * 4, 2 * ntiles + 2 * g, 2
    else:
        _, tr = run(gate_residual_kernel, act, act, rows, trace_only=True)
        want_bytes, want_dma, nrows = 3 * n * c * 2 + g * c * 4, 3 * ntiles + g, 1
    assert _hbm_bytes(tr) == want_bytes
    assert tr.count("dma_copy") == want_dma
    assert tr.count("nc_matmul") == g * nrows * math.ceil(c / CHUNK)  # the per-frame broadcast only


def test_ops_dispatch_and_per_sample_rows() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 70, 200, generator=g)
    y = torch.randn(2, 70, 200, generator=g)
    m = torch.randn(2, 200, generator=g) * 0.5  # [B, C]: one row per sample
    m5 = torch.randn(2, 5, 200, generator=g) * 0.5
    for fn, args, ref, ref_args in (
        (
            ops.adaln_norm_modulate,
            (x, m5, -m5, 1e-5),
            ref_adaln,
            [x.double(), m5.double(), -m5.double(), 1e-5],
        ),
        (ops.gate_residual, (x, y, m), ref_gate, [x.double(), y.double(), m.double()]),
        (ops.rms_norm, (x, m[0], 1e-5), ref_rms, [x.double(), m[0].double(), 1e-5]),
    ):
        r = fn(*args, backend="reference")
        e = fn(*args, backend="emulator")
        assert r.shape == e.shape == x.shape
        ref_err, base = reference_error(ref, ref_args, torch.float32)
        assert_within(e, base, torch.float32, ref_err, what=f"ops.{fn.__name__} emulator")
        assert_within(r, base, torch.float32, ref_err, what=f"ops.{fn.__name__} reference")
    assert ops.has_kernel("adaln_norm_modulate", "emulator") and ops.has_kernel("gate_residual", "emulator")


_X = torch.zeros(2, 6, 8)
_M = torch.zeros(2, 3, 8)


@pytest.mark.parametrize(
    ("args", "err", "match"),
    [
        ((torch.zeros(6, 8), _M, _M), ValueError, r"x must be \[B, L, C\]"),
        ((_X.to(torch.int32), _M, _M), TypeError, "x must be torch.bfloat16"),
        ((_X, torch.zeros(2, 4, 8), _M), ValueError, "shift has F=4 frames: F must divide"),
        ((_X, _M, torch.zeros(1, 3, 8)), ValueError, r"scale must be \[B=2, F, C=8\]"),
        ((_X, _M, torch.zeros(2, 8)), ValueError, r"scale \(2, 8\) torch.float32 must have shift's shape"),
        ((_X, _M, torch.zeros(2, 3, 8, dtype=torch.float64)), TypeError, "scale must be torch.bfloat16"),
        (
            (_X, _M.bfloat16(), _M.bfloat16()),
            TypeError,
            r"shift dtype torch.bfloat16 must be x's dtype torch.fl",
        ),
        ((_X, _M, _M, 0.0), ValueError, "eps must be finite and > 0"),
        ((_X, _M.transpose(1, 2).contiguous().transpose(1, 2), _M), ValueError, "shift must be contiguous"),
        (
            (torch.zeros(1, 2, 4609, dtype=torch.bfloat16), torch.zeros(1, 1, 4609), torch.zeros(1, 4609)),
            ValueError,
            "at most C=4608",
        ),  # fmt: skip
    ],
)
def test_adaln_op_rejects_bad_input(args, err, match) -> None:
    with pytest.raises(err, match=match):
        ops.adaln_norm_modulate(*args, backend="reference")


@pytest.mark.parametrize(
    ("args", "err", "match"),
    [
        ((_X, torch.zeros(9)), ValueError, r"weight must be \[C=8\]"),
        ((_X, torch.zeros(8, dtype=torch.float64)), TypeError, "weight must be torch.bfloat16"),
        ((_X, torch.zeros(8, dtype=torch.bfloat16)), TypeError, "weight dtype torch.bfloat16 must be x's"),
        ((_X, torch.zeros(8), -1.0), ValueError, "eps must be finite and > 0"),
        ((_X[:, :, 0], torch.zeros(8)), ValueError, r"x must be \[B, L, C\]"),
    ],
)
def test_rms_norm_op_rejects_bad_input(args, err, match) -> None:
    with pytest.raises(err, match=match):
        ops.rms_norm(*args, backend="reference")


@pytest.mark.parametrize(
    ("args", "err", "match"),
    [
        ((_X, torch.zeros(2, 6, 9), _M), ValueError, r"y shape \(2, 6, 9\) must equal x shape"),
        ((_X.bfloat16(), _X, _M), TypeError, "y dtype torch.float32 must match x dtype torch.bfloat16"),
        ((_X, _X, torch.zeros(2, 7, 8)), ValueError, "gate has F=7 frames"),
        ((_X, _X, torch.zeros(8)), ValueError, r"gate must be \[B, F, C\] or \[B, C\]"),
    ],
)
def test_gate_op_rejects_bad_input(args, err, match) -> None:
    with pytest.raises(err, match=match):
        ops.gate_residual(*args, backend="reference")


def test_bench_rows_move_exactly_the_minimum_bytes() -> None:
    """The perf/bench_kernels elementwise rows (quick shapes) run and their traced HBM bytes are the
    one-pass minimum each row states."""
    from perf.bench_elementwise import elementwise_cases

    rows = elementwise_cases(quick=True)
    assert [(r[0], r[1].rsplit("_", 1)[1]) for r in rows] == [
        ("adaln_norm_modulate", "bf16"),
        ("gate_residual", "bf16"),
        ("rms_norm", "bf16"),
        ("adaln_norm_modulate", "fp32res"),
        ("gate_residual", "fp32res"),
        ("gelu_tanh", "bf16"),
        ("gate_residual_adaln", "fp32res"),
    ]
    for _, _, _, fn in rows:
        f = fn()
        assert f["hbm_bytes"] == f["hbm_bytes_min"] > 0
        assert f["latency_us"] > f["extra"]["fixed_us"] > 0 and f["extra"]["hbm_roofline_us"] > 0
