"""The end-to-end model's hookup onto cost model v2 (perf/e2e/kernels.py, perf/e2e/params.py).

Every figure is *modelled*.  References are computed independently: the emulator run + ``profile_range``
called directly, and hand sums of the chunk model's formulas (``docs/e2e_model.md``).
"""

from __future__ import annotations

import math

import ml_dtypes
import pytest

from nki_kernels.emulator import TensorSpec, run
from nki_kernels.emulator.cost import Trn2CostParams, profile_range
from perf.e2e import E2EParams, KernelCost, TracedKernels, chunk_model
from rolling_forcing.config import PipelineConfig, get_preset

WAN = get_preset("wan2.1-1.3b")
PIPE = PipelineConfig()
BF = ml_dtypes.bfloat16


class _Blocks:
    """Matmul blocks of a fixed 1 us (only the kernel provider varies between the chunks compared)."""

    name = "fixed-blocks"

    def block(self, block_m, k, block_n):
        from perf.matmul_model import BlockProfile

        return BlockProfile(
            block_m, block_n, k, 1e-6, {"tensor": 1e-6}, 0, 2 * block_m * k * block_n, 1, "fixed"
        )


class _Kernels:
    """Every kernel: ``(t_lo, t_hi)`` of which ``(f_lo, f_hi)`` is the cost model's fixed part."""

    name = "two-ended"

    def __init__(self, t_lo, t_hi, f_lo, f_hi):
        self.args = (t_lo, t_hi, f_lo, f_hi)

    def _c(self):
        t_lo, t_hi, f_lo, f_hi = self.args
        return KernelCost(t_lo, 0, 0, {}, "fake", f_lo, t_hi, f_hi, "schedule")

    def attention(self, lq, lk, heads, head_dim):
        return self._c()

    rope = kv_write = lambda self, tokens, heads, head_dim: self._c()  # noqa: E731


def _chunk(kernels, end, params=None):
    p = params or E2EParams()
    # one collective model at both ends and the collectives serialised (no end-dependent overlap
    # contention), so the ends differ only by the kernels and the e2e ranges
    cm = p.at("optimistic").comm_model
    return chunk_model(
        WAN, PIPE, cores=8, vae=None, kernels=kernels, matmul=_Blocks(), params=p, end=end, comm_model=cm,
        comm_schedule="serial_split",
    )  # fmt: skip


def test_one_source_for_the_fixed_per_kernel_time():
    """The e2e model's pessimistic per-call fixed time IS the cost model's pessimistic kernel_fixed_ns."""
    r = E2EParams().kernel_fixed_s
    assert r.high == Trn2CostParams.high().kernel_fixed_ns * 1e-9
    assert r.low == 2e-6 and r.low <= r.high


def test_fixed_time_not_double_charged_at_either_end():
    """Each kernel call pays kernel_fixed_s.at(end) once: the cost model's fixed part (different at each
    end) is stripped, so two providers differing only in their fixed part give the same chunk."""
    p = E2EParams()
    net_lo, net_hi = 20e-6, 35e-6
    a = _Kernels(net_lo, net_hi, 0.0, 0.0)
    b = _Kernels(net_lo + 12.4e-6, net_hi + 13.3e-6, 12.4e-6, 13.3e-6)
    for end, net in (("optimistic", net_lo), ("pessimistic", net_hi)):
        ca, cb = _chunk(a, end), _chunk(b, end)
        assert cb.chunk_s == pytest.approx(ca.chunk_s, rel=1e-12)
        comps = {c.name: c for c in cb.components}
        assert comps["attn_denoise"].time_s == pytest.approx(net)
        assert comps["rope3d"].time_s == pytest.approx(net)
        assert comps["kernel_fixed"].time_s == p.kernel_fixed_s.at(end)
        assert comps["kernel_fixed"].calls == cb.kernel_calls
    # the kernels' share of the chunk moves by exactly (net_hi - net_lo) per kernel-provider call
    lo, hi = _chunk(b, "optimistic"), _chunk(b, "pessimistic")
    # the provider's calls: self- and cross-attention, RoPE (window + the sink's roped copy), KV write
    # (30 layers each)
    provided = ("attn_update", "attn_denoise", "cross_attn", "rope3d", "rope3d_copies", "kv_cache_write")
    assert {c.name for c in lo.components if c.source == "fake"} == set(provided)
    k_calls = sum(c.calls for c in lo.components if c.name in provided)
    assert k_calls == 6 * WAN.num_layers
    fixed_diff = lo.kernel_calls * (p.kernel_fixed_s.high - p.kernel_fixed_s.low)
    barrier_diff = lo.collectives * (p.collective_barrier_s.high - p.collective_barrier_s.low)
    assert hi.chunk_s - lo.chunk_s == pytest.approx(
        k_calls * (net_hi - net_lo) + fixed_diff + barrier_diff, rel=1e-9
    )


