"""The per-linear FSDP gathers priced in the chunk model (perf/e2e/weights.py, chunk_model(gather_unit=
"linear")): parameter counts by hand from Wan2.1-1.3B's shapes, the double-buffered prefetch scheduled by
hand on small programs, the chunk's collectives / barriers / launches counted from the plan."""

from __future__ import annotations

import pytest

from perf.e2e.components import Component
from perf.e2e.params import ENDS
from perf.e2e.weights import (
    LINEAR_UNITS,
    fsdp_linear_components,
    linear_gather_units,
    linear_prefetch_exposed,
    outside_gather_units,
    params_gather,
)
from perf.footprint import dit_block_param_count, dit_outside_param_count
from sharding.plan import CommModel
from tests.test_e2e_overlap import WAN, _wan

D, F = 1536, 8960


def test_units_by_hand():
    """Per layer: q,k,v + norms + modulation 3 (d^2 + d) + 8d, o d^2 + d, cross q + norms + LN3 d^2 + d +
    4d, cross o d^2 + d, FFN up d f + f, down f d + d: the block without the cross k, v projections."""
    want = (
        3 * (D * D + D) + 8 * D,
        D * D + D,
        D * D + D + 4 * D,
        D * D + D,
        D * F + F,
        F * D + D,
    )
    assert tuple(n for _, n in linear_gather_units(WAN)) == want
    assert tuple(u for u, _ in linear_gather_units(WAN)) == LINEAR_UNITS
    assert sum(want) == dit_block_param_count(WAN) - 2 * (D * D + D) == 46_440_704 - 4_721_664
    out = dict(outside_gather_units(WAN))
    assert out["time_proj"] == 6 * D * D + 6 * D and out["patch_embed"] == 16 * 4 * D + D
    assert sum(out.values()) == dit_outside_param_count(WAN) == 25_775_680


def test_prefetch_by_hand():
    # a) two units, no compute between: gather 0 [0, 2), linear 0 [2, 3); gather 1 [2, 3), linear 1 [3, 4)
    assert linear_prefetch_exposed([2, 1], [0, 0], [1, 1], 0.0, 1) == 2
    # b) the double buffer: gather 2 waits for linear 0 to free its half: g0 [0, 1), l0 [1, 4); g1 [1, 1),
    #    l1 [4, 5); g2 [4, 6) (the queue is free at 1), l2 [6, 7): 7 - 5 = 2 exposed (1 with 3 buffers)
    assert linear_prefetch_exposed([1, 0, 2], [0, 0, 0], [3, 1, 1], 0.0, 1) == 2
    # c) compute before a linear hides its gather: g0 [0, 1) under 1 s of before; l0 [1, 2); g1 [1, 3)
    #    under l0 + 1 s of before -> l1 [3, 4); tail 2: layer 2's g0 [3, 4) (l0 of layer 1 ended at 2: free)
    #    hides under the tail [4, 6) + before 1: l0 [7, 8); g1 [4, 6) hides: l1 [9, 10), tail -> 12. 0 exposed
    assert linear_prefetch_exposed([1, 2], [1, 1], [1, 1], 2.0, 2) == 0
    # d) a gather longer than everything: g0 [0, 5), l0 [5, 6), g1 [5, 10), l1 [10, 11): 11 - 2 = 9
    assert linear_prefetch_exposed([5, 5], [0, 0], [1, 1], 0.0, 1) == 9
    with pytest.raises(ValueError, match="equal, non-empty"):
        linear_prefetch_exposed([1], [0, 0], [1], 0.0, 1)
    with pytest.raises(ValueError, match="layers must be an int >= 1"):
        linear_prefetch_exposed([1], [0], [1], 0.0, 0)
    with pytest.raises(ValueError, match="times must be >= 0"):
        linear_prefetch_exposed([1], [-1], [1], 0.0, 1)


def _layer(times: dict[str, float], group: str = "elementwise") -> list[Component]:
    return [
        Component(
            n, "linear" if n in LINEAR_UNITS else ("attention" if n == "attn" else group), t, 30, 0, 1, True
        )
        for n, t in times.items()
    ]


