"""gate_residual_adaln (nki_kernels/elementwise_fused.py) on the NKI emulator: the fp32 residual update and
the next adaLN norm + modulation in one kernel, against reference.elementwise.gate_residual_adaln (both
outputs, tests/numerics.py tolerances) and bitwise against the two separate kernels; one-pass traffic,
the SBUF limit, validation."""

from __future__ import annotations

import pytest
import torch

from nki_kernels import ops
from nki_kernels.elementwise import adaln_norm_modulate_emulated, frame_tiles, gate_residual_emulated
from nki_kernels.elementwise_fused import (
    fused_max_features,
    fused_tile_bytes,
    gate_residual_adaln_emulated,
    gate_residual_adaln_kernel,
)
from nki_kernels.emulator import TensorSpec, run
from reference.elementwise import gate_residual_adaln as ref_fused
from tests.numerics import assert_within, max_abs_err

pytestmark = pytest.mark.emulator

BF, F32 = torch.bfloat16, torch.float32

# (B, L, C, F, lnc): 150-token frames (128 + 22 tail), C = 640 (512 + 128), per-token rows with C < 128,
# LNC2 over 3 frames, one short frame with C = 1030
CASES = [(2, 300, 640, 2, 1), (1, 12, 96, 12, 1), (2, 390, 520, 3, 2), (1, 7, 1030, 1, 1)]


def _inputs(b: int, length: int, c: int, f: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, length, c, generator=g, dtype=torch.float64) * 2.0 + 0.7
    y = torch.randn(b, length, c, generator=g, dtype=torch.float64).to(BF).double()  # bf16-exact
    gate, shift, scale = (torch.randn(b, f, c, generator=g, dtype=torch.float64) * 0.6 for _ in range(3))
    return x, y, gate, shift, scale


@pytest.mark.parametrize(("b", "length", "c", "f", "lnc"), CASES)
def test_fused_matches_reference_and_the_separate_kernels(b, length, c, f, lnc) -> None:
    x, y, gate, shift, scale = _inputs(b, length, c, f, b * 7 + length + c)
    base_x, base_br = ref_fused(x, y, gate, shift, scale, 1e-6, None)  # float64 baseline
    low_x, low_br = ref_fused(x.float(), y.to(BF), gate.float(), shift.float(), scale.float(), 1e-6, BF)
    args = (x.float(), y.to(BF), gate.float(), shift.float(), scale.float(), 1e-6)
    xo, br = gate_residual_adaln_emulated(*args, lnc=lnc)
    assert xo.dtype == F32 and br.dtype == BF and xo.shape == br.shape == x.shape
    assert_within(xo, base_x, F32, max_abs_err(low_x, base_x), what=f"x_new {b}x{length}x{c} F={f}")
    assert_within(br, base_br, BF, max_abs_err(low_br, base_br), what=f"branch {b}x{length}x{c} F={f}")
    # the same instructions per element as the two kernels in sequence (x_new is not re-read)
    x1 = gate_residual_emulated(x.float(), y.to(BF), gate.float(), lnc=lnc)
    b1 = adaln_norm_modulate_emulated(x1, shift.float(), scale.float(), 1e-6, lnc=lnc, out_dtype=BF)
    assert torch.equal(xo, x1) and torch.equal(br, b1)


def test_fused_fp32_branch() -> None:
    x, y, gate, shift, scale = _inputs(1, 200, 512, 2, 3)
    base_x, base_br = ref_fused(x, y, gate, shift, scale, 1e-6, None)
    low = ref_fused(x.float(), y.to(BF), gate.float(), shift.float(), scale.float(), 1e-6, F32)
    args = (x.float(), y.to(BF), gate.float(), shift.float(), scale.float(), 1e-6)
    xo, br = gate_residual_adaln_emulated(*args, out_dtype=F32)
    assert br.dtype == F32
    assert_within(br, base_br, F32, max_abs_err(low[1], base_br), what="fp32 branch")


