"""The peer-structure attention kernel (perf/e2e/peer_attention.py) computes attention, obeys the emulator's
rules and issues the peer's P^T DMA count and sizes.

Numerics: kernel (bf16 inputs, D-major q/k) vs the fp32 torch reference ``reference.attention.attention`` on
the original fp32 inputs, tolerance ``2 x the reference's own bf16 error + the bf16 floor``
(tests/numerics.py: the floor covers flash-style re-association over key tiles and sections).
"""

from __future__ import annotations

import math

import ml_dtypes
import pytest
import torch

from nki_kernels._nki import launch
from nki_kernels.emulator import TensorSpec, run
from perf.e2e.peer_attention import (
    SECTION,
    TRANSPOSE_KEYS,
    dmajor_layout_kernel,
    padded_keys,
    peer_attention_kernel,
    peer_sections,
    row_tiles,
    transpose_pieces,
)
from reference.attention import attention
from tests.numerics import assert_within, reference_error

BF = ml_dtypes.bfloat16


def _ref(q, k, v):
    return attention(q, k, v, 1.0 / math.sqrt(q.shape[-1]))


def _run_peer(q, k, v, lk_buf, junk=50.0):
    """Kernel on bf16 inputs in the peer's layouts; keys ``[Lk, lk_buf)`` of the buffers hold large junk
    (the kernel must attend only ``actual_seqlen_k`` = Lk keys)."""
    _, lq, h, d = q.shape
    lk = k.shape[1]
    kb = torch.full((lk_buf, h, d), junk, dtype=torch.bfloat16)
    vb = torch.full((lk_buf, h, d), junk, dtype=torch.bfloat16)
    kb[:lk], vb[:lk] = k[0].bfloat16(), v[0].bfloat16()
    qk = q[0].bfloat16().permute(1, 2, 0).contiguous()
    out, _ = launch(
        peer_attention_kernel,
        qk,
        kb.permute(1, 2, 0).contiguous(),
        vb.permute(1, 0, 2).contiguous(),
        1.0 / math.sqrt(d),
        lk,
    )
    return out.unsqueeze(0)  # [Lq, H, d] -> [1, Lq, H, d]


@pytest.mark.parametrize(
    "h, d, lq, lk, lk_buf",
    [
        (2, 64, 200, 700, 1024),  # one section; 2 groups (query tail 72), key tail 700 % 128
        (
            1,
            128,
            300,
            10_300,
            10_752,
        ),  # two flash sections (8192 + 2108), 3 groups: the steady pipeline stage
    ],
)
def test_peer_attention_matches_reference(h, d, lq, lk, lk_buf):
    torch.manual_seed(lq + lk)
    q, k, v = torch.randn(1, lq, h, d), torch.randn(1, lk, h, d), torch.randn(1, lk, h, d)
    ref_err, base = reference_error(_ref, [q, k, v], torch.bfloat16)
    out = _run_peer(q, k, v, lk_buf)
    assert_within(out.float(), base, torch.bfloat16, ref_err, "peer attention vs torch softmax attention")


def test_peer_attention_many_groups_and_q_reload():
    """More than 8 query groups: q^T reloads every 8 groups into the other buffer."""
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 1100, 1, 32), torch.randn(1, 300, 1, 32), torch.randn(1, 300, 1, 32)
    ref_err, base = reference_error(_ref, [q, k, v], torch.bfloat16)
    assert_within(_run_peer(q, k, v, 512).float(), base, torch.bfloat16, ref_err, "peer attention, 9 groups")


def test_peer_attention_rejects_bad_input():
    q = TensorSpec((1, 64, 128), BF)
    k, v = TensorSpec((1, 64, 512), BF), TensorSpec((1, 512, 64), BF)
    with pytest.raises(ValueError, match="actual_seqlen_k"):
        run(peer_attention_kernel, q, k, v, 0.125, 513, trace_only=True)
    with pytest.raises(ValueError, match=r"v .* \[B, Lk, d\]"):
        run(peer_attention_kernel, q, k, TensorSpec((1, 64, 512), BF), 0.125, 512, trace_only=True)
    with pytest.raises(ValueError, match="2-byte"):
        f = "float32"
        run(
            peer_attention_kernel,
            TensorSpec((1, 64, 128), f),
            TensorSpec((1, 64, 512), f),
            TensorSpec((1, 512, 64), f),
            0.125,
            512,
            trace_only=True,
        )


