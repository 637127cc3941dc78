"""RoPE kernel (nki_kernels.rope3d) on the NKI emulator against reference.rope3d (complex128)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nki_kernels.emulator import TensorSpec, run
from nki_kernels.rope3d import rope3d_emulated, rope3d_kernel, rope3d_naive_kernel, rope_tables_np
from reference.rope3d import rope3d
from tests.numerics import assert_within, reference_error

pytestmark = pytest.mark.emulator


def _check(b: int, grid: tuple[int, int, int], h: int, d: int, dtype: torch.dtype, seed: int, **kw) -> None:
    g = torch.Generator().manual_seed(seed)
    n = grid[0] * grid[1] * grid[2]
    q = torch.randn(b, n, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, n, h, d, generator=g, dtype=torch.float64)
    ref_err, base = reference_error(rope3d, [q, k, grid], dtype, **kw)
    out = rope3d_emulated(q.to(dtype), k.to(dtype), grid, **kw)
    assert out[0].dtype == dtype and out[0].shape == q.shape
    assert_within(out, base, dtype, ref_err, what=f"rope3d kernel {dtype} grid={grid}")


@settings(max_examples=6, deadline=None)
@given(
    b=st.integers(1, 2),
    f=st.integers(1, 3),
    hp=st.integers(1, 9),
    wp=st.integers(1, 60),
    h=st.integers(1, 3),
    d=st.sampled_from([12, 32, 64, 128]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    start=st.integers(0, 40),
)
def test_rope3d_kernel_matches_reference(b, f, hp, wp, h, d, dtype, start) -> None:
    _check(b, (f, hp, wp), h, d, dtype, seed=f * 100 + wp, start_frame=start)


def test_rope3d_kernel_super_tiles_and_tail() -> None:
    # L = 2*13*50 = 1300 at H=2: one super-tile of m=10 (no ramp at 128 pairs per token) + 20-token tail
    _check(2, (2, 13, 50), 2, 128, torch.bfloat16, seed=1, start_frame=5)


def test_rope3d_kernel_ramp_and_compute_chunks() -> None:
    # L = 2*20*65 = 2600 at H=12, D=128: super-tiles m = 2, 4, 8, 4, 2 (the ramp) + a 40-token tail; the
    # m=8 tile is rotated in chunks of 5 and 3 tokens (4,096 pairs per instruction at most)
    from nki_kernels.rope3d import _plan, _ramp_start, _super_tiles

    m_max, ct = _plan(12, 128, 2)
    tiles = _super_tiles(2600, m_max, _ramp_start(12, 128, m_max))
    assert (m_max, ct) == (8, 5) and [m for _, _, m in tiles] == [2, 4, 8, 4, 2, 1]
    _check(1, (2, 20, 65), 12, 128, torch.bfloat16, seed=11, frame_positions=[0, 9])


@settings(max_examples=40, deadline=None)
@given(length=st.integers(1, 40_000), max_m=st.integers(1, 16), min_m=st.sampled_from([1, 2, 4, 8, 16]))
def test_super_tiles_cover_every_token_once(length: int, max_m: int, min_m: int) -> None:
    from nki_kernels.rope3d import _super_tiles

    tiles = _super_tiles(length, max_m, min_m)
    t = 0
    for t0, rows, m in tiles:
        assert t0 == t and 1 <= m <= max_m and 1 <= rows <= 128 and (rows == 128 or m == 1)
        t += rows * m
    assert t == length


def test_rope3d_kernel_frame_positions() -> None:
    _check(1, (3, 4, 11), 2, 64, torch.float32, seed=2, frame_positions=[0, 7, 8])


def test_rope3d_kernel_lnc2_equals_lnc1() -> None:
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 1300, 2, 64, generator=g).bfloat16()
    k = torch.randn(1, 1300, 2, 64, generator=g).bfloat16()
    a = rope3d_emulated(q, k, (2, 13, 50), 1)
    c = rope3d_emulated(q, k, (2, 13, 50), 1, lnc=2)
    assert torch.equal(a[0], c[0]) and torch.equal(a[1], c[1])


def test_rope3d_kernel_rejects_bad_input() -> None:
    q = torch.randn(1, 10, 2, 8)
    with pytest.raises(ValueError, match="grid"):
        rope3d_emulated(q, q, (1, 2, 3))
    with pytest.raises(ValueError, match="even"):
        rope3d_emulated(torch.randn(1, 6, 2, 7), torch.randn(1, 6, 2, 7), (1, 2, 3))
    with pytest.raises(TypeError, match="dtype"):
        rope3d_emulated(q, q.double(), (1, 2, 5))


def _trace(kernel, b: int, length: int, h: int, d: int):
    args = [TensorSpec((b, length, h, d), "bfloat16")] * 2 + [TensorSpec((length, d // 2), "float32")] * 2
    return run(kernel, *args, trace_only=True)[1]


def test_rope3d_kernel_trace_one_pass_large_descriptors() -> None:
    """Wan shape: q and k read once and written once; every q/k descriptor is >= 2 KiB (whole token rows)."""
    b, length, h, d = 1, 23400, 12, 128
    tr = _trace(rope3d_kernel, b, length, h, d)
    qk_bytes = 2 * b * length * h * d * 2
    table_bytes = 2 * length * (d // 2) * 4
    dmas = tr.select(op="dma_copy")
    hbm_read = sum(r.bytes_read * n for r, n in dmas if r.direction == "hbm->sbuf")
    hbm_written = sum(r.bytes_written * n for r, n in dmas if r.direction == "sbuf->hbm")
    assert hbm_read == qk_bytes + table_bytes
    assert hbm_written == qk_bytes
    for r, _ in dmas:
        if r.dtypes[0] == "bfloat16":  # q/k traffic (tables are fp32)
            assert min(s for s, _ in r.descriptors) >= 2048, r.descriptors
    # The naive variant gathers single elements: one 2-byte descriptor per element of q and k.
    naive = _trace(rope3d_naive_kernel, 1, 256, 2, 16)
    hist = naive.descriptor_histogram()
    assert hist[2] == 2 * 2 * 256 * 2 * 16


def test_rope_tables_shape() -> None:
    cos, sin = rope_tables_np((2, 3, 4), 16, 0)
    assert cos.shape == (24, 8) and sin.dtype.name == "float32"


def test_rope3d_tables_entry_equals_per_call_tables_on_every_tiling_path() -> None:
    # L = 1300: m=8, m=2 and tail super-tiles; float64 tables are rounded to fp32 as rope_tables_np does
    from nki_kernels.rope3d import rope3d_tables_emulated
    from reference.rope3d import rope_tables

    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 1300, 2, 64, generator=g).bfloat16()
    k = torch.randn(2, 1300, 2, 64, generator=g).bfloat16()
    want = rope3d_emulated(q, k, (2, 13, 50), frame_positions=[3, 9])
    for dt in (torch.float32, torch.float64):
        cos, sin = rope_tables((2, 13, 50), 64, frame_positions=[3, 9], dtype=dt)
        got = rope3d_tables_emulated(q, k, cos, sin)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="cos must be"):
        rope3d_tables_emulated(q, k, cos[1:], sin)
    with pytest.raises(TypeError, match="sin must be"):
        rope3d_tables_emulated(q, k, cos, sin.bfloat16())
