"""Trace-only speed work must not change what the emulator computes or records.

* The indexing fast path of ``NkiTensor.__getitem__`` gives exactly the view (or the error) of the general
  path, for random keys (hypothesis).
* Trace-only and full-arithmetic runs of the project's kernels (attention, attention segments, RoPE, KV
  cache) record identical traces: the same records, counts and first-seen order.
* Slow: the production attention kernel at Wan shapes (Lq=23,400, Lk=32,760, H=12, D=128, bf16, LNC2)
  traces in under a minute. The figure is *measured* CPU wall clock and depends on machine load
  (2 cores shared with other jobs); the test prints it with the load average.
"""

from __future__ import annotations

import os
import time

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nki_kernels.attention import attention_kernel, attention_segments_kernel
from nki_kernels.emulator import TRN2, NkiEmulatorError, TensorSpec, Trace, run
from nki_kernels.emulator import language as nl
from nki_kernels.emulator import state as _state
from nki_kernels.kv_cache import kv_cache_slide_kernel, kv_cache_write_kernel
from nki_kernels.rope3d import rope3d_kernel, rope3d_naive_kernel

pytestmark = pytest.mark.emulator

# ------------------------------------------------------------------------------------- indexing fast path


@st.composite
def _index(draw, n: int):
    """Mostly valid in-range ints/unit slices (the fast path), plus anything else (the general path)."""
    kind = draw(st.sampled_from(["int", "slice", "slice", "slice", "wild"]))
    if kind == "int":
        return draw(st.integers(0, n - 1))
    if kind == "slice":
        start = draw(st.one_of(st.none(), st.integers(0, n - 1)))
        stop = draw(st.one_of(st.none(), st.integers((start or 0) + 1, n)))
        return slice(start, stop)
    bound = st.one_of(st.none(), st.integers(-n - 2, n + 2), st.builds(np.int64, st.integers(0, n)))
    return draw(
        st.one_of(
            st.integers(-n - 2, n + 2),
            st.builds(slice, bound, bound, st.one_of(st.none(), st.integers(0, 3))),
            st.just(Ellipsis),
            st.builds(np.int64, st.integers(0, n - 1)),
            st.just(True),
            st.just(1.0),
        )
    )


@st.composite
def _view_and_key(draw):
    rank = draw(st.integers(1, 4))
    shape = tuple(draw(st.integers(1, 6)) for _ in range(rank))
    on_chip = draw(st.booleans()) and rank >= 2
    nk = draw(st.integers(1, rank + 1))
    key = tuple(draw(_index(shape[min(i, rank - 1)])) for i in range(nk))
    single = draw(st.booleans()) and nk == 1
    return shape, on_chip, key[0] if single else key


def _outcome(fn, *args):
    try:
        t = fn(*args)
    except (NkiEmulatorError, IndexError, TypeError, ValueError) as e:
        return ("error", type(e), str(e))
    return ("view", t.offset, t.shape, t.strides, t.dtype, t._dyn, t._st)


def _compare(shape, on_chip, keys):
    launch = _state.Launch(TRN2, Trace(), True, 1)
    _state.push(launch)
    try:
        base = nl.ndarray(shape, nl.bfloat16, buffer=nl.sbuf if on_chip else nl.hbm)
        # start from a view with an offset (a slice of the allocation)
        t = base[(slice(1, None),) + (slice(None),) * (len(shape) - 1)]
        for key in keys:
            fast = _outcome(t.__getitem__, key)
            general = _outcome(t._getitem_general, key if isinstance(key, tuple) else (key,))
            assert fast == general, (shape, on_chip, key)
    finally:
        _state.pop()


@settings(max_examples=300, deadline=None)
@given(_view_and_key())
def test_getitem_fast_path_equals_general_path(case):
    shape, on_chip, key = case
    _compare((shape[0] + 1,) + shape[1:], on_chip, [key])


