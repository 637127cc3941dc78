"""The static pass of every head at once over one short key chunk (nki_kernels.attention_heads, cross-
attention over the text tokens): every head's K/V resident, each query tile's q of all heads in one
transposing DMA.

Against ``reference.attention`` with the tolerance rule of ``tests/numerics.py`` (float64 reference of the
rounded inputs, 2x the reference's own error in bf16 + bf16's floor), at shapes that exercise what the pass
adds: several head groups per PSUM bank (H = 7: groups 3, 3, 1), a partial last query tile with a tail of
fewer than 16 queries, a partial last 128-key block, two segments, lnc2 (tiles split over the cores), lse;
each data run checked to be the fast path alone (no running-max recompute). As the per-head loop's one-chunk
pass, each row's offset is its own largest score: rows far below the others stay on the fast path, and only
a non-finite row trips the guard (its wiring checked with the bound lowered)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import nki_kernels.attention as att
from nki_kernels.attention import attention_emulated, attention_segments_emulated
from nki_kernels.attention_heads import heads_fit
from nki_kernels.emulator import run
from reference.attention import attention, attention_segments
from tests.numerics import assert_within, reference_error

pytestmark = pytest.mark.emulator
BF = torch.bfloat16


def _rand(seed: int, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) for s in shapes]


def _launches(monkeypatch: pytest.MonkeyPatch) -> list:
    from nki_kernels import _nki

    traces: list = []

    def launch(kernel: Any, *args: Any, lnc: int = 1, **kwargs: Any) -> tuple[Any, Any]:
        out, tr = run(kernel, *args, lnc=lnc, **kwargs)
        traces.append(tr)
        return out, tr

    monkeypatch.setattr(_nki, "launch", launch)
    return traces


def _fast_path_only(tr: Any, cores: int) -> None:
    """The guard's one reduce over the tiles per core, and no running-max recompute (which adds a row max
    per tile: the pass's own row maxima are ``tensor_scalar_reduce``)."""
    assert tr.count(op="tensor_reduce") == cores


@pytest.mark.parametrize(("lq", "lk", "h", "d", "lnc"), [(300, 512, 3, 128, 1), (200, 400, 7, 64, 2)])
def test_every_head_at_once_matches_reference(
    lq: int, lk: int, h: int, d: int, lnc: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """300 queries = 2 tiles + 44 (2 x 16 + a 12-query tail); 7 heads = PSUM groups of 3, 3, 1 per tile,
    400 keys = 3 blocks + 16 (a partial block), lnc2: the tiles split over the two cores."""
    q, k, v = _rand(11, (1, lq, h, d), (1, lk, h, d), (1, lk, h, d))
    k[:, -16:] *= 2.0  # the last keys score higher and carry shifted values: their rows must be right
    v[:, -16:] += 3.0
    assert heads_fit(((0, lk),), h, d, True, (0, 1))
    ref_err, (base_o, base_l) = reference_error(attention, [q, k, v], BF, scale=0.2, return_lse=True)
    traces = _launches(monkeypatch)
    out, lse = attention_emulated(q.to(BF), k.to(BF), v.to(BF), scale=0.2, return_lse=True, lnc=lnc)
    assert traces[0].count(op="tensor_scalar_reduce") == -(-lq // 128) * h  # one row max per (tile, head)
    _fast_path_only(traces[0], lnc)
    assert_within(out, base_o, BF, ref_err, what=f"heads pass {lq}x{lk} H={h} out")
    assert_within(lse, base_l, BF, ref_err, what=f"heads pass {lq}x{lk} H={h} lse")


def test_two_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    q, kb, vb = _rand(12, (1, 130, 2, 64), (1, 500, 2, 64), (1, 500, 2, 64))
    segs = [(0, 160), (300, 96)]
    kw = {"scale": 0.15, "return_lse": True}

    def ref(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> Any:
        return attention_segments(a, b, c, segs, **kw)

    ref_err, (base_o, base_l) = reference_error(ref, [q, kb, vb], BF)
    traces = _launches(monkeypatch)
    out, lse = attention_segments_emulated(q.to(BF), kb.to(BF), vb.to(BF), segs, **kw)
    _fast_path_only(traces[0], 1)
    assert_within(out, base_o, BF, ref_err, what="heads pass segments out")
    assert_within(lse, base_l, BF, ref_err, what="heads pass segments lse")


def test_rows_far_below_the_others_stay_on_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Queries 0..39 score key 5 at 8 * 50 * 0.25 = 100 nats, the others O(1): each row's offset is its
    own maximum, so no row underflows and none is recomputed; with the guard's upper bound lowered below
    every row's l (>= 1) every head is recomputed with the running max, and the result is the same."""
    q, k, v = _rand(4, (1, 160, 2, 16), (1, 512, 2, 16), (1, 512, 2, 16))
    q[:, :40, :, 0] = 8.0
    q[:, 40:, :, 0] = 0.0
    k[:, 5, :, :] = 0.0
    k[:, 5, :, 0] = 50.0
    kw = {"scale": 0.25, "return_lse": True}
    ref_err, (base_o, base_l) = reference_error(attention, [q, k, v], BF, **kw)
    traces = _launches(monkeypatch)
    out, lse = attention_emulated(q.to(BF), k.to(BF), v.to(BF), **kw)
    _fast_path_only(traces[0], 1)
    assert_within(out, base_o, BF, ref_err, what="heads pass, rows far apart, out")
    assert_within(lse, base_l, BF, ref_err, what="heads pass, rows far apart, lse")
    monkeypatch.setattr(att, "GUARD_L_MAX", 0.5)
    out2, lse2 = attention_emulated(q.to(BF), k.to(BF), v.to(BF), **kw)
    assert traces[-1].count(op="tensor_reduce") > 1 + 2  # each head's recompute: a row max per tile
    assert_within(out2, base_o, BF, ref_err, what="heads pass, every head recomputed, out")
    assert_within(lse2, base_l, BF, ref_err, what="heads pass, every head recomputed, lse")


def test_a_non_finite_row_in_one_tile_trips_its_heads_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """An infinite query element in tile 1 of head 1 makes that row's l NaN: the guard (over every tile)
    recomputes head 1 alone with the running max (a row max per tile: 2 more reduces), head 0 stays on the
    fast path and matches the reference."""
    q, k, v = _rand(5, (1, 200, 2, 32), (1, 256, 2, 32), (1, 256, 2, 32))
    q[0, 150, 1, 3] = float("inf")
    traces = _launches(monkeypatch)
    out = attention_emulated(q.to(BF), k.to(BF), v.to(BF), scale=0.2)
    assert traces[0].count(op="tensor_reduce") == 1 + 2
    ref_err, base_o = reference_error(attention, [q[:, :, :1], k[:, :, :1], v[:, :, :1]], BF, scale=0.2)
    assert_within(out[:, :, :1], base_o, BF, ref_err, what="heads pass, the finite head")


def test_heads_fit_rules() -> None:
    assert heads_fit(((0, 512),), 12, 128, True, (0, 1))  # Wan's cross-attention: 12 heads x 512 text keys
    assert not heads_fit(((0, 512),), 12, 128, False, (0, 1))  # fp32: the per-head loop
    assert not heads_fit(((0, 512),), 12, 128, True, (1, 2))  # a DMA share of P^T
    assert not heads_fit(((0, 528),), 2, 64, True, (0, 1))  # more than one PSUM bank of scores
    assert not heads_fit(((0, 500),), 2, 64, True, (0, 1))  # not whole 16-key rows
    assert not heads_fit(((0, 512),), 48, 128, True, (0, 1))  # 48 heads' K/V past the SBUF share
