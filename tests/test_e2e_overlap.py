"""The overlap-aware critical path of the sharded forward (perf/e2e/overlap.py) and the collectives it
schedules (sharding/layer_comm.py): a small program scheduled by hand, the code's bytes counted by hand,
and on the real Wan program no collective runs under compute that depends on it or that it depends on
(the dependencies written out here from sharding.attention.sharded_attention's data flow)."""

from __future__ import annotations

import pytest

from perf.e2e.chunk import chunk_model
from perf.e2e.overlap import (
    Op,
    Schedule,
    Slot,
    check_schedule,
    forward_overlap,
    layer_program,
    schedule,
)
from perf.e2e.params import ENDS, E2EParams
from perf.matmul_model import AnalyticMatmulProvider
from rolling_forcing.config import PipelineConfig, get_preset
from sharding.layer_comm import LayerCollective, layer_collectives
from sharding.plan import AttentionShape, CommModel, plan
from tests.compile_helpers import BlockTableKernels

# a small layer: seconds per layer of each compute component, and the four collectives
TIMES = {"qkv_proj": 2.0, "rmsnorm_qk": 1.0, "rope3d": 1.0, "kv_cache_write": 1.0, "attn_merged": 4.0}
TIMES |= {"o_proj": 1.0, "ffn_up": 2.0}
COLLS = (
    LayerCollective("kv_cache", "sp", 0, 3.0, 2, True),
    LayerCollective("qkv_in", "tp", 0, 1.0, 10, False),
    LayerCollective("kv_fresh", "sp", 0, 2.0, 10, False),
    LayerCollective("out", "tp", 0, 1.0, 10, False),
)


def test_two_layers_scheduled_by_hand():
    """Layer 0: the cache gather [0, 3) under qkv_proj + rmsnorm; qkv_in [3, 4), kv_fresh [4, 6): compute
    waits 3; rope [6, 7), write [7, 8), attention [8, 12); out [12, 13): compute waits 1; o_proj [13, 14),
    ffn_up [14, 16). Layer 1: its cache gather waits for the buffer (layer 0's attention, 12) and the CC
    stream (out, 13): [13, 16) under o_proj + ffn_up of layer 0; then the same waits: 3 + 1. Makespan 32,
    compute 2 x 12 = 24, exposed 8; serial 2 x 7 = 14."""
    sched = schedule(layer_program(TIMES, COLLS, 2))
    check_schedule(sched)
    want = {
        "0:kv_cache": (0, 3), "0:qkv_proj": (0, 2), "0:rmsnorm_qk": (2, 3), "0:qkv_in": (3, 4),
        "0:kv_fresh": (4, 6), "0:rope3d": (6, 7), "0:kv_cache_write": (7, 8), "0:attn_merged": (8, 12),
        "0:out": (12, 13), "0:o_proj": (13, 14), "0:ffn_up": (14, 16), "1:kv_cache": (13, 16),
        "1:qkv_proj": (16, 18), "1:rmsnorm_qk": (18, 19), "1:qkv_in": (19, 20), "1:kv_fresh": (20, 22),
        "1:rope3d": (22, 23), "1:kv_cache_write": (23, 24), "1:attn_merged": (24, 28), "1:out": (28, 29),
        "1:o_proj": (29, 30), "1:ffn_up": (30, 32),
    }  # fmt: skip
    assert {s.op.name: (s.start, s.end) for s in sched.slots} == want
    assert (sched.makespan_s, sched.compute_s, sched.exposed_s, sched.comm_s) == (32, 24, 8, 14)
    assert sched.under("0:kv_cache") == ("0:qkv_proj", "0:rmsnorm_qk")
    assert sched.under("1:kv_cache") == ("0:o_proj", "0:ffn_up")
    assert sched.hidden_s("1:kv_cache") == 3 and sched.hidden_s("1:kv_fresh") == 0
    # contention: only the cache gathers run under compute, wholly: 2 x (3/3) x 2 B / (1 B/s) x factor
    assert sched.contention_s(1.0, 1.0) == 4 and sched.contention_s(0.5, 1.0) == 2
    fo = forward_overlap("f", TIMES, COLLS, 2, end="pessimistic", hbm_Bps=1.0)
    assert (fo.exposed_s, fo.contention_s, fo.charge_s, fo.serial_s) == (8, 4, 12, 14)
    assert forward_overlap("f", TIMES, COLLS, 2, end="optimistic", hbm_Bps=1.0).charge_s == 8


