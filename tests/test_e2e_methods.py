"""Per-method end-to-end rows (perf/e2e/methods.py): forwards per block, FLOPs against independent
arithmetic, Rolling Forcing's row equal to the report's merged chunk, HBM ordering; all modelled."""

from __future__ import annotations

import pytest

from perf.e2e.chunk import chunk_model
from perf.e2e.kernels import AnalyticKernels
from perf.e2e.methods import method_bench_rows, method_forwards, method_rows, method_table
from perf.e2e.params import E2EParams
from perf.e2e.run import _model
from perf.matmul_model import AnalyticMatmulProvider
from rolling_forcing.config import PipelineConfig
from rolling_forcing.methods import METHODS


def _flops_per_block(m, q_frames: int, k_frames: int, calls: int) -> float:
    """2 x MACs of ``calls`` forwards of q query / k key frames (own arithmetic): per layer the linears
    (self q,k,v,o + cross q,o: 6 d^2; FFN 2 d f per token), self-attention 2 Lq Lk d, cross 2 Lq text d."""
    t = m.tokens_per_frame
    lq, lk = q_frames * t, k_frames * t
    per_layer = (
        lq * (6 * m.dim**2 + 2 * m.dim * m.ffn_dim) + 2 * lq * lk * m.dim + 2 * lq * m.text_len * m.dim
    )
    return 2.0 * per_layer * m.num_layers * calls


@pytest.fixture(scope="module")
def rows():
    params = E2EParams()
    m = _model("wan2.1-1.3b", 480, 832)  # at small shapes the per-forward text embedding is not negligible
    kw = {"kernels": AnalyticKernels(params), "matmul": AnalyticMatmulProvider(), "params": params}
    return m, method_rows(m, cores=8, vae=None, **kw), kw


def test_forwards_and_flops(rows) -> None:
    m, rs, _ = rows
    by = {r.method: r for r in rs}
    assert {n: r.forwards_per_block for n, r in by.items()} == {
        "rolling-forcing": 1, "self-forcing": 5, "causvid": 4, "longlive": 5,
        "self-forcing+batched": 4, "causvid+batched": 3, "longlive+batched": 4,
        "self-forcing+static": 4, "causvid+static": 3, "longlive+static": 4,
    }  # fmt: skip
    want = {
        "self-forcing": _flops_per_block(m, 3, 21, 5),
        "causvid": _flops_per_block(m, 3, 21, 4),
        "longlive": _flops_per_block(m, 3, 12, 5),
        "rolling-forcing": _flops_per_block(m, 15, 21, 1) + _flops_per_block(m, 3, 21, 1),
    }
    for name, f in want.items():
        got = by[name].chunks["optimistic"].dit_flops
        assert got == pytest.approx(f, rel=1e-3), name
        if name != "rolling-forcing":  # batching moves the update into another forward: same FLOPs
            assert by[f"{name}+batched"].chunks["optimistic"].dit_flops == pytest.approx(got, rel=1e-9)
            # static: the masked update blocks of steps 2..S add their linear and cross-attention work
            steps = METHODS[name].steps
            extra = (steps - 1) * (_flops_per_block(m, 3, 0, 1))
            assert by[f"{name}+static"].chunks["optimistic"].dit_flops == pytest.approx(got + extra, rel=1e-3)
    # the same arithmetic at Wan2.1-1.3B, 480x832 gives the public per-block TFLOP: SF 202.0, LongLive
    # 141.5, RF 242.4 (what `python -m perf.e2e --methods` prints)
    w = _model("wan2.1-1.3b", 480, 832)
    assert _flops_per_block(w, 3, 21, 5) / 1e12 == pytest.approx(202.0, abs=0.1)
    assert _flops_per_block(w, 3, 12, 5) / 1e12 == pytest.approx(141.5, abs=0.1)
    assert (_flops_per_block(w, 15, 21, 1) + _flops_per_block(w, 3, 21, 1)) / 1e12 == pytest.approx(
        242.4, abs=0.1
    )
    # LongLive's 12-frame window is the cheapest per block; its KV buffer the smallest
    assert min(rs, key=lambda r: r.chunks["optimistic"].dit_flops).method == "longlive"
    assert min(rs, key=lambda r: r.hbm_bytes).method.startswith("longlive")


def test_rolling_forcing_row_is_the_merged_chunk(rows) -> None:
    m, rs, kw = rows
    rf = next(r for r in rs if r.method == "rolling-forcing")
    ref = chunk_model(m, PipelineConfig(dtype="bfloat16"), cores=8, variant="merged", vae=None, **kw)
    assert rf.chunks["optimistic"].chunk_s == pytest.approx(ref.chunk_s, rel=1e-12)


def test_table_and_bench_rows(rows) -> None:
    m, rs, _ = rows
    text = method_table(rs)
    assert all(name in text for name in METHODS) and "modelled" in text and "20.7 fps" in text
    brows = method_bench_rows(rs, m, 480, 832)
    assert len(brows) == 2 * len(rs) == 2 * (3 * len(METHODS) - 2)
    assert all(b.kind == "modelled" for b in brows)
    assert len(method_forwards(m, METHODS["longlive"])) == 5
