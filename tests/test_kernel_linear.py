"""The linear op set: nki_kernels.linear on the NKI emulator against reference.linear, the tile plan, the
kernel's structure (x^T computed once per m-block, one weight DMA per panel) and the op's validation."""

from __future__ import annotations

import math

import pytest
import torch

from nki_kernels import ops
from nki_kernels.emulator import TensorSpec, run
from nki_kernels.linear import (
    PMAX,
    SBUF_BUDGET,
    W_BUDGET,
    W_CHUNK,
    XS_BUFS,
    XS_COLS,
    linear_emulated,
    linear_kernel,
    plan_tiles,
)
from reference.linear import linear as ref_linear
from tests.numerics import assert_within, reference_error

pytestmark = pytest.mark.emulator

# (M, K, N, bias, lnc): tails in every dim, K > XS_COLS (staged in chunks), several m-blocks (1100 > 1024),
# one x^T set (K = 9000: bf16 bm 640 with 3 blocks of 5/5/1 row tiles and 2 panels, the next block's row
# tiles transposed as soon as the last panel has read them; fp32 bm 128), N < 128, LNC2 with an odd block
# count.
CASES = [
    (200, 300, 130, True, 1),
    (256, 256, 512, False, 1),
    (1100, 384, 700, True, 2),
    (5, 7, 3, False, 1),
    (300, 2500, 200, True, 1),
    (1300, 9000, 300, False, 1),
    (2100, 130, 60, True, 2),
]


def _inputs(m: int, k: int, n: int, bias: bool, seed: int) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    # unit-scale outputs (x ~ N(0, 1/K)) so the absolute floors of tests/numerics.py apply
    x = torch.randn(m, k, generator=g, dtype=torch.float64) / math.sqrt(k)
    w = torch.randn(k, n, generator=g, dtype=torch.float64)
    b = torch.randn(n, generator=g, dtype=torch.float64) if bias else None
    return [x, w, b]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("m", "k", "n", "bias", "lnc"), CASES)
def test_linear_kernel_matches_reference(m, k, n, bias, lnc, dtype) -> None:
    x, w, b = _inputs(m, k, n, bias, seed=m + k + n)
    ref_err, baseline = reference_error(ref_linear, [x, w, b], dtype)
    out = linear_emulated(x.to(dtype), w.to(dtype), None if b is None else b.to(torch.float32), lnc=lnc)
    assert out.dtype == dtype and out.shape == (m, n)
    assert_within(out, baseline, dtype, ref_err, what=f"linear {m}x{k}x{n} bias={bias} lnc={lnc}")


@pytest.mark.parametrize("k", [1, 7, 128, 300, 1536, 2048, 5120, 8960, 12000, 18432])
@pytest.mark.parametrize("itemsize", [2, 4])
def test_plan_fits_the_sbuf_budget(k: int, itemsize: int) -> None:
    kt = math.ceil(k / PMAX)
    if 2 * kt * PMAX * itemsize > W_BUDGET:
        with pytest.raises(ValueError, match=f"K={k} is too large"):
            plan_tiles(3000, k, 1536, itemsize)
        return
    for m, n in ((1, 1), (3000, 1536), (100, 8960)):
        bm, nb, sets = plan_tiles(m, k, n, itemsize)
        assert bm % PMAX == 0 and PMAX <= bm <= 1024 and bm <= math.ceil(m / PMAX) * PMAX
        assert 1 <= nb <= min(512, n) and (nb == n or nb % PMAX == 0)
        used = (
            sets * kt * bm * itemsize  # resident x^T sets
            + 2 * kt * max(nb, min(n, PMAX)) * itemsize  # two weight panels
            + XS_BUFS * XS_COLS * itemsize  # x staging
            + 3 * 512 * itemsize
            + 2 * 512 * 4  # output and bias tiles
        )
        assert used <= SBUF_BUDGET, (k, itemsize, m, n, bm, nb, sets, used)


def test_plan_is_wide_where_it_can_be() -> None:
    assert plan_tiles(3510, 1536, 8960, 2) == (1024, 512, 2)  # Wan ffn_up: full blocks, two x^T sets
    assert plan_tiles(3510, 8960, 1536, 2) == (640, 256, 1)  # Wan ffn_down: one set of 640 tokens
    with pytest.raises(ValueError, match="m must be a positive int"):
        plan_tiles(0, 8, 8, 2)


