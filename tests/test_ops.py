"""nki_kernels.ops: parity with the reference, input validation (the bad-call table) and the tolerance rule;
backends, tracing and emulator parity are in tests/test_ops_backends.py, the RoPE tables in
tests/test_ops_rope_tables.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from nki_kernels import ops
from reference.attention import attention as ref_attention
from reference.kv_cache import kv_cache_slide as ref_kv_cache_slide
from reference.kv_cache import kv_cache_write as ref_kv_cache_write
from reference.rope3d import rope3d as ref_rope3d
from tests.numerics import FLOORS, assert_within, reference_error, tolerance
from tests.ops_helpers import (
    BF16,
    F32,
    KV,
    Q,
    clean_backend_env,  # noqa: F401 (autouse fixture)
    rnd,
)
from tests.ops_helpers import zeros as _q

# ------------------------------------------------------------------------- parity with the reference


@given(
    b=st.integers(1, 2),
    grid=st.tuples(st.integers(1, 3), st.integers(1, 7), st.integers(1, 9)),
    h=st.integers(1, 3),
    d=st.sampled_from([2, 6, 8, 16, 34]),
    start=st.integers(0, 50),
    dtype=st.sampled_from([BF16, F32]),
)
def test_rope3d_op_matches_reference(
    b: int, grid: tuple[int, int, int], h: int, d: int, start: int, dtype: torch.dtype
) -> None:
    seq = grid[0] * grid[1] * grid[2]
    q, k = rnd(b, seq, h, d, dtype=dtype, seed=1), rnd(b, seq, h, d, dtype=dtype, seed=2)
    qo, ko = ops.rope3d(q, k, grid, start, backend="reference")
    qr, kr = ref_rope3d(q, k, grid, start)
    assert qo.dtype == dtype and qo.shape == q.shape
    assert torch.equal(qo, qr) and torch.equal(ko, kr)
    fp = [start + 2 * i for i in range(grid[0])]
    qo, ko = ops.rope3d(q, k, grid, frame_positions=fp, max_positions=1024)
    assert torch.equal(qo, ref_rope3d(q, k, grid, frame_positions=fp)[0])


@given(
    b=st.integers(1, 2),
    lq=st.integers(1, 200),
    lk=st.integers(1, 260),
    h=st.integers(1, 3),
    d=st.sampled_from([8, 16, 64]),
    dtype=st.sampled_from([BF16, F32]),
    with_lse=st.booleans(),
)
def test_attention_op_matches_reference(
    b: int, lq: int, lk: int, h: int, d: int, dtype: torch.dtype, with_lse: bool
) -> None:
    q, k, v = (
        rnd(b, lq, h, d, dtype=dtype, seed=3),
        rnd(b, lk, h, d, dtype=dtype, seed=4),
        rnd(b, lk, h, d, dtype=dtype, seed=5),
    )
    res = ops.attention(q, k, v, return_lse=with_lse)
    exp = ref_attention(q, k, v, return_lse=with_lse)
    if with_lse:
        assert isinstance(res, tuple) and isinstance(exp, tuple)
        assert res[1].shape == (b, lq, h) and res[1].dtype == F32
        assert torch.equal(res[0], exp[0]) and torch.equal(res[1], exp[1])
    else:
        assert isinstance(res, torch.Tensor) and res.dtype == dtype and torch.equal(res, exp)


@st.composite
def segment_lists(draw: Any) -> tuple[int, list[tuple[int, int]]]:
    """A buffer length S and non-overlapping segments over it, in a random order."""
    s = draw(st.integers(1, 300))
    cuts = sorted(set(draw(st.lists(st.integers(0, s), min_size=2, max_size=8))))
    pairs = [(a, b - a) for a, b in zip(cuts, cuts[1:]) if b > a]
    if not pairs:
        pairs = [(0, s)]
    chosen = draw(st.lists(st.sampled_from(pairs), min_size=1, max_size=len(pairs), unique=True))
    return s, chosen


@given(seg=segment_lists(), b=st.integers(1, 2), lq=st.integers(1, 130), dtype=st.sampled_from([BF16, F32]))
def test_attention_segments_op_matches_gathered(
    seg: tuple[int, list[tuple[int, int]]], b: int, lq: int, dtype: torch.dtype
) -> None:
    s, segments = seg
    q = rnd(b, lq, 2, 16, dtype=dtype, seed=6)
    kv_k, kv_v = rnd(b, s, 2, 16, dtype=dtype, seed=7), rnd(b, s, 2, 16, dtype=dtype, seed=8)
    out, lse = ops.attention_segments(q, kv_k, kv_v, segments, scale=0.2, return_lse=True)
    idx = [a + i for a, n in segments for i in range(n)]
    exp_out, exp_lse = ref_attention(q, kv_k[:, idx], kv_v[:, idx], scale=0.2, return_lse=True)
    assert torch.equal(out, exp_out) and torch.equal(lse, exp_lse)


@given(
    b=st.integers(1, 2),
    t=st.integers(1, 40),
    slots=st.integers(1, 5),
    dtype=st.sampled_from([BF16, F32]),
    data=st.data(),
)
def test_kv_cache_ops_match_reference(b: int, t: int, slots: int, dtype: torch.dtype, data: Any) -> None:
    s = t * slots + data.draw(st.integers(0, 7))
    slot = data.draw(st.integers(0, slots - 1))
    sink = data.draw(st.integers(0, s - t))
    ck, cv = rnd(b, s, 2, 8, dtype=dtype, seed=9), rnd(b, s, 2, 8, dtype=dtype, seed=10)
    k, v = rnd(b, t, 2, 8, dtype=dtype, seed=11), rnd(b, t, 2, 8, dtype=dtype, seed=12)
    for op, ref, arg in (
        (ops.kv_cache_write, ref_kv_cache_write, slot),
        (ops.kv_cache_slide, ref_kv_cache_slide, sink),
    ):
        a_k, a_v, e_k, e_v = ck.clone(), cv.clone(), ck.clone(), cv.clone()
        assert op(a_k, a_v, k, v, arg) is None
        ref(e_k, e_v, k, v, arg)
        assert torch.equal(a_k, e_k) and torch.equal(a_v, e_v)
        assert not torch.equal(a_k, ck) or t == 0


# ---------------------------------------------------------------------------------------------- validation


CACHE = _q(2, 24, 3, 16)
BLOCK = _q(2, 6, 3, 16)


def _noncontig() -> torch.Tensor:
    return _q(2, 3, 12, 16).transpose(1, 2)


BAD_CALLS: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    # rope3d
    ("rope dtype", lambda: ops.rope3d(Q.half(), Q.half(), (1, 3, 4)), TypeError, "q must be torch.bfloat16"),
    ("rope int", lambda: ops.rope3d(Q.long(), Q.long(), (1, 3, 4)), TypeError, "q must be"),
    ("rope dtype mismatch", lambda: ops.rope3d(Q, Q.to(BF16), (1, 3, 4)), TypeError, "k dtype"),
    ("rope rank", lambda: ops.rope3d(Q[0], Q[0], (1, 3, 4)), ValueError, "q must have rank 4"),
    ("rope not tensor", lambda: ops.rope3d(Q.numpy(), Q, (1, 3, 4)), TypeError, "q must be a torch.Tensor"),
    ("rope k shape", lambda: ops.rope3d(Q, _q(2, 12, 2, 16), (1, 3, 4)), ValueError, "k shape"),
    (
        "rope odd D",
        lambda: ops.rope3d(_q(1, 12, 1, 15), _q(1, 12, 1, 15), (1, 3, 4)),
        ValueError,
        "D=15 must be even",
    ),
    ("rope grid L", lambda: ops.rope3d(Q, Q, (2, 3, 4)), ValueError, "grid"),
    ("rope grid len", lambda: ops.rope3d(Q, Q, (12,)), ValueError, "grid"),
    ("rope grid zero", lambda: ops.rope3d(Q, Q, (0, 3, 4)), ValueError, r"grid\[0\]"),
    ("rope grid float", lambda: ops.rope3d(Q, Q, (1.0, 3, 4)), TypeError, r"grid\[0\]"),
    ("rope start<0", lambda: ops.rope3d(Q, Q, (1, 3, 4), -1), ValueError, "start_frame"),
    ("rope start float", lambda: ops.rope3d(Q, Q, (1, 3, 4), 1.5), TypeError, "start_frame"),
    (
        "rope fp len",
        lambda: ops.rope3d(Q, Q, (1, 3, 4), frame_positions=[0, 1]),
        ValueError,
        "frame_positions",
    ),
    ("rope fp neg", lambda: ops.rope3d(Q, Q, (1, 3, 4), frame_positions=[-2]), ValueError, "frame_positions"),
    (
        "rope fp float",
        lambda: ops.rope3d(Q, Q, (1, 3, 4), frame_positions=[0.5]),
        TypeError,
        "frame_positions",
    ),
    (
        "rope fp float tensor",
        lambda: ops.rope3d(Q, Q, (1, 3, 4), frame_positions=torch.tensor([0.0])),
        TypeError,
        "frame_positions",
    ),
    (
        "rope fp + start",
        lambda: ops.rope3d(Q, Q, (1, 3, 4), 3, frame_positions=[3]),
        ValueError,
        "frame_positions",
    ),
    (
        "rope table time",
        lambda: ops.rope3d(Q, Q, (1, 3, 4), 1024, max_positions=1024),
        ValueError,
        "max_positions",
    ),
    (
        "rope table fp",
        lambda: ops.rope3d(Q, Q, (1, 3, 4), frame_positions=[9], max_positions=8),
        ValueError,
        "time",
    ),
    (
        "rope table width",
        lambda: ops.rope3d(Q, Q, (1, 3, 4), max_positions=3),
        ValueError,
        "width position 3",
    ),
    ("rope table zero", lambda: ops.rope3d(Q, Q, (1, 3, 4), max_positions=0), ValueError, "max_positions"),
    (
        "rope contiguous",
        lambda: ops.rope3d(_noncontig(), _noncontig(), (1, 3, 4)),
        ValueError,
        "q must be contiguous",
    ),
    ("rope backend", lambda: ops.rope3d(Q, Q, (1, 3, 4), backend="gpu"), ValueError, "backend"),
    # attention
    ("att dtype", lambda: ops.attention(Q.double(), KV.double(), KV.double()), TypeError, "q must be"),
    ("att qk dtype", lambda: ops.attention(Q, KV.to(BF16), KV), TypeError, "k dtype"),
    ("att v dtype", lambda: ops.attention(Q, KV, KV.to(BF16)), TypeError, "v dtype"),
    (
        "att heads",
        lambda: ops.attention(Q, _q(2, 20, 2, 16), _q(2, 20, 2, 16)),
        ValueError,
        "k heads H",
    ),
    (
        "att head_dim",
        lambda: ops.attention(Q, _q(2, 20, 3, 8), _q(2, 20, 3, 8)),
        ValueError,
        "k head_dim D",
    ),
    ("att v head_dim", lambda: ops.attention(Q, KV, _q(2, 20, 3, 8)), ValueError, "v head_dim D"),
    (
        "att batch",
        lambda: ops.attention(Q, _q(1, 20, 3, 16), _q(1, 20, 3, 16)),
        ValueError,
        "k batch B",
    ),
    ("att v len", lambda: ops.attention(Q, KV, _q(2, 19, 3, 16)), ValueError, "v length Lk"),
    ("att rank", lambda: ops.attention(Q, KV[0], KV), ValueError, "k must have rank 4"),
    (
        "att empty k",
        lambda: ops.attention(Q, KV[:, :0], KV[:, :0]),
        ValueError,
        r"^k must have Lk >= 1 tokens",
    ),
    ("att empty q", lambda: ops.attention(Q[:, :0], KV, KV), ValueError, r"^q must have Lq >= 1 tokens"),
    ("att scale", lambda: ops.attention(Q, KV, KV, scale=0.0), ValueError, "scale"),
    ("att scale nan", lambda: ops.attention(Q, KV, KV, scale=float("nan")), ValueError, "scale"),
    ("att scale str", lambda: ops.attention(Q, KV, KV, scale="1"), TypeError, "scale"),
    ("att lse", lambda: ops.attention(Q, KV, KV, return_lse=1), TypeError, "return_lse"),
    (
        "att contiguous",
        lambda: ops.attention(Q, KV, _q(2, 3, 20, 16).transpose(1, 2)),
        ValueError,
        "v must be contiguous",
    ),
    # attention_segments
    ("seg empty list", lambda: ops.attention_segments(Q, KV, KV, []), ValueError, "segments"),
    (
        "seg empty q",
        lambda: ops.attention_segments(Q[:, :0], KV, KV, [(0, 4)]),
        ValueError,
        r"^q must have Lq >= 1",
    ),
    (
        "table v shape",
        lambda: ops.attention_block_table(
            Q, [KV], [KV[:, :10].contiguous()], torch.zeros(1, 1, 2, dtype=torch.int64), [Q.shape[1]], 10
        ),
        ValueError,
        r"^v_sources\[0\] shape \(2, 10, 3, 16\) must equal k_sources\[0\] shape \(2, 20, 3, 16\)$",
    ),  # fmt: skip
    (
        "seg empty seg",
        lambda: ops.attention_segments(Q, KV, KV, [(0, 0)]),
        ValueError,
        r"segments\[0\].*empty",
    ),
    (
        "seg oob",
        lambda: ops.attention_segments(Q, KV, KV, [(0, 4), (15, 6)]),
        ValueError,
        r"segments\[1\].*out of bounds",
    ),
    ("seg neg", lambda: ops.attention_segments(Q, KV, KV, [(-1, 4)]), ValueError, r"segments\[0\]"),
    (
        "seg overlap",
        lambda: ops.attention_segments(Q, KV, KV, [(8, 4), (0, 9)]),
        ValueError,
        "segments overlap",
    ),
    ("seg pair", lambda: ops.attention_segments(Q, KV, KV, [(0, 4, 1)]), ValueError, r"segments\[0\]"),
    ("seg float", lambda: ops.attention_segments(Q, KV, KV, [(0.0, 4)]), TypeError, r"segments\[0\].start"),
    (
        "seg kv_v shape",
        lambda: ops.attention_segments(Q, KV, _q(2, 21, 3, 16), [(0, 4)]),
        ValueError,
        "kv_v",
    ),
    (
        "seg heads",
        lambda: ops.attention_segments(Q, _q(2, 20, 1, 16), _q(2, 20, 1, 16), [(0, 4)]),
        ValueError,
        "kv_k heads",
    ),
    ("seg dtype", lambda: ops.attention_segments(Q.to(BF16), KV, KV, [(0, 4)]), TypeError, "kv_k dtype"),
    # kv_cache_write
    (
        "write slot high",
        lambda: ops.kv_cache_write(CACHE.clone(), CACHE.clone(), BLOCK, BLOCK, 4),
        ValueError,
        "slot=4",
    ),
    (
        "write slot neg",
        lambda: ops.kv_cache_write(CACHE.clone(), CACHE.clone(), BLOCK, BLOCK, -1),
        ValueError,
        "slot=-1",
    ),
    (
        "write slot bool",
        lambda: ops.kv_cache_write(CACHE.clone(), CACHE.clone(), BLOCK, BLOCK, True),
        TypeError,
        "slot",
    ),
    (
        "write dtype",
        lambda: ops.kv_cache_write(CACHE.clone(), CACHE.clone(), BLOCK.to(BF16), BLOCK.to(BF16), 0),
        TypeError,
        "k dtype",
    ),
    (
        "write heads",
        lambda: ops.kv_cache_write(CACHE.clone(), CACHE.clone(), _q(2, 6, 2, 16), _q(2, 6, 2, 16), 0),
        ValueError,
        "k heads",
    ),
    (
        "write batch",
        lambda: ops.kv_cache_write(CACHE.clone(), CACHE.clone(), _q(1, 6, 3, 16), _q(1, 6, 3, 16), 0),
        ValueError,
        "k batch",
    ),
    (
        "write v shape",
        lambda: ops.kv_cache_write(CACHE.clone(), CACHE.clone(), BLOCK, _q(2, 5, 3, 16), 0),
        ValueError,
        r"^v shape \(2, 5, 3, 16\) must equal k shape \(2, 6, 3, 16\)$",
    ),
    (
        "write cache_v",
        lambda: ops.kv_cache_write(CACHE.clone(), _q(2, 25, 3, 16), BLOCK, BLOCK, 0),
        ValueError,
        r"^cache_v shape \(2, 25, 3, 16\) must equal cache_k shape \(2, 24, 3, 16\)$",
    ),
    (
        "write empty",
        lambda: ops.kv_cache_write(CACHE.clone(), CACHE.clone(), BLOCK[:, :0], BLOCK[:, :0], 0),
        ValueError,
        "T >= 1",
    ),
    (
        "write cache rank",
        lambda: ops.kv_cache_write(CACHE[0], CACHE[0], BLOCK, BLOCK, 0),
        ValueError,
        "cache_k must have rank 4",
    ),
    (
        "write contiguous",
        lambda: ops.kv_cache_write(_q(2, 3, 24, 16).transpose(1, 2), CACHE.clone(), BLOCK, BLOCK, 0),
        ValueError,
        "cache_k must be contiguous",
    ),
    # kv_cache_slide
    (
        "slide sink high",
        lambda: ops.kv_cache_slide(CACHE.clone(), CACHE.clone(), BLOCK, BLOCK, 19),
        ValueError,
        "sink_tokens=19",
    ),
    (
        "slide sink neg",
        lambda: ops.kv_cache_slide(CACHE.clone(), CACHE.clone(), BLOCK, BLOCK, -1),
        ValueError,
        "sink_tokens",
    ),
    (
        "slide sink float",
        lambda: ops.kv_cache_slide(CACHE.clone(), CACHE.clone(), BLOCK, BLOCK, 1.0),
        TypeError,
        "sink_tokens",
    ),
    (
        "slide head_dim",
        lambda: ops.kv_cache_slide(CACHE.clone(), CACHE.clone(), _q(2, 6, 3, 8), _q(2, 6, 3, 8), 0),
        ValueError,
        "k head_dim",
    ),
    (
        "slide backend",
        lambda: ops.kv_cache_slide(CACHE.clone(), CACHE.clone(), BLOCK, BLOCK, 0, backend="cpu"),
        ValueError,
        "backend",
    ),
]


@pytest.mark.parametrize("name,call,exc,match", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_naming_the_argument(
    name: str, call: Callable[[], Any], exc: type[Exception], match: str
) -> None:
    with pytest.raises(exc, match=match):
        call()


@given(
    b=st.integers(1, 2),
    s=st.integers(1, 300),
    t=st.integers(1, 150),
    slot=st.integers(-2, 12),
    sink=st.integers(-2, 300),
    dtype=st.sampled_from([BF16, F32]),
)
def test_cache_range_rules_property(b: int, s: int, t: int, slot: int, sink: int, dtype: torch.dtype) -> None:
    """slot / sink_tokens are accepted exactly when the block fits, for arbitrary (non-128) lengths."""
    ck, k = _q(b, s, 1, 4, dtype=dtype), torch.ones(b, t, 1, 4, dtype=dtype)
    if slot >= 0 and (slot + 1) * t <= s:
        ops.kv_cache_write(ck, ck.clone(), k, k, slot)
        assert (ck[:, slot * t : (slot + 1) * t] == 1).all()
    else:
        with pytest.raises(ValueError, match=f"slot={slot} out of range"):
            ops.kv_cache_write(ck, ck.clone(), k, k, slot)
    if sink >= 0 and sink + t <= s:
        ops.kv_cache_slide(ck, ck.clone(), k, k, sink)
        assert (ck[:, s - t :] == 1).all()
    else:
        with pytest.raises(ValueError, match=f"sink_tokens={sink} out of range"):
            ops.kv_cache_slide(ck, ck.clone(), k, k, sink)


@given(
    grid=st.tuples(st.integers(1, 4), st.integers(1, 9), st.integers(1, 9)),
    extra=st.integers(-3, 3),
    start=st.integers(0, 40),
    table=st.integers(1, 48),
)
def test_rope_grid_and_table_rules_property(
    grid: tuple[int, int, int], extra: int, start: int, table: int
) -> None:
    seq = grid[0] * grid[1] * grid[2] + extra
    if seq < 1:
        return
    q = _q(2, seq, 1, 12, dtype=BF16)
    fits = start + grid[0] - 1 < table and grid[1] - 1 < table and grid[2] - 1 < table
    if extra != 0:
        with pytest.raises(ValueError, match="grid"):
            ops.rope3d(q, q, grid, start, max_positions=table)
    elif not fits:
        with pytest.raises(ValueError, match=f"max_positions={table}"):
            ops.rope3d(q, q, grid, start, max_positions=table)
    else:
        ops.rope3d(q, q, grid, start, max_positions=table)


def test_valid_edges_accepted() -> None:
    """The boundaries of each range rule are inclusive where they should be."""
    ops.rope3d(Q, Q, (1, 3, 4), 1023, max_positions=1024)  # last table row
    ops.rope3d(Q, Q, (1, 3, 4), frame_positions=torch.tensor([7]))
    ops.kv_cache_write(CACHE.clone(), CACHE.clone(), BLOCK, BLOCK, 3)  # (3+1)*6 == 24
    ops.kv_cache_slide(CACHE.clone(), CACHE.clone(), BLOCK, BLOCK, 18)  # 18 + 6 == 24
    ops.attention_segments(Q, KV, KV, [(10, 10), (0, 10)])  # adjacent, reversed order


# ---------------------------------------------------------------------------------------------- numerics


def test_tolerance_rule() -> None:
    for dtype in (F32, BF16):
        assert tolerance(dtype, 0.0) == FLOORS[dtype] > 0
        assert tolerance(dtype, 0.25) == 2 * 0.25 + FLOORS[dtype]
    assert FLOORS[BF16] > FLOORS[F32]
    with pytest.raises(ValueError, match="dtype"):
        tolerance(torch.float16, 0.1)
    with pytest.raises(ValueError, match="ref_err"):
        tolerance(F32, float("nan"))
    # the bf16 reference error of attention is real and positive, and a perturbed result fails the check
    q, k, v = rnd(1, 20, 2, 16, seed=30), rnd(1, 30, 2, 16, seed=31), rnd(1, 30, 2, 16, seed=32)
    ref_err, base = reference_error(ref_attention, [q, k, v], BF16)
    assert 0 < ref_err < 0.05
    good = ref_attention(q.to(BF16), k.to(BF16), v.to(BF16))
    assert_within(good, base, BF16, ref_err)
    bad = good.clone()
    bad[0, 0, 0, 0] += 2 * tolerance(BF16, ref_err)
    with pytest.raises(AssertionError, match="tolerance"):
        assert_within(bad, base, BF16, ref_err)
