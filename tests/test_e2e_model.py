"""Tests of the end-to-end performance model (perf/e2e/, perf/footprint.py, perf/matmul_model.py).

All figures under test are *modelled* (arithmetic), so the references are hand calculations.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from perf.e2e import (
    AnalyticKernels,
    ChunkModel,
    Component,
    E2EParams,
    chunk_model,
    main,
    summarize,
)
from perf.footprint import activation_peak_bytes, dit_param_count, footprint, kv_cache_bytes
from perf.matmul_model import AnalyticMatmulProvider, BlockProfile, linear_profile
from rolling_forcing.config import PipelineConfig, get_preset

WAN = get_preset("wan2.1-1.3b")
PIPE = PipelineConfig()


def test_summation_of_known_parts():
    parts = [
        Component("a", "linear", 1e-3, 30, flops=10, per_layer=True),
        Component("b", "attention", 2e-3, 30, flops=20, per_layer=True),
        Component("c", "launch", 150e-6, 1, launches=0),
        Component("d", "vae", 0.1, 1, flops=5),
    ]
    cm = ChunkModel("merged", 8, "TP4xSP2", 4, 2, tuple(parts), 12, E2EParams())
    expected = 30 * 1e-3 + 30 * 2e-3 + 150e-6 + 0.1
    assert cm.chunk_s == pytest.approx(expected, rel=1e-12)
    assert cm.dit_s == pytest.approx(expected - 0.1, rel=1e-12)
    assert sum(summarize(parts).values()) == pytest.approx(expected, rel=1e-12)
    assert cm.flops == 30 * 10 + 30 * 20 + 5
    assert cm.launches == 30 + 30 + 0 + 1
    # fps / MFU / headroom arithmetic
    assert cm.fps == pytest.approx(12 / expected)
    assert cm.mfu == pytest.approx(cm.flops / (expected * 8 * 128 * 128 * 2 * 2.4e9))
    assert cm.headroom(20.0) == pytest.approx(1 - expected / 0.6)


def test_component_rejects_bad_group():
    with pytest.raises(ValueError, match="group"):
        Component("x", "nonsense", 1.0, 1)


def test_kv_cache_hand_calculation():
    # original contiguous 24-frame buffer: 37,440 tokens x 1,536 x 2 B x 2 (k, v) x 30 layers = 6.9 GB
    assert PIPE.buffer_tokens(WAN) == 37_440
    assert kv_cache_bytes(WAN, PIPE, 2) == 37_440 * 1_536 * 2 * 2 * 30
    assert kv_cache_bytes(WAN, PIPE, 2) / 1e9 == pytest.approx(6.90, abs=0.01)
    assert kv_cache_bytes(WAN, PIPE, 1) * 2 == kv_cache_bytes(WAN, PIPE, 2)


def test_dit_params_hand_calculation():
    d, f, layers = 1536, 8960, 30
    per_block = 8 * d * d + 2 * d * f  # dominant weights only (no biases/norms)
    n = dit_param_count(WAN)
    assert per_block * layers < n < per_block * layers * 1.03  # biases, norms, embeddings are < 3 %
    assert 1.3e9 < n < 1.5e9  # "1.3B" model, ~2.6-2.8 GB in bf16


def test_footprint_items_sum_and_sharding():
    fp = footprint(WAN, PIPE, tp=4, sp=2, kv_bytes=2)
    kv = fp.item("kv_cache")
    assert kv.per_chip == kv_cache_bytes(WAN, PIPE, 2)
    assert kv.per_core == math.ceil(kv.per_chip / 8)
    w = fp.item("dit_weights")
    assert w.per_chip == 8 * w.per_core  # replicated per core by default
    assert fp.per_chip == sum(i.per_chip for i in fp.items)
    shared = footprint(WAN, PIPE, tp=4, sp=2, kv_bytes=2, weight_copies=1)
    assert fp.per_chip - shared.per_chip == 7 * w.per_core
    fp8 = footprint(WAN, PIPE, tp=4, sp=2, kv_bytes=1)
    gather = fp.item("kv_gather_buffer").per_chip
    assert fp.per_chip - fp8.per_chip == kv.per_chip // 2 + gather // 2
    with pytest.raises(ValueError, match="tp"):
        footprint(WAN, PIPE, tp=5, sp=1)


# one layer's whole key range of 3 local heads (TP4): 8 slots x 4,680 tokens x 3 x 128 x 2 (k, v) x 2 B
GATHER_TP4 = 37_440 * 3 * 128 * 2 * 2


def test_kv_cache_layouts_hand_calculation():
    """SP-sharded cache (the sharded stream's default) vs replicated within the head group, and the
    per-layer gather buffer, by hand for Wan TP4xSP2 and for a block that SP does not divide."""
    fp = footprint(WAN, PIPE, tp=4, sp=2)
    assert fp.item("kv_cache").per_core == 8 * 2_340 * 3 * 128 * 2 * 30 * 2  # ceil(4,680 / 2) tokens per slot
    g = fp.item("kv_gather_buffer")
    assert (g.per_core, g.per_chip) == (GATHER_TP4, 8 * GATHER_TP4)
    assert (
        footprint(WAN, PIPE, tp=4, sp=2, gather_buffers=2).item("kv_gather_buffer").per_core == 2 * GATHER_TP4
    )
    rep = footprint(WAN, PIPE, tp=4, sp=2, kv_cache="replicated")
    assert rep.item("kv_cache").per_core == 37_440 * 3 * 128 * 2 * 30 * 2
    assert rep.item("kv_cache").per_chip == 2 * kv_cache_bytes(WAN, PIPE, 2)  # x sp
    assert "kv_gather_buffer" not in {i.name for i in rep.items}
    assert "kv_gather_buffer" not in {i.name for i in footprint(WAN, PIPE, tp=4, sp=1).items}
    odd = dataclasses.replace(WAN, latent_height=6, latent_width=10)  # 15 tokens per frame, T = 45
    o = footprint(odd, PIPE, tp=4, sp=2).item("kv_cache")
    assert o.per_core == 8 * 23 * 3 * 128 * 2 * 30 * 2  # the busiest SP rank keeps 23 of 45 tokens
    assert o.per_chip == 8 * 45 * 1536 * 2 * 30 * 2
    for bad in ({"kv_cache": "sharded"}, {"gather_buffers": 0}, {"gather_buffers": True}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            footprint(WAN, PIPE, tp=4, sp=2, **bad)  # type: ignore[arg-type]


def test_activation_peak_hand_calculation():
    a = activation_peak_bytes(WAN, PIPE, 4, 2)
    n = math.ceil(28_080 / 8)
    ffn = 4 * n * 1536 + n * 1536 * 2 + n * 8960 * 2 + n * 1536 * 2
    assert a["ffn"] == ffn
    assert a["peak"] == max(a["ffn"], a["attention"])


def test_analytic_matmul_block_hand_calculation():
    prov = AnalyticMatmulProvider()
    b = prov.block(1024, 1536, 512)
    # 8 token tiles x 12 K tiles matmuls of 512 cycles + as many 64-cycle transposes at 2.4 GHz
    assert b.engine_busy_s["tensor"] == pytest.approx((96 * 512 + 96 * 64) / 2.4e9)
    assert b.flops == 2 * 1024 * 1536 * 512
    assert b.latency_s == pytest.approx(max(b.engine_busy_s.values()) + prov.hw.fixed_s)
    with pytest.raises(ValueError, match="block_n"):
        prov.block(128, 128, 1024)


class _FixedBlocks:
    name = "fixed"

    def block(self, block_m: int, k: int, block_n: int) -> BlockProfile:
        return BlockProfile(
            block_m, block_n, k, 1e-6, {"tensor": 1e-6}, 0, 2 * block_m * k * block_n, 1, "fixed"
        )


def test_linear_profile_scales_blocks():
    lp = linear_profile("x", 3_510, 1_536, 4_608, _FixedBlocks())
    # M: ceil(3510/1024)=4 blocks of 896 rows; N: 4608/512 = 9 blocks
    assert lp.block.block_m == 896
    assert lp.blocks == 4 * 9
    assert lp.latency_s == pytest.approx(36e-6)
    assert lp.flops == 2 * 3_510 * 1_536 * 4_608


def test_merged_vs_two_pass_flops_match_doc():
    params = E2EParams()
    kw = dict(vae=None, kernels=AnalyticKernels(params), matmul=_FixedBlocks(), params=params)
    mg = chunk_model(WAN, PIPE, cores=8, variant="merged", **kw)
    tw = chunk_model(WAN, PIPE, cores=8, variant="two_pass", **kw)
    # dense-FLOP count (docs/e2e_model.md): ~242 TFLOP per chunk for the two forwards at 480x832
    assert tw.dit_flops / 1e12 == pytest.approx(242.4, rel=0.02)
    assert mg.dit_flops == pytest.approx(tw.dit_flops, rel=1e-3)
    assert tw.launches > mg.launches


def test_quick_command_writes_report_at_both_ends(tmp_path, capsys):
    assert main(["--quick", "--analytic", "--no-peer", "--out-dir", str(tmp_path)]) == 0
    report = (tmp_path / "REPORT_quick.md").read_text()
    assert "modelled" in report and "published" in report
    assert (tmp_path / "results" / "e2e_quick.png").stat().st_size > 0
    rows = [json.loads(x) for x in (tmp_path / "results" / "e2e_quick.jsonl").read_text().splitlines()]
    assert {r["kind"] for r in rows} == {"modelled"}
    fps = {r["variant"]: r["fps"] for r in rows if r["op"] == "e2e_chunk"}
    # every headline figure at both ends; the pessimistic end is the slower one
    assert 0 < fps["merged/pessimistic"] < fps["merged/optimistic"]
    out = capsys.readouterr().out
    lo, hi = (f"{fps[f'merged/{e}']:.2f}" for e in ("pessimistic", "optimistic"))
    assert f"merged        {lo}-{hi} fps" in out
    # the targets are printed too, each with met / missed at both ends (the quick model meets them all)
    assert "| >= 20 fps with >= 20% deadline headroom" in out and "| >= 16 fps without FP8" in out
    assert "| HBM <= 11.00 GB in bf16 |" in out and "| HBM <= 8.00 GB with the FP8 KV cache |" in out
    assert "yes / yes |" in out and "| no /" not in out
    # the spread target: its verdict follows the two ends (the quick model's chunk is mostly fixed costs,
    # which the ends price 2-13.3 us apart, so its spread is large)
    spread = [ln for ln in out.splitlines() if ln.startswith("| pessimistic-optimistic spread <= 15%")]
    assert len(spread) == 1
    share = 1 - fps["merged/pessimistic"] / fps["merged/optimistic"]  # (pess. - opt. chunk) / pess. chunk
    assert f"= {share:.1%} of" in spread[0] and spread[0].endswith("| yes |" if share <= 0.15 else "| no |")
    assert [ln for ln in out.splitlines() if ln.endswith("| no |")] == ([] if share <= 0.15 else spread)
    assert "Per-chunk budget" in out


# ---------------------------------------------------------------------------------------------------
# Weight placements (FSDP, TP-sharded linears) and the KV + one-weight-copy floor
# ---------------------------------------------------------------------------------------------------
def _block_params_from_module() -> dict[str, tuple[int, ...]]:
    """Parameter shapes of one real WanBlock (rolling_forcing.model) built on the meta device."""
    import torch

    from rolling_forcing.model import WanBlock

    with torch.device("meta"):
        blk = WanBlock(WAN)
    return {n: tuple(p.shape) for n, p in blk.named_parameters()}


def test_block_param_count_and_gather_bytes_from_module_shapes():
    from perf.e2e import fsdp_gather
    from perf.footprint import dit_block_param_count, dit_block_param_split
    from sharding.plan import CommModel

    shapes = _block_params_from_module()
    n_block = sum(math.prod(s) for s in shapes.values())
    assert dit_block_param_count(WAN) == n_block
    # Megatron split: column-parallel weights+biases (q, k, v of both attentions, FFN up) and row-parallel
    # weights (o of both attentions, FFN down) are split; everything else is replicated.
    col = [f"{a}.{p}.{t}" for a in ("self_attn", "cross_attn") for p in "qkv" for t in ("weight", "bias")]
    col += ["ffn.0.weight", "ffn.0.bias"]
    row = ["self_attn.o.weight", "cross_attn.o.weight", "ffn.2.weight"]
    sharded = sum(math.prod(shapes[k]) for k in col + row)
    assert dit_block_param_split(WAN) == (sharded, n_block - sharded)
    # FSDP: every rank receives the 7/8 of the block's bf16 bytes it does not hold
    cm = CommModel.conservative()
    recv, t, _, _ = fsdp_gather(WAN, 8, cm)
    assert recv == 2 * n_block - math.ceil(2 * n_block / 8)
    assert t == pytest.approx(10e-6 + 7 * 2e-6 + recv / 40.7e9)


def test_fsdp_footprint_hand_calculation():
    from perf.footprint import dit_block_param_count, dit_outside_param_count

    fp = footprint(WAN, PIPE, tp=4, sp=2, kv_bytes=2, weights="fsdp")
    n_par = dit_param_count(WAN)
    assert fp.item("dit_weights").per_core == math.ceil(2 * n_par / 8)
    unit = max(dit_block_param_count(WAN), dit_outside_param_count(WAN)) * 2
    assert unit == sum(math.prod(s) for s in _block_params_from_module().values()) * 2  # block is the larger
    buf = fp.item("weight_gather_buffer")
    assert (buf.per_core, buf.per_chip) == (2 * unit, 16 * unit)
    kv = 37_440 * 1_536 * 2 * 30 * 2
    text = 512 * 1536 * 2 * 30 * 2
    act = activation_peak_bytes(WAN, PIPE, 4, 2)["peak"]
    gather = 8 * GATHER_TP4
    assert fp.per_chip == 8 * math.ceil(2 * n_par / 8) + 16 * unit + kv + gather + 8 * text + 8 * act
    fp8 = footprint(WAN, PIPE, tp=4, sp=2, kv_bytes=1, weights="fsdp")
    assert fp.per_chip - fp8.per_chip == kv // 2 + gather // 2
    with pytest.raises(ValueError, match="weight_copies"):
        footprint(WAN, PIPE, tp=4, sp=2, weights="fsdp", weight_copies=1)
    with pytest.raises(ValueError, match="weights"):
        footprint(WAN, PIPE, tp=4, sp=2, weights="zero")


def test_tp_linear_footprint_hand_calculation():
    from perf.footprint import activation_peak_bytes_tp_linear

    shapes = _block_params_from_module()
    d, f, L = 1536, 8960, 30
    linear = 8 * d * d + 6 * d + 2 * d * f + f  # all weights + column-parallel biases
    repl = sum(math.prod(s) for s in shapes.values()) - linear
    outside = dit_param_count(WAN) - L * sum(math.prod(s) for s in shapes.values())
    per_core = (L * (linear // 4 + repl) + outside) * 2
    fp = footprint(WAN, PIPE, tp=4, sp=2, kv_bytes=2, weights="tp_linear")
    assert fp.item("dit_weights").per_core == per_core
    assert fp.item("text_kv").per_chip == 512 * d * 2 * L * 2 // 4 * 8  # heads / tp per core, x 8 cores
    # activations, FFN phase: residual (fp32, token shard) + gathered input + hidden/4 + partial output
    n, ns = math.ceil(28_080 / 8), 28_080 // 2
    ffn = 4 * n * d + ns * d * 2 + ns * (f // 4) * 2 + ns * d * 2
    a = activation_peak_bytes_tp_linear(WAN, PIPE, 4, 2)
    assert a["ffn"] == ffn
    assert fp.item("activations").per_core == max(a["ffn"], a["attention"])
    kv = 37_440 * d * 2 * L * 2
    gather = 8 * GATHER_TP4
    assert fp.per_chip == 8 * per_core + kv + gather + 8 * fp.item("text_kv").per_core + 8 * a["peak"]


def test_lower_bound_is_kv_plus_one_weight_copy():
    from perf.footprint import lower_bound_footprint

    lb = lower_bound_footprint(WAN, PIPE, cores=8)
    assert lb.per_chip == 37_440 * 1_536 * 2 * 30 * 2 + 2 * dit_param_count(WAN)
    assert lb.per_chip > 9e9  # a 9 GB bf16 budget would be below this floor
    lb8 = lower_bound_footprint(WAN, PIPE, cores=8, kv_bytes=1)
    assert lb8.per_chip == 37_440 * 1_536 * 2 * 30 + 2 * dit_param_count(WAN)


def test_tp_linear_comm_and_fsdp_exposure():
    from perf.e2e import all_reduce_s, tp_linear_comm
    from sharding.plan import CommModel

    cm = CommModel.conservative()
    # ring all-reduce of S bytes in 4 ranks = 2 x all-gather of 3/4 S
    s = 14_040 * 1536 * 2
    assert all_reduce_s(cm, 4, s, False) == pytest.approx(2 * (10e-6 + 3 * 2e-6 + 0.75 * s / 40.7e9))
    assert all_reduce_s(cm, 1, s, False) == 0.0
    moved, t, n = tp_linear_comm(WAN, 28_080, 4, 2, cm)
    assert n == 5
    assert moved == 3 * 2 * (3 * s // 4) + 2 * (3 * 14_040 * 8 // 4) + 2 * (3 * 14_040 * 4 // 4)
    small = all_reduce_s(cm, 4, 14_040 * 8, False) + all_reduce_s(cm, 4, 14_040 * 4, False)
    assert t == pytest.approx(3 * all_reduce_s(cm, 4, s, False) + small)
    # chunk variants: FSDP exposes only what the previous layer's compute cannot hide
    params = E2EParams()
    kw = dict(
        vae=None, kernels=AnalyticKernels(params), matmul=_FixedBlocks(), params=params, end="pessimistic"
    )
    base = chunk_model(WAN, PIPE, cores=8, comm_schedule="serial_plan", **kw)  # FSDP's comm charge
    fs = chunk_model(WAN, PIPE, cores=8, weights="fsdp", **kw)
    extra = {c.name: c for c in fs.components if c.group == "weight_comm"}
    layer_s = sum(c.time_s for c in base.components if c.per_layer)
    from perf.e2e import fsdp_gather

    assert base.params.at("pessimistic").comm_model == cm  # the pessimistic end uses the conservative line

    _, g_blk, _, g_out = fsdp_gather(WAN, 8, cm)
    assert extra["weight_gather_first"].total_s == pytest.approx(g_blk + g_out)
    assert extra["weight_gather_exposed"].time_s == pytest.approx(max(0.0, g_blk - layer_s))
    assert extra["weight_gather_exposed"].calls == 29
    # the gathers are collectives too: 2 once + 1 per later layer, each behind a barrier
    assert fs.collectives == base.collectives + 2 + 29
    barrier = params.collective_barrier_s.high * 31
    assert fs.chunk_s == pytest.approx(base.chunk_s + sum(c.total_s for c in extra.values()) + barrier)
    tpl = chunk_model(WAN, PIPE, cores=8, weights="tp_linear", **kw)
    assert tpl.dit_flops == base.dit_flops  # same useful work, different placement
    with pytest.raises(ValueError, match="weights"):
        chunk_model(WAN, PIPE, cores=8, weights="zero", **kw)


# ---------------------------------------------------------------------------------------------------
# End-to-end accounting: NEFF launches, per-kernel fixed cost, barriers, port contention
# ---------------------------------------------------------------------------------------------------
def _analytic_kw(params: E2EParams | None = None, **extra):
    params = params or E2EParams()
    return dict(vae=None, kernels=AnalyticKernels(params), matmul=_FixedBlocks(), params=params, **extra)


def test_ranges_and_ends():
    from perf.e2e import Range

    p = E2EParams()
    assert p.kernel_fixed_s.at("optimistic") == 2e-6
    assert p.kernel_fixed_s.at("pessimistic") == pytest.approx(13.3e-6, rel=1e-12)
    assert (
        p.collective_barrier_s.at("optimistic") == 2e-6 and p.collective_barrier_s.at("pessimistic") == 31e-6
    )
    assert p.neff_launch_s == pytest.approx(71e-6 + 43e-6 + 31e-6)  # measured: submit + host + hw barrier
    assert set(p.ranges()) == {"kernel_fixed_s", "collective_barrier_s", "vector_gpsimd_contention"}
    assert p.at("optimistic").comm_model.name == "optimistic"
    assert p.at("pessimistic").comm_model.name == "conservative"
    with pytest.raises(ValueError, match="end"):
        p.at("middle")
    with pytest.raises(ValueError, match="low <= high"):
        Range(2.0, 1.0, "x")


def test_neff_count_rules():
    from perf.e2e import neffs_per_chunk

    # fullgraph: 1 graph per forward + 1 sampler graph per forward + 1 VAE decode per chunk
    assert neffs_per_chunk("fullgraph", forwards=1, collectives=91).neffs == 3
    assert neffs_per_chunk("fullgraph", forwards=2, collectives=181).neffs == 5
    # eager sharded: C host collectives cut F forwards into C + F graphs, plus C collective launches
    assert neffs_per_chunk("eager_sharded", forwards=1, collectives=91).neffs == (91 + 1) + 91 + 1 + 1
    assert neffs_per_chunk("eager_sharded", forwards=1, collectives=0).neffs == 3  # one core: as fullgraph
    assert neffs_per_chunk("peer", forwards=2, peer_neffs_per_forward=370).neffs == 740
    with pytest.raises(ValueError, match="peer_neffs_per_forward"):
        neffs_per_chunk("peer", forwards=1)
    with pytest.raises(ValueError, match="mode"):
        neffs_per_chunk("lazy", forwards=1)
    with pytest.raises(ValueError, match="forwards"):
        neffs_per_chunk("fullgraph", forwards=0)


_LAYER_COMPONENTS = (
    # 6 per-layer linears (Wan block: fused QKV, O, cross Q, cross O, FFN up, FFN down)
    "qkv_proj", "o_proj", "cross_q_proj", "cross_o_proj", "ffn_up", "ffn_down",
    "cross_attn", "rope3d",
    # 9 elementwise passes: 2 adaLN norm+modulate, 1 affine norm3, 2 RMSNorms, 2 gated residuals,
    # 1 plain residual, 1 GELU
    "adaln_norm1_mod", "rmsnorm_qk", "gate_residual_sa", "norm3_affine", "rmsnorm_cross_q",
    "residual_cross", "adaln_norm2_mod", "gelu_tanh", "gate_residual_ffn",
)  # fmt: skip


def test_chunk_component_set_and_launch_count_pinned():
    """The component set and the kernel-call / collective / NEFF counts, from an independent count."""
    L = WAN.num_layers
    mg = chunk_model(WAN, PIPE, cores=8, **_analytic_kw())
    expected = {"patch_embed", "head_proj", "attn_update", "attn_denoise", "kv_cache_write", "sharding_comm"}
    expected |= set(_LAYER_COMPONENTS) | {"head_gather", "kernel_fixed", "collective_barrier", "neff_launch"}
    expected |= {"rope3d_copies"}  # the merged forward ropes the sink's copy in a RoPE call of its own
    expected |= {"comm_contention"}  # the hidden collectives' DMA/HBM contention (perf/e2e/overlap.py)
    assert set(mg.component_names()) == expected
    assert len(mg.component_names()) == len(expected)  # no duplicate
    # + update and denoise attention + KV write + the sink copy's RoPE
    per_layer_kernels = len(_LAYER_COMPONENTS) + 2 + 1 + 1
    assert mg.kernel_calls == L * per_layer_kernels + 2  # + patch embed and head
    # TP4 x SP2: all-to-all + inverse all-to-all in the TP group, the new K/V's all-gather and the cached
    # share's all-gather in the SP group, per layer; one all-gather of the head output per forward
    assert mg.collectives == L * 4 + 1
    assert mg.neffs == 2  # one forward graph + the sampler graph (no VAE in this chunk)
    fixed = {c.name: c for c in mg.components}
    assert fixed["kernel_fixed"].calls == mg.kernel_calls
    assert fixed["collective_barrier"].calls == mg.collectives
    assert fixed["neff_launch"].calls == 2
    # two-pass: denoise forward (no KV write) + update forward (KV write, no head gather)
    tw = chunk_model(WAN, PIPE, cores=8, variant="two_pass", **_analytic_kw())
    assert tw.kernel_calls == (L * (len(_LAYER_COMPONENTS) + 1) + 2) + (L * (len(_LAYER_COMPONENTS) + 2) + 2)
    assert tw.collectives == 2 * L * 4 + 1
    assert tw.neffs == 4
    # one core: no collectives at all
    one = chunk_model(WAN, PIPE, cores=1, **_analytic_kw())
    assert one.collectives == 0 and "head_gather" not in one.component_names()
    # the sharded stream as it runs today: every host collective cuts the graph
    eager = chunk_model(WAN, PIPE, cores=8, compile_mode="eager_sharded", **_analytic_kw())
    assert eager.neffs == (L * 4 + 1 + 1) + (L * 4 + 1) + 1
    assert eager.comm_schedule == "serial_split"  # host collectives: nothing overlaps
    serial = chunk_model(WAN, PIPE, cores=8, comm_schedule="serial_split", **_analytic_kw())
    assert eager.chunk_s - serial.chunk_s == pytest.approx((eager.neffs - mg.neffs) * 145e-6)


def test_kernel_fixed_cost_per_call_and_barrier_per_collective():
    lo = chunk_model(
        WAN, PIPE, cores=8, end="optimistic", **_analytic_kw(comm_model=None, comm_schedule="serial_split")
    )
    hi = chunk_model(
        WAN,
        PIPE,
        cores=8,
        end="pessimistic",
        **_analytic_kw(comm_model=lo.params.at("optimistic").comm_model, comm_schedule="serial_split"),
    )
    # same collective model at both ends here, so the ends differ only by the fixed costs and barriers
    assert hi.time(["kernel_fixed"]) == pytest.approx(hi.kernel_calls * 13.3e-6)
    assert lo.time(["kernel_fixed"]) == pytest.approx(lo.kernel_calls * 2e-6)
    assert hi.time(["barrier"]) == pytest.approx(hi.collectives * 31e-6)
    diff = hi.kernel_calls * (13.3e-6 - 2e-6) + hi.collectives * (31e-6 - 2e-6)
    assert hi.chunk_s - lo.chunk_s == pytest.approx(diff, rel=1e-9)
    assert hi.time(["launch"]) == pytest.approx(2 * 145e-6)


class _FixedKernels:
    """Every kernel costs ``t`` of which ``fixed`` is a per-kernel fixed part."""

    name = "fixed"

    def __init__(self, t: float, fixed: float, busy: dict | None = None):
        self.t, self.fixed, self.busy = t, fixed, busy or {}

    def _c(self):
        from perf.e2e import KernelCost

        return KernelCost(self.t, 0, 0, dict(self.busy), "fixed", self.fixed)

    def attention(self, lq, lk, heads, head_dim):
        return self._c()

    rope = kv_write = lambda self, tokens, heads, head_dim: self._c()  # noqa: E731


def test_provider_fixed_time_is_not_charged_twice():
    p = E2EParams()
    a = chunk_model(
        WAN, PIPE, cores=8, vae=None, kernels=_FixedKernels(50e-6, 0.0), matmul=_FixedBlocks(), params=p
    )
    b = chunk_model(
        WAN, PIPE, cores=8, vae=None, kernels=_FixedKernels(62e-6, 12e-6), matmul=_FixedBlocks(), params=p
    )
    assert a.chunk_s == pytest.approx(b.chunk_s, rel=1e-12)
    att = {c.name: c.time_s for c in b.components}
    assert att["attn_denoise"] == pytest.approx(50e-6)


def test_vector_gpsimd_contention():
    from perf.e2e.components import contended_s

    p = E2EParams()
    k = _FixedKernels(3.5e-6, 0.0, {"vector": 3e-6, "gpsimd": 2e-6, "tensor": 1e-6})._c()
    assert contended_s(k, p.at("optimistic")) == pytest.approx(3.5e-6)  # engines overlap: the latency
    assert contended_s(k, p.at("pessimistic")) == pytest.approx(5e-6)  # shared port: 3 + 2 serialised
    one = _FixedKernels(3.5e-6, 0.0, {"vector": 3e-6})._c()
    assert contended_s(one, p.at("pessimistic")) == pytest.approx(3.5e-6)  # VectorE alone: no contention


def test_vae_conv_flops_count_every_frame():
    """Conv FLOPs of the VAE decode of 3 steady latent frames at 480x832, independently from the shapes."""
    from perf.e2e import vae_components, vae_conv_flops
    from perf.footprint import vae_probe

    probe = vae_probe(60, 104, 3)
    ref = 0
    for r in probe.steady:
        if r.kind == "WanCausalConv3d":  # [B, C, T, H, W]: positions B x T x H x W
            b, _, t, h, w = r.out_shape
            cout, cin, kt, kh, kw = r.weight_shape
            ref += 2 * (b * t * h * w) * cin * (kt * kh * kw) * cout
        elif r.kind == "Conv2d":  # frames folded into the batch: [B*T, C, H, W]
            bt, _, h, w = r.out_shape
            cout, cin, kh, kw = r.weight_shape
            ref += 2 * (bt * h * w) * cin * (kh * kw) * cout
    assert vae_conv_flops(probe.steady) == ref
    comps = {c.name: c for c in vae_components(probe, probe.steady, 8, _FixedBlocks(), E2EParams(), "s")}
    assert comps["vae_convs_s"].flops == ref
    # the Conv2d upsampling convs carry 2 and 4 frames in their batch: dropping it loses ~2.5 TFLOP
    dropped = sum(
        2 * (r.out_shape[0] - 1) * r.out_shape[2] * r.out_shape[3] * math.prod(r.weight_shape)
        for r in probe.steady
        if r.kind == "Conv2d"
    )
    assert dropped / 1e12 == pytest.approx(2.5, abs=0.2)


def test_peer_model_uses_its_launch_count_and_reports_the_ratio():
    from perf.e2e.peer import PEER_CONFIGS, measured_for
    from perf.e2e.report import calibration_verdict, peer_table
    from perf.e2e.run import PeerRow

    cfg = PEER_CONFIGS[0]
    assert (cfg.height, cfg.width, cfg.cores, cfg.variant, cfg.plan) == (480, 832, 8, "merged", "TP4xSP2")
    meas = measured_for(cfg)
    assert meas is not None and (meas.fps, meas.fps_low, meas.fps_high) == (8.1, 7.8, 8.6)
    chunks = {
        e: chunk_model(WAN, PIPE, cores=8, end=e, weights="tp_linear", compile_mode="peer", **_analytic_kw())
        for e in ("optimistic", "pessimistic")
    }
    assert chunks["optimistic"].neffs == 370
    assert chunks["pessimistic"].time(["launch"]) == pytest.approx(370 * 145e-6)
    row = PeerRow(cfg, chunks, meas)
    assert row.ratio("pessimistic") == pytest.approx(chunks["pessimistic"].fps / 8.1)
    text = "\n".join(peer_table([row])) + calibration_verdict([row])
    assert f"x{row.ratio('pessimistic'):.2f}, x{row.ratio('optimistic'):.2f}" in text
    assert f"{chunks['pessimistic'].fps:.2f}-{chunks['optimistic'].fps:.2f}" in text
    two = [c for c in PEER_CONFIGS if c.variant == "two_pass"]
    assert two and all(measured_for(c) is None for c in two)  # the peer measured its merged forward only
    assert {(c.height, c.width, c.cores) for c in PEER_CONFIGS} == {
        (480, 832, 8), (480, 640, 8), (480, 832, 16), (480, 640, 16)
    }  # fmt: skip


@pytest.mark.slow
def test_bench_e2e_cli_prints_peer_comparison(tmp_path):
    from typer.testing import CliRunner

    from nki_ardiff.cli import app

    r = CliRunner().invoke(app, ["bench", "e2e", "--quick", "--analytic", "--out-dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert "End-to-end calibration (peer, 480x832" in r.output
    assert "predicted/measured" in r.output and "pessimistic-optimistic" in r.output
