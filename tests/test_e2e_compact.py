"""The HBM-best placement's price (perf/e2e/compact.py, the text k/v gather in perf/e2e/overlap.py's layer
program, chunk_model(kv_cache="sp_compact"), the Targets note): bytes counted by hand from the model's
sizes and sharding.kv_shard.TextKVGather's padding, small programs scheduled by hand."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from perf.e2e.chunk import chunk_model
from perf.e2e.compact import text_kv_collective, text_kv_gather_bytes, vae_weight_gather
from perf.e2e.overlap import check_schedule, forward_overlap, layer_program, schedule
from perf.e2e.params import ENDS, E2EParams
from perf.e2e.report_compact import compact_note, text_gather_s
from perf.footprint import footprint
from perf.matmul_model import AnalyticMatmulProvider
from sharding.layer_comm import LayerCollective
from sharding.plan import CommModel
from tests.compile_helpers import BlockTableKernels
from tests.test_e2e_overlap import COLLS, PIPE, TIMES, WAN, _wan

# TIMES of test_e2e_overlap plus a cross-attention (post stage, after o_proj and before ffn_up)
XTIMES = {**TIMES, "cross_attn": 1.0}


def _text(t: float) -> LayerCollective:
    return LayerCollective("text_kv", "world", 0, t, 0, True)


def test_text_bytes_by_hand_and_equal_to_the_footprint():
    """Wan2.1-1.3B on 8 cores: each rank receives 7 shares of 512 / 8 = 64 tokens x 1536 x 2 (k, v) x 2 B
    per layer, 30 layers: 82,575,360 B (82.6 MB) per forward, 7/8 of the footprint's one-layer buffer per
    layer. A prompt that does not split evenly: shares padded to ceil(512 / 3) = 171 tokens."""
    assert (WAN.num_layers, WAN.text_len, WAN.dim) == (30, 512, 1536)
    assert WAN.num_layers * text_kv_gather_bytes(WAN, 8) == 30 * 7 * 64 * 1536 * 2 * 2 == 82_575_360
    fp = footprint(WAN, PIPE, tp=4, sp=2, weights="fsdp", kv_cache="sp_compact")
    buf = fp.item("text_kv_gather_buffer").per_core
    assert WAN.num_layers * text_kv_gather_bytes(WAN, 8) == WAN.num_layers * buf * 7 // 8
    assert text_kv_gather_bytes(WAN, 3) == 2 * 171 * 1536 * 4
    assert text_kv_gather_bytes(WAN, 1) == 0
    cm = CommModel.optimistic()
    c = text_kv_collective(WAN, 8, cm)
    assert (c.role, c.bytes, c.hbm_bytes, c.independent) == ("text_kv", 7 * 64 * 1536 * 4, 2 * c.bytes, True)
    assert c.time_s == cm.all_gather_s(8, c.bytes, False) and c.latency_s == cm.all_gather_s(8, 0, False)
    with pytest.raises(ValueError, match="world must be an int >= 1"):
        text_kv_gather_bytes(WAN, 0)


def test_vae_weight_gather_by_hand():
    cm = CommModel.conservative()
    recv, t = vae_weight_gather(1001, 8, cm)
    assert recv == 2002 - 251  # each rank holds ceil(2002 / 8) bytes and receives the rest
    assert t == cm.all_gather_s(8, recv, False)
    assert vae_weight_gather(1001, 1, cm) == (0, 0.0)
    with pytest.raises(ValueError, match="cores must be an int >= 1"):
        vae_weight_gather(1001, 0, cm)


def test_text_gather_hidden_under_the_attention_by_hand():
    """One layer, the four collectives + a text gather of 2 s: kv_cache [0, 3), qkv_in [3, 4), kv_fresh
    [4, 6), text_kv [6, 8) under RoPE + KV write (it needs no compute of the layer), attention [8, 12),
    out [12, 13), o_proj [13, 14), cross_attn [14, 15) (its text arrived at 8), ffn_up [15, 17): the
    same exposed time (17 - 13 = 4) as without it."""
    sched = schedule(layer_program(XTIMES, (*COLLS, _text(2.0)), 1))
    check_schedule(sched)
    assert (sched.slot("0:text_kv").start, sched.slot("0:text_kv").end) == (6, 8)
    assert sched.under("0:text_kv") == ("0:rope3d", "0:kv_cache_write")
    assert (sched.slot("0:cross_attn").start, sched.makespan_s, sched.exposed_s) == (14, 17, 4)
    assert schedule(layer_program(XTIMES, COLLS, 1)).exposed_s == 4


def test_text_gather_exposed_when_compute_is_short_by_hand():
    """A 10 s text gather [6, 16): 6 s under RoPE, write and attention, then the output all-to-all queues
    behind it on the one CC stream: out [16, 17), o_proj [17, 18), cross_attn [18, 19), ffn_up [19, 21);
    exposed 21 - 13 = 8 (4 more)."""
    sched = schedule(layer_program(XTIMES, (*COLLS, _text(10.0)), 1))
    check_schedule(sched)
    assert sched.slot("0:out").start == 16 and sched.slot("0:cross_attn").start == 18
    assert (sched.hidden_s("0:text_kv"), sched.exposed_s) == (6, 8)


def test_text_gather_alone_waits_for_its_buffer_and_cross_attention_waits_for_it():
    """Only the text gather (12 s), two layers: layer 0's [0, 12) (no deps); cross_attn of layer 0
    waits for it: [12, 13) instead of [10, 11) (2 s exposed). Layer 1's gather needs the one-layer buffer
    layer 0's cross_attn read: [13, 25) though the CC stream is free at 12; layer 1's compute reaches
    cross_attn at 25: no wait. Exposed 2 in all."""
    sched = schedule(layer_program(XTIMES, (_text(12.0),), 2))
    check_schedule(sched)
    assert sched.slot("0:cross_attn").start == 12
    assert sched.slot("1:text_kv").start == sched.slot("0:cross_attn").end == 13
    assert sched.slot("1:cross_attn").start == 25
    assert (sched.makespan_s, sched.compute_s, sched.exposed_s) == (28, 26, 2)
    with pytest.raises(ValueError, match="needs a 'cross_attn' component"):
        layer_program(TIMES, (_text(1.0),), 1)


@pytest.mark.parametrize("end", ENDS)
def test_chunk_prices_the_text_gather_only_for_sp_compact(end: str):
    """Wan2.1-1.3B, 8 cores: the default layout's program has no text gather; the compact one has one per
    layer (82.6 MB per forward), the cache-share gather of a ring one slot shorter (7 of 8 slots), and
    ``text_kv_gather`` = the charge the gather adds to the program without it (rebuilt here from the
    schedule's own compute times); eager: its time, serialised."""
    L = WAN.num_layers
    base = _wan(end)
    assert not any(s.op.name.endswith(":text_kv") for s in base.overlaps[0].sched.slots)
    assert "text_kv_gather" not in base.component_names()
    cm = _wan(end, weights="fsdp", kv_cache="sp_compact")
    assert cm.comm_schedule == "overlap"
    fo = cm.overlaps[0]
    texts = [s for s in fo.sched.slots if s.op.name.endswith(":text_kv")]
    assert [s.op.name for s in texts] == [f"{ly}:text_kv" for ly in range(L)]
    per = {c.role: c for c in fo.collectives}
    assert L * per["text_kv"].bytes == 82_575_360
    dflt = {c.role: c for c in base.overlaps[0].collectives}
    assert per["kv_cache"].bytes * 8 == dflt["kv_cache"].bytes * 7
    times = {s.op.name[2:]: s.op.time_s for s in fo.sched.slots if s.op.name.startswith("0:")}
    times = {n: t for n, t in times.items() if n not in per}
    hbm = cm.params.hbm_Bps_per_core
    without = forward_overlap(
        "f", times, [c for c in fo.collectives if c.role != "text_kv"], L, end=end, hbm_Bps=hbm
    )
    comps = {c.name: c for c in cm.components}
    assert comps["text_kv_gather"].total_s == pytest.approx(
        fo.charge_s - without.charge_s, rel=1e-9, abs=1e-15
    )
    assert comps["sharding_comm"].total_s == pytest.approx(without.exposed_s, rel=1e-9)
    assert (comps["text_kv_gather"].collectives, comps["sharding_comm"].collectives) == (1, 4)
    assert cm.collectives == base.collectives + L + (L - 1) + 2  # text + FSDP gathers (first: 2)
    eager = _wan(end, weights="fsdp", kv_cache="sp_compact", compile_mode="eager_sharded")
    ec = {c.name: c for c in eager.components}
    assert eager.comm_schedule == "serial_split"
    assert ec["text_kv_gather"].total_s == pytest.approx(L * per["text_kv"].time_s, rel=1e-12)
    point = cm.params.at(end)
    assert text_gather_s(cm) == pytest.approx(
        comps["text_kv_gather"].total_s + L * point.collective_barrier_s
    )


def test_chunk_rejects_what_it_does_not_price():
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        _wan("optimistic", kv_cache="replicated")
    with pytest.raises(ValueError, match="'replicated' or 'fsdp'"):
        _wan("optimistic", kv_cache="sp_compact", weights="tp_linear")
    with pytest.raises(ValueError, match="'overlap' or 'serial_split'"):
        _wan("optimistic", kv_cache="sp_compact", comm_schedule="serial_plan")
    with pytest.raises(ValueError, match="vae_weights must be one of"):
        _wan("optimistic", vae_weights="tp")
    prm = E2EParams()
    with pytest.raises(ValueError, match="needs sp > 1"):  # one core: plan TP1xSP1
        chunk_model(
            WAN, PIPE, cores=1, vae=None, kernels=BlockTableKernels(prm), matmul=AnalyticMatmulProvider(),
            params=prm, kv_cache="sp_compact",
        )  # fmt: skip


def test_targets_note_gives_the_placement_fps_at_both_ends():
    chunks = {
        (mode, end): _wan(end, weights="fsdp", kv_cache="sp_compact", compile_mode=mode)
        for mode in ("fullgraph", "eager_sharded")
        for end in ENDS
    }
    r = SimpleNamespace(model=WAN, cores=8, compact=chunks)
    fp = SimpleNamespace(label="bf16, FSDP-sharded DiT + VAE weights, compact KV cache")
    note = compact_note(fp, r)  # type: ignore[arg-type]
    lo, hi = chunks[("fullgraph", "pessimistic")], chunks[("fullgraph", "optimistic")]
    assert "82.6 MB per core per forward" in note
    assert (
        f"streams at {lo.fps:.2f}-{hi.fps:.2f} fps (chunk {lo.chunk_s * 1e3:.1f}-{hi.chunk_s * 1e3:.1f} ms)"
        in note
    )
    assert f"exposes {text_gather_s(lo) * 1e3:.2f}-{text_gather_s(hi) * 1e3:.2f} ms" in note
    elo = chunks[("eager_sharded", "pessimistic")]
    assert f"{elo.fps:.2f}-" in note and "not in the fps rows" not in note
    assert compact_note(SimpleNamespace(label="bf16, weights per core"), r) == ""  # type: ignore[arg-type]
    assert math.isfinite(lo.fps) and lo.fps <= hi.fps