def test_getitem_fast_path_equals_general_path_exhaustive_small():
    bounds = (None, -2, 0, 1, 2, 3, 4, 5)
    elems = [*range(-5, 6), Ellipsis, np.int64(1), True]
    elems += [slice(a, b, c) for a in bounds for b in bounds for c in (None, 1, 2)]
    pairs = [(a, b) for a in elems for b in elems[::3]]
    for on_chip in (False, True):
        _compare((5, 4), on_chip, elems + pairs)


# ----------------------------------------------------------------- trace-only == full arithmetic traces


def _bf16(rng, shape):
    return rng.standard_normal(shape).astype(np.float32).astype(ml_dtypes.bfloat16)


def _same_trace(kernel, arrays, extra=(), lnc=1):
    """Run ``kernel`` with numpy inputs and trace-only with TensorSpecs; both traces must be identical."""
    specs = [TensorSpec(a.shape, a.dtype) for a in arrays]
    _, t_num = run(kernel, *arrays, *extra, lnc=lnc)
    _, t_only = run(kernel, *specs, *extra, lnc=lnc, trace_only=True)
    assert t_only.num_instructions == t_num.num_instructions > 0
    assert list(t_only.entries()) == list(t_num.entries())  # same records, counts and first-seen order
    return t_only


@pytest.mark.parametrize("lnc", [1, 2])
def test_trace_only_equals_numeric_trace_attention(lnc):
    rng = np.random.default_rng(0)
    B, Lq, Lk, H, D = 1, 200, 2600, 2, 64  # a full 2048-key chunk, a 512 chunk and a 40-key tail
    q, k, v = _bf16(rng, (B, Lq, H, D)), _bf16(rng, (B, Lk, H, D)), _bf16(rng, (B, Lk, H, D))
    tr = _same_trace(attention_kernel, [q, k, v], (0.125, True), lnc=lnc)
    assert tr.count(op="nc_matmul") > 0
    kv = _bf16(rng, (B, 3000, H, D))
    segs = ((0, 200), (700, 900), (2500, 300))
    _same_trace(attention_segments_kernel, [q, kv, kv.copy()], (segs, 0.125, False), lnc=lnc)


def test_trace_only_equals_numeric_trace_attention_fp32():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 130, 1, 32)).astype(np.float32)
    k = rng.standard_normal((1, 1100, 1, 32)).astype(np.float32)
    _same_trace(attention_kernel, [q, k, k.copy()], (0.2, True))


