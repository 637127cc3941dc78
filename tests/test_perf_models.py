"""Analytic perf helpers against their definitions (mutation-check survivors): the DMA efficiency step
curve, the DMA time caps, and the per-core activation footprint at a TP != SP layout.

Figures here are *modelled* (no hardware); the expected values are written from each docstring's
definition, not by calling the code under test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from nki_kernels.emulator.cost import DMA_EFFICIENCY_POINTS
from perf.footprint import activation_peak_bytes
from perf.matmul_model import MatmulHw
from rolling_forcing.config import PipelineConfig, get_preset


def test_dma_efficiency_is_a_step_curve_over_the_published_points() -> None:
    hw = MatmulHw()
    prev = DMA_EFFICIENCY_POINTS[0][1]
    for size, eff in DMA_EFFICIENCY_POINTS:
        assert hw.dma_eff(size) == eff, size  # a run of exactly a table size gets that size's efficiency
        if size > DMA_EFFICIENCY_POINTS[0][0]:
            assert hw.dma_eff(size - 1) == prev, size - 1  # one byte shorter: the previous step
        prev = eff
    assert hw.dma_eff(10**9) == DMA_EFFICIENCY_POINTS[-1][1]


@pytest.mark.parametrize("run_bytes", [32, 512, 2048, 4096, 65536])
def test_dma_time_respects_both_caps(run_bytes: int) -> None:
    # time >= bytes / HBM share and >= bytes / (derated DMA rate); equal to the slower of the two
    hw = MatmulHw()
    n = 1 << 26
    t_hbm = n / hw.hbm_Bps_per_core
    t_dma = n / (hw.dma_peak_Bps * hw.dma_eff(run_bytes))
    t = hw.dma_s(n, run_bytes)
    assert t >= t_hbm * (1 - 1e-12) and t >= t_dma * (1 - 1e-12)
    assert t == pytest.approx(t_hbm if t_hbm > t_dma else t_dma, rel=1e-12)


def test_activation_footprint_at_tp4_sp2_matches_its_definition() -> None:
    # Wan2.1-1.3B merged forward: N = (3 + 15 frames) x 1,560 tokens = 28,080; TP4 x SP2, bf16 activations.
    m, p = get_preset("wan2.1-1.3b"), PipelineConfig()
    n_tot = 18 * 1560
    assert (p.frames_per_block + p.window_frames) * m.tokens_per_frame == n_tot
    tp, sp, b = 4, 2, 2
    n = math.ceil(n_tot / 8)  # 3,510 tokens per core
    q_loc = math.ceil(n_tot / sp)  # the SP shard's queries after the all-to-all: 14,040
    hl, hd, d = 12 // tp, 128, 1536
    attn = 4 * n * d + 3 * n * d * b + q_loc * hl * hd * b + 2 * n_tot * hl * hd * b + q_loc * hl * hd * b
    ffn = 4 * n * d + n * d * b + n * 8960 * b + n * d * b
    got = activation_peak_bytes(m, p, tp, sp)
    assert got == {"attention": attn, "ffn": ffn, "peak": max(attn, ffn)}


@pytest.mark.parametrize("m,k,n", [(256, 384, 128), (384, 640, 96)])
def test_matmul_block_kernel_numerics(m: int, k: int, n: int) -> None:
    """The software-pipelined block kernel (x^T transposed TRANSPOSE_AHEAD tiles ahead) computes x @ w:
    against a float64 product of the same bf16 inputs, the error is at most the bf16 output rounding
    (2^-8 relative) plus the fp32 PSUM accumulation bound (k * 2^-24 * sum |x| |w|)."""
    import ml_dtypes

    from nki_kernels.emulator import run
    from perf.matmul_model import TRANSPOSE_AHEAD, matmul_block_kernel

    assert k // 128 > TRANSPOSE_AHEAD  # the lookahead is exercised (more tiles than it)
    bf = ml_dtypes.bfloat16
    rng = np.random.default_rng(7)
    x = rng.standard_normal((m, k)).astype(bf)
    w = rng.standard_normal((k, n)).astype(bf)
    out = np.asarray(run(matmul_block_kernel, x, w)[0]).astype(np.float64)
    xf, wf = x.astype(np.float64), w.astype(np.float64)
    ref = xf @ wf
    bound = 2.0**-8 * np.abs(ref) + k * 2.0**-24 * (np.abs(xf) @ np.abs(wf))
    assert out.shape == (m, n)
    assert np.all(np.abs(out - ref) <= bound)
