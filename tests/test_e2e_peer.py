"""The peer rows' kernel provider (perf/e2e/peer_kernels.py), its layout components, and the VectorE/GpSimd
contention charged once (perf/e2e/components.py). Every figure is *modelled*; references are hand sums of
the documented formulas or ``profile_range`` called directly on the same trace."""

from __future__ import annotations

import math

import ml_dtypes
import pytest

from nki_kernels._nki import nisa, nki, nl
from nki_kernels.emulator import TensorSpec, run
from nki_kernels.emulator.cost import profile_range
from perf.e2e import E2EParams, KernelCost, TracedKernels, chunk_model
from perf.e2e.components import contended_s
from perf.e2e.kernels import AnalyticKernels, _profile_cost
from perf.e2e.peer_attention import dmajor_layout_kernel, peer_attention_kernel
from perf.e2e.peer_kernels import PeerKernels
from perf.e2e.run import peer_provider
from rolling_forcing.config import PipelineConfig, get_preset

WAN = get_preset("wan2.1-1.3b")
PIPE = PipelineConfig()


class _Prof:
    """A cost-model profile stand-in: latency, fixed time, busy times."""

    def __init__(self, lat_ns, fixed_ns=0.0, busy=None, model="schedule"):
        self.latency_ns, self.fixed_ns, self.model = lat_ns, fixed_ns, model
        self.engine_busy_ns = busy or {}
        self.hbm_bytes = 0


class _Base:
    """Base provider: every kernel 7 us (model ``schedule``); records the attention shapes it priced."""

    name = "base"

    def __init__(self):
        self.calls = []

    def _c(self, tag):
        return KernelCost(7e-6, 0, 0, {}, tag, 0.0, 7e-6, 0.0, "schedule")

    def attention(self, lq, lk, heads, head_dim):
        self.calls.append((lq, lk, heads, head_dim))
        return self._c("base-attn")

    def rope(self, tokens, heads, head_dim):
        return self._c("base-rope")

    def kv_write(self, tokens, heads, head_dim):
        return self._c("base-kvw")


class _Blocks:
    name = "fixed-blocks"

    def block(self, block_m, k, block_n):
        from perf.matmul_model import BlockProfile

        return BlockProfile(
            block_m, block_n, k, 1e-6, {"tensor": 1e-6}, 0, 2 * block_m * k * block_n, 1, "fixed"
        )


def _fake_profile(log):
    """Profile pair of a ``(kernel, *specs)`` call, 2 us fixed time in each: attention low ``1 us x heads``
    + fixed, layout low ``1 ns x q rows`` + fixed; high = 3 x low - 4 us (so high - fixed = 3 x the
    variable part)."""

    def prof(kernel, *args):
        shapes = tuple(a.shape for a in args if hasattr(a, "shape"))
        log.append((kernel, shapes, args[len(shapes) :]))
        var = 1000.0 * shapes[0][0] if kernel is peer_attention_kernel else float(shapes[0][0])
        lo = var + 2000.0
        return _Prof(lo, 2000.0), _Prof(3 * lo - 4000.0, 2000.0)

    return prof


def test_peer_kernels_trace_the_peer_kernel_at_the_peer_shapes():
    log: list = []
    pk = PeerKernels(_Base(), profile=_fake_profile(log))
    c = pk.attention(11_700, 32_760, 3, 128)
    kern, shapes, rest = log[-1]
    assert kern is peer_attention_kernel
    assert shapes == ((3, 128, 11_700), (3, 128, 32_768), (3, 32_768, 128))  # buffer padded to 8192 keys
    assert rest == (pytest.approx(1 / math.sqrt(128)), 32_760)  # attends the valid keys only
    assert (c.time_s, c.time_high_s, c.fixed_s) == pytest.approx((5e-6, 11e-6, 2e-6))
    assert c.at("optimistic") == pytest.approx(3e-6) and c.at("pessimistic") == pytest.approx(9e-6)
    assert c.flops == 4 * 11_700 * 32_760 * 3 * 128 and c.model == "schedule"
    # 12 local heads traced at 3 and scaled x4 (heads are independent)
    c12 = pk.attention(100, 600, 12, 128)
    assert log[-1][1][0] == (3, 128, 100) and c12.time_s == pytest.approx(4 * 5e-6)
    n = len(log)
    pk.attention(11_700, 32_760, 3, 128)
    assert len(log) == n  # cached per shape


def test_peer_kernels_layout_cross_and_delegation():
    log: list = []
    base = _Base()
    pk = PeerKernels(base, profile=_fake_profile(log))
    pk.attention_layout(2_340, 32_760, 3, 128, True)
    kern, shapes, _ = log[-1]
    assert kern is dmajor_layout_kernel
    assert shapes == ((2_340, 3, 128), (32_768, 3, 128), (32_768, 3, 128))  # the whole padded buffer
    pk.attention_layout(14_040, 512, 3, 128, False)
    assert log[-1][1] == ((14_040, 3, 128), (512, 3, 128), (512, 3, 128))  # text keys: no padding
    c = pk.cross_attention(14_040, 512, 3, 128)
    assert base.calls[-1] == (14_040, 512, 3, 128) and "our kernel" in c.source
    assert pk.rope(10, 3, 128).source == "base-rope" and pk.kv_write(10, 3, 128).source == "base-kvw"
    n = len(log)
    PeerKernels(base, profile=_fake_profile(log), cross_with_peer_kernel=True).cross_attention(
        64, 512, 3, 128
    )
    assert log[n][0] is peer_attention_kernel