def test_a_long_cache_gather_delays_the_stream_behind_it():
    """A cache gather longer than the compute before the layer's projection is done: qkv_in queues behind
    it on the one CC stream. Layer 0: kv_cache [0, 10), qkv_in [10, 11), kv_fresh [11, 13); rope [13, 14)
    ... attention [15, 19), out [19, 20), post [20, 23): exposed 23 - 12 = 11 for one layer."""
    colls = (LayerCollective("kv_cache", "sp", 0, 10.0, 0, True), *COLLS[1:])
    sched = schedule(layer_program(TIMES, colls, 1))
    assert sched.slot("0:qkv_in").start == 10 and sched.slot("0:attn_merged").start == 15
    assert sched.exposed_s == 11
    # with the cache gather alone on the stream, its first reader (the KV write) still waits for it
    only = schedule(layer_program(TIMES, colls[:1], 1))
    assert only.slot("0:rope3d").start == 3 and only.slot("0:kv_cache_write").start == 10
    assert only.exposed_s == 10 - 4
    # two buffers change nothing here: the stream's order already puts the gather after the release
    two = schedule(layer_program(TIMES, COLLS, 3, gather_buffers=2))
    assert two.exposed_s == schedule(layer_program(TIMES, COLLS, 3)).exposed_s == 12


def test_token_sub_blocks_estimate_by_hand():
    """``pieces=2`` (not built): projection + norm, attention and o_proj in halves, each projection-bound
    collective in halves (no latency here; the output all-to-all 2 s whole). One layer: kv_cache [0, 3)
    holds the stream, so qkv_in#0 [3, 3.5), kv_fresh#0 [3.5, 4.5), qkv_in#1 [4.5, 5), kv_fresh#1 [5, 6);
    rope [6, 7), write [7, 8), attention halves [8, 10) and [10, 12); out#0 [10, 11) under the second
    half, out#1 [12, 13); o_proj#0 [12, 12.5), o_proj#1 waits for out#1: [13, 13.5); ffn_up [13.5, 15.5):
    exposed 3.5 (whole: 5)."""
    colls = (*COLLS[:3], LayerCollective("out", "tp", 0, 2.0, 10, False))
    sched = schedule(layer_program(TIMES, colls, 1, pieces=2))
    check_schedule(sched)
    got = {s.op.name: (s.start, s.end) for s in sched.slots}
    assert got["0:qkv_proj#1"] == (1.5, 2.5) and got["0:rmsnorm_qk#1"] == (2.5, 3)
    assert [got[f"0:{n}"] for n in ("qkv_in#0", "kv_fresh#0", "qkv_in#1", "kv_fresh#1")] == [
        (3, 3.5), (3.5, 4.5), (4.5, 5), (5, 6)
    ]  # fmt: skip
    assert got["0:rope3d"] == (6, 7) and got["0:attn_merged#1"] == (10, 12)
    assert got["0:out#0"] == (10, 11) and sched.under("0:out#0") == ("0:attn_merged#1",)
    assert got["0:o_proj#0"] == (12, 12.5) and got["0:o_proj#1"] == (13, 13.5)
    assert got["0:ffn_up"] == (13.5, 15.5)
    assert sched.exposed_s == 3.5 and schedule(layer_program(TIMES, colls, 1)).exposed_s == 5
    # a split collective pays its whole latency per part: 0.25 + (1 - 0.25) / 2
    lat = (COLLS[0], LayerCollective("qkv_in", "tp", 0, 1.0, 10, False, 0.25), *COLLS[2:])
    two = schedule(layer_program(TIMES, lat, 1, pieces=2))
    assert two.slot("0:qkv_in#0").op.time_s == 0.625 and two.slot("0:qkv_in#1").op.time_s == 0.625
    with pytest.raises(ValueError, match="pieces"):
        layer_program(TIMES, COLLS, 1, pieces=0)


def test_schedule_rejects_bad_programs_and_check_catches_overlaps():
    with pytest.raises(ValueError, match="duplicate"):
        schedule([Op("a", "compute", 1.0), Op("a", "comm", 1.0)])
    with pytest.raises(ValueError, match="unknown"):
        schedule([Op("a", "compute", 1.0, ("b",))])
    with pytest.raises(ValueError, match="deadlock"):  # compute's first op needs comm's second
        schedule([Op("a", "compute", 1.0, ("d",)), Op("c", "comm", 1.0, ("a",)), Op("d", "comm", 1.0)])
    with pytest.raises(ValueError, match="engine"):
        Op("a", "dma", 1.0)
    with pytest.raises(ValueError, match="layers"):
        layer_program(TIMES, COLLS, 0)
    with pytest.raises(ValueError, match="pre-attention"):
        layer_program({"o_proj": 1.0}, COLLS, 1)
    a, b = Op("a", "comm", 2.0), Op("b", "compute", 1.0, ("a",))
    with pytest.raises(AssertionError, match="before its dep"):
        check_schedule(Schedule((Slot(a, 0.0, 2.0), Slot(b, 1.0, 2.0))))
    with pytest.raises(AssertionError, match="overlap on compute"):
        c, d = Op("c", "compute", 2.0), Op("d", "compute", 1.0)
        check_schedule(Schedule((Slot(a, 0.0, 2.0), Slot(c, 0.0, 2.0), Slot(d, 1.5, 2.5))))


