"""The causal conv3d op set: nki_kernels.conv3d on the NKI emulator against reference.conv3d (torch conv3d)
through the op (the planner's packing), the streaming cache, the tile plan's limits, the plain packings'
matmul counts and the op's validation.  The forced packings: tests/test_kernel_conv3d_packing.py."""

from __future__ import annotations

import math

import pytest
import torch

from nki_kernels import ops
from nki_kernels.conv3d import SBUF_BYTES, W_BYTES_MAX, conv3d_causal_kernel, plan_conv
from nki_kernels.conv3d_plan import forced_plan
from nki_kernels.emulator import TensorSpec, run
from reference.conv3d import conv3d_causal as ref_conv
from tests.numerics import assert_within, reference_error

pytestmark = pytest.mark.emulator

# (B, C_in, C_out, T, H, W, ksize, bias, cache): 2 input-channel tiles (130), 2 output tiles (140), a row
# split into 2 segments (W 600 > 512), several bands of 4 rows with a partial last one (H 11, W 500: the
# halo rows of a band and the zero rows below the image), every kernel shape Wan's VAE uses.
CASES = [
    (1, 5, 7, 2, 9, 11, (3, 3, 3), True, True),
    (1, 130, 6, 1, 5, 9, (3, 3, 3), False, False),
    (1, 6, 140, 1, 3, 5, (3, 3, 3), True, True),
    (1, 4, 3, 1, 3, 600, (3, 3, 3), True, False),
    (2, 8, 5, 2, 40, 12, (3, 3, 3), False, True),
    (1, 8, 5, 2, 11, 500, (3, 3, 3), True, False),
    (1, 9, 16, 3, 6, 7, (1, 1, 1), True, False),
    (1, 9, 16, 2, 6, 7, (3, 1, 1), True, True),
    (1, 9, 16, 2, 6, 7, (1, 3, 3), False, False),
]


def _inputs(b, cin, cout, t, h, w, ks, bias, cache, seed):
    g = torch.Generator().manual_seed(seed)
    taps = math.prod(ks)
    x = torch.randn(b, cin, t, h, w, generator=g, dtype=torch.float64)
    wt = torch.randn(taps, cin, cout, generator=g, dtype=torch.float64) / math.sqrt(taps * cin)
    bb = torch.randn(cout, generator=g, dtype=torch.float64) if bias else None
    cc = torch.randn(b, cin, ks[0] - 1, h, w, generator=g, dtype=torch.float64) if cache else None
    return x, wt, bb, cc


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("b", "cin", "cout", "t", "h", "w", "ks", "bias", "cache"), CASES)
def test_conv_kernel_matches_reference(b, cin, cout, t, h, w, ks, bias, cache, dtype) -> None:
    x, wt, bb, cc = _inputs(b, cin, cout, t, h, w, ks, bias, cache, seed=cin + cout + h + w)

    def ref(x_, wt_, bb_, cc_):
        return ref_conv(x_, wt_, bb_, ks, cc_)[0]

    ref_err, baseline = reference_error(ref, [x, wt, bb, cc], dtype)
    out, new_cache = ops.conv3d_causal(
        x.to(dtype),
        wt.to(dtype),
        None if bb is None else bb.to(torch.float32),
        ksize=ks,
        cache=None if cc is None else cc.to(dtype),
        backend="emulator",
    )
    assert out.shape == (b, cout, t, h, w) and out.dtype == dtype
    assert_within(out, baseline, dtype, ref_err, what=f"conv3d {cin}->{cout} {ks} {t}x{h}x{w}")
    full = torch.cat([torch.zeros(b, cin, ks[0] - 1, h, w) if cc is None else cc.to(dtype), x.to(dtype)], 2)
    assert torch.equal(new_cache, full[:, :, full.shape[2] - (ks[0] - 1) :])


@pytest.mark.parametrize("backend", ["reference", "emulator"])
def test_streaming_with_the_cache_equals_one_call(backend: str) -> None:
    x, wt, bb, _ = _inputs(1, 6, 5, 5, 4, 9, (3, 3, 3), True, False, seed=1)
    x, wt, bb = x.float(), wt.float(), bb.float()
    whole, _ = ops.conv3d_causal(x, wt, bb, backend=backend)
    a, cache = ops.conv3d_causal(x[:, :, :2].contiguous(), wt, bb, backend=backend)
    bpart, _ = ops.conv3d_causal(x[:, :, 2:].contiguous(), wt, bb, cache=cache, backend=backend)
    torch.testing.assert_close(torch.cat([a, bpart], 2), whole, rtol=0, atol=2e-6)