def test_index_maths():
    assert (
        padded_keys(32_760) == 32_768
        and padded_keys(32_769) == 40_960
        and padded_keys(8192) == 8192
        and padded_keys(1) == 8192
    )
    assert peer_sections(32_760) == (8192, 4)
    assert peer_sections(10_240) == (10_240, 1) and peer_sections(10_241) == (8192, 2)
    assert peer_sections(512) == (512, 1)
    # one 128-query group over a full section: 8 slices x 2 key halves = 16 DMAs (the peer's 16 per section)
    p = transpose_pieces(128, SECTION)
    assert len(p) == 16 and {n for _, _, n in p} == {TRANSPOSE_KEYS}
    assert sorted({q0 for q0, _, _ in p}) == list(range(0, 128, 16))
    # key tail: 8184 keys = 4096 + 4088 -> the tail rides in a whole 128-key block (4096)
    assert {(k0, n) for _, k0, n in transpose_pieces(52, 8184)} == {(0, 4096), (4096, 4096)}
    assert len(transpose_pieces(52, 8184)) == 2 * 4  # 52 queries: 4 slices of 16
    assert transpose_pieces(1, 100) == [(0, 0, 128)]
    assert row_tiles(1040) == [(0, 512), (512, 512), (1024, 16)]
    assert row_tiles(1030) == [(0, 512), (512, 512), (1014, 16)]  # a < 16-row tail moves back
    assert row_tiles(16) == [(0, 16)]
    for bad in (lambda: padded_keys(0), lambda: transpose_pieces(129, 10), lambda: row_tiles(15)):
        with pytest.raises(ValueError):
            bad()


def test_peer_transposes_have_the_peers_count_and_sizes():
    """Trace (rules checked: shapes, start partitions, SBUF/PSUM capacity, DMA shapes) at 3 heads over 2
    sections: every P^T DMA moves [16 q, 4096 k] with 1 KiB per destination partition, 16 per group and
    full section (the peer's 16 DMAs of [128 q, 512 k], also 1 KiB per destination partition)."""
    h, d, lq, lk = 3, 128, 256, 16_384
    _, tr = run(
        peer_attention_kernel,
        TensorSpec((h, d, lq), BF),
        TensorSpec((h, d, lk), BF),
        TensorSpec((h, lk, d), BF),
        1 / math.sqrt(d),
        lk,
        trace_only=True,
    )
    recs = [(r, n) for r, n in tr.counts.items() if r.op == "dma_transpose"]
    total = sum(n for _, n in recs)
    assert total == h * 2 * (lq // 128) * 16  # heads x sections x groups x 16
    for r, _ in recs:
        assert r.direction == "sbuf->sbuf" and r.partitions == 128
        assert r.bytes_read == 16 * TRANSPOSE_KEYS * 2
        assert r.bytes_read // r.partitions == 1024


def test_dmajor_layout_kernel_is_the_permute():
    """The layout kernel equals the peer's torch permutes exactly (a copy: bit-identical)."""
    torch.manual_seed(0)
    q = torch.randn(37, 2, 64).bfloat16()
    k = torch.randn(530, 2, 64).bfloat16()
    v = torch.randn(530, 2, 64).bfloat16()
    (qT, kT, vh), _ = launch(dmajor_layout_kernel, q, k, v)
    assert torch.equal(qT, q.permute(1, 2, 0))
    assert torch.equal(kT, k.permute(1, 2, 0))
    assert torch.equal(vh, v.permute(1, 0, 2))


@pytest.mark.slow
def test_peer_attention_traces_at_the_peers_wan_shape():
    """The denoise call of the peer's merged forward at 480x832 on one core of TP4xSP2 (3 heads, 11,700
    queries, 32,760 keys of a 32,768-wide buffer): the emulator's rules hold (the trace raises otherwise),
    every P^T DMA has the peer's per-section count, and the v2 schedule prices it DMA-bound at both ends."""
    from nki_kernels.emulator.cost import profile_range

    h, d, lq, lk = 3, 128, 11_700, 32_760
    kb = padded_keys(lk)
    _, tr = run(
        peer_attention_kernel,
        TensorSpec((h, d, lq), BF),
        TensorSpec((h, d, kb), BF),
        TensorSpec((h, kb, d), BF),
        1 / math.sqrt(d),
        lk,
        trace_only=True,
        keep_events=True,
    )
    n_t = sum(n for r, n in tr.counts.items() if r.op == "dma_transpose")
    # by hand: 4 sections (8192 x 3 + 8184 keys), each 2 key slices of 4096; 91 full groups of 8 16-row
    # slices and one of 52 queries (4 slices): (91 x 8 + 4) x 2 per section and head
    assert n_t == 3 * 4 * (91 * 8 + 4) * 2 == 17_568
    lo, hi = profile_range(tr, schedule=True)
    assert lo.model == hi.model == "schedule" and lo.latency_ns <= hi.latency_ns
    assert lo.bottleneck == hi.bottleneck == "dma"