def test_components_place_the_layer_by_its_data_flow():
    """The layer's non-linear components go before the linear that follows them in the forward (the
    attention before o_proj, GELU before ffn_down, ...), the rest (gate_residual_ffn) after ffn_down;
    the result is linear_prefetch_exposed of that program. One collective per gather."""
    cm = CommModel.conservative()
    times = {u: 1e-4 for u in LINEAR_UNITS}
    times.update(attn=3e-3, gelu_tanh=2e-4, adaln_norm1_mod=1e-4, gate_residual_ffn=5e-4)
    cs = [*_layer(times), Component("patch_embed", "linear", 9.0, 1, 0, 1, False)]  # not per layer: ignored
    got = {c.name: c for c in fsdp_linear_components(WAN, cs, 8, cm)}
    g = [params_gather(n, 8, cm)[1] for _, n in linear_gather_units(WAN)]
    before = [1e-4, 3e-3, 0.0, 0.0, 0.0, 2e-4]
    want = linear_prefetch_exposed(g, before, [1e-4] * 6, 5e-4, 30)
    assert got["weight_gather_exposed"].time_s == pytest.approx(want, rel=1e-12)
    assert want > 0  # the program is short enough for the FFN gathers to show
    assert (got["weight_gather_exposed"].collectives, got["weight_gather_exposed"].calls) == (180, 1)
    out = sum(params_gather(n, 8, cm)[1] for _, n in outside_gather_units(WAN))
    assert got["weight_gather_first"].time_s == pytest.approx(out, rel=1e-12)
    assert got["weight_gather_first"].collectives == 7
    with pytest.raises(ValueError, match="has no \\['ffn_down'\\] components"):
        fsdp_linear_components(WAN, [c for c in cs if c.name != "ffn_down"], 8, cm)


@pytest.mark.parametrize("end", ENDS)
def test_chunk_prices_the_per_linear_gathers(end: str):
    """Against the block gathers: 6 per layer + 7 non-block collectives instead of 30 + 1 blocks; the
    one-graph chunk differs by the gathers' components and the barriers of the difference; eager, each
    collective also cuts the graph (more NEFFs)."""
    L = WAN.num_layers
    blk = _wan(end, weights="fsdp", kv_cache="sp_compact")
    lin = _wan(end, weights="fsdp", kv_cache="sp_compact", gather_unit="linear")
    assert lin.collectives - blk.collectives == (6 * L + 7) - (L + 1)
    w = {c.name: c.total_s for c in lin.components if c.group == "weight_comm"}
    wb = {c.name: c.total_s for c in blk.components if c.group == "weight_comm"}
    barrier = blk.params.at(end).collective_barrier_s
    assert lin.chunk_s - blk.chunk_s == pytest.approx(
        sum(w.values()) - sum(wb.values()) + (lin.collectives - blk.collectives) * barrier, rel=1e-9
    )
    e_blk = _wan(end, weights="fsdp", kv_cache="sp_compact", compile_mode="eager_sharded")
    e_lin = _wan(
        end, weights="fsdp", kv_cache="sp_compact", compile_mode="eager_sharded", gather_unit="linear"
    )
    assert e_lin.neffs > e_blk.neffs and e_lin.chunk_s > e_blk.chunk_s
    with pytest.raises(ValueError, match="gather_unit must be one of"):
        _wan(end, gather_unit="linear")  # replicated weights: nothing to gather
    with pytest.raises(ValueError, match="gather_unit must be one of"):
        _wan(end, weights="fsdp", gather_unit="layer")