def test_conv_weight_taps_matches_torch_conv3d() -> None:
    g = torch.Generator().manual_seed(4)
    w = torch.randn(7, 5, 3, 3, 3, generator=g, dtype=torch.float64)
    x = torch.randn(1, 5, 4, 6, 6, generator=g, dtype=torch.float64)
    ours, _ = ref_conv(x, ops.conv_weight_taps(w), None, (3, 3, 3))
    pad = torch.nn.functional.pad(x, (1, 1, 1, 1, 2, 0))
    torch.testing.assert_close(ours, torch.nn.functional.conv3d(pad, w), rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("cin", "cout", "h", "w", "ks"),
    [
        (384, 384, 60, 104, (3, 3, 3)),
        (96, 96, 480, 832, (3, 3, 3)),
        (384, 192, 240, 416, (1, 3, 3)),
        (3, 3, 1, 1, (3, 3, 3)),
    ],
)
def test_plan_fits_its_sbuf_shares(cin, cout, h, w, ks) -> None:
    p = plan_conv(cin, cout, h, w, 2, ks)
    assert p.w_bytes() <= W_BYTES_MAX and p.w_bytes() + p.band_bytes() + p.out_bytes() <= SBUF_BYTES
    assert p.jb * p.seg <= 512 and p.seg * math.ceil(w / p.seg) >= w and 1 <= p.jb <= p.j <= p.groups


def test_plan_rejects_what_does_not_fit() -> None:
    with pytest.raises(ValueError, match="weights of C_in=1024"):
        plan_conv(1024, 1024, 8, 8, 2)
    with pytest.raises(ValueError, match="weights of C_in=384 x C_out=384 need 124416 B"):
        plan_conv(384, 384, 8, 8, 4)  # Wan's 384 x 384 in fp32
    with pytest.raises(ValueError, match="W=20000 is too wide"):
        plan_conv(384, 8, 8, 20000, 2)
    with pytest.raises(ValueError, match="ksize must be 3 extents"):
        plan_conv(8, 8, 8, 8, 2, (2, 3, 3))
    with pytest.raises(ValueError, match="frames must be a positive int"):
        plan_conv(8, 8, 8, 8, 2, (3, 3, 3), frames=0)


@pytest.mark.parametrize(("packing", "per_position"), [((1, 1), 27 * 2 * 2), ((1, 3), 9 * 4 * 2)])
def test_matmuls_per_bank_of_the_plain_packings(packing, per_position) -> None:
    """``s = 1``: one matmul per (tap, input-channel tile, output-channel tile) per PSUM bank, the time taps
    looped (130 channels: 2 tiles) or packed into the contraction (3 x 130 rows: 4 tiles, 9 taps left)."""
    cin, cout, t, h, w = 130, 140, 2, 6, 20  # 2 output-channel tiles
    p = forced_plan(cin, cout, h, w, 2, (3, 3, 3), packing)
    _, tr = run(
        conv3d_causal_kernel,
        TensorSpec((cin, t + 2, h, w), "bfloat16"),
        TensorSpec((27, cin, cout), "bfloat16"),
        TensorSpec((cout,), "float32"),
        (3, 3, 3),
        packing,
        trace_only=True,
    )
    positions = t * math.ceil(h / p.jb) * math.ceil(w / p.seg)
    assert tr.count("nc_matmul") == positions * per_position


@pytest.mark.parametrize(
    ("kw", "err", "match"),
    [
        ({"x": torch.zeros(1, 4, 2, 3, 3), "weight_taps": torch.zeros(27, 5, 2)}, ValueError, "C_in=4"),
        (
            {"x": torch.zeros(1, 4, 2, 3, 3), "weight_taps": torch.zeros(27, 4, 2), "ksize": (2, 3, 3)},
            ValueError,
            "each 1 or 3",
        ),
        ({"x": torch.zeros(4, 2, 3, 3), "weight_taps": torch.zeros(27, 4, 2)}, ValueError, "rank 5"),
        (
            {"x": torch.zeros(1, 4, 2, 3, 3), "weight_taps": torch.zeros(27, 4, 2, dtype=torch.bfloat16)},
            TypeError,
            "weight_taps dtype",
        ),
        (
            {
                "x": torch.zeros(1, 4, 2, 3, 3),
                "weight_taps": torch.zeros(27, 4, 2),
                "cache": torch.zeros(1, 4, 1, 3, 3),
            },
            ValueError,
            "cache must be",
        ),
        (
            {"x": torch.zeros(1, 4, 2, 3, 3), "weight_taps": torch.zeros(27, 4, 2), "bias": torch.zeros(3)},
            ValueError,
            r"bias must be \[C_out\]",
        ),
    ],
)
def test_op_rejects_bad_input(kw, err, match) -> None:
    with pytest.raises(err, match=match):
        ops.conv3d_causal(**kw, backend="reference")
