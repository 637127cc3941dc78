"""perf.e2e prices the roped copies with the one-tensor RoPE kernel (keys only) when the provider has it:
TracedKernels.rope_one is the schedule of rope3d_one_kernel's own trace, and the component's compulsory
bytes are one tensor's."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import pytest

from nki_kernels.emulator import TensorSpec, run
from nki_kernels.emulator.cost import profile_range
from perf.e2e.chunk import chunk_model, steady_forwards
from perf.e2e.kernels import AnalyticKernels, TracedKernels
from perf.e2e.params import E2EParams
from perf.matmul_model import AnalyticMatmulProvider
from rolling_forcing.config import PipelineConfig, get_preset

pytestmark = pytest.mark.emulator

BF = ml_dtypes.bfloat16


def test_traced_rope_one_is_the_one_kernel_schedule_and_cheaper_than_q_and_k() -> None:
    from nki_kernels.rope3d import rope3d_one_kernel

    tokens, heads, d = 1100, 3, 128
    x, tab = TensorSpec((1, tokens, heads, d), BF), TensorSpec((tokens, d // 2), "float32")
    _, tr = run(rope3d_one_kernel, x, tab, tab, trace_only=True, keep_events=True)
    lo, hi = profile_range(tr)
    traced = TracedKernels(max_heads=2)
    one, both = traced.rope_one(tokens, heads, d), traced.rope(tokens, heads, d)
    assert one.model == "schedule" and "traced" in one.source
    assert one.time_s == pytest.approx(lo.latency_ns * 1e-9, rel=1e-12)
    assert one.time_high_s == pytest.approx(hi.latency_ns * 1e-9, rel=1e-12)
    # one tensor read and written + both tables, against two tensors + the same tables
    assert one.hbm_bytes == 2 * tokens * heads * d * 2 + 2 * tokens * (d // 2) * 4
    assert both.hbm_bytes == 4 * tokens * heads * d * 2 + 2 * tokens * (d // 2) * 4
    assert one.at("pessimistic") < both.at("pessimistic")


@pytest.mark.parametrize("with_one", [True, False], ids=["rope_one", "q_and_k_fallback"])
def test_copies_component_prices_keys_only_when_the_provider_can(with_one: bool) -> None:
    class QKOnly:
        """A provider without the one-tensor kernel (e.g. the peer's): the copies are priced as q and k."""

        def __init__(self, base: AnalyticKernels) -> None:
            self.base = base

        def __getattr__(self, name: str) -> Any:
            if name == "rope_one":
                raise AttributeError(name)
            return getattr(self.base, name)

    m, p, prm = get_preset("tiny"), PipelineConfig(), E2EParams()
    kern: Any = AnalyticKernels(prm) if with_one else QKOnly(AnalyticKernels(prm))
    cm = chunk_model(m, p, cores=2, vae=None, kernels=kern, matmul=AnalyticMatmulProvider(), params=prm)
    copies = {c.name: c for c in cm.components}["rope3d_copies"]
    n_tok = steady_forwards(m, p, "merged")[0].copy_tokens
    hl = m.num_heads // cm.tp
    tensors = 1 if with_one else 2
    moved = tensors * n_tok * hl * m.head_dim * 2 * 2  # read + written, bf16
    assert n_tok > 0 and copies.calls == m.num_layers
    assert copies.hbm_bytes == moved + 2 * 4 * n_tok * (m.head_dim // 2)  # + the fp32 cos/sin rows
    # analytic pricing: the bytes the kernel moves over the per-core HBM bandwidth
    assert copies.time_s == pytest.approx(moved / prm.hbm_Bps_per_core, rel=1e-12)