def test_x_transposed_once_per_block_and_one_weight_dma_per_panel() -> None:
    m, k, n = 1100, 384, 1100  # 2 m-blocks (1024 + 76), 3 k-tiles, 3 panels (512, 512, 76)
    bm, nb, sets = plan_tiles(m, k, n, 2)
    _, tr = run(
        linear_kernel,
        TensorSpec((m, k), "bfloat16"),
        TensorSpec((k, n), "bfloat16"),
        TensorSpec((n,), "float32"),
        trace_only=True,
    )
    m_tiles = math.ceil(1024 / PMAX) + 1
    panels = math.ceil(n / nb)
    assert tr.count("nc_transpose") == m_tiles * 3  # once per (128-row tile, k-tile), not per panel
    assert tr.count("nc_matmul") == m_tiles * 3 * panels
    # DMAs: x staging (1 per row tile), weights (1 per panel per block), bias (1 per panel per block),
    # stores (1 per row tile per panel)
    assert tr.count("dma_copy") == m_tiles + 2 * panels * 2 + m_tiles * panels
    # x^T evictions: one copy per PSUM tile of up to 8 bf16 k-tiles for the 8 full row tiles (3 k-tiles
    # each), one per k-tile for the 76-row tail; the accumulators' evictions add the bias (tensor_tensor)
    assert tr.count("tensor_copy") + tr.count("activation") == 8 * 1 + 3
    assert tr.count("tensor_tensor") == m_tiles * panels


def test_the_next_panels_weights_load_in_chunks_over_this_panel() -> None:
    # K = 4224: 33 k-tiles -> W_CHUNK-tile weight DMAs (16, 16, 1: the last one also moves nothing else),
    # N = 600 -> 2 panels (512, 88), M = 640 -> one block of 5 row tiles; no bias
    m, k, n = 640, 4224, 600
    bm, nb, sets = plan_tiles(m, k, n, 2)
    assert (bm, nb) == (640, 512)
    _, tr = run(
        linear_kernel,
        TensorSpec((m, k), "bfloat16"),
        TensorSpec((k, n), "bfloat16"),
        None,
        trace_only=True,
        keep_events=True,
    )
    chunks = math.ceil(33 / W_CHUNK)
    groups = 5 * math.ceil(k / XS_COLS)
    assert tr.count("dma_copy") == groups + 2 * chunks + 5 * 2  # staging, weights, stores
    # program order: chunk c of the second panel (88 columns) right before row tile c of the first panel
    matmuls, before = 0, []
    for rec, _, _ in tr.iter_events():
        if rec.op == "nc_matmul":
            matmuls += 1
        elif rec.op == "dma_copy" and len(rec.shapes[0]) == 3 and rec.shapes[0][2] == 88:
            before.append(matmuls)
    assert before == [c * 33 for c in range(chunks)]


def test_op_dispatch_and_leading_dims() -> None:
    x, w, b = _inputs(70, 300, 90, True, seed=3)
    x3 = x.to(torch.float32).reshape(2, 35, 300)
    w32, b32 = w.to(torch.float32), b.to(torch.float32)
    r = ops.linear(x3, w32, b32, backend="reference")
    e = ops.linear(x3, w32, b32, backend="emulator")
    assert r.shape == (2, 35, 90) and e.shape == (2, 35, 90)
    ref_err, baseline = reference_error(ref_linear, [x, w, b], torch.float32)
    assert_within(e.reshape(70, 90), baseline, torch.float32, ref_err, what="ops.linear emulator")
    assert ops.has_kernel("linear", "emulator")


@pytest.mark.parametrize(
    ("args", "err", "match"),
    [
        ((torch.zeros(4, 8), torch.zeros(9, 3)), ValueError, r"x in-features \(x.shape\[-1\]=8\) must match"),
        ((torch.zeros(4, 8), torch.zeros(8, 3, dtype=torch.bfloat16)), TypeError, "weight_t dtype"),
        ((torch.zeros(4, 8), torch.zeros(3, 8).t()), ValueError, "weight_t must be contiguous"),
        ((torch.zeros(4, 8, dtype=torch.int32), torch.zeros(8, 3)), TypeError, "x must be torch.bfloat16"),
        ((torch.zeros(4, 8), torch.zeros(8, 3), torch.zeros(4)), ValueError, r"bias must be \[N\] with N=3"),
        ((torch.zeros(0, 8), torch.zeros(8, 3)), ValueError, "at least one token"),
        ((torch.zeros(2, 9300), torch.zeros(9300, 3)), ValueError, "1 <= K <= 9216"),
    ],
)
def test_op_rejects_bad_input(args, err, match) -> None:
    with pytest.raises(err, match=match):
        ops.linear(*args, backend="reference")
