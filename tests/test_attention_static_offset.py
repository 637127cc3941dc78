"""The guarded static softmax offset of the attention kernels (``nki_kernels.attention._guarded_rows``, the
default) and the running-max path it falls back to, on the emulator against ``reference.attention``.

Data that trips the guard: for the first 40 queries one key in a LATER key chunk (key 1,500; chunks are
512 keys in fp32, 1,024 in bf16) scores ~110 nats above everything in the first chunk, so ``exp`` against
the first chunk's offset overflows (``l`` = inf); the other queries see ordinary scores. Baseline and
tolerance: the rule of ``tests/numerics.py`` (float64 reference of the rounded inputs, 2x the reference's
own error in the dtype + the dtype's floor). The same data with the guard disabled (``GUARD_L_MAX`` = inf)
gives non-finite rows, which shows the data exercises the guard.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import nki_kernels.attention as att
from nki_kernels.attention import attention_emulated, attention_segments_emulated
from nki_kernels.attention_block_table import attention_block_table_emulated
from reference.attention import attention, attention_block_table, attention_segments
from tests.numerics import assert_within, reference_error

pytestmark = pytest.mark.emulator

LQ, LK, H, D, SPIKE, SCALE = 160, 2600, 2, 16, 1500, 0.25


def _spiked(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, n, H, D, generator=g) for n in (LQ, LK, LK))
    q[:, :40, :, 0] = 8.0
    q[:, 40:, :, 0] = 0.0  # the other queries score the spike key 0: their logits stay O(1)
    k[:, SPIKE, :, :] = 0.0
    k[:, SPIKE, :, 0] = 60.0  # scaled score 8 * 60 * 0.25 = 120 for queries 0..39; the rest are O(1)
    return q, k, v


def _run(kind: str, q, k, v, dtype, static: bool):
    q, k, v = (t.to(dtype) for t in (q, k, v))
    kw = {"scale": SCALE, "return_lse": True, "static": static}
    if kind == "attention":
        return attention_emulated(q, k, v, **kw)
    if kind == "segments":  # the keys as two segments of a buffer with a gap
        buf_k = torch.cat([k[:, :1300], torch.zeros_like(k[:, :200]), k[:, 1300:]], dim=1)
        buf_v = torch.cat([v[:, :1300], torch.zeros_like(v[:, :200]), v[:, 1300:]], dim=1)
        return attention_segments_emulated(q, buf_k, buf_v, [(0, 1300), (1500, LK - 1300)], **kw)
    t = LK // 4  # 650-token blocks: the spike sits in block 2; group 0 = queries 0..79 over blocks 0..3
    table = torch.tensor([[[0, 0], [0, 1], [0, 2], [0, 3]], [[0, 0], [0, 1], [-1, 0], [0, 3]]])
    return attention_block_table_emulated(q, [k], [v], table, [80, LQ - 80], t, **kw)


def _reference(kind: str, q, k, v, dtype):
    kw = {"scale": SCALE, "return_lse": True}
    if kind == "attention":
        return reference_error(attention, [q, k, v], dtype, **kw)
    if kind == "segments":
        return reference_error(lambda a, b, c: attention_segments(a, b, c, [(0, LK)], **kw), [q, k, v], dtype)
    t = LK // 4
    table = torch.tensor([[[0, 0], [0, 1], [0, 2], [0, 3]], [[0, 0], [0, 1], [-1, 0], [0, 3]]])
    return reference_error(
        lambda a, b, c: attention_block_table(a, [b], [c], table, [80, LQ - 80], t, **kw), [q, k, v], dtype
    )


@pytest.mark.parametrize("kind", ["attention", "segments", "block_table"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_guard_recomputes_rows_whose_later_keys_overflow(kind: str, dtype: torch.dtype) -> None:
    q, k, v = _spiked()
    x = SCALE * torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double())
    kc = 512 if dtype == torch.float32 else 1024
    assert (x[..., :40, SPIKE] - x[..., :40, :kc].amax(-1) > 100).all(), "the data must overflow exp"
    ref_err, (base_o, base_l) = _reference(kind, q, k, v, dtype)
    for static in (True, False):  # guarded static offset, and the running max it falls back to
        out, lse = _run(kind, q, k, v, dtype, static)
        what = f"{kind} {dtype} static={static}"
        assert_within(out, base_o, dtype, ref_err, what=what + " out")
        assert_within(lse, base_l, dtype, ref_err, what=what + " lse")


def test_without_the_guard_the_same_data_overflows(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = _spiked()
    monkeypatch.setattr(att, "GUARD_L_MAX", float("inf"))
    out, lse = _run("attention", q, k, v, torch.bfloat16, True)
    assert not torch.isfinite(out.float()[:, :40]).all()  # the spiked rows overflow
    assert torch.isfinite(out.float()[:, 40:]).all()  # the others do not need the guard


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_running_max_path_matches_reference_on_ordinary_data(dtype: torch.dtype) -> None:
    """The fallback path alone (``static=False``) over several key chunks and a query tail."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, n, H, D, generator=g) for n in (150, 2300, 2300))
    ref_err, (base_o, base_l) = reference_error(attention, [q, k, v], dtype, return_lse=True)
    out, lse = attention_emulated(q.to(dtype), k.to(dtype), v.to(dtype), return_lse=True, static=False)
    assert_within(out, base_o, dtype, ref_err, what=f"running max {dtype} out")
    assert_within(lse, base_l, dtype, ref_err, what=f"running max {dtype} lse")


