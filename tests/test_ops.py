"""nki_kernels.ops: dispatch, validation, tracing (torch.compile / export / opcheck) and emulator parity."""

from __future__ import annotations

import importlib
import importlib.util
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nki_kernels import op_dispatch, ops
from reference.attention import attention as ref_attention
from reference.attention import attention_segments as ref_attention_segments
from reference.kv_cache import kv_cache_slide as ref_kv_cache_slide
from reference.kv_cache import kv_cache_write as ref_kv_cache_write
from reference.rope3d import rope3d as ref_rope3d
from tests.numerics import FLOORS, assert_within, reference_error, tolerance

BF16, F32 = torch.bfloat16, torch.float32


def rnd(*shape: int, dtype: torch.dtype = F32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ops.BACKEND_ENV, raising=False)


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


def _q(*shape: int, dtype: torch.dtype = F32) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype)


Q = _q(2, 12, 3, 16)
KV = _q(2, 20, 3, 16)
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
    ("att heads", lambda: ops.attention(Q, _q(2, 20, 2, 16), _q(2, 20, 2, 16)), ValueError, "k heads H"),
    ("att head_dim", lambda: ops.attention(Q, _q(2, 20, 3, 8), _q(2, 20, 3, 8)), ValueError, "k head_dim D"),
    ("att v head_dim", lambda: ops.attention(Q, KV, _q(2, 20, 3, 8)), ValueError, "v head_dim D"),
    ("att batch", lambda: ops.attention(Q, _q(1, 20, 3, 16), _q(1, 20, 3, 16)), ValueError, "k batch B"),
    ("att v len", lambda: ops.attention(Q, KV, _q(2, 19, 3, 16)), ValueError, "v length Lk"),
    ("att rank", lambda: ops.attention(Q, KV[0], KV), ValueError, "k must have rank 4"),
    ("att empty k", lambda: ops.attention(Q, KV[:, :0], KV[:, :0]), ValueError, "Lk >= 1"),
    ("att empty q", lambda: ops.attention(Q[:, :0], KV, KV), ValueError, "Lq >= 1"),
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
    ("seg kv_v shape", lambda: ops.attention_segments(Q, KV, _q(2, 21, 3, 16), [(0, 4)]), ValueError, "kv_v"),
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
        "v shape",
    ),
    (
        "write cache_v",
        lambda: ops.kv_cache_write(CACHE.clone(), _q(2, 25, 3, 16), BLOCK, BLOCK, 0),
        ValueError,
        "cache_v shape",
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


# ---------------------------------------------------------------------------------------------- backends


def test_backend_from_env_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ops.resolve_backend() == "reference"
    monkeypatch.setenv(ops.BACKEND_ENV, "emulator")
    assert ops.resolve_backend() == "emulator"
    assert ops.resolve_backend("reference") == "reference"  # explicit wins
    monkeypatch.setenv(ops.BACKEND_ENV, "tpu")
    with pytest.raises(ValueError, match="backend.*NKI_ARDIFF_BACKEND"):
        ops.attention(Q, KV, KV)
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.resolve_backend("Reference ")


def test_neuron_backend_needs_real_nki() -> None:
    if importlib.util.find_spec("nki") is not None:
        pytest.skip("an `nki` package is installed here, so backend='neuron' may legitimately be available")
    with pytest.raises(RuntimeError, match="backend='neuron' needs the real NKI package"):
        ops.attention(Q, KV, KV, backend="neuron")


class _Recorder:
    """Stands in for the kernel modules to check what dispatch passes (the kernels are tested elsewhere)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __call__(self, module: str, fn: str) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((f"{module}.{fn}", args, kwargs))
            if fn == "rope3d_emulated":
                return args[0], args[1] * 2  # q returned as-is: dispatch must not alias it
            if fn == "attention_emulated":
                return ref_attention(*args, **kwargs)
            if fn == "attention_segments_emulated":
                return ref_attention_segments(*args, **kwargs)
            new_k, new_v = args[0].clone().fill_(7), args[1].clone().fill_(8)
            return new_k, new_v  # functional style: dispatch copies back into the caches

        return run


def test_emulator_dispatch_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = _Recorder()
    monkeypatch.setattr(op_dispatch, "_kernel", rec)
    monkeypatch.setenv(ops.BACKEND_ENV, "emulator")
    q = rnd(1, 12, 2, 8)
    qo, ko = ops.rope3d(q, q, (1, 3, 4), frame_positions=[5])
    assert rec.calls[-1][0] == "rope3d.rope3d_emulated"
    assert rec.calls[-1][2] == {"start_frame": 0, "frame_positions": [5]}
    assert torch.equal(qo, q) and qo.data_ptr() != q.data_ptr() and torch.equal(ko, 2 * q)
    ops.rope3d(q, q, (1, 3, 4), 9)
    assert rec.calls[-1][2] == {"start_frame": 9, "frame_positions": None}
    out = ops.attention(q, q, q, scale=0.5)
    assert rec.calls[-1][0] == "attention.attention_emulated" and rec.calls[-1][2] == {
        "scale": 0.5,
        "return_lse": False,
    }
    assert torch.equal(out, ref_attention(q, q, q, scale=0.5))
    ops.attention_segments(q, q, q, [(4, 2), (0, 3)], return_lse=True)
    name, args, kwargs = rec.calls[-1]
    assert name == "attention.attention_segments_emulated" and args[3] == [(4, 2), (0, 3)]
    assert kwargs == {"scale": 1 / math.sqrt(8), "return_lse": True}
    ck, cv = torch.zeros(1, 24, 2, 8), torch.zeros(1, 24, 2, 8)
    ops.kv_cache_write(ck, cv, q[:, :6].contiguous(), q[:, :6].contiguous(), 2)
    assert rec.calls[-1][0] == "kv_cache.kv_cache_write_emulated" and rec.calls[-1][1][4] == 2
    assert (ck == 7).all() and (cv == 8).all()
    ops.kv_cache_slide(ck, cv, q[:, :6].contiguous(), q[:, :6].contiguous(), 3, backend="emulator")
    assert rec.calls[-1][0] == "kv_cache.kv_cache_slide_emulated" and rec.calls[-1][1][4] == 3
    n = len(rec.calls)
    ops.attention(q, q, q, backend="reference")
    assert len(rec.calls) == n  # explicit reference backend never reaches the kernels


# ---------------------------------------------------------------------------------------------- tracing


def _all_ops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor) -> Any:
    qr, kr = ops.rope3d(q, k, (2, 3, 5), 4, max_positions=1024)
    qs, _ = ops.rope3d(q, k, (2, 3, 5), frame_positions=[0, 9])
    out, lse = ops.attention(qr, kr, v, return_lse=True)
    seg = ops.attention_segments(qs, ck, cv, [(12, 6), (0, 6)], scale=0.3)
    ops.kv_cache_write(ck, cv, kr[:, :6].contiguous(), v[:, :6].contiguous(), 1)
    ops.kv_cache_slide(ck, cv, kr[:, 6:12].contiguous(), v[:, 6:12].contiguous(), 6)
    return out, lse, seg


def _inputs(dtype: torch.dtype = F32) -> list[torch.Tensor]:
    return [rnd(2, 30, 2, 16, dtype=dtype, seed=s) for s in range(3)] + [
        rnd(2, 24, 2, 16, dtype=dtype, seed=s) for s in (3, 4)
    ]


def test_torch_compile_fullgraph() -> None:
    eager_in, comp_in = _inputs(), _inputs()
    expect = _all_ops(*eager_in)
    got = torch.compile(_all_ops, fullgraph=True, backend="aot_eager")(*comp_in)
    for a, b in zip(got, expect):
        assert torch.equal(a, b)
    assert torch.equal(comp_in[3], eager_in[3]) and torch.equal(
        comp_in[4], eager_in[4]
    )  # in-place writes kept


def test_compiled_graph_reads_backend_env_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = _Recorder()
    monkeypatch.setattr(op_dispatch, "_kernel", rec)
    fn = torch.compile(lambda q: ops.attention(q, q, q), fullgraph=True, backend="aot_eager")
    q = rnd(1, 5, 2, 8)
    fn(q)
    assert rec.calls == []
    monkeypatch.setenv(ops.BACKEND_ENV, "emulator")
    fn(q)
    assert [c[0] for c in rec.calls] == ["attention.attention_emulated"]


class _Block(torch.nn.Module):
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor
    ) -> Any:
        return _all_ops(q, k, v, ck, cv)


def test_torch_export() -> None:
    inputs = _inputs(BF16)
    ep = torch.export.export(_Block(), tuple(t.clone() for t in inputs))
    names = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    for op in ("rope3d", "attention", "attention_segments", "kv_cache_write", "kv_cache_slide"):
        assert f"nki_ardiff.{op}.default" in names
    eager_in = [t.clone() for t in inputs]
    expect = _all_ops(*eager_in)
    exp_in = [t.clone() for t in inputs]
    got = ep.module()(*exp_in)
    for a, b in zip(got, expect):
        assert torch.equal(a, b)
    assert torch.equal(exp_in[3], eager_in[3])


OPCHECK_CASES = [
    (
        "rope3d",
        lambda: (
            torch.ops.nki_ardiff.rope3d,
            (rnd(1, 6, 2, 8), rnd(1, 6, 2, 8), [1, 2, 3], 2, None, "reference"),
        ),
    ),
    (
        "rope3d fp",
        lambda: (
            torch.ops.nki_ardiff.rope3d,
            (rnd(1, 6, 2, 8), rnd(1, 6, 2, 8), [2, 1, 3], 0, [4, 1], "reference"),
        ),
    ),
    (
        "attention",
        lambda: (
            torch.ops.nki_ardiff.attention,
            (rnd(1, 5, 2, 8), rnd(1, 7, 2, 8), rnd(1, 7, 2, 8), 0.3, True, "reference"),
        ),
    ),
    (
        "attention nolse",
        lambda: (
            torch.ops.nki_ardiff.attention,
            (rnd(1, 5, 2, 8), rnd(1, 7, 2, 8), rnd(1, 7, 2, 8), 0.3, False, "reference"),
        ),
    ),
    (
        "attention_segments",
        lambda: (
            torch.ops.nki_ardiff.attention_segments,
            (rnd(1, 5, 2, 8), rnd(1, 9, 2, 8), rnd(1, 9, 2, 8), [6, 3, 0, 2], 0.3, True, "reference"),
        ),
    ),
    (
        "kv_cache_write",
        lambda: (
            torch.ops.nki_ardiff.kv_cache_write,
            (rnd(1, 9, 2, 8), rnd(1, 9, 2, 8), rnd(1, 3, 2, 8), rnd(1, 3, 2, 8), 1, "reference"),
        ),
    ),
    (
        "kv_cache_slide",
        lambda: (
            torch.ops.nki_ardiff.kv_cache_slide,
            (rnd(1, 9, 2, 8), rnd(1, 9, 2, 8), rnd(1, 3, 2, 8), rnd(1, 3, 2, 8), 2, "reference"),
        ),
    ),
]


@pytest.mark.parametrize("name,case", OPCHECK_CASES, ids=[c[0] for c in OPCHECK_CASES])
def test_opcheck(name: str, case: Callable[[], Any]) -> None:
    op, args = case()
    torch.library.opcheck(op, args)


# ------------------------------------------------------------------------------------- emulator parity


def _kernels_available(module: str) -> None:
    """The kernel module must import: a broken kernel fails these tests, it is never skipped."""
    importlib.import_module(f"nki_kernels.{module}")


@pytest.mark.emulator
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_emulator_rope3d_within_tolerance(dtype: torch.dtype) -> None:
    _kernels_available("rope3d")
    grid = (2, 3, 7)  # L = 42, not a multiple of 128
    q64, k64 = (
        rnd(2, 42, 2, 32, dtype=torch.float64, seed=20),
        rnd(2, 42, 2, 32, dtype=torch.float64, seed=21),
    )
    ref_err, base = reference_error(lambda q, k: ref_rope3d(q, k, grid, 5), [q64, k64], dtype)
    got = ops.rope3d(q64.to(dtype), k64.to(dtype), grid, 5, backend="emulator")
    assert got[0].dtype == dtype
    assert_within(got, base, dtype, ref_err, "emulator rope3d")


@pytest.mark.emulator
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_emulator_attention_within_tolerance(dtype: torch.dtype) -> None:
    _kernels_available("attention")
    q, k, v = rnd(1, 130, 2, 32, seed=22), rnd(1, 140, 2, 32, seed=23), rnd(1, 140, 2, 32, seed=24)
    ref_err, base = reference_error(lambda *a: ref_attention(*a, return_lse=True), [q, k, v], dtype)
    got = ops.attention(q.to(dtype), k.to(dtype), v.to(dtype), return_lse=True, backend="emulator")
    assert_within(got, base, dtype, ref_err, "emulator attention")
    segs = [(100, 40), (0, 30)]
    ref_err, base = reference_error(
        lambda *a: ref_attention_segments(*a, segs, return_lse=True), [q, k, v], dtype
    )
    got = ops.attention_segments(
        q.to(dtype), k.to(dtype), v.to(dtype), segs, return_lse=True, backend="emulator"
    )
    assert_within(got, base, dtype, ref_err, "emulator attention_segments")


@pytest.mark.emulator
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_emulator_kv_cache_exact(dtype: torch.dtype) -> None:
    _kernels_available("kv_cache")
    ck, cv = rnd(2, 40, 2, 16, dtype=dtype, seed=25), rnd(2, 40, 2, 16, dtype=dtype, seed=26)
    k, v = rnd(2, 9, 2, 16, dtype=dtype, seed=27), rnd(2, 9, 2, 16, dtype=dtype, seed=28)
    for op, ref, arg in (
        (ops.kv_cache_write, ref_kv_cache_write, 3),
        (ops.kv_cache_slide, ref_kv_cache_slide, 5),
    ):
        a_k, a_v, e_k, e_v = ck.clone(), cv.clone(), ck.clone(), cv.clone()
        op(a_k, a_v, k, v, arg, backend="emulator")
        ref(e_k, e_v, k, v, arg)
        assert torch.equal(a_k, e_k) and torch.equal(a_v, e_v)  # a copy is exact


# ------------------------------------------------------------------------ rope3d_tables / rope_tables


@settings(max_examples=8, deadline=None)
@given(
    b=st.integers(1, 2),
    f=st.integers(1, 3),
    hp=st.integers(1, 5),
    wp=st.integers(1, 9),
    d=st.sampled_from([6, 16, 32]),
    dtype=st.sampled_from([F32, BF16]),
    start=st.integers(0, 40),
)
def test_rope3d_tables_bitwise_equals_rope3d(b, f, hp, wp, d, dtype, start) -> None:
    grid = (f, hp, wp)
    q, k = rnd(b, f * hp * wp, 2, d, dtype=dtype, seed=1), rnd(b, f * hp * wp, 2, d, dtype=dtype, seed=2)
    fp = [start + 3 * i for i in range(f)]
    for kw in ({"start_frame": start}, {"frame_positions": fp}, {"frame_positions": torch.tensor(fp)}):
        sf = kw.get("start_frame", 0)
        cos, sin = ops.rope_tables(
            grid, d, sf, frame_positions=kw.get("frame_positions"), dtype=torch.float64
        )
        got = ops.rope3d_tables(q, k, cos, sin, backend="reference")
        fpl = fp if "frame_positions" in kw else None
        want = ref_rope3d(q, k, grid, sf, fpl)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # rows of a larger table are the tables of those tokens (the merged forward's last layer slices them)
    cos, sin = ops.rope_tables(grid, d, frame_positions=fp, dtype=torch.float64)
    n1 = hp * wp
    if f > 1:
        sub = ops.rope_tables((f - 1, hp, wp), d, frame_positions=fp[1:], dtype=torch.float64)
        assert torch.equal(cos[n1:], sub[0]) and torch.equal(sin[n1:], sub[1])


def test_rope_tables_float32_is_rounded_float64() -> None:
    c64, s64 = ops.rope_tables((2, 3, 4), 16, 5, dtype=torch.float64)
    c32, s32 = ops.rope_tables((2, 3, 4), 16, 5)
    assert c32.dtype == F32 and c32.shape == (24, 8)
    assert torch.equal(c32, c64.float()) and torch.equal(s32, s64.float())


TABLE = _q(12, 8)
BAD_TABLE_CALLS: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    ("q dtype", lambda: ops.rope3d_tables(Q.half(), Q.half(), TABLE, TABLE), TypeError, "q must be"),
    ("k shape", lambda: ops.rope3d_tables(Q, _q(2, 6, 3, 16), TABLE, TABLE), ValueError, "k shape"),
    (
        "odd D",
        lambda: ops.rope3d_tables(_q(1, 12, 1, 15), _q(1, 12, 1, 15), TABLE, TABLE),
        ValueError,
        "even",
    ),
    ("cos type", lambda: ops.rope3d_tables(Q, Q, TABLE.numpy(), TABLE), TypeError, "cos must be a torch"),
    (
        "cos dtype",
        lambda: ops.rope3d_tables(Q, Q, TABLE.half(), TABLE),
        TypeError,
        "cos must be torch.float32",
    ),
    ("sin dtype", lambda: ops.rope3d_tables(Q, Q, TABLE, TABLE.to(BF16)), TypeError, "sin must be"),
    ("dtype mix", lambda: ops.rope3d_tables(Q, Q, TABLE, TABLE.double()), TypeError, "sin dtype"),
    ("cos rank", lambda: ops.rope3d_tables(Q, Q, TABLE[None], TABLE), ValueError, r"cos must be \[L, D//2\]"),
    ("cos D", lambda: ops.rope3d_tables(Q, Q, _q(12, 7), TABLE), ValueError, r"cos must be \[L, D//2\]"),
    ("sin L", lambda: ops.rope3d_tables(Q, Q, TABLE, _q(11, 8)), ValueError, "sin has 11 rows"),
    (
        "cos noncontig",
        lambda: ops.rope3d_tables(Q, Q, _q(8, 12).t(), TABLE),
        ValueError,
        "cos must be contig",
    ),
    ("backend", lambda: ops.rope3d_tables(Q, Q, TABLE, TABLE, backend="cpu"), ValueError, "backend"),
    ("tables grid", lambda: ops.rope_tables((0, 3, 4), 16), ValueError, r"grid\[0\]"),
    ("tables head_dim", lambda: ops.rope_tables((1, 3, 4), 15), ValueError, "head_dim"),
    ("tables dtype", lambda: ops.rope_tables((1, 3, 4), 16, dtype=BF16), TypeError, "dtype"),
    ("tables start", lambda: ops.rope_tables((1, 3, 4), 16, -1), ValueError, "start_frame"),
    ("tables both", lambda: ops.rope_tables((1, 3, 4), 16, 2, frame_positions=[0]), ValueError, "either"),
    ("tables fp len", lambda: ops.rope_tables((2, 3, 4), 16, frame_positions=[0]), ValueError, "length F=2"),
    ("tables fp neg", lambda: ops.rope_tables((1, 3, 4), 16, frame_positions=[-1]), ValueError, r"\[0\]"),
    (
        "tables fp float tensor",
        lambda: ops.rope_tables((1, 3, 4), 16, frame_positions=torch.zeros(1)),
        TypeError,
        "frame_positions",
    ),
    (
        "tables fp neg tensor",
        lambda: ops.rope_tables((1, 3, 4), 16, frame_positions=torch.tensor([-2])),
        ValueError,
        r"frame_positions\[0\]",
    ),
]


@pytest.mark.parametrize("name,call,exc,match", BAD_TABLE_CALLS, ids=[c[0] for c in BAD_TABLE_CALLS])
def test_rope3d_tables_bad_input_raises(name: str, call: Callable[[], Any], exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        call()


def test_rope3d_tables_compile_one_graph_and_opcheck() -> None:
    grid, d = (3, 2, 5), 16
    q, k = rnd(2, 30, 2, d, seed=5), rnd(2, 30, 2, d, seed=6)

    def fn(q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor) -> Any:
        cos, sin = ops.rope_tables(grid, d, frame_positions=pos, dtype=torch.float64)
        return ops.rope3d_tables(q, k, cos, sin)

    from torch._dynamo.testing import CompileCounter

    cnt = CompileCounter()
    comp = torch.compile(fn, fullgraph=True, backend=cnt)
    for pos in ([0, 1, 2], [0, 7, 8], [4, 5, 9]):
        got = comp(q, k, torch.tensor(pos))
        want = ref_rope3d(q, k, grid, 0, pos)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert cnt.frame_count == 1  # new positions reuse the graph
    cos, sin = ops.rope_tables(grid, d, 2)
    torch.library.opcheck(torch.ops.nki_ardiff.rope3d_tables, (q, k, cos, sin, "reference"))
    torch.library.opcheck(torch.ops.nki_ardiff.rope_tables, (torch.tensor([0, 3, 4]), list(grid), d, F32))


@pytest.mark.emulator
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_emulator_rope3d_tables_within_tolerance(dtype: torch.dtype) -> None:
    _kernels_available("rope3d")
    grid, fp = (2, 3, 7), [5, 9]  # L = 42, not a multiple of 128
    q64, k64 = (
        rnd(2, 42, 2, 32, dtype=torch.float64, seed=22),
        rnd(2, 42, 2, 32, dtype=torch.float64, seed=23),
    )
    ref_err, base = reference_error(lambda q, k: ref_rope3d(q, k, grid, 0, fp), [q64, k64], dtype)
    cos, sin = ops.rope_tables(grid, 32, frame_positions=fp)
    got = ops.rope3d_tables(q64.to(dtype), k64.to(dtype), cos, sin, backend="emulator")
    assert got[0].dtype == dtype
    assert_within(got, base, dtype, ref_err, "emulator rope3d_tables")
    # same kernel, same fp32 tables: bit for bit the per-call-table entry
    per_call = ops.rope3d(q64.to(dtype), k64.to(dtype), grid, frame_positions=fp, backend="emulator")
    assert torch.equal(got[0], per_call[0]) and torch.equal(got[1], per_call[1])