def test_kernel_cost_at_strips_each_ends_fixed_time():
    c = KernelCost(30e-6, 0, 0, {}, "x", 12e-6, 50e-6, 13e-6, "schedule")
    assert c.at("optimistic") == pytest.approx(18e-6)
    assert c.at("pessimistic") == pytest.approx(37e-6)
    with pytest.raises(ValueError, match="end"):
        c.at("middle")
    with pytest.raises(ValueError, match="time_high_s"):
        KernelCost(30e-6, 0, 0, {}, "x", 0.0, 20e-6)


@pytest.fixture(scope="module")
def traced():
    return TracedKernels(max_heads=2)


def test_traced_kernels_priced_by_the_v2_schedule_at_both_ends(traced):
    """TracedKernels = the event-log schedule's profile_range of the same run, flagged "schedule"."""
    from nki_kernels.rope3d import rope3d_kernel

    tokens, heads, d = 256, 2, 128
    x, tab = TensorSpec((1, tokens, heads, d), BF), TensorSpec((tokens, d // 2), "float32")
    _, tr = run(rope3d_kernel, x, x, tab, tab, trace_only=True, keep_events=True)
    lo, hi = profile_range(tr)
    assert lo.model == hi.model == "schedule" and not lo.notes
    c = traced.rope(tokens, heads, d)
    assert c.model == "schedule" and "schedule" in c.source
    assert c.time_s == pytest.approx(lo.latency_ns * 1e-9, rel=1e-12)
    assert c.time_high_s == pytest.approx(hi.latency_ns * 1e-9, rel=1e-12)
    assert c.fixed_s == pytest.approx(Trn2CostParams.low().kernel_fixed_ns * 1e-9)
    assert c.fixed_high_s == pytest.approx(Trn2CostParams.high().kernel_fixed_ns * 1e-9)
    assert c.at("pessimistic") == pytest.approx((hi.latency_ns - hi.fixed_ns) * 1e-9, rel=1e-12)
    assert c.time_high_s >= c.time_s and c.at("pessimistic") >= c.at("optimistic")
    # the bound model (no event log) prices the same trace differently: the flag is not decorative
    _, tr_nolog = run(rope3d_kernel, x, x, tab, tab, trace_only=True)
    assert profile_range(tr_nolog)[0].model == "bound"


def test_traced_attention_high_end_and_head_scaling(traced):
    """Attention with more heads than max_heads is traced at h heads and scaled by heads / h (cost and
    fixed part alike), at both ends, high >= low."""
    lq, lk, d = 128, 512, 128
    two = traced.attention(lq, lk, 2, d)
    four = traced.attention(lq, lk, 4, d)
    assert two.model == four.model == "schedule"
    assert two.time_high_s >= two.time_s > two.fixed_s
    assert four.time_s == pytest.approx(2 * two.time_s, rel=1e-12)
    assert four.at("pessimistic") == pytest.approx(2 * two.at("pessimistic"), rel=1e-12)
    assert four.flops == 4 * lq * lk * 4 * d
    assert "x 2" in four.source
    # the cache hands back the same object for the same shape (the trace runs once per run)
    assert traced.attention(lq, lk, 2, d) is two
    assert math.isclose(two.fixed_high_s, Trn2CostParams.high().kernel_fixed_ns * 1e-9)


def test_traced_matmul_blocks_strip_the_fixed_time_and_carry_both_ends():
    """A linear's blocks run inside one kernel call: each block's time at an end is its v2 schedule
    latency minus the cost model's fixed time of that end, and the linear = blocks x that."""
    from perf.matmul_model import TracedMatmulProvider, linear_profile, matmul_block_kernel

    prov = TracedMatmulProvider()
    b = prov.block(256, 256, 128)
    _, tr = run(
        matmul_block_kernel,
        TensorSpec((256, 256), BF),
        TensorSpec((256, 128), BF),
        trace_only=True,
        keep_events=True,
    )
    lo, hi = profile_range(tr)
    assert b.model == "schedule" and "schedule" in b.source
    assert b.at("optimistic") == pytest.approx((lo.latency_ns - lo.fixed_ns) * 1e-9, rel=1e-12)
    assert b.at("pessimistic") == pytest.approx((hi.latency_ns - hi.fixed_ns) * 1e-9, rel=1e-12)
    assert b.at("pessimistic") >= b.at("optimistic") > 0
    lp = linear_profile("x", 300, 256, 256, prov, block_m=256, block_n=128, end="pessimistic")
    assert lp.blocks == 2 * 2 and lp.block is prov.block(256, 256, 128)
    assert lp.latency_s == pytest.approx(4 * b.at("pessimistic"), rel=1e-12)
    # engine times of each end (the VAE convs use TensorE's): the low / high profile's busy times
    assert lp.engine_busy_s["tensor"] == pytest.approx(4 * hi.engine_busy_ns["tensor"] * 1e-9, rel=1e-12)
    lo_lp = linear_profile("x", 300, 256, 256, prov, block_m=256, block_n=128, end="optimistic")
    assert lo_lp.engine_busy_s["tensor"] == pytest.approx(4 * lo.engine_busy_ns["tensor"] * 1e-9, rel=1e-12)


class _FixedPartBlocks:
    """Matmul blocks of ``net + fixed`` (low end) / ``2 net + fixed_high`` (high end)."""

    name = "fixed-part-blocks"

    def __init__(self, net, fixed, fixed_high):
        self.net, self.fixed, self.fixed_high = net, fixed, fixed_high

    def block(self, block_m, k, block_n):
        from perf.matmul_model import BlockProfile

        return BlockProfile(
            block_m, block_n, k, self.net + self.fixed, {"tensor": self.net}, 0, 2 * block_m * k * block_n, 1,
            "fixed", 2 * self.net + self.fixed_high, self.fixed, self.fixed_high, "schedule",
        )  # fmt: skip


def test_linear_blocks_fixed_time_not_charged_per_block():
    """The chunk's linears pay blocks x (block time - that end's cost-model fixed time)."""
    k = _Kernels(20e-6, 30e-6, 0.0, 0.0)
    p = E2EParams()
    for end in ("optimistic", "pessimistic"):
        cm = p.at("optimistic").comm_model
        kw = dict(cores=8, vae=None, kernels=k, params=p, end=end, comm_model=cm)
        a = chunk_model(WAN, PIPE, matmul=_FixedPartBlocks(1e-6, 0.0, 0.0), **kw)
        b = chunk_model(WAN, PIPE, matmul=_FixedPartBlocks(1e-6, 12.4e-6, 13.3e-6), **kw)
        assert b.chunk_s == pytest.approx(a.chunk_s, rel=1e-12)
        qkv = {c.name: c for c in b.components}["qkv_proj"]
        # TP4xSP2 replicated linears: ceil(28,080 / 8) = 3,510 rows -> 4 M blocks; 4,608 cols -> 9 N blocks
        net = 1e-6 if end == "optimistic" else 2e-6
        assert qkv.time_s == pytest.approx(4 * 9 * net, rel=1e-12)
