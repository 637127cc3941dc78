"""Attention kernels (nki_kernels.attention) on the NKI emulator against reference.attention (fp32)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nki_kernels.attention import (
    attention_emulated,
    attention_kernel,
    attention_segments_emulated,
    attention_segments_kernel,
    fit_group,
    p_transpose_plan,
)
from nki_kernels.emulator import TensorSpec, run
from reference.attention import attention, attention_segments
from tests.numerics import assert_within, reference_error

pytestmark = pytest.mark.emulator

DTYPES = st.sampled_from([torch.bfloat16, torch.float32])


def _qkv(b, lq, lk, h, d, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, h, d, generator=g) for n in (lq, lk, lk)]


def _check(b, lq, lk, h, d, dtype, seed, scale=None) -> None:
    q, k, v = _qkv(b, lq, lk, h, d, seed)
    ref_err, (base_o, base_l) = reference_error(attention, [q, k, v], dtype, scale=scale, return_lse=True)
    out, lse = attention_emulated(q.to(dtype), k.to(dtype), v.to(dtype), scale=scale, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (b, lq, h)
    assert_within(out, base_o, dtype, ref_err, what=f"attention out {dtype} {(b, lq, lk, h, d)}")
    assert_within(lse, base_l, dtype, ref_err, what=f"attention lse {dtype} {(b, lq, lk, h, d)}")


@settings(max_examples=5, deadline=None)
@given(
    b=st.integers(1, 2),
    lq=st.integers(1, 200),
    lk=st.integers(1, 700),
    h=st.integers(1, 2),
    d=st.sampled_from([16, 64, 128]),
    dtype=DTYPES,
)
def test_attention_kernel_matches_reference(b, lq, lk, h, d, dtype) -> None:
    _check(b, lq, lk, h, d, dtype, seed=lq * 1000 + lk)


def test_attention_kernel_multi_chunk_tails_bf16() -> None:
    # Lk = 2048 + 512 + 77: a full 4-bank chunk (GpSimd max tree), a 512 chunk and a tail; Lq = 128 + 33.
    _check(2, 161, 2637, 1, 64, torch.bfloat16, seed=1, scale=0.2)


def test_attention_dma_and_pe_transposes_agree_bitwise() -> None:
    """P^T through the SBUF->SBUF DMA transpose (one chunk or a group of chunks per instruction) and through
    TensorE transposes are exact copies: the same kernel with every full chunk on the DMA, none, and mixes
    (both paths in one run, across query tiles and heads; groups of 1, 2 and 3 chunks, including a short last
    group) gives bit-identical out and lse, and a mix matches the fp32 reference within tolerance."""
    b, lq, lk, h, d = 1, 200, 3 * 2048 + 300, 2, 64  # 3 full 2048-key chunks + a 300-key tail per query tile
    q, k, v = _qkv(b, lq, lk, h, d, seed=5)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    outs = {}
    n_full = 3
    tiles = [8, 5] * h  # P^T DMA pieces per transpose instruction set: 128 q -> 8 x 16, 72 q -> 4 x 16 + 8
    # hwdge-legal loads per head: K^T = one 3-D transpose of 6432 rows + one 16-row tail (6444 % 16 = 12);
    # q^T = 1 for the 128-row tile, 1 + 1 tail for the 72-row tile (72 % 16 = 8)
    loads = h * (2 + 1 + 2)
    cases = [((0, 1), 1), ((1, 1), 1), ((1, 2), 1), ((2, 3), 1), ((1, 1), 2), ((1, 2), 2), ((2, 3), 3)]
    for frac, group in cases:
        (o, lse), tr = run(attention_kernel, qb, kb, vb, 0.15, True, frac, group, False)  # running max
        outs[(frac, group)] = (o, lse)
        # groups of `group` consecutive full chunks per query tile, dealt in order by a running counter
        sizes = [min(group, n_full - g0) for g0 in range(0, n_full, group)]
        n_dma_instr = n_dma_chunks = i = 0
        for pieces in tiles:
            for size in sizes:
                if (i * frac[0]) % frac[1] < frac[0]:
                    n_dma_instr += pieces
                    n_dma_chunks += size
                i += 1
        assert tr.count(op="dma_transpose") == loads + n_dma_instr, (frac, group)
        n_pe = (n_full * len(tiles) - n_dma_chunks) * 16 + len(tiles) * 3  # tail: 3 blocks per tile
        assert tr.count(op="nc_transpose") == n_pe, (frac, group)
    base = outs[((0, 1), 1)]
    for key, (o, lse) in outs.items():
        assert torch.equal(o, base[0]) and torch.equal(lse, base[1]), key
    ref_err, (base_o, base_l) = reference_error(
        attention, [q, k, v], torch.bfloat16, scale=0.15, return_lse=True
    )
    o, lse = outs[((1, 2), 2)]
    assert_within(torch.as_tensor(o), base_o, torch.bfloat16, ref_err, what="attention dma/pe mix out")
    assert_within(torch.as_tensor(lse), base_l, torch.bfloat16, ref_err, what="attention dma/pe mix lse")
    with pytest.raises(ValueError, match="dma_transpose_chunks"):
        run(attention_kernel, qb, kb, vb, 0.15, False, (3, 2))
    with pytest.raises(ValueError, match="dma_group"):
        run(attention_kernel, qb, kb, vb, 0.15, False, (1, 2), 0)


def test_p_transpose_plan_groups_and_deals() -> None:
    """Pure schedule: full chunks in groups of consecutive chunks, dealt by a running counter; partial chunks
    always on TensorE; the last member of a DMA group flushes it."""
    chunks = [(0, 2048), (2048, 2048), (4096, 2048), (6144, 512), (6656, 77)]
    plan, n = p_transpose_plan(chunks, 2048, 2, 0, (1, 2))
    assert n == 2  # groups {0, 1} (dealt: 0 * 1 % 2 < 1) and {2} (not: 1 % 2 >= 1)
    assert plan == [
        (True, 0, False),
        (True, 1, True),
        (False, 0, False),
        (False, 0, False),
        (False, 0, False),
    ]
    plan, n = p_transpose_plan(chunks, 2048, 2, 1, (1, 2))
    assert n == 3 and plan[:3] == [(False, 0, False), (False, 0, False), (True, 0, True)]
    plan, n = p_transpose_plan(chunks, 2048, 8, 5, (0, 1))
    assert n == 6 and not any(dma for dma, _, _ in plan)


def test_fit_group_respects_budget() -> None:
    # 2 * g * chunk + fixed <= budget
    assert fit_group(8, 200, 40, 10) == 8
    assert fit_group(8, 200, 140, 10) == 3
    assert fit_group(8, 200, 199, 10) == 1  # never below one chunk (the kernel's own capacity check decides)


def test_attention_kernel_multi_chunk_fp32() -> None:
    _check(1, 130, 1100, 2, 32, torch.float32, seed=2)


def test_attention_without_lse_and_lnc2() -> None:
    q, k, v = (x.bfloat16() for x in _qkv(1, 70, 300, 3, 32, seed=3))
    a = attention_emulated(q, k, v)
    c = attention_emulated(q, k, v, lnc=2)
    assert isinstance(a, torch.Tensor) and torch.equal(a, c)


@settings(max_examples=4, deadline=None)
@given(data=st.data(), dtype=DTYPES)
def test_attention_segments_matches_reference(data, dtype) -> None:
    s = data.draw(st.integers(20, 400))
    nseg = data.draw(st.integers(1, 3))
    segs = []
    for _ in range(nseg):
        start = data.draw(st.integers(0, s - 1))
        segs.append((start, data.draw(st.integers(1, s - start))))
    q, kk, vv = _qkv(2, data.draw(st.integers(1, 140)), s, 2, 32, seed=s)
    ref_err, base = reference_error(attention_segments, [q, kk, vv, segs], dtype)
    out = attention_segments_emulated(q.to(dtype), kk.to(dtype), vv.to(dtype), segs)
    assert_within(out, base, dtype, ref_err, what=f"attention_segments {dtype} {segs}")


def test_attention_rejects_bad_input() -> None:
    q, k, v = _qkv(1, 4, 6, 2, 8, seed=4)
    with pytest.raises(TypeError, match="dtype"):
        attention_emulated(q, k.bfloat16(), v)
    with pytest.raises(ValueError, match="H and D"):
        attention_emulated(q, torch.randn(1, 6, 3, 8), torch.randn(1, 6, 3, 8))
    with pytest.raises(ValueError, match="segments"):
        attention_segments_emulated(q, k, v, [(4, 5)])
    with pytest.raises(ValueError, match="D=256"):
        attention_emulated(torch.randn(1, 2, 1, 256), torch.randn(1, 2, 1, 256), torch.randn(1, 2, 1, 256))


def _spec(b, n, h, d):
    return TensorSpec((b, n, h, d), "bfloat16")


def test_attention_trace_no_transpose_pass_over_hbm() -> None:
    """q/k are transposed by the DMA on their way in, P on TensorE; HBM traffic is q, k, v read once per head
    (plus the < 16-row overlap of hwdge tail transposes) and out written once: no HBM->HBM copy, no store of a
    transposed intermediate."""
    b, lq, lk, h, d = 1, 300, 1000, 2, 128
    _, tr = run(
        attention_kernel,
        _spec(b, lq, h, d),
        _spec(b, lk, h, d),
        _spec(b, lk, h, d),
        0.1,
        False,
        trace_only=True,
    )
    dmas = [(r, n) for r, n in tr.entries() if r.engine == "dma"]
    assert not [r for r, _ in dmas if r.direction == "hbm->hbm"]
    read = sum(r.bytes_read * n for r, n in dmas if r.direction == "hbm->sbuf")
    written = sum(r.bytes_written * n for r, n in dmas if r.direction == "sbuf->hbm")
    # hwdge-legal transposes move whole 16-row groups: a tail of r % 16 rows re-reads 16 - r % 16 rows of the
    # previous group (q tile of 44 rows: 4, K^T of 1000 keys: 8), at most 15 rows per transposed load
    overlap = (16 - 44 % 16) + (16 - lk % 16)
    assert read == (lq + 2 * lk + overlap) * h * d * 2 * b
    assert written == lq * h * d * 2 * b  # exactly the output, in its [B, Lq, H, D] layout
    assert tr.count(op="dma_transpose") > 0 and tr.count(op="nc_transpose") > 0
    # segments: the same bytes as the gathered keys, read in place from the buffer
    segs = ((0, 300), (500, 200), (900, 100))
    _, tr2 = run(
        attention_segments_kernel,
        _spec(b, lq, h, d),
        _spec(b, lk, h, d),
        _spec(b, lk, h, d),
        segs,
        0.1,
        False,
        trace_only=True,
    )
    read2 = sum(
        r.bytes_read * n for r, n in tr2.entries() if r.engine == "dma" and r.direction == "hbm->sbuf"
    )
    seg_overlap = sum((16 - n % 16) % 16 for _, n in segs)  # per segment's K^T tail: 4 + 8 + 12 rows
    assert read2 == (lq + 2 * 600 + (16 - 44 % 16) + seg_overlap) * h * d * 2 * b
