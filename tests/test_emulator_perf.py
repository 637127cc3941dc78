"""Trace-only mode at production shapes: the attention-shaped benchmark kernel.

The full-size case (12 heads x 23,400 queries x 32,760 keys x D=128, ~3.7 M instructions) is marked
slow; the fast tests check exact instruction counts and, at small shapes, the benchmark kernel's
numerics against numpy attention (so the traced kernel is a real attention kernel)."""

from __future__ import annotations

import time

import ml_dtypes
import numpy as np
import pytest

from nki_kernels.emulator import TensorSpec, run

from .emulator_attention_bench import attention_like, instructions_per_call

pytestmark = pytest.mark.emulator


def _specs(H, D, Sq, Sk):
    return (
        TensorSpec((H, D, Sq), "bfloat16"),
        TensorSpec((H, D, Sk), "bfloat16"),
        TensorSpec((H, Sk, D), "bfloat16"),
    )


def test_bench_kernel_is_attention_numerically():
    H, D, Sq, Sk = 2, 64, 200, 700  # ragged q and k tiles
    rng = np.random.default_rng(0)
    q = rng.standard_normal((H, Sq, D)).astype(ml_dtypes.bfloat16)
    k = rng.standard_normal((H, Sk, D)).astype(ml_dtypes.bfloat16)
    v = rng.standard_normal((H, Sk, D)).astype(ml_dtypes.bfloat16)
    qT = np.ascontiguousarray(q.transpose(0, 2, 1))
    kT = np.ascontiguousarray(k.transpose(0, 2, 1))
    out, trace = run(attention_like, qT, kT, v)
    s = np.einsum("hqd,hkd->hqk", q.astype(np.float64), k.astype(np.float64))
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = np.einsum("hqk,hkd->hqd", p / p.sum(-1, keepdims=True), v.astype(np.float64))
    # P is rounded to bf16 before PV (as on hardware) and the output is bf16: bf16 relative error 2^-8
    # on P and on the output; the reference has none.  Observed max abs error ~1e-2 for |ref| < 3.
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=3e-2, rtol=2**-7, equal_nan=False)
    assert trace.num_instructions == instructions_per_call(H, Sq, Sk)


def test_trace_only_counts_match_numeric_run():
    H, D, Sq, Sk = 1, 32, 130, 600
    _, t_only = run(attention_like, *_specs(H, D, Sq, Sk), trace_only=True)
    assert t_only.num_instructions == instructions_per_call(H, Sq, Sk)
    # 2 q tiles x (2 k tiles x 1 QK matmul + (4 + 1) key chunks x 1 PV matmul)
    assert t_only.count(op="nc_matmul") == 2 * (2 + 5)
    rng = np.random.default_rng(1)
    args = [rng.standard_normal(s.shape).astype(ml_dtypes.bfloat16) for s in _specs(H, D, Sq, Sk)]
    _, t_num = run(attention_like, *args)
    assert t_num.counts == t_only.counts


@pytest.mark.slow
def test_trace_only_full_attention_under_a_minute():
    H, D, Sq, Sk = 12, 128, 23_400, 32_760
    t0 = time.perf_counter()
    _, trace = run(attention_like, *_specs(H, D, Sq, Sk), trace_only=True)
    dt = time.perf_counter() - t0
    n = trace.num_instructions
    assert n == instructions_per_call(H, Sq, Sk)
    print(f"\n[measured] trace-only attention {H}x{Sq}x{Sk}x{D}: {n} instructions in {dt:.1f} s "
          f"({dt / n * 1e6:.1f} us/instruction)")  # fmt: skip
    # Budget: 1.5 M instructions in < 60 s => 40 us/instruction.
    assert dt / n < 40e-6