def test_layer_collectives_bytes_by_hand():
    """Wan2.1-1.3B merged forward (28,080 tokens), TP4xSP2, 3 heads x 128 per core, bf16; the cache:
    8 slots x 4,680 tokens, 2,340 per SP rank. The code's tensors: share [2, 1, 8, 2340, 3, 128] from the
    other SP rank; q, k, v of 3,510 tokens to 3 other TP ranks; k, v of the SP shard (4 x 3,510 tokens)
    from the other SP rank; the output of 3,510 tokens to 3 other TP ranks."""
    pl = plan(12, 8, shape=AttentionShape(28_080, 32_760))
    got = layer_collectives(pl, tokens=28_080, cache_slots=8, tokens_per_block=4_680)
    row = 3 * 128 * 2
    assert [c.role for c in got] == ["kv_cache", "qkv_in", "kv_fresh", "out"]
    assert [c.bytes for c in got] == [
        2 * 8 * 2_340 * row,
        3 * 3 * 3_510 * row,
        2 * 14_040 * row,
        3 * 3_510 * row,
    ]
    assert [c.independent for c in got] == [True, False, False, False]
    m = CommModel()
    assert got[0].time_s == pytest.approx(10e-6 + 2e-6 + got[0].bytes / 40.7e9, rel=1e-12)
    assert got[1].time_s == pytest.approx(10e-6 + 2e-6 + got[1].bytes / 40.7e9, rel=1e-12)
    assert all(c.hbm_bytes == 2 * c.bytes for c in got) and pl.model == m
    # uneven tokens (10 over 4 ranks: 3, 3, 2, 2; SP shards 6 and 4) and a block of 5 (shares 3 + 2)
    small = plan(4, 4, tp=2, shape=AttentionShape(10, 10, 8, 2))
    b = {c.role: c.bytes for c in layer_collectives(small, tokens=10, cache_slots=2, tokens_per_block=5)}
    assert b == {"kv_cache": 2 * 2 * 3 * 16 * 2, "qkv_in": 3 * 3 * 32, "kv_fresh": 2 * 6 * 32, "out": 3 * 32}
    rep = layer_collectives(small, tokens=10, cache_slots=2, tokens_per_block=5, kv_cache="replicated")
    assert [c.role for c in rep] == ["qkv_in", "kv_fresh", "out"]
    ulysses = layer_collectives(plan(4, 4, tp=4), tokens=10, cache_slots=2, tokens_per_block=5)
    assert [c.role for c in ulysses] == ["qkv_in", "out"]
    with pytest.raises(ValueError, match="tokens"):
        layer_collectives(small, tokens=0, cache_slots=2, tokens_per_block=5)
    with pytest.raises(ValueError, match="kv_cache"):
        layer_collectives(small, tokens=10, cache_slots=2, tokens_per_block=5, kv_cache="x")


WAN = get_preset("wan2.1-1.3b")
PIPE = PipelineConfig(dtype="bfloat16")


def _wan(end: str, **kw):
    prm = E2EParams()
    return chunk_model(
        WAN, PIPE, cores=8, vae=None, kernels=BlockTableKernels(prm), matmul=AnalyticMatmulProvider(),
        params=prm, end=end, **kw,
    )  # fmt: skip


# the merged forward's data flow (sharding.attention.sharded_attention + RankStream._merged_attn's local
# step), written out independently of perf/e2e/overlap.py: what runs before a layer's projection-bound
# collectives, and what runs after its output all-to-all
BEFORE_QKV_IN = ("gate_residual_ffn+adaln_norm1_mod", "adaln_norm1_mod", "qkv_proj", "rmsnorm_qk")
AFTER_OUT: tuple[str, ...] = (
    "o_proj",
    "gate_residual_sa",
    "norm3_affine",
    "cross_q_proj",
    "rmsnorm_cross_q",
    "cross_attn",
)
AFTER_OUT += ("cross_o_proj", "residual_cross", "adaln_norm2_mod", "ffn_up", "gelu_tanh", "ffn_down")
AFTER_OUT += ("gate_residual_ffn", "gate_residual_sa+norm3_affine", "residual_cross+adaln_norm2_mod")


