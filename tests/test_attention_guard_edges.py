"""The static softmax offset's guard (``nki_kernels.attention._guarded_rows``) at its bounds exactly, in both
kernels that use it (plain attention and the block-table kernel), on the emulator.

A guard that exists to catch overflow / underflow is tested where it decides: one chosen row's softmax
denominator ``l`` is driven to one fp32 ulp below, exactly onto, and one ulp above ``GUARD_L_MAX`` (1e30,
``l <= GUARD_L_MAX`` passes) and ``GUARD_L_MIN`` (1e-18, ``l >= GUARD_L_MIN`` passes; only where the offset
is one per 128-query tile), and the test counts the rows the guard sent to the running-max recompute.

How ``l`` is made exact: with 2-byte inputs ``P = exp(score - offset)`` is stored in bf16, and ``l`` is the
fp32 sum of the row's P (the PV matmul's ones column). The target (an fp32 value) is cut into at most three
bf16 pieces whose exact sum it is (:func:`_bf16_pieces`); each piece is the P of one key whose score is
``offset + ln(piece)`` (fp32 rounding of the score moves ``exp`` by ~1e-5 relative, far inside bf16's
half-ulp of 2e-3, so P rounds to the piece exactly). Every other term of the row is ``exp(0) = 1`` (at most
2,045 of them: below half an fp32 ulp of any partial sum that holds a piece, so they vanish exactly) or
``exp(-200) = 0``. Partial sums of the pieces need at most 24 bits: any summation order gives the target.

Observable: the kernels' ``_flash_rows`` calls (monkeypatched wrapper): a static pass per unit, and one
running-max call per recomputed unit with its ``(b, h, q_lo, q_hi)``; the recomputed rows are the sum of
``q_hi - q_lo`` (a unit is recomputed whole: one (b, h) of the plain kernel, one (b, h, group) of the
block-table kernel). Outputs are checked against the reference by the rule of tests/numerics.py.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

import nki_kernels.attention as att
from nki_kernels.attention import attention_emulated
from nki_kernels.attention_block_table import attention_block_table_emulated
from reference.attention import attention, attention_block_table
from tests.numerics import assert_within, reference_error

pytestmark = pytest.mark.emulator

BF = torch.bfloat16
LQ, H, D, T = 200, 2, 16, 512  # two query tiles (128 + 72); block-table blocks of 512 keys
ROW, HEAD = 198, 1  # the chosen row: tile 1 (partition 70) of the plain kernel, group 1 of the block table
GROUPS = [100, 100]  # block-table query groups: ROW is row 98 of group 1
SPIKES = (1100, 1300, 1500)  # keys in the second 1,024-key chunk (bf16), before key 1,536
LOW_TOP = 200.0  # lower-bound data: every row but ROW scores key 5 at 200 (the tile's offset)
# the documented bounds (docs/kernels/attention.md, "Static softmax offset": good &= 1e-18 <= l <= 1e30),
# written out here, not read from the module: a bound moved in the code must fail this test
L_MAX, L_MIN = 1e30, 1e-18


def _fp32_step(x: float, ulps: int) -> float:
    """The fp32 value ``ulps`` (-1, 0 or 1) fp32 steps from fp32(x)."""
    v = np.float32(x)
    if ulps:
        v = np.nextafter(v, np.float32(math.inf if ulps > 0 else 0.0))
    return float(v)


def _bf16_pieces(total: float) -> list[float]:
    """Positive bf16 values whose exact sum is the fp32 value ``total`` (its 24-bit significand cut into
    bf16's 8-bit pieces, largest first)."""
    pieces = []
    rest = total
    while rest:
        bits = np.array([rest], dtype=np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
        piece = float(bits.view(np.float32)[0])
        pieces.append(piece)
        rest -= piece  # exact in float64
    assert math.fsum(pieces) == total and len(pieces) <= 3
    assert all(float(torch.tensor(p).to(BF)) == p for p in pieces)
    return pieces


def _bf16_terms(x: float) -> torch.Tensor:
    """Three bf16 numbers whose fp32 sum is ``x`` to ~2^-24 relative: a key holding them scores ``x``
    against a query of three ones (the fp32 matmul sums the products)."""
    terms = []
    rest = x
    for _ in range(3):
        t = float(torch.tensor(rest).to(BF))
        terms.append(t)
        rest -= t
    return torch.tensor(terms)


def _spike(
    q: torch.Tensor, k: torch.Tensor, row: int, head: int, dims: slice, l_row: float, top: float
) -> None:
    """Give ``row`` of ``head`` scores ``top + ln(piece)`` on the SPIKES through query/key dims ``dims``
    (three of them; other rows hold zeros there), one key per bf16 piece of ``l_row``."""
    q[0, row, head, dims] = 1.0
    for key, piece in zip(SPIKES, _bf16_pieces(l_row), strict=False):
        k[0, key, head, dims] = _bf16_terms(top + math.log(piece))


def _case(bound: str, ulps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, float]:
    """q, k, v ``[1, L, H, D]`` (k/v of 2,048 keys, 1,536 for ``upper-row``), the key count, and the l that
    row ROW of head HEAD gets, ``ulps`` fp32 steps from the bound.

    * ``upper-tile`` / ``upper-row``: every score is 0 except ROW's on the SPIKES (second chunk), so the
      offset is 0 (one per tile with 2,048 keys, per row with 1,024 + 512) and ROW's
      ``l = (lk - 3) + sum(pieces)`` = 1e30's neighbour.
    * ``lower``: every row but ROW scores key 5 at 200 (the tile offset); ROW scores 0 there and
      ``200 + ln(piece)`` on the SPIKES, every other term underflows: ``l = sum(pieces)`` = 1e-18's
      neighbour (against its own maximum ROW would have l >= 1).
    """
    lk = 1536 if bound == "upper-row" else 2048
    target = _fp32_step(L_MIN if bound == "lower" else L_MAX, ulps)
    q, k = torch.zeros(1, LQ, H, D), torch.zeros(1, lk, H, D)
    v = torch.randn(1, lk, H, D, generator=torch.Generator().manual_seed(7))
    top = 0.0
    if bound == "lower":
        top = LOW_TOP
        q[0, :, :, 0] = 1.0
        q[0, ROW, HEAD, 0] = 0.0
        k[0, 5, :, 0] = LOW_TOP
    _spike(q, k, ROW, HEAD, slice(1, 4), target, top)
    return q, k, v, lk, target


def _table(lk: int) -> torch.Tensor:
    """Both groups list every block of the one source, in order."""
    row = torch.tensor([[0, b] for b in range(lk // T)], dtype=torch.int32)
    return torch.stack([row, row])


def _run(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lk: int) -> Any:
    q, k, v = (t.to(BF) for t in (q, k, v))
    if kernel == "attention":
        return attention_emulated(q, k, v, scale=1.0, return_lse=True, static=True)
    return attention_block_table_emulated(q, [k], [v], _table(lk), GROUPS, T, scale=1.0, return_lse=True)


def _reference(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lk: int) -> Any:
    if kernel == "attention":
        return reference_error(attention, [q, k, v], BF, scale=1.0, return_lse=True)
    table = _table(lk)
    return reference_error(
        lambda a, b, c: attention_block_table(a, [b], [c], table, GROUPS, T, scale=1.0, return_lse=True),
        [q, k, v],
        BF,
    )


def _watch(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, int, int, int, int]]:
    """Every ``_flash_rows`` call of the kernels: (static pass?, b, h, q_lo, q_hi)."""
    calls: list[tuple[bool, int, int, int, int]] = []
    inner = att._flash_rows

    def watching(*args: Any, **kw: Any) -> Any:
        calls.append((bool(kw.get("static")), *args[6:10]))
        return inner(*args, **kw)

    monkeypatch.setattr(att, "_flash_rows", watching)
    return calls


def _unit_of_row(kernel: str) -> tuple[int, int, int, int]:
    """(b, h, q_lo, q_hi) of the unit holding ROW of HEAD."""
    if kernel == "attention":
        return (0, HEAD, 0, LQ)
    return (0, HEAD, GROUPS[0], LQ)


@pytest.mark.parametrize("kernel", ["attention", "block_table"])
@pytest.mark.parametrize("ulps", [-1, 0, 1], ids=["ulp-below", "at", "ulp-above"])
@pytest.mark.parametrize("bound", ["upper-tile", "upper-row", "lower"])
def test_guard_recomputes_exactly_the_rows_across_its_bound(
    bound: str, ulps: int, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    q, k, v, lk, target = _case(bound, ulps)
    calls = _watch(monkeypatch)
    out, lse = _run(kernel, q, k, v, lk)
    units = 2 * (1 if kernel == "attention" else len(GROUPS))  # (b, h) [x group]
    static = [c for c in calls if c[0]]
    recomputed = [c[1:] for c in calls if not c[0]]
    across = ulps > 0 if bound.startswith("upper") else ulps < 0
    assert len(static) == units, calls
    want = [_unit_of_row(kernel)] if across else []
    assert recomputed == want, f"{bound} l = {target!r}: recomputed units {recomputed}, want {want}"
    assert sum(hi - lo for _, _, lo, hi in recomputed) == (want[0][3] - want[0][2] if across else 0)
    # whichever path produced them, the rows are right (tests/numerics.py rule)
    ref_err, (base_o, base_l) = _reference(kernel, q, k, v, lk)
    what = f"{kernel} {bound} {ulps:+d} ulp"
    assert_within(out, base_o, BF, ref_err, what=what + " out")
    assert_within(lse, base_l, BF, ref_err, what=what + " lse")
    # the data is what it claims: in float64, ROW's l against the offset is the target up to the residual
    # of the scores' three-bf16 split (|score| * 2^-24 ~ 1.2e-5 relative at |score| = 200; bound 1e-4)
    x = torch.einsum("qd,kd->qk", q[0, :, HEAD].double(), k[0, :, HEAD].to(BF).double())
    offset = LOW_TOP if bound == "lower" else 0.0
    l_row = torch.exp(x[ROW] - offset).sum().item()
    assert l_row == pytest.approx(target, rel=1e-4)


@pytest.mark.parametrize("kernel", ["attention", "block_table"])
def test_guard_counts_every_unit_with_a_row_across(kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows one ulp above GUARD_L_MAX in both heads: ROW in head 0; row 3 (first tile / group) and ROW
    (second) in head 1. Each unit holding one is recomputed once (head 1's two tiles: one recompute of the
    plain kernel's unit), the block table's head-0 group 0 is not."""
    q, k, v, lk, _ = _case("upper-tile", 1)
    above = _fp32_step(L_MAX, 1)
    _spike(q, k, ROW, 0, slice(1, 4), above, 0.0)
    _spike(q, k, 3, HEAD, slice(4, 7), above, 0.0)
    calls = _watch(monkeypatch)
    out, lse = _run(kernel, q, k, v, lk)
    recomputed = sorted(c[1:] for c in calls if not c[0])
    if kernel == "attention":
        assert recomputed == [(0, 0, 0, LQ), (0, 1, 0, LQ)], calls
    else:  # head 0: only group 1 holds ROW; head 1: row 3 is in group 0, ROW in group 1
        assert recomputed == [(0, 0, 100, LQ), (0, 1, 0, 100), (0, 1, 100, LQ)], calls
    ref_err, (base_o, base_l) = _reference(kernel, q, k, v, lk)
    assert_within(out, base_o, BF, ref_err, what=f"{kernel} rows across in several units out")
    assert_within(lse, base_l, BF, ref_err, what=f"{kernel} rows across in several units lse")
