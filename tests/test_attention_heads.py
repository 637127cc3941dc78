"""The static pass of every head at once over one short key chunk (nki_kernels.attention_heads, cross-
attention over the text tokens): every head's K/V resident, each query tile's q of all heads in one
transposing DMA.

Against ``reference.attention`` with the tolerance rule of ``tests/numerics.py`` (float64 reference of the
rounded inputs, 2x the reference's own error in bf16 + bf16's floor), at shapes that exercise what the pass
adds: several head groups per PSUM bank (H = 7: groups 3, 3, 1), a partial last query tile with a tail of
fewer than 16 queries, a partial last 128-key block, two segments, lnc2 (tiles split over the cores), lse;
each data run checked to be the fast path alone (no running-max recompute), and the guard's lower bound
tripping on data built to trip it."""

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


def _fast_path_only(tr: Any, offsets: int) -> None:
    """One offset max per (tile, head) + the guard's reduce over the tiles (per core), and no running-max
    recompute (which adds a row max per tile and P transposes)."""
    assert tr.count(op="tensor_reduce") == offsets


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
    tiles = -(-lq // 128)
    _fast_path_only(traces[0], tiles * h + lnc)
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
    _fast_path_only(traces[0], 2 * 2 + 1)
    assert_within(out, base_o, BF, ref_err, what="heads pass segments out")
    assert_within(lse, base_l, BF, ref_err, what="heads pass segments lse")


def test_rows_far_below_the_tile_offset_trip_the_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """Queries 0..39 score key 5 at 8 * 50 * 0.25 = 100 nats, the others O(1): with one offset per tile and
    head their terms sit ~100 nats below it and underflow; the guard recomputes those heads with the running
    max (exact), and without its lower bound the same rows come back wrong."""
    q, k, v = _rand(4, (1, 160, 2, 16), (1, 512, 2, 16), (1, 512, 2, 16))
    q[:, :40, :, 0] = 8.0
    q[:, 40:, :, 0] = 0.0
    k[:, 5, :, :] = 0.0
    k[:, 5, :, 0] = 50.0
    kw = {"scale": 0.25, "return_lse": True}
    ref_err, (base_o, base_l) = reference_error(attention, [q, k, v], BF, **kw)
    out, lse = attention_emulated(q.to(BF), k.to(BF), v.to(BF), **kw)
    assert_within(out, base_o, BF, ref_err, what="heads pass, guard tripped, out")
    assert_within(lse, base_l, BF, ref_err, what="heads pass, guard tripped, lse")
    monkeypatch.setattr(att, "GUARD_L_MIN", 0.0)
    bad, bad_lse = attention_emulated(q.to(BF), k.to(BF), v.to(BF), **kw)
    assert not torch.isfinite(bad_lse[:, 40:128]).all() or (bad.float() - base_o).abs().max() > 0.1


def test_heads_fit_rules() -> None:
    assert heads_fit(((0, 512),), 12, 128, True, (0, 1))  # Wan's cross-attention: 12 heads x 512 text keys
    assert not heads_fit(((0, 512),), 12, 128, False, (0, 1))  # fp32: the per-head loop
    assert not heads_fit(((0, 512),), 12, 128, True, (1, 2))  # a DMA share of P^T
    assert not heads_fit(((0, 1040),), 2, 64, True, (0, 1))  # more than one key chunk
    assert not heads_fit(((0, 500),), 2, 64, True, (0, 1))  # not whole 16-key rows
    assert not heads_fit(((0, 1024),), 24, 128, True, (0, 1))  # 24 heads' K/V past the SBUF share