@pytest.mark.parametrize("end", ENDS)
def test_no_collective_hides_behind_compute_it_feeds_or_needs(end: str):
    """On the Wan merged forward: the all-to-alls and the new keys' gather run under no compute (all that
    precedes them feeds them, all that follows needs them); the cache share's gather of layer l runs only
    under layer l-1's work after its output all-to-all and layer l's work before the RoPE that waits for
    the new keys (it needs neither, and layer l's KV write needs it)."""
    cm = _wan(end)
    fo = cm.overlaps[0]
    sched = fo.sched
    check_schedule(sched)
    L = WAN.num_layers
    hidden = 0.0
    for ly in range(L):
        for role in ("qkv_in", "kv_fresh", "out"):
            assert sched.under(f"{ly}:{role}") == (), (ly, role)
        allowed = {f"{ly - 1}:{n}" for n in AFTER_OUT} | {f"{ly}:{n}" for n in BEFORE_QKV_IN}
        under = set(sched.under(f"{ly}:kv_cache"))
        assert under <= allowed, under - allowed
        hidden += sched.hidden_s(f"{ly}:kv_cache")
        # the KV write, the first reader of the gathered cache, starts after it
        assert sched.slot(f"{ly}:kv_cache_write").start >= sched.slot(f"{ly}:kv_cache").end
    # here every cache gather is hidden whole, so the exposed time is the other three, serialised
    per = {c.role: c.time_s for c in fo.collectives}
    assert hidden == pytest.approx(L * per["kv_cache"], rel=1e-9)
    assert fo.exposed_s == pytest.approx(L * (per["qkv_in"] + per["kv_fresh"] + per["out"]), rel=1e-9)


def test_chunk_charges_and_alternatives_are_consistent():
    """``sharding_comm`` x layers is the exposed time, ``comm_contention`` the contention; the chunk under
    another schedule (``chunk_s_under``) equals the chunk model run with that schedule."""
    L = WAN.num_layers
    for end in ENDS:
        cm = _wan(end)
        comps = {c.name: c for c in cm.components}
        fo = cm.overlaps[0]
        assert cm.comm_schedule == "overlap"
        assert comps["sharding_comm"].total_s == pytest.approx(fo.exposed_s, rel=1e-12)
        assert comps["comm_contention"].total_s == pytest.approx(fo.contention_s, rel=1e-12)
        assert comps["sharding_comm"].collectives == 4
        assert (comps["comm_contention"].total_s == 0) == (end == "optimistic")
        for other in ("serial_split", "serial_plan"):
            assert cm.chunk_s_under(other) == pytest.approx(_wan(end, comm_schedule=other).chunk_s, rel=1e-12)
        assert cm.comm_alternative("serial_plan").collectives == 3 * L
        # the sub-block estimate: 3 more parts of each projection-bound collective, 3 more calls of each
        # split kernel (qkv_proj, rmsnorm_qk, attention, o_proj: one launch each with this provider)
        est = cm.comm_alternative("overlap_sub4")
        assert (est.collectives, est.extra_kernel_calls) == ((4 + 3 * 3) * L, 3 * 4 * L)
        point = cm.params.at(end)
        want = cm.chunk_s - cm.comm_alternative("overlap").comm_s + est.comm_s
        want += 9 * L * point.collective_barrier_s + 12 * L * point.kernel_fixed_s
        assert cm.chunk_s_under("overlap_sub4") == pytest.approx(want, rel=1e-12)
        assert cm.comm_alternative("overlap").comm_s < cm.comm_alternative("serial_split").comm_s
    with pytest.raises(ValueError, match="comm_schedule"):
        _wan("optimistic", comm_schedule="hidden")
    with pytest.raises(ValueError, match="replicated"):
        _wan("optimistic", comm_schedule="overlap", weights="fsdp")


def test_report_section_lists_what_overlaps_and_what_waits():
    from perf.e2e.report_overlap import overlap_lines

    lo, hi = _wan("pessimistic"), _wan("optimistic")
    text = "\n".join(overlap_lines(lo, hi))
    assert "## Per-layer critical path" in text
    # the headline row (bold) is the chunk as modelled; the other two are the serialised alternatives
    assert f"**{lo.chunk_s * 1e3:,.2f}-{hi.chunk_s * 1e3:,.2f}**" in text
    for s in ("serial_split", "serial_plan"):
        assert f"{lo.chunk_s_under(s) * 1e3:,.2f}-{hi.chunk_s_under(s) * 1e3:,.2f}" in text
    rows = {r.split("|")[1].strip(): r for r in text.splitlines() if r.startswith("| ") and "comm |" in r}
    assert set(rows) == {"kv_cache", "qkv_in", "kv_fresh", "out"}
    assert "under 0:o_proj" in rows["kv_cache"] and "hidden 0 of" in rows["qkv_in"]
    waits = [r for r in text.splitlines() if r.startswith("| rope3d |")]
    assert len(waits) == 1 and "waits" in waits[0] and "1:kv_fresh" in waits[0]
    prm = E2EParams()
    one = chunk_model(
        WAN, PIPE, cores=1, vae=None, kernels=BlockTableKernels(prm), matmul=AnalyticMatmulProvider(),
        params=prm,
    )  # fmt: skip
    assert one.overlaps == () and overlap_lines(one, one) == []  # one core: no collectives, no section
