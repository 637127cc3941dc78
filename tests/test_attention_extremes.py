"""Attention at extreme scores and at the reference's memory budget.

* Multi-chunk flash attention (emulator) whose scaled scores swing by ~500 between key chunks, upwards
  for half of the queries and downwards for the other half: a running maximum that is not the max over
  every chunk seen so far overflows ``exp`` (NaN rows) or underflows every weight.
* Block-table attention (emulator) with extreme *unlisted* blocks: the stand-in keys of an empty entry must
  be a listed block of the group; any unlisted block here outscores the listed keys by > 88, so picking one
  moves the row max and underflows every valid weight. With the listed keys far below 0, a stand-in that
  is no block at all (zeros, a stale staging tile) does the same.
* The reference's query chunking (above ``SCORE_BUDGET_ELEMENTS``) forced with a tiny budget, against the
  unchunked call.

Tolerance for the extreme cases (fp32, float64 softmax baseline): fp32 rounding of an exp argument of size
|x| costs a relative |x| * 2^-24 on its weight, which the unit-scale floor of tests/numerics.py does not
cover at |x| ~ 250: bound = FLOORS[fp32] + 2 * max|x| * 2^-24 * max|v| (the rule of
tests/test_kernel_attention_block_table.py::test_large_scores_empty_entries_exact).
"""

from __future__ import annotations

import math

import pytest
import torch

import reference.attention as ref_attention
from nki_kernels.attention import attention_emulated
from nki_kernels.attention_block_table import attention_block_table_emulated
from tests.numerics import FLOORS, assert_within, max_abs_err

F32 = torch.float32