def test_static_must_be_a_bool() -> None:
    q = torch.zeros(1, 4, 1, 16)
    with pytest.raises(TypeError, match="static must be a bool"):
        attention_emulated(q, q, q, static=1)  # type: ignore[arg-type]


def _tall_first_chunk(seed: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries 0..39 score key 5 (first chunk) at 8 * 50 * 0.25 = 100; the other queries score everything
    O(1): with one offset per 128-query tile their terms sit ~100 nats below it and underflow."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, n, H, D, generator=g) for n in (LQ, LK, LK))
    q[:, :40, :, 0] = 8.0
    q[:, 40:, :, 0] = 0.0
    k[:, 5, :, :] = 0.0
    k[:, 5, :, 0] = 50.0
    return q, k, v


@pytest.mark.parametrize("kind", ["attention", "block_table"])
def test_guard_recomputes_rows_far_below_the_tile_offset(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16, every P^T on TensorE: the offset is one per query tile, so rows far below the tile's maximum
    underflow (l < GUARD_L_MIN) and the guard recomputes them; without that bound they come back wrong."""
    q, k, v = _tall_first_chunk()
    ref_err, (base_o, base_l) = _reference(kind, q, k, v, torch.bfloat16)
    out, lse = _run(kind, q, k, v, torch.bfloat16, True)
    assert_within(out, base_o, torch.bfloat16, ref_err, what=f"{kind} tile offset out")
    assert_within(lse, base_l, torch.bfloat16, ref_err, what=f"{kind} tile offset lse")
    monkeypatch.setattr(att, "GUARD_L_MIN", 0.0)
    bad, bad_lse = _run(kind, q, k, v, torch.bfloat16, True)
    assert not torch.isfinite(bad_lse[:, 40:128]).all() or (bad.float() - base_o).abs().max() > 0.1


@pytest.mark.parametrize("kind", ["attention", "block_table"])
def test_rows_below_the_tile_offset_stay_on_the_fast_path(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16: queries 0..39 score key 5 at 25 nats; the other rows' mass sits ~17 nats below that tile
    offset (l ~ 1e-7, inside the guard's bounds), so no row is recomputed (the running-max pass never
    runs) and every row is still within the reference tolerance: the denominator is used as it is, not
    clamped."""
    q, k, v = _tall_first_chunk()
    k[:, 5, :, 0] = 12.5  # 8 * 12.5 * 0.25 = 25
    passes: list[bool] = []
    inner = att._flash_rows

    def counting(*args, **kw):  # type: ignore[no-untyped-def]
        passes.append(bool(kw.get("static")))
        return inner(*args, **kw)

    monkeypatch.setattr(att, "_flash_rows", counting)
    ref_err, (base_o, base_l) = _reference(kind, q, k, v, torch.bfloat16)
    out, lse = _run(kind, q, k, v, torch.bfloat16, True)
    assert passes and all(passes), "a guard tripped: the data must stay on the fast path"
    assert_within(out, base_o, torch.bfloat16, ref_err, what=f"{kind} rows below the tile offset out")
    assert_within(lse, base_l, torch.bfloat16, ref_err, what=f"{kind} rows below the tile offset lse")


@settings(max_examples=6, deadline=None)
@given(
    lq=st.integers(1, 300),
    lk=st.integers(1025, 3600),
    h=st.integers(1, 2),
    lnc=st.sampled_from([1, 2]),
)
def test_static_offset_with_transposed_chunks_matches_reference(lq: int, lk: int, h: int, lnc: int) -> None:
    """bf16 over more than one 1,024-key chunk (so the later full chunks take the transposed path), any
    query tail, remainder chunks, one or two logical cores: within the reference tolerance."""
    g = torch.Generator().manual_seed(lq * 7 + lk)
    q, k, v = (torch.randn(1, n, h, 32, generator=g) for n in (lq, lk, lk))
    ref_err, (base_o, base_l) = reference_error(attention, [q, k, v], torch.bfloat16, return_lse=True)
    out, lse = attention_emulated(q.bfloat16(), k.bfloat16(), v.bfloat16(), return_lse=True, lnc=lnc)
    what = f"static bf16 lq={lq} lk={lk} h={h} lnc={lnc}"
    assert_within(out, base_o, torch.bfloat16, ref_err, what=what + " out")
    assert_within(lse, base_l, torch.bfloat16, ref_err, what=what + " lse")


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 10_000), nb=st.integers(3, 6), g1=st.integers(1, 150))
def test_block_table_static_offset_over_several_chunks(seed: int, nb: int, g1: int) -> None:
    """The block-table kernel (the merged forward's attention) with random tables over 512-token blocks,
    so each group reads 1,536-3,072 keys (the transposed path), one entry per group possibly empty."""
    t = 512
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, g1 + 60, 1, 32, generator=g)
    k, v = (torch.randn(1, 8 * t, 1, 32, generator=g) for _ in range(2))
    rows = []
    for _ in range(2):
        blocks = torch.randperm(8, generator=g)[:nb]
        row = torch.stack([torch.zeros_like(blocks), blocks], dim=-1)
        row[int(torch.randint(nb, (1,), generator=g))] = torch.tensor([-1, 0])
        rows.append(row)
    table = torch.stack(rows).to(torch.int32)
    groups = [g1, 60]
    kw = {"return_lse": True}
    ref_err, (base_o, base_l) = reference_error(
        lambda a, b, c: attention_block_table(a, [b], [c], table, groups, t, **kw), [q, k, v], torch.bfloat16
    )
    out, lse = attention_block_table_emulated(
        q.bfloat16(), [k.bfloat16()], [v.bfloat16()], table, groups, t, **kw
    )
    what = f"block table static seed={seed} nb={nb} groups={groups}"
    assert_within(out, base_o, torch.bfloat16, ref_err, what=what + " out")
    assert_within(lse, base_l, torch.bfloat16, ref_err, what=what + " lse")