def test_one_pass_twelve_bytes_per_element() -> None:
    """fp32 x in and out, bf16 y in, bf16 branch out; three fp32 rows per frame; one DMA per operand per
    tile (4 per tile) and 3 per frame."""
    n, c, g = 2 * 1560, 1536, 2
    x, y, rows = TensorSpec((n, c), "float32"), TensorSpec((n, c), "bfloat16"), TensorSpec((g, c), "float32")
    _, tr = run(gate_residual_adaln_kernel, x, y, rows, rows, rows, 1e-6, trace_only=True)
    dma = [(r, k) for r, k in tr.entries() if r.engine == "dma"]
    assert sum((r.bytes_read + r.bytes_written) // 2 * k for r, k in dma) == n * c * 12 + 3 * g * c * 4
    assert tr.count("dma_copy") == 4 * len(frame_tiles(n, g)) + 3 * g


def test_fused_limit_is_wans_width() -> None:
    c = fused_max_features()
    assert c == ops.FUSED_MAX_C == 1536 and fused_tile_bytes(c) <= 160 * 1024 < fused_tile_bytes(c + 512)


def test_op_repeats_rows_to_one_frame_count_on_both_backends() -> None:
    """norm3's [B, C] rows with a per-frame gate: the op repeats rows to the largest frame count."""
    x, y, gate, shift, scale = _inputs(2, 60, 200, 3, 11)
    sh1, sc1 = shift[:, 0], scale[:, 0]  # [B, C]
    base = ref_fused(x, y, gate, sh1, sc1, 1e-6, None)
    low = ref_fused(x.float(), y.to(BF), gate.float(), sh1.float(), sc1.float(), 1e-6, BF)
    for be in ("reference", "emulator"):
        xo, br = ops.gate_residual_adaln(
            x.float(), y.to(BF), gate.float(), sh1.float(), sc1.float(), 1e-6, backend=be
        )
        assert_within(xo, base[0], F32, max_abs_err(low[0], base[0]), what=f"x_new on {be}")
        assert_within(br, base[1], BF, max_abs_err(low[1], base[1]), what=f"branch on {be}")
    assert ops.has_kernel("gate_residual_adaln", "emulator")


_X, _Y, _M = torch.zeros(2, 6, 8), torch.zeros(2, 6, 8, dtype=BF), torch.zeros(2, 3, 8)


@pytest.mark.parametrize(
    ("args", "kwargs", "err", "match"),
    [
        ((_X.to(BF), _Y, _M, _M, _M), {}, TypeError, "x dtype torch.bfloat16 must be torch.float32"),
        ((_X, _X, _M, _M, _M), {}, TypeError, "y dtype torch.float32 must be torch.bfloat16"),
        (
            (_X, torch.zeros(2, 5, 8, dtype=BF), _M, _M, _M),
            {},
            ValueError,
            r"y shape \(2, 5, 8\) must equal x shape",
        ),
        ((_X, _Y, torch.zeros(2, 4, 8), _M, _M), {}, ValueError, "gate has F=4 frames"),
        ((_X, _Y, _M, torch.zeros(2, 2, 8), _M), {}, ValueError, "frame counts"),
        ((_X, _Y, _M, _M, _M), {"out_dtype": torch.float16}, TypeError, "out_dtype must be"),
        ((_X, _Y, _M, _M, _M, 0.0), {}, ValueError, "eps must be finite and > 0"),
        (
            (torch.zeros(1, 2, 1537), torch.zeros(1, 2, 1537, dtype=BF), *[torch.zeros(1, 1537)] * 3),
            {},
            ValueError,
            "at most C=1536",
        ),
    ],
)
def test_fused_op_rejects_bad_input(args, kwargs, err, match) -> None:
    with pytest.raises(err, match=match):
        ops.gate_residual_adaln(*args, **kwargs, backend="reference")
