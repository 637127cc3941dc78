"""nki_kernels.ops: rope3d_tables / rope_tables (the table-driven RoPE op pair)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nki_kernels import ops
from reference.rope3d import rope3d as ref_rope3d
from tests.numerics import assert_within, reference_error
from tests.ops_helpers import (
    BF16,
    F32,
    Q,
    clean_backend_env,  # noqa: F401 (autouse fixture)
    kernels_available,
    rnd,
)
from tests.ops_helpers import zeros as _q

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
    kernels_available("rope3d")
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