def test_peer_kernels_failed_trace_is_labelled():
    def boom(kernel, *args):
        raise RuntimeError("no")

    pk = PeerKernels(_Base(), profile=boom)
    c = pk.attention(128, 512, 3, 128)
    assert c.source.startswith("base-attn (peer trace failed: RuntimeError")
    assert pk.attention_layout(128, 512, 3, 128) is None


def test_peer_provider_only_wraps_traced_kernels():
    p = E2EParams()
    tk = TracedKernels(p)
    pk = peer_provider(tk)
    assert isinstance(pk, PeerKernels) and pk.base is tk
    ak = AnalyticKernels(p)
    assert peer_provider(ak) is ak


def test_layout_components_add_time_not_kernel_calls():
    """A provider with ``attention_layout`` adds one layout component per attention call, each L times, at
    its time, with no kernel calls: the chunk's kernel calls and the other components are unchanged."""
    p = E2EParams()
    log: list = []
    base = _Base()
    kw = dict(cores=8, vae=None, matmul=_Blocks(), params=p, end="pessimistic", weights="tp_linear")
    plain = chunk_model(WAN, PIPE, kernels=base, **kw)
    peer = chunk_model(WAN, PIPE, kernels=PeerKernels(base, profile=_fake_profile(log)), **kw)
    extra = {c.name: c for c in peer.components}.keys() - {c.name for c in plain.components}
    assert extra == {"attn_update_layout", "attn_denoise_layout", "cross_attn_layout"}
    assert peer.kernel_calls == plain.kernel_calls
    lay = {c.name: c for c in peer.components if c.name in extra}
    rows = {"attn_update_layout": 2_340, "attn_denoise_layout": 11_700, "cross_attn_layout": 14_040}
    for name, r in rows.items():  # pessimistic end: high - fixed = 3 ns x q rows
        assert lay[name].launches == 0 and lay[name].calls == WAN.num_layers
        assert lay[name].time_s == pytest.approx(3 * r * 1e-9)
    # self-attention from the peer kernel (3 heads: 3 x 3 us = 9 us), cross-attention from the base (7 us)
    att = {c.name: c.time_s for c in peer.components}
    assert att["attn_update"] == pytest.approx(9e-6) and att["attn_denoise"] == pytest.approx(9e-6)
    assert att["cross_attn"] == pytest.approx(7e-6)
    layouts = sum(c.total_s for c in lay.values())
    assert peer.chunk_s - plain.chunk_s == pytest.approx(layouts + 2 * WAN.num_layers * 2e-6, rel=1e-9)


@nki.jit
def _vec_and_pool(x):
    """VectorE and GpSimd each stream their own copy of x at once (both engines busy together)."""
    a = nl.ndarray((128, 2048), dtype=nl.float32, buffer=nl.sbuf)
    b = nl.ndarray((128, 2048), dtype=nl.float32, buffer=nl.sbuf)
    c = nl.ndarray((128, 2048), dtype=nl.float32, buffer=nl.sbuf)
    out = nl.ndarray((128, 2048), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=a, src=x)
    for _ in range(4):
        nisa.tensor_scalar(b, a, nl.multiply, 2.0, engine=nisa.vector_engine)
        nisa.tensor_tensor(c, a, a, nl.add, engine=nisa.gpsimd_engine)
    nisa.tensor_tensor(b, b, c, nl.add)
    nisa.dma_copy(dst=out, src=b)
    return out


def test_contention_is_charged_once_for_schedule_priced_kernels():
    """Cost model v2 prices VectorE/GpSimd contention inside the schedule (its high end slows the overlap
    2x); the end-to-end term must not add it again: a schedule-priced kernel's time is ``at(end)``."""
    _, tr = run(_vec_and_pool, TensorSpec((128, 2048), "float32"), trace_only=True, keep_events=True)
    lo, hi = profile_range(tr, schedule=True)
    cost = _profile_cost(lo, hi, 0, "traced")
    p = E2EParams()
    v, g = cost.engine_busy_s["vector"], cost.engine_busy_s["gpsimd"]
    assert v > 0 and g > 0
    for end in ("optimistic", "pessimistic"):
        assert contended_s(cost, p.at(end)) == cost.at(end)
    # the old double count: the e2e term (v + g serialised at c = 1) binds for this kernel
    assert v + g > cost.at("pessimistic")
    # a kernel priced without contention (analytic / bound) still gets the end-to-end term
    from dataclasses import replace

    analytic = replace(cost, model="analytic")
    assert contended_s(analytic, p.at("pessimistic")) == pytest.approx(max(cost.at("pessimistic"), v + g))


def test_peer_attention_trace_is_schedule_priced():
    """The real provider path at a small shape: the cost equals ``profile_range`` of the same trace."""
    bf = ml_dtypes.bfloat16
    pk = PeerKernels(_Base())
    c = pk.attention(200, 700, 2, 64)
    _, tr = run(
        peer_attention_kernel,
        TensorSpec((2, 64, 200), bf),
        TensorSpec((2, 64, 8192), bf),
        TensorSpec((2, 8192, 64), bf),
        1 / 8,
        700,
        trace_only=True,
        keep_events=True,
    )
    lo, hi = profile_range(tr, schedule=True)
    assert c.model == "schedule" and c.source == "peer kernel traced (schedule)"
    assert c.time_s == pytest.approx(lo.latency_ns * 1e-9) and c.time_high_s == pytest.approx(
        hi.latency_ns * 1e-9
    )