@pytest.mark.parametrize("lnc", [1, 2])
def test_trace_only_equals_numeric_trace_rope_and_kv_cache(lnc):
    rng = np.random.default_rng(2)
    L, H, D = 300, 2, 128
    x = [_bf16(rng, (1, L, H, D)) for _ in range(2)]
    tables = [rng.standard_normal((L, D // 2)).astype(np.float32) for _ in range(2)]
    _same_trace(rope3d_kernel, x + tables, lnc=lnc)
    _same_trace(rope3d_naive_kernel, x + tables, lnc=lnc)
    S, T = 1200, 300
    caches = [_bf16(rng, (1, S, H, 64)) for _ in range(2)]
    new = [_bf16(rng, (1, T, H, 64)) for _ in range(2)]
    _same_trace(kv_cache_write_kernel, caches + new + [np.array([[2]], np.int32)], lnc=lnc)
    _same_trace(kv_cache_slide_kernel, caches + new, (T,), lnc=lnc)


# --------------------------------------------------------------------------------- full-size speed


@pytest.mark.slow
def test_trace_only_production_attention_under_a_minute():
    Lq, Lk, H, D = 23_400, 32_760, 12, 128
    args = [TensorSpec((1, n, H, D), "bfloat16") for n in (Lq, Lk, Lk)]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    _, trace = run(attention_kernel[2], *args, 1.0 / D**0.5, False, trace_only=True)
    dt = time.perf_counter() - t0
    n = trace.num_instructions
    assert trace.count(op="nc_matmul") >= H * ((Lq + 127) // 128) * ((Lk + 511) // 512)
    print(
        f"\n[measured] trace-only attention_kernel[2] Lq={Lq} Lk={Lk} H={H} D={D} bf16: {n} instructions in "
        f"{dt:.1f} s ({dt / n * 1e6:.2f} us/instruction), load average {load:.2f} at start"
    )
    # The trace-speed budget: under a minute. Measured 12.4 s at load 2.2 on this 2-core machine; a much
    # higher load from other jobs can stretch it.
    assert dt < 60.0


# ------------------------------------------------- checks still run after an identical valid instruction


def _violations():
    from nki_kernels.emulator import isa as nisa

    def matmul_crosses_bank():
        a = nl.ndarray((128, 128), nl.bfloat16, buffer=nl.sbuf)
        b = nl.ndarray((128, 512), nl.bfloat16, buffer=nl.sbuf)
        ps = nl.ndarray((128, 1024), nl.float32, buffer=nl.psum)
        nisa.memset(a, 0.0)
        nisa.memset(b, 0.0)
        nisa.nc_matmul(ps[:, 0:512], a, b)  # valid: bank 0
        nisa.nc_matmul(ps[:, 256:768], a, b)  # same shapes/strides, crosses a 2 KiB bank

    def matmul_dst_in_sbuf():
        a = nl.ndarray((128, 128), nl.bfloat16, buffer=nl.sbuf)
        ps = nl.ndarray((128, 128), nl.float32, buffer=nl.psum)
        sb = nl.ndarray((128, 128), nl.float32, buffer=nl.sbuf)
        nisa.memset(a, 0.0)
        nisa.nc_matmul(ps, a, a)
        nisa.nc_matmul(sb, a, a)

    def copy_gpsimd_from_psum():
        ps = nl.ndarray((128, 64), nl.float32, buffer=nl.psum)
        sb = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf)
        nisa.memset(ps, 0.0)
        nisa.tensor_copy(sb, ps, engine=nisa.vector_engine)
        nisa.tensor_copy(sb, ps, engine=nisa.gpsimd_engine)

    def transpose_too_big_on_vector():
        sb = nl.ndarray((32, 32), nl.bfloat16, buffer=nl.sbuf)
        ps = nl.ndarray((32, 32), nl.bfloat16, buffer=nl.psum)
        big = nl.ndarray((64, 64), nl.bfloat16, buffer=nl.sbuf)
        big_t = nl.ndarray((64, 64), nl.bfloat16, buffer=nl.sbuf)
        nisa.memset(sb, 0.0)
        nisa.memset(big, 0.0)
        nisa.nc_transpose(ps, sb)  # TensorE (SBUF -> PSUM)
        nisa.nc_transpose(big_t, big)  # SBUF -> SBUF runs on VectorE: 64 > 32

    def transpose_mode_accumulate_true():
        a = nl.ndarray((128, 128), nl.bfloat16, buffer=nl.sbuf)
        ident = nl.ndarray((128, 128), nl.bfloat16, buffer=nl.sbuf)
        pt = nl.ndarray((128, 128), nl.bfloat16, buffer=nl.psum)
        nisa.memset(a, 0.0)
        nisa.iota(ident, [[1, 128]], 0, -1)  # p - i: zero on the diagonal
        nisa.tensor_scalar(ident, ident, nl.equal, 0.0)  # identity
        nisa.nc_matmul(pt, a, ident, is_transpose=True)  # valid
        nisa.nc_matmul(pt, a, ident, is_transpose=True, accumulate=True)  # a pass-through cannot accumulate

    return [
        matmul_crosses_bank,
        matmul_dst_in_sbuf,
        copy_gpsimd_from_psum,
        transpose_too_big_on_vector,
        transpose_mode_accumulate_true,
    ]


@pytest.mark.parametrize("kernel", _violations(), ids=lambda f: f.__name__)
def test_rules_checked_after_an_identical_valid_instruction(kernel):
    messages = []
    for trace_only in (False, True):
        with pytest.raises(NkiEmulatorError) as exc:
            run(kernel, trace_only=trace_only)
        messages.append((type(exc.value), str(exc.value)))
    assert messages[0] == messages[1]
    assert messages[0][1].startswith("[")
