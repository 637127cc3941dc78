"""nki_kernels.ops: backend resolution and dispatch, tracing (torch.compile / export / opcheck) and
parity of the emulator backend with the reference."""

from __future__ import annotations

import importlib
import importlib.util
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from nki_kernels import op_dispatch, ops
from reference.attention import attention as ref_attention
from reference.attention import attention_segments as ref_attention_segments
from reference.kv_cache import kv_cache_slide as ref_kv_cache_slide
from reference.kv_cache import kv_cache_write as ref_kv_cache_write
from reference.rope3d import rope3d as ref_rope3d
from tests.numerics import assert_within, reference_error
from tests.ops_helpers import (
    BF16,
    F32,
    KV,
    Q,
    clean_backend_env,  # noqa: F401 (autouse fixture)
    kernels_available,
    rnd,
)

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


@pytest.mark.emulator
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_emulator_rope3d_within_tolerance(dtype: torch.dtype) -> None:
    kernels_available("rope3d")
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
    kernels_available("attention")
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
    kernels_available("kv_cache")
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