def _softmax64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Independent float64 attention ``[B, L, H, D]``: (out, lse, scaled scores)."""
    x = scale * torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double())
    lse = torch.logsumexp(x, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(x - lse[..., None]), v.double())
    return out, lse.permute(0, 2, 1), x


def _extreme_tol(x: torch.Tensor, v: torch.Tensor) -> float:
    return FLOORS[F32] + 2 * x.abs().max().item() * 2.0**-24 * v.abs().max().item()


def _check_close(out, lse, want_o, want_l, x, v, what: str) -> None:
    assert torch.isfinite(out).all() and torch.isfinite(lse).all(), f"{what}: non-finite output"
    tol = _extreme_tol(x, v)
    err_o, err_l = max_abs_err(out, want_o), max_abs_err(lse, want_l)
    assert err_o <= tol, f"{what}: out error {err_o:.3e} > {tol:.3e}"
    assert err_l <= tol * want_l.abs().max().item(), f"{what}: lse error {err_l:.3e}"


@pytest.mark.emulator
def test_multi_chunk_attention_with_score_swings_between_chunks() -> None:
    # fp32 key chunks: Lk = 700 -> (512, 188). Chunk 0 keys lean +e0, chunk 1 keys lean -e0; queries 0..19
    # lean +e0 (max falls after chunk 0), queries 20..39 lean -e0 (max rises by ~500 in chunk 1).
    b, lq, lk, h, d, scale = 1, 40, 700, 1, 16, 4.0
    g = torch.Generator().manual_seed(11)
    e0 = torch.zeros(d)
    e0[0] = 1.0
    q = 0.3 * torch.randn(b, lq, h, d, generator=g)
    q[:, :20] += 8.0 * e0
    q[:, 20:] -= 8.0 * e0
    k = 0.3 * torch.randn(b, lk, h, d, generator=g)
    k[:, :512] += 4.0 * e0
    k[:, 512:] -= 4.0 * e0
    v = torch.randn(b, lk, h, d, generator=g)
    want_o, want_l, x = _softmax64(q, k, v, scale)
    first, rest = x[..., :512].amax(-1), x[..., 512:].amax(-1)
    assert ((first - rest)[..., :20] > 200).all() and ((rest - first)[..., 20:] > 200).all(), "data"
    out, lse = attention_emulated(q, k, v, scale=scale, return_lse=True)
    _check_close(out, lse, want_o, want_l, x, v, "multi-chunk large-score attention")


def _stand_in_case(listed: tuple[tuple[int, int], ...], lean: float) -> None:
    """Source 0: 5 blocks, source 1: 2 blocks, T = 16; the group lists two blocks with an empty entry
    first and one between. Every unlisted block holds keys along +e0 that score ~ +250 against the
    queries; the listed ones score ~ ``32 * lean`` +- 40. Checked against a float64 softmax over the
    listed blocks alone."""
    t, d, scale = 16, 16, 4.0
    g = torch.Generator().manual_seed(5)
    e0 = torch.zeros(d)
    e0[0] = 1.0
    q = 0.3 * torch.randn(1, 24, 1, d, generator=g) + 8.0 * e0
    ks = [0.3 * torch.randn(1, n * t, 1, d, generator=g) for n in (5, 2)]
    vs = [torch.randn(1, n * t, 1, d, generator=g) for n in (5, 2)]
    for s, k in enumerate(ks):
        for blk in range(k.shape[1] // t):
            k[:, blk * t : (blk + 1) * t] += (lean if (s, blk) in listed else 8.0) * e0
    (s1, b1), (s2, b2) = listed
    table = torch.tensor([[[-1, 0], [s1, b1], [-1, 0], [s2, b2]]])
    keys = torch.cat([ks[s][:, b * t : (b + 1) * t] for s, b in listed], dim=1)
    vals = torch.cat([vs[s][:, b * t : (b + 1) * t] for s, b in listed], dim=1)
    want_o, want_l, x = _softmax64(q, keys, vals, scale)
    for s, k in enumerate(ks):
        for blk in range(k.shape[1] // t):
            if (s, blk) not in listed:
                xu = scale * torch.einsum("bqhd,bkhd->bhqk", q, k[:, blk * t : (blk + 1) * t])
                assert (xu.amin(-1) - x.amax(-1) > 88).all(), "the unlisted blocks must dominate every row"
    if lean < 0:
        assert (x.amax(-1) < -88).all(), "a zero key (score 0) must dominate every row too"
    out, lse = attention_block_table_emulated(q, ks, vs, table, [24], t, scale=scale, return_lse=True)
    _check_close(out, lse, want_o, want_l, x, vals, f"block table, listed {listed}, lean {lean}")


@pytest.mark.emulator
@pytest.mark.parametrize(
    "listed",
    [((0, 2), (0, 3)), ((0, 1), (0, 3)), ((0, 0), (0, 4)), ((0, 3), (1, 1))],
    ids=["adjacent", "gap", "both-ends", "two-sources"],
)
def test_block_table_stand_in_ignores_extreme_unlisted_blocks(listed: tuple[tuple[int, int], ...]) -> None:
    # the listed keys score within ~ +-40, every unlisted block ~ +250: a stand-in (the key block an empty
    # entry loads) taken from any unlisted block shifts the row max by > 88 and every listed weight
    # underflows. Listed blocks with a gap, at both ends or in two sources leave an unlisted block between
    # or beside them, which adjacent ones hide.
    _stand_in_case(listed, 0.0)


@pytest.mark.emulator
@pytest.mark.parametrize("listed", [((0, 1), (0, 3)), ((0, 3), (1, 1))], ids=["gap", "two-sources"])
def test_block_table_stand_in_is_a_listed_block_not_zeros(listed: tuple[tuple[int, int], ...]) -> None:
    # the listed keys score ~ -250 +- 40: a stand-in that is no block at all (an empty entry whose loads
    # all skip keeps the staging tile's zeros, or a stale tile) scores 0 there and moves the row max by
    # > 88, so every listed weight underflows (out = 0, lse = -inf)
    _stand_in_case(listed, -8.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_query_chunks_equal_unchunked(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    # B*H*Lk = 2*3*50 = 300 score elements per query row; budget 3 rows -> chunks of 3, 3, 3, 1 queries
    b, lq, lk, h, d = 2, 10, 50, 3, 32
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(b, n, h, d, generator=g).to(dtype) for n in (lq, lk, lk))
    whole = ref_attention.attention(q, k, v, return_lse=True)
    rows = []
    real = torch.einsum

    def counting(eq: str, *ops: torch.Tensor) -> torch.Tensor:
        if eq.startswith("bqhd,bkhd"):
            rows.append(ops[0].shape[1])
        return real(eq, *ops)

    monkeypatch.setattr(ref_attention, "SCORE_BUDGET_ELEMENTS", 3 * b * h * lk + 7)
    monkeypatch.setattr(ref_attention.torch, "einsum", counting)
    chunked = ref_attention.attention(q, k, v, return_lse=True)
    monkeypatch.undo()
    assert rows == [3, 3, 3, 1], rows
    # the same fp32 rows in another batching, output rounded to dtype: within the dtype's floor (ref_err 0:
    # both sides are the reference)
    assert_within(chunked, whole, dtype, 0.0, what="chunked reference")
    _, lse64, _ = _softmax64(q, k, v, 1 / math.sqrt(d))
    # and it is attention: fp32 lse vs a float64 lse of the same (rounded) inputs; measured 4.7e-07 (fp32)
    # and 5.2e-07 (bf16) for |lse| <= 5.01; bound 2 x that rounded up to 2e-6 (fp32 arithmetic only)
    assert max_abs_err(chunked[1], lse64) <= 2e-6
    assert chunked[0].shape == q.shape and chunked[1].shape == (b, lq, h)


def test_merge_weighs_partials_without_keys_zero() -> None:
    # merge_attention's contract: a partial with lse = -inf (no keys) weighs zero, whatever its out holds
    # (here deliberately non-zero), both next to a real partial and when every partial is empty.
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, n, 2, 16, generator=g) for n in (5, 7, 7))
    o_real, l_real = ref_attention.attention(q, k, v, return_lse=True)
    junk = torch.full_like(o_real, 3.0)
    empty = torch.full_like(l_real, -math.inf)
    out, lse = ref_attention.merge_attention([junk, o_real], [empty, l_real])
    assert torch.equal(out, o_real) and torch.equal(lse, l_real)
    out, lse = ref_attention.merge_attention([junk, 2 * junk], [empty, empty])
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
