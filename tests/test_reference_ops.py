"""The pure-PyTorch references against independent formulas (numpy fp64, naive loops, hand-built caches)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from reference.attention import attention, attention_segments, merge_attention
from reference.kv_cache import kv_cache_slide, kv_cache_write
from reference.rope3d import rope3d, rope_split, rope_tables

# ---------------------------------------------------------------------------------------------- rope


def numpy_rope(x: np.ndarray, grid: tuple[int, int, int], time_pos: list[int]) -> np.ndarray:
    """Independent float64 real-arithmetic 3D RoPE: explicit per-token (f, h, w) and per-pair cos/sin."""
    b, seq, h, d = x.shape
    f_n, hp, wp = grid
    n_pairs = d // 2
    n_hw = d // 6  # pairs for height and for width each
    n_t = n_pairs - 2 * n_hw
    out = np.empty_like(x, dtype=np.float64)
    for tok in range(seq):
        f, rem = divmod(tok, hp * wp)
        row, col = divmod(rem, wp)
        theta = np.empty(n_pairs)
        for j in range(n_pairs):
            if j < n_t:
                pos, jj, group = time_pos[f], j, n_t
            elif j < n_t + n_hw:
                pos, jj, group = row, j - n_t, n_hw
            else:
                pos, jj, group = col, j - n_t - n_hw, n_hw
            theta[j] = pos * 10000.0 ** (-(2.0 * jj) / (2.0 * group))
        c, s = np.cos(theta), np.sin(theta)
        re, im = x[:, tok, :, 0::2].astype(np.float64), x[:, tok, :, 1::2].astype(np.float64)
        out[:, tok, :, 0::2] = re * c - im * s
        out[:, tok, :, 1::2] = re * s + im * c
    return out


def wan_table(head_dim: int, max_pos: int = 1024) -> torch.Tensor:
    """Wan's frequency table built as in WanModel: three polar tables concatenated along the pair axis."""

    def params(dim: int) -> torch.Tensor:
        freqs = torch.outer(
            torch.arange(max_pos), 1.0 / torch.pow(10000, torch.arange(0, dim, 2).to(torch.float64).div(dim))
        )
        return torch.polar(torch.ones_like(freqs), freqs)

    d = head_dim
    return torch.cat([params(d - 4 * (d // 6)), params(2 * (d // 6)), params(2 * (d // 6))], dim=1)


def wan_rope_apply(
    x: torch.Tensor, grid: tuple[int, int, int], table: torch.Tensor, start: int
) -> torch.Tensor:
    """Wan's causal_rope_apply restated: index the table, multiply in complex128, return float32."""
    b, seq, n, d = x.shape
    c = d // 2
    t_freqs, h_freqs, w_freqs = table.split([c - 2 * (c // 3), c // 3, c // 3], dim=1)
    f, h, w = grid
    freqs = torch.cat(
        [
            t_freqs[start : start + f].view(f, 1, 1, -1).expand(f, h, w, -1),
            h_freqs[:h].view(1, h, 1, -1).expand(f, h, w, -1),
            w_freqs[:w].view(1, 1, w, -1).expand(f, h, w, -1),
        ],
        dim=-1,
    ).reshape(seq, 1, -1)
    out = []
    for i in range(b):
        xi = torch.view_as_complex(x[i].to(torch.float64).reshape(seq, n, -1, 2))
        out.append(torch.view_as_real(xi * freqs).flatten(2))
    return torch.stack(out).float()


def test_rope_split_matches_wan() -> None:
    assert rope_split(128) == (22, 21, 21)
    assert rope_split(64) == (12, 10, 10)
    assert rope_split(6) == (1, 1, 1)
    for d in (2, 4, 8, 64, 96, 128, 256):
        t, h, w = rope_split(d)
        c = d // 2
        assert (t, h, w) == (c - 2 * (c // 3), c // 3, c // 3)  # the split rope_apply uses
        assert 2 * t == d - 4 * (d // 6)  # the time table's dim in WanModel.__init__
    with pytest.raises(ValueError, match="head_dim"):
        rope_split(7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [128, 64, 12])
def test_rope_against_numpy_real_formula(dtype: torch.dtype, d: int) -> None:
    g = torch.Generator().manual_seed(d)
    grid = (3, 2, 5)
    seq = 30
    q = torch.randn(2, seq, 2, d, generator=g).to(dtype)
    k = torch.randn(2, seq, 2, d, generator=g).to(dtype)
    qr, kr = rope3d(q, k, grid, start_frame=4)
    assert qr.dtype == dtype and qr.shape == q.shape
    tp = [4, 5, 6]
    for x, xr in ((q, qr), (k, kr)):
        expect = numpy_rope(x.float().numpy(), grid, tp)
        if dtype == torch.float32:
            # reference rounds the float64 result to fp32 once: within 1 fp32 ulp of |x| <= ~6
            np.testing.assert_allclose(xr.numpy(), expect, rtol=0, atol=2e-6, equal_nan=False)
        else:
            exp_bf16 = torch.from_numpy(expect).float().to(torch.bfloat16).float()
            # same float64 value rounded the same way; allow 1 bf16 ulp where numpy and torch
            # cos/sin differ in the last float64 bit at a rounding boundary
            ulp = torch.finfo(torch.bfloat16).eps * exp_bf16.abs().clamp_min(1e-30)
            assert ((xr.float() - exp_bf16).abs() <= ulp).all()
            assert (xr.float() == exp_bf16).float().mean() > 0.999


@pytest.mark.parametrize("table_dtype", [torch.float64, torch.float32])
def test_rope3d_tables_against_numpy_real_formula(table_dtype: torch.dtype) -> None:
    from reference.rope3d import rope3d_tables

    g = torch.Generator().manual_seed(11)
    grid, tp = (3, 2, 5), [0, 9, 10]
    q = torch.randn(2, 30, 2, 64, generator=g)
    k = torch.randn(2, 30, 2, 64, generator=g)
    cos, sin = rope_tables(grid, 64, frame_positions=tp, dtype=table_dtype)
    qr, kr = rope3d_tables(q, k, cos, sin)
    for x, xr in ((q, qr), (k, kr)):
        expect = numpy_rope(x.numpy(), grid, tp)
        # float64 tables: one fp32 rounding of the float64 result (<= 1 ulp of |x| <= ~6, as above);
        # float32 tables add each factor's fp32 rounding: |x| * 2 * 2^-24 <= ~1e-6 more
        atol = 2e-6 if table_dtype == torch.float64 else 3e-6
        np.testing.assert_allclose(xr.numpy(), expect, rtol=0, atol=atol, equal_nan=False)
    if table_dtype == torch.float64:  # the exact factors: bitwise the per-call reference
        assert torch.equal(qr, rope3d(q, k, grid, frame_positions=tp)[0])
    with pytest.raises(ValueError, match="cos must be"):
        rope3d_tables(q, k, cos[1:], sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_bitwise_equals_wan_table_lookup(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    grid, start = (4, 3, 5), 1017  # 1017 + 4 = 1021 < 1024 table rows
    q = torch.randn(2, 60, 3, 128, generator=g).to(dtype)
    table = wan_table(128)
    qr, _ = rope3d(q, q, grid, start_frame=start)
    expect = wan_rope_apply(q, grid, table, start).to(dtype)
    assert torch.equal(qr, expect)


def test_rope_split_groups_rotate_with_their_axis() -> None:
    """Time pairs [0,22) move with f only, height pairs [22,43) with h only, width [43,64) with w only."""
    d = 128
    x = torch.randn(1, 1, 1, d).expand(1, 2 * 3 * 4, 1, d).contiguous()
    xr, _ = rope3d(x, x, (2, 3, 4), start_frame=0)
    xr = xr.reshape(2, 3, 4, d)
    base = x[0, 0, 0]
    t_sl, h_sl, w_sl = slice(0, 44), slice(44, 86), slice(86, 128)
    # atol 1e-6 below (~4 fp32 ulps of |x| <= ~3): an angle of 0 gives cos 1, sin 0 exactly; measured 0.0
    # token (0,0,0): all angles zero -> unchanged
    assert torch.allclose(xr[0, 0, 0], base, atol=1e-6)
    # token (1,0,0): only time dims change
    assert not torch.allclose(xr[1, 0, 0, t_sl], base[t_sl])
    assert torch.allclose(xr[1, 0, 0, h_sl], base[h_sl], atol=1e-6)
    assert torch.allclose(xr[1, 0, 0, w_sl], base[w_sl], atol=1e-6)
    # token (0,2,0): only height dims change
    assert torch.allclose(xr[0, 2, 0, t_sl], base[t_sl], atol=1e-6)
    assert not torch.allclose(xr[0, 2, 0, h_sl], base[h_sl])
    assert torch.allclose(xr[0, 2, 0, w_sl], base[w_sl], atol=1e-6)
    # token (0,0,3): only width dims change
    assert torch.allclose(xr[0, 0, 3, :86], base[:86], atol=1e-6)
    assert not torch.allclose(xr[0, 0, 3, w_sl], base[w_sl])
    # height and width share frequencies: with equal h and w blocks, (0, p, 0)'s height block equals
    # (0, 0, p)'s width block
    y = x.clone()
    y[..., w_sl] = y[..., h_sl]
    yr = rope3d(y, y, (2, 3, 4))[0].reshape(2, 3, 4, d)
    assert torch.equal(yr[0, 2, 0, h_sl], yr[0, 0, 2, w_sl])
    assert not torch.allclose(yr[0, 2, 0, h_sl], y[0, 0, 0, h_sl])


def test_rope_frame_positions_override_and_sink_reposition() -> None:
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 3 * 2 * 2, 2, 64, generator=g)
    a, _ = rope3d(q, q, (3, 2, 2), start_frame=9)
    b, _ = rope3d(q, q, (3, 2, 2), frame_positions=[9, 10, 11])
    c, _ = rope3d(q, q, (3, 2, 2), start_frame=123, frame_positions=torch.tensor([9, 10, 11]))
    assert torch.equal(a, b) and torch.equal(a, c)
    # a sink of 1 frame re-positioned before a 2-frame window
    s, _ = rope3d(q, q, (3, 2, 2), frame_positions=[5, 20, 21])
    sink_alone, _ = rope3d(q[:, :4].contiguous(), q[:, :4].contiguous(), (1, 2, 2), start_frame=5)
    win_alone, _ = rope3d(q[:, 4:].contiguous(), q[:, 4:].contiguous(), (2, 2, 2), start_frame=20)
    assert torch.equal(s[:, :4], sink_alone) and torch.equal(s[:, 4:], win_alone)
    with pytest.raises(ValueError, match="frame_positions"):
        rope3d(q, q, (3, 2, 2), frame_positions=[1, 2])


def test_rope_scores_depend_only_on_relative_time() -> None:
    """q.k after RoPE is invariant to a common time shift (fp64 inputs: only the fp32 output cast)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2 * 3 * 3, 2, 128, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2 * 3 * 3, 2, 128, generator=g, dtype=torch.float64)
    q0, k0 = rope3d(q, k, (2, 3, 3), start_frame=0)
    q1, k1 = rope3d(q, k, (2, 3, 3), start_frame=700)
    s0 = torch.einsum("bqhd,bkhd->bhqk", q0, k0)
    s1 = torch.einsum("bqhd,bkhd->bhqk", q1, k1)
    # measured 1.5e-06 on |s| <= ~37; atol 1e-4 (+ default rtol 1e-5) allows the fp32 angle of position
    # 700 (ulp(700) = 6.1e-05 rad) to be rounded differently from that of position 0
    assert torch.allclose(s0, s1, atol=1e-4)


def test_rope_tables_match_angles() -> None:
    cos, sin = rope_tables((2, 3, 4), 128, start_frame=5)
    assert cos.shape == (24, 64) and sin.shape == (24, 64) and cos.dtype == torch.float32
    # token l = (f=1, h=2, w=3): pair 0 time angle (5+1)*1, pair 22 height 2*1, pair 43 width 3*1
    tok = 1 * 12 + 2 * 4 + 3
    assert math.isclose(cos[tok, 0].item(), math.cos(6.0), abs_tol=1e-7)
    assert math.isclose(sin[tok, 22].item(), math.sin(2.0), abs_tol=1e-7)
    assert math.isclose(sin[tok, 43].item(), math.sin(3.0), abs_tol=1e-7)
    assert math.isclose(sin[tok, 1].item(), math.sin(6.0 * 10000 ** (-2 / 44)), abs_tol=1e-7)
    assert math.isclose(sin[tok, 23].item(), math.sin(2.0 * 10000 ** (-2 / 42)), abs_tol=1e-7)
    cb, _ = rope_tables((2, 3, 4), 128, start_frame=5, dtype=torch.bfloat16)
    assert cb.dtype == torch.bfloat16 and torch.equal(cb, cos.to(torch.bfloat16))
    # applying the tables with real arithmetic reproduces the reference (fp32 arithmetic error only)
    x = torch.randn(1, 24, 2, 128)
    xe, xo = x[..., 0::2], x[..., 1::2]
    c, s = cos[None, :, None], sin[None, :, None]
    alt = torch.stack([xe * c - xo * s, xe * s + xo * c], -1).flatten(-2)
    # measured 2.4e-07; the same comparison as tests/numerics.py floor (b) (fp32 max 4.77e-07 over 8 seeds)
    assert torch.allclose(alt, rope3d(x, x, (2, 3, 4), 5)[0], atol=3e-6)


# ---------------------------------------------------------------------------------------------- attention


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[np.ndarray, np.ndarray]:
    qn, kn, vn = (t.double().numpy() for t in (q, k, v))
    b, lq, h, d = qn.shape
    out = np.zeros((b, lq, h, d))
    lse = np.zeros((b, lq, h))
    for bi in range(b):
        for hi in range(h):
            for i in range(lq):
                s = np.array(
                    [scale * float(np.dot(qn[bi, i, hi], kn[bi, j, hi])) for j in range(kn.shape[1])]
                )
                m = s.max()
                e = np.exp(s - m)
                out[bi, i, hi] = (e[:, None] * vn[bi, :, hi]).sum(0) / e.sum()
                lse[bi, i, hi] = m + math.log(e.sum())
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_attention_against_naive_float64(dtype: torch.dtype, scale: float | None) -> None:
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 7, 3, 16, generator=g).to(dtype)
    k = torch.randn(2, 11, 3, 16, generator=g).to(dtype)
    v = torch.randn(2, 11, 3, 16, generator=g).to(dtype)
    out, lse = attention(q, k, v, scale=scale, return_lse=True)
    assert (
        out.dtype == dtype and out.shape == q.shape and lse.dtype == torch.float32 and lse.shape == (2, 7, 3)
    )
    exp_out, exp_lse = naive_attention(q, k, v, 1 / math.sqrt(16) if scale is None else scale)
    out_tol = 2e-6 if dtype == torch.float32 else 2**-8 * 4  # fp32 arithmetic / one bf16 output rounding
    np.testing.assert_allclose(out.double().numpy(), exp_out, atol=out_tol, rtol=0, equal_nan=False)
    np.testing.assert_allclose(lse.double().numpy(), exp_lse, atol=2e-6, rtol=0, equal_nan=False)
    plain = attention(q, k, v, scale=scale)
    assert isinstance(plain, torch.Tensor) and torch.equal(plain, out)


def test_attention_empty_keys_is_merge_neutral() -> None:
    q = torch.randn(1, 3, 2, 8)
    out, lse = attention(q, q[:, :0], q[:, :0], return_lse=True)
    assert torch.equal(out, torch.zeros_like(q)) and torch.isneginf(lse).all()


@given(
    segs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 9)), min_size=1, max_size=4),
    b=st.integers(1, 2),
    lq=st.integers(1, 9),
)
def test_attention_segments_equals_gathered(segs: list[tuple[int, int]], b: int, lq: int) -> None:
    g = torch.Generator().manual_seed(5)
    kv_k = torch.randn(b, 50, 2, 8, generator=g)
    kv_v = torch.randn(b, 50, 2, 8, generator=g)
    q = torch.randn(b, lq, 2, 8, generator=g)
    idx = [s + i for s, n in segs for i in range(n)]  # overlap allowed in the reference
    out, lse = attention_segments(q, kv_k, kv_v, segs, return_lse=True)
    exp_out, exp_lse = attention(q, kv_k[:, idx], kv_v[:, idx], return_lse=True)
    assert torch.equal(out, exp_out) and torch.equal(lse, exp_lse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_attention_of_split_equals_full(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 9, 2, 16, generator=g).to(dtype)
    k = torch.randn(2, 40, 2, 16, generator=g).to(dtype)
    v = torch.randn(2, 40, 2, 16, generator=g).to(dtype)
    full, full_lse = attention(q, k, v, return_lse=True)
    parts = [attention(q, k[:, a:b], v[:, a:b], return_lse=True) for a, b in ((0, 13), (13, 14), (14, 40))]
    parts.append(attention(q, k[:, :0], v[:, :0], return_lse=True))  # an empty shard weighs zero
    out, lse = merge_attention([p[0] for p in parts], [p[1] for p in parts])
    assert out.dtype == dtype and lse.dtype == torch.float32
    # fp32: merge reorders the softmax sum, measured 2.4e-07 (tests/numerics.py floor (a): max 7.75e-07);
    # bf16: partials rounded once to bf16, measured 3.9e-03 = 2**-8 (half an ulp in [1, 2))
    atol = 1e-6 if dtype == torch.float32 else 2**-7
    assert torch.allclose(out.float(), full.float(), atol=atol, rtol=0)
    assert torch.allclose(lse, full_lse, atol=1e-5)  # fp32 lse of either dtype: measured 4.8e-07 (|lse| < 5)
    with pytest.raises(ValueError, match="outs and lses"):
        merge_attention([full], [])


# ---------------------------------------------------------------------------------------------- kv cache


def token_ids(cache: torch.Tensor) -> list[int]:
    """Recover the integer id stored in every token (all elements of a token hold the same id)."""
    return [int(x) for x in cache[0, :, 0, 0].tolist()]


def coded(b: int, ids: list[int], h: int = 2, d: int = 4) -> torch.Tensor:
    t = torch.tensor(ids, dtype=torch.float32)[None, :, None, None].expand(b, len(ids), h, d)
    return (t + torch.arange(b, dtype=torch.float32)[:, None, None, None] * 1000).contiguous()


def test_kv_cache_write_hand_built() -> None:
    ck, cv = coded(2, list(range(12))), -coded(2, list(range(12)))
    k, v = coded(2, [100, 101, 102]), -coded(2, [100, 101, 102])
    assert kv_cache_write(ck, cv, k, v, 2) is None
    assert token_ids(ck) == [0, 1, 2, 3, 4, 5, 100, 101, 102, 9, 10, 11]
    assert token_ids(-cv) == token_ids(ck)
    assert torch.equal(ck[1, 6:9], k[1])  # batch 1 too
    kv_cache_write(ck, cv, k, v, 3)
    assert token_ids(ck)[9:] == [100, 101, 102]
    with pytest.raises(ValueError, match="slot"):
        kv_cache_write(ck, cv, k, v, 4)


def test_kv_cache_slide_hand_built() -> None:
    # sink of 2 tokens, blocks of 3: [s s | a a a | b b b | c c c]
    ids = [0, 1, 10, 11, 12, 20, 21, 22, 30, 31, 32]
    ck, cv = coded(2, ids), -coded(2, ids)
    k, v = coded(2, [40, 41, 42]), -coded(2, [40, 41, 42])
    kv_cache_slide(ck, cv, k, v, 2)
    assert token_ids(ck) == [0, 1, 20, 21, 22, 30, 31, 32, 40, 41, 42]
    assert token_ids(-cv) == token_ids(ck)
    assert torch.equal(ck[1], coded(2, [0, 1, 20, 21, 22, 30, 31, 32, 40, 41, 42])[1])
    # no sink; block fills everything after the sink
    ck2 = coded(1, [1, 2, 3, 4])
    kv_cache_slide(ck2, ck2.clone(), coded(1, [7, 8]), coded(1, [7, 8]), 2)
    assert token_ids(ck2) == [1, 2, 7, 8]
    ck3 = coded(1, [1, 2, 3, 4, 5])
    kv_cache_slide(ck3, ck3.clone(), coded(1, [9, 9]), coded(1, [9, 9]), 0)
    assert token_ids(ck3) == [3, 4, 5, 9, 9]
    with pytest.raises(ValueError, match="sink_tokens"):
        kv_cache_slide(ck3, ck3.clone(), coded(1, [9, 9]), coded(1, [9, 9]), 4)