def _fake_result(target_bf16: float = 11e9):
    """A result with the real footprints of the report's compact placements and the lean placements'
    chunks (vae=None here: the text does not depend on the decode)."""
    from types import SimpleNamespace

    from perf.e2e.run import COMPACT, LEAN, LEAN_LABEL
    from perf.footprint import footprint, lower_bound_footprint, model_at_resolution, vae_probe
    from perf.footprint_phases import persistent_floor, taehv_footprint
    from tests.test_e2e_overlap import PIPE

    m = model_at_resolution(WAN, 480, 832, 8)
    vae = vae_probe(m.latent_height, m.latent_width, PIPE.frames_per_block)
    fps = [footprint(m, PIPE, tp=4, sp=2, vae=vae, label="bf16, weights per core")]
    for kvb, lab in ((2, "bf16"), (1.03125, "fp8 KV cache")):
        fps.append(
            footprint(m, PIPE, tp=4, sp=2, kv_bytes=kvb, vae=vae, label=f"{lab}, compact KV", **COMPACT)
        )
        fps += [
            footprint(m, PIPE, tp=4, sp=2, kv_bytes=kvb, vae=vae, label=f"{lab}, {LEAN_LABEL[n]}", **LEAN[n])
            for n in LEAN
        ]
        fps.append(taehv_footprint(m, PIPE, tp=4, sp=2, kv_bytes=kvb, **LEAN["shared"]))
    lower = [lower_bound_footprint(m, PIPE, cores=8, compact=True)]
    lower += [persistent_floor(m, PIPE, cores=8, vae=vae, kv_bytes=k) for k in (2, 1.03125)]
    chunks = {
        (mode, end): _wan(end, weights="fsdp", kv_cache="sp_compact", compile_mode=mode, gather_unit="linear")
        for mode in ("fullgraph", "eager_sharded")
        for end in ENDS
    }
    lean = {(n, mode, end): cm for n in LEAN for (mode, end), cm in chunks.items()}
    params = SimpleNamespace(target_hbm_bytes=target_bf16, target_hbm_fp8_bytes=8e9)
    r = SimpleNamespace(
        model=m, cores=8, footprints=fps, lower_bounds=lower, lean=lean, compact={}, params=params
    )
    return r, {fp.label: fp for fp in fps}


def test_hbm_rows_name_the_best_placement_its_fps_and_what_holds_the_target():
    from perf.e2e.report_compact import hbm_target_rows
    from perf.e2e.report_fmt import _gb

    r, by = _fake_result()
    rows = hbm_target_rows(r)  # type: ignore[arg-type]
    bf16, tiny16, fp8, tiny8 = rows
    best = by["bf16, FSDP per-linear DiT + VAE weights, compact KV cache, one DiT/VAE scratchpad"]
    floor = r.lower_bounds[1]
    lo, hi = r.lean[("shared", "fullgraph", "pessimistic")], r.lean[("shared", "fullgraph", "optimistic")]
    assert (
        f"best modelled placement {_gb(best.per_chip)} GB ({best.label}) at {lo.fps:.2f}-{hi.fps:.2f} fps"
        in bf16
    )
    assert (
        best.per_chip > 11e9
        and f"missed by {_gb(best.per_chip - 11e9)} GB" in bf16
        and bf16.endswith("| no |")
    )
    assert (
        f"persistent floor {_gb(floor.per_chip)} GB (kv_cache 6.04, dit_weights 2.84, vae_causal_cache 1.86"
        in bf16
    )
    assert f"leaves {_gb(11e9 - floor.per_chip)} GB for the transients, which need " in bf16
    assert f"need {_gb(best.per_chip - floor.per_chip)} GB" in bf16
    cache = floor.item("vae_causal_cache").per_chip
    assert f"the VAE causal cache is {_gb(cache)} GB of the floor" in bf16
    assert f"(the placement without it: {(best.per_chip - cache) / 1e9:.3f} GB)" in bf16
    # the tiny decoder is smaller but never the headline: its own row
    tiny = [fp for fp in r.footprints if fp.label.startswith("tiny decoder") and "bf16" in fp.label][0]
    assert tiny.per_chip < best.per_chip and tiny.label not in bf16
    assert tiny16.startswith("| HBM <= 11.00 GB in bf16, a tiny decoder") and tiny16.endswith(
        "| yes, quality not measured |"
    )
    # FP8 KV cache: the floor alone is over 8 GB
    assert "over the target by itself: not reachable with the Wan VAE" in fp8 and fp8.endswith("| no |")
    t8 = [fp for fp in r.footprints if fp.label.startswith("tiny decoder") and "fp8" in fp.label][0]
    assert t8.per_chip <= 8e9 and tiny8.endswith("| yes, quality not measured |")
    # a target the best placement fits: met, by how much, and the floor leaves room
    r2, _ = _fake_result(target_bf16=13e9)
    row = hbm_target_rows(r2)[0]  # type: ignore[arg-type]
    assert (
        f"met with {_gb(13e9 - best.per_chip)} GB" in row and row.endswith("| yes |") and "which fit" in row
    )