def _count_recomputes(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The kernels' ``_flash_rows`` calls, True for a static pass, False for a running-max recompute."""
    passes: list[bool] = []
    inner = att._flash_rows

    def counting(*args, **kw):  # type: ignore[no-untyped-def]
        passes.append(bool(kw.get("static")))
        return inner(*args, **kw)

    monkeypatch.setattr(att, "_flash_rows", counting)
    return passes


@pytest.mark.parametrize("side", [-1, 1], ids=["just-below", "just-across"])
def test_upper_guard_bound_edge_counts_the_recompute(side: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 (one offset per row: its first 512-key chunk's max, 0 here): exactly ONE row (7) of the 128 has
    a later key scoring x, so its l = 512 + e^x (the other later keys score -200: e^-200 underflows). x puts
    l 1 % below or above GUARD_L_MAX: below, no head is recomputed; across, exactly one recompute (one
    (b, h), one tile) and the output still matches the reference."""
    lq, lk, d = 128, 1024, 16
    # the documented bound (docs/kernels/attention.md): below 1e30, o = sum P v stays finite for |v| < 3e8
    x = float(torch.log(torch.tensor(1e30 - 512.0, dtype=torch.float64))) + side * 0.01
    q, k, v = torch.zeros(1, lq, 1, d), torch.zeros(1, lk, 1, d), torch.randn(1, lk, 1, d)
    q[:, 7, :, 0] = 1.0
    k[:, 512:, :, 0] = -200.0
    k[:, 700, :, 0] = x
    passes = _count_recomputes(monkeypatch)
    out, lse = attention_emulated(q, k, v, scale=1.0, return_lse=True, static=True)
    assert passes.count(True) == 1 and passes.count(False) == (1 if side > 0 else 0), passes
    ref_err, (base_o, base_l) = reference_error(
        attention, [q, k, v], torch.float32, scale=1.0, return_lse=True
    )
    assert_within(out, base_o, torch.float32, ref_err, what="upper bound edge out")
    assert_within(lse, base_l, torch.float32, ref_err, what="upper bound edge lse")


@pytest.mark.parametrize("side", [-1, 1], ids=["just-inside", "just-across"])
def test_lower_guard_bound_edge_counts_the_recompute(side: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 (two 1,024-key chunks; after the first, one offset per 128-query tile): every row but 7 scores
    key 5 at ``scale`` (the tile offset); row 7 scores every key 0, so against the tile offset its
    l = 2048 e^-scale. ``scale`` puts that 1 % above or below GUARD_L_MIN: inside, no recompute; across,
    exactly one, and row 7 is right."""
    lq, lk, d = 128, 2048, 16
    # the documented bound: l below 1e-18 means the row's largest term sits ~41 nats under the tile offset
    scale = float(torch.log(torch.tensor(lk / 1e-18, dtype=torch.float64))) + side * 0.01
    q, k = torch.zeros(1, lq, 1, d), torch.zeros(1, lk, 1, d)
    v = torch.randn(1, lk, 1, d, generator=torch.Generator().manual_seed(2))
    q[:, :, :, 0] = 1.0
    q[:, 7, :, 0] = 0.0
    k[:, 5, :, 0] = 1.0
    passes = _count_recomputes(monkeypatch)
    bf = torch.bfloat16
    out, lse = attention_emulated(q.to(bf), k.to(bf), v.to(bf), scale=scale, return_lse=True, static=True)
    assert passes.count(True) == 1 and passes.count(False) == (1 if side > 0 else 0), passes
    ref_err, (base_o, base_l) = reference_error(attention, [q, k, v], bf, scale=scale, return_lse=True)
    assert_within(out, base_o, bf, ref_err, what="lower bound edge out")
    assert_within(lse, base_l, bf, ref_err, what="lower bound edge lse")
