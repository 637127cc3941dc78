"""``perf/REPORT.md`` text (generated from an :class:`~perf.e2e.run.E2EResult`; never edited by hand).

Every headline figure is printed at both ends of the parameter ranges: ``low-high`` fps (pessimistic end
first) and ``high-low`` ms per chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

from perf.e2e.budget import budget_lines, layer_path_lines
from perf.e2e.budget_baseline import before_after_lines
from perf.e2e.chunk import ChunkModel
from perf.e2e.components import GROUPS
from perf.e2e.fp8 import fp8_gate_lines, fp8_target_lines
from perf.e2e.params import ENDS
from perf.e2e.peer import PUBLISHED
from perf.e2e.report_compact import floor_footprint, hbm_target_rows
from perf.e2e.report_fmt import _chunk_ms, _fps, _gb, _ms
from perf.e2e.report_guard import guard_headline_lines, guard_lines, read_guard_rows
from perf.e2e.report_kernels import _attention_row_text, attention_side_by_side_lines
from perf.e2e.report_overlap import overlap_lines
from perf.e2e.report_peer import calibration_verdict, peer_breakdown_lines, peer_table
from perf.e2e.run import E2EResult
from perf.e2e.weights import WEIGHT_VARIANTS

__all__ = [
    "render_report",
    "peer_table",
    "peer_breakdown_lines",
    "headline_lines",
    "calibration_verdict",
    "kernel_pricing_lines",
]

_WP_NAMES = {"replicated": "replicated", "fsdp": "FSDP-sharded", "tp_linear": "TP-sharded linears"}
_WP_LABEL = {
    "replicated": "weights per core",
    "fsdp": "FSDP-sharded weights",
    "tp_linear": "TP-sharded linears",
}
_VARIANT_TEXT = {
    "merged": "merged forward, one NEFF per forward",
    "two_pass": "two-pass (the original's two forwards), one NEFF per forward",
    "merged_eager": "merged forward of the sharded stream without --compile (host collectives cut the graph)",
}


def _footprint_check_lines() -> list[str]:
    """The footprint formulas against the sharded CPU stream's allocations (the newest saved run)."""
    from perf.footprint_check import latest_rows, table_lines

    rows = latest_rows()
    head = "### The formulas against the sharded CPU stream's allocations (measured)\n"
    if not rows:
        return [head, "Not run: `python -m perf.footprint_check --save`.\n"]
    same = sum(r.exact for r in rows)
    return [
        head,
        "Bytes of the tensors every rank of the TP x SP sharded stream holds (gloo ranks on this CPU, "
        "reported by the ranks) next to `perf.footprint` at the same model, plan, dtype and KV-cache "
        "layout (one gather buffer: the CPU stream does not overlap the gather); per core = the busiest "
        f"rank, per chip = the sum over ranks. {same} of {len(rows)} items equal to the byte "
        "(`python -m perf.footprint_check --save`; activations and the VAE are not compared: the CPU "
        "reference ops allocate temporaries the device kernels never materialise).\n",
        *table_lines(rows),
        "",
    ]


def _pair(r: E2EResult, variant: str) -> tuple[ChunkModel, ChunkModel]:
    return r.chunk(variant, "pessimistic"), r.chunk(variant, "optimistic")


def kernel_pricing_lines(r: E2EResult) -> list[str]:
    """Which model priced the NKI kernels, and the attention kernel's per-layer figure at both ends."""
    pess, opt = _pair(r, "merged")
    kgroups = ("attention", "cross_attention", "rope", "kv_write")
    comps = [c for c in pess.components if c.group in kgroups]
    sources = sorted({c.source for c in comps})
    attn = {
        e: sum(c.time_s for c in cm.components if c.group == "attention")
        for e, cm in (("p", pess), ("o", opt))
    }
    share = {e: cm.time(["attention"]) / cm.chunk_s for e, cm in (("p", pess), ("o", opt)) if cm.chunk_s > 0}
    return [
        "## Kernel pricing (cost model v2)\n",
        f"The NKI kernels (self- and cross-attention, RoPE, KV write) are priced by: {'; '.join(sources)}. "
        "`traced (schedule)` = an emulator trace with its ordered event log, priced by cost model v2's "
        "dependency-aware schedule (`nki_kernels.emulator.cost.profile_range`: every unmeasured cost-model "
        "parameter at its optimistic end for the optimistic column, at its pessimistic end for the "
        "pessimistic one, together with the end-to-end ranges); the cost model's fixed per-kernel time is "
        "stripped from every kernel and `kernel_fixed_s` charged once per call instead "
        "(`docs/e2e_model.md`).\n",
        f"**The project's attention kernel is modelled at {_ms(attn['o'])}-{_ms(attn['p'])} ms per layer on "
        "each core** (optimistic-pessimistic end; the update and denoise self-attention of one merged "
        f"forward at this plan's per-core shapes), {share['p']:.0%}-{share['o']:.0%} of the chunk "
        "(pessimistic-optimistic). " + _attention_row_text() + " Its design (`docs/kernels/attention.md`): "
        "a static softmax offset per query tile (the largest score of its first 1,024-key chunk, kept for "
        "the other chunks; a guard recomputes a head with the running max if any row's denominator leaves "
        "[1e-18, 1e30]), and every later chunk computes S^T (keys on the partitions), so ONE ScalarE exp "
        "straight from PSUM writes the P^T the PV matmuls read: no row max, rescale, transposes or "
        "evictions after the first chunk; ScalarE's exp and TensorE are balanced at ~1 us per 1,024-key "
        "chunk (1.91 us VectorE/ScalarE-bound with the running max). The figures assume the guard does not "
        'trip (the fast path); section "Guard sensitivity" prices the trips.\n',
    ]


def headline_lines(r: E2EResult) -> list[str]:
    """Plain-text lines for the terminal: our configuration and the peer comparison at both ends."""
    out = [
        f"MODELLED end to end, {r.model.name} {r.height}x{r.width}, {r.cores} cores (fps: "
        "pessimistic-optimistic end)"
    ]
    for v in ("merged", "two_pass", "merged_eager"):
        lo, hi = _pair(r, v)
        out.append(
            f"  {v:13s} {_fps(lo, hi)} fps, {_chunk_ms(lo, hi)} ms per chunk, {lo.neffs} NEFFs, "
            f"{lo.kernel_calls} kernel calls, {lo.collectives} collectives per chunk"
        )
    out += guard_headline_lines(r.guard)
    if r.peer:
        out.append(
            "Peer (yahavb/rolling_forcing) configurations, modelled with its ~370 NEFFs per forward vs "
            "measured:"
        )
        for row in r.peer:
            c = row.config
            if not row.chunks:
                out.append(f"  {c.height}x{c.width} {c.cores} cores {c.variant}: not modelled ({row.error})")
                continue
            lo, hi = row.chunks["pessimistic"], row.chunks["optimistic"]
            meas = (
                ""
                if row.measured is None
                else (
                    f"; measured {row.measured.fps:g} fps; predicted/measured "
                    f"x{row.ratio('pessimistic'):.2f}-x{row.ratio('optimistic'):.2f}"
                )
            )
            out.append(
                f"  {c.height}x{c.width} {c.cores:2d} cores {lo.plan_name} {c.variant:8s} {_fps(lo, hi)} "
                f"fps{meas}"
            )
        out.append(calibration_verdict(r.peer))
    out.append("Unmeasured parameters (optimistic end - pessimistic end):")
    for pname, rng in r.params.ranges().items():
        scale, unit = (1e6, " us") if pname.endswith("_s") else (1.0, "")
        out.append(f"  {pname}: {rng.low * scale:g}-{rng.high * scale:g}{unit} ({rng.source})")
    out.append(
        f"  comm_models: {r.params.comm_models[0]} - {r.params.comm_models[1]} (sharding.plan.CommModel)"
    )
    launch_us = r.params.neff_launch_s * 1e6
    out.append(f"Measured parameter: neff_launch_s {launch_us:g} us (Rolling Forcing port profiles)")
    return out


def targets_lines(r: E2EResult) -> list[str]:
    """The "Targets" section: every target of the project at both ends, met or not, and by how much."""
    prm = r.params
    mg_lo, mg_hi = _pair(r, "merged")
    deadline = mg_lo.video_frames / prm.target_fps
    fps_ok = {e: r.chunk("merged", e).headroom() >= prm.target_headroom for e in ENDS}
    bf16_lines = [fp for fp in r.footprints if fp.label.startswith("bf16") and "shared" not in fp.label]
    best = min(bf16_lines, key=lambda fp: fp.per_chip)
    L: list[str] = []
    L.append("## Targets (modelled, one trn2 chip)\n")
    L.append("| target | modelled (pessimistic / optimistic end) | met? |")
    L.append("|---|---|---|")
    L.append(
        f"| >= {prm.target_fps:.0f} fps with >= {prm.target_headroom:.0%} deadline headroom (chunk <= "
        f"{_ms(deadline * (1 - prm.target_headroom))} ms of the {_ms(deadline)} ms deadline) | "
        f"{mg_lo.fps:.2f} / "
        f"{mg_hi.fps:.2f} fps, chunk {_ms(mg_lo.chunk_s)} / {_ms(mg_hi.chunk_s)} ms, headroom "
        f"{mg_lo.headroom():.1%} / {mg_hi.headroom():.1%} | {'yes' if fps_ok['pessimistic'] else 'no'} / "
        f"{'yes' if fps_ok['optimistic'] else 'no'} |"
    )
    need = mg_lo.video_frames / (mg_lo.video_frames / prm.target_fps * (1 - prm.target_headroom))
    L.extend(fp8_target_lines(r))
    L.append(
        f"| >= {prm.target_fps_bf16:.0f} fps without FP8 (all figures here are bf16) | {mg_lo.fps:.2f} / "
        f"{mg_hi.fps:.2f} fps | {'yes' if mg_lo.fps >= prm.target_fps_bf16 else 'no'} / "
        f"{'yes' if mg_hi.fps >= prm.target_fps_bf16 else 'no'} |"
    )
    spread = (mg_lo.chunk_s - mg_hi.chunk_s) / mg_lo.chunk_s
    L.append(
        f"| pessimistic-optimistic spread <= {prm.target_spread:.0%} of the chunk (what rests on unmeasured "
        f"parameters) | {_ms(mg_lo.chunk_s - mg_hi.chunk_s)} ms = {spread:.1%} of {_ms(mg_lo.chunk_s)} ms | "
        f"{'yes' if spread <= prm.target_spread else 'no'} |"
    )
    L.extend(hbm_target_rows(r))  # perf/e2e/report_compact.py
    L.append("")
    L.append(
        f"By how much (pessimistic end): the frame-rate target needs {need:.1f} fps of chunk throughput "
        f"(x{need / mg_lo.fps:.2f} today's), the bf16 target x{prm.target_fps_bf16 / mg_lo.fps:.2f}; HBM "
        f"x{best.per_chip / prm.target_hbm_bytes:.2f} the bf16 target. The steady state has one chunk "
        "shape (every window of the stream runs the same merged forward), so the model's p99 chunk time is "
        "the steady chunk above; the warm-up windows are in the time to first frame.\n"
    )
    return L


def render_report(r: E2EResult, png_names: Sequence[str]) -> str:
    """``perf/REPORT.md`` text (generated; every figure labelled)."""
    prm = r.params
    mg_lo, mg_hi = _pair(r, "merged")
    cmd = r.command or "python -m perf.e2e"
    fp_bf16 = r.footprints[0]
    bf16_lines = [fp for fp in r.footprints if fp.label.startswith("bf16") and "shared" not in fp.label]
    best = min(bf16_lines, key=lambda fp: fp.per_chip)
    hbm_ok = best.per_chip <= prm.target_hbm_bytes
    by_label = {fp.label: fp for fp in r.footprints}
    L: list[str] = []
    L.append("# nki-ardiff performance report (GENERATED by `python -m perf.e2e --save`; do not edit)\n")
    L.append(
        f"Model: {r.model.name} at {r.height}x{r.width} ({r.model.tokens_per_frame} tokens per latent "
        "frame), "
        f"{r.cores} NeuronCore-v3 ({mg_lo.plan_name}), one chunk = one merged forward of "
        f"{r.pipe.frames_per_block + r.pipe.window_frames} latent frames -> {mg_lo.video_frames} video "
        "frames. "
        f"Kernel costs: **{r.kernels_name}**; linear layers: **{r.matmul_name}**. All nki-ardiff figures are "
        f"**modelled** (trn2 cost model + the end-to-end accounting of `docs/e2e_model.md`; no Trainium was "
        f"used); the only measured figure is this command's CPU wall time ({r.wall_s:.1f} s). Every headline "
        f"figure is given at both ends of the unmeasured parameters (fps: pessimistic-optimistic end; ms: "
        f"the same order). Reproduce every number with `{cmd}`.\n"
    )
    L.append("## Headline\n")
    L.append("| system | figure | kind | reproduce / source |")
    L.append("|---|---|---|---|")
    for v in ("merged", "two_pass", "merged_eager"):
        lo, hi = _pair(r, v)
        L.append(
            f"| nki-ardiff {_VARIANT_TEXT[v]}, {lo.cores} cores | **{_fps(lo, hi)} fps** end to end, "
            f"{_chunk_ms(lo, hi)} ms per chunk (DiT {lo.dit_fps:.2f}-{hi.dit_fps:.2f} fps), MFU "
            f"{lo.mfu:.1%}-{hi.mfu:.1%} of {lo.cores}x78.6 TF; {lo.neffs} NEFFs, {lo.kernel_calls:,} kernel "
            "calls, "
            f"{lo.collectives} collectives per chunk | modelled | `{cmd}` |"
        )
    for wp in WEIGHT_VARIANTS:
        if wp == "replicated":
            continue
        pair = {e: cm for w, e, cm in r.weight_variants if w == wp}
        L.append(
            f"| nki-ardiff merged forward, {_WP_NAMES[wp]} | "
            f"{_fps(pair['pessimistic'], pair['optimistic'])} fps, "
            f"{_chunk_ms(pair['pessimistic'], pair['optimistic'])} ms per chunk | modelled | `{cmd}` |"
        )
    L.append(
        f"| nki-ardiff HBM per chip, bf16 | {_gb(fp_bf16.per_chip)} GB ({fp_bf16.label}); "
        f"{_gb(r.footprints[1].per_chip)} GB ({r.footprints[1].label}) | modelled | `{cmd}` |"
    )
    L.append(
        f"| nki-ardiff HBM per chip, fp8 KV | {_gb(r.footprints[2].per_chip)} GB ({r.footprints[2].label}); "
        f"{_gb(r.footprints[3].per_chip)} GB ({r.footprints[3].label}) | modelled | `{cmd}` |"
    )
    for wl in ("FSDP-sharded weights", "TP-sharded linears"):
        fa, fb = by_label.get(f"bf16, {wl}"), by_label.get(f"fp8 KV cache, {wl}")
        if fa is not None and fb is not None:
            L.append(
                f"| nki-ardiff HBM per chip, {wl} | {_gb(fa.per_chip)} GB (bf16); {_gb(fb.per_chip)} GB "
                f"(fp8 KV cache) | modelled | `{cmd}` |"
            )
    for lb in r.lower_bounds:
        L.append(f"| nki-ardiff HBM floor: {lb.label} | {_gb(lb.per_chip)} GB | modelled | `{cmd}` |")
    t_lo, t_hi = r.ttff["pessimistic"], r.ttff["optimistic"]
    L.append(
        f"| nki-ardiff time to first frame | {_ms(t_lo.total_s)}-{_ms(t_hi.total_s)} ms (warm-up windows "
        "with "
        f"growing shapes); {_ms(t_lo.static_s)}-{_ms(t_hi.static_s)} ms (static padded shapes) | modelled | "
        f"`{cmd}` |"
    )
    for p in PUBLISHED:
        L.append(f"| {p['system']} | {p['figure']} | {p['kind']} | {p['source']} |")
    L.append("")
    L += kernel_pricing_lines(r)
    L += guard_lines(r.guard, read_guard_rows())
    if r.peer:
        L.append("## The measured peer, modelled side by side (end-to-end calibration)\n")
        L.append(
            "The open Rolling Forcing port on trn2 (github.com/yahavb/rolling_forcing) modelled with this "
            "project's kernel costs in the port's configuration: Megatron TP linears inside the TP group "
            "(`weights=tp_linear`), the SP K/V all-gather, and its launch count fed in: "
            f"{prm.peer_neffs_per_forward} NEFFs per rank per forward (`docs/compilation_pattern.md` of that "
            f"repository) at {prm.neff_launch_s * 1e6:.0f} us each. Its published figures are measured by "
            "them; the two-pass rows and 480x832 on 16 cores have none (1,560 tokens per frame do not split "
            "16 ways in its layout).\n"
        )
        L += peer_table(r.peer)
        L.append("")
        L.append(calibration_verdict(r.peer) + "\n")
        L.append(
            "The peer rows are priced with the peer's own attention (kernel provider "
            f"**{r.peer_kernels_name}**; `perf/e2e/peer_kernels.py`, docs/e2e_model.md): its flash "
            "self-attention design re-written in "
            "NKI 0.6 (`perf/e2e/peer_attention.py`: D-major q/k, 8,192-key sections, P^T by SBUF->SBUF DMA) "
            "traced at its per-core shapes and priced by cost model v2 at both ends, plus the D-major "
            "permutes its XLA graph makes before every attention call; its linears at the 65-69 % "
            "TensorE-active its profiles publish for its matmul NEFFs and its VAE convs at the one "
            "efficiency that reproduces its published ~135 ms VAE decode (480x640, 16 cores) "
            "(`perf/e2e/peer_matmul.py`); cross-attention, RoPE and the KV write with this project's "
            "kernels. Our own configuration above keeps our kernels.\n"
        )
        L += peer_breakdown_lines(r.peer)
        L.append(
            "Not modelled, and published for the peer: kernel waits of 1.4-5.2 ms in its profiles and its "
            "RoPE swap on GpSimd; the measured gap is what those and the cost model's per-kernel error "
            "leave.\n"
        )
    L.append("## Launch accounting (modelled, per chunk and per rank)\n")
    L.append(
        "| variant | compile mode | NEFFs per chunk (derivation) | kernel calls | collectives | launch ms | "
        "kernel fixed ms (pess.-opt.) | barrier ms (pess.-opt.) |"
    )
    L.append("|---|---|---|---|---|---|---|---|")
    rows_acc: list[tuple[str, ChunkModel, ChunkModel]] = [
        (v, *_pair(r, v)) for v in ("merged", "two_pass", "merged_eager")
    ]
    for row in r.peer[:1]:
        if row.chunks:
            rows_acc.append(
                (
                    f"peer {row.config.height}x{row.config.width} {row.config.variant}",
                    row.chunks["pessimistic"],
                    row.chunks["optimistic"],
                )
            )
    for name, lo, hi in rows_acc:
        assert lo.launch_plan is not None
        L.append(
            f"| {name} | {lo.launch_plan.mode} | {lo.launch_plan.describe()} | {lo.kernel_calls:,} | "
            f"{lo.collectives} | "
            f"{_ms(lo.time(['launch']))} | "
            f"{_ms(lo.time(['kernel_fixed']))}-{_ms(hi.time(['kernel_fixed']))} | "
            f"{_ms(lo.time(['barrier']))}-{_ms(hi.time(['barrier']))} |"
        )
    L.append("")
    L.append(
        "Rules (`perf/e2e/launches.py`): the single-process merged forward is one "
        "`torch.compile(fullgraph=True)` "
        "graph (one NEFF per forward, measured on CPU: one graph, no break); so is the sharded stream's "
        "with `compile=` (`generate --cores N --compile`): its collectives are functional ops inside the "
        "graph (`tests/test_sharding_compile.py` ties the graph's collectives and kernel calls to this "
        "model); without `compile=` every host collective cuts the graph (`eager_sharded`). Each forward "
        "adds one sampler-update "
        "graph, each chunk one VAE-decode NEFF. Kernel calls are counted per component (one per linear, "
        "attention group, RoPE, KV write, fused elementwise kernel (two for the RMSNorms of q and k), VAE "
        "layer).\n"
    )
    L.append("## Parameters (unmeasured ones are ranges)\n")
    L.append("| parameter | value | source |")
    L.append("|---|---|---|")
    for pname, rng in prm.ranges().items():
        scale = 1e6 if pname.endswith("_s") else 1.0
        unit = " us" if pname.endswith("_s") else ""
        L.append(f"| `{pname}` | {rng.low * scale:g}-{rng.high * scale:g}{unit} (range) | {rng.source} |")
    L.append(
        f"| `comm_models` | {prm.comm_models[0]} (optimistic end) - {prm.comm_models[1]} (pessimistic end) "
        "| `sharding.plan.CommModel` lines (docs/sharding.md) |"
    )
    L.append(
        f"| `neff_launch_s` | {prm.neff_launch_s * 1e6:g} us (measured by the peer) | submit 71 + host "
        "barrier 43 + hardware barrier 31 us, github.com/yahavb/rolling_forcing |"
    )
    L.append("")
    L += targets_lines(r)
    L += fp8_gate_lines()
    L.append("## Attention side by side with AWS's attention_cte (modelled, same cost model and shapes)\n")
    L.append(
        "`attention_cte` (github.com/aws-neuron/nki-library, core/attention/attention_cte.py) re-written in "
        "this project's NKI 0.6 API as a harness (`perf/attention_cte_harness.py`: its tiling, layouts, "
        "softmax pipeline and SBUF->SBUF DMA transposes of P; adaptations in its docstring), traced and "
        "priced at both ends like the project's kernel (`python -m perf.bench_kernels --ops "
        "attention,attention_cte_harness`; docs/kernels/attention.md). The harness rows leave out the "
        "layout permutes its callers need, which favours it.\n"
    )
    L += attention_side_by_side_lines()
    L.append("")
    L.append("")
    groups = mg_lo.by_group()
    top = max(groups, key=lambda g: groups[g])
    L.append(
        f"What holds the frame rate back (pessimistic end): **{top}** ({_ms(groups[top])} ms of "
        f"{_ms(mg_lo.chunk_s)} ms "
        f"per chunk). At 100% of {mg_lo.cores}x78.6 TF the chunk's {mg_lo.flops / 1e12:.0f} TFLOP (DiT "
        f"{mg_lo.dit_flops / 1e12:.0f} + VAE {(mg_lo.flops - mg_lo.dit_flops) / 1e12:.0f}) would take "
        f"{_ms(mg_lo.flops / (mg_lo.cores * prm.peak_flops_per_core))} ms.\n"
    )
    if not hbm_ok:
        big = max(fp_bf16.items, key=lambda i: i.per_chip)
        L.append(
            f"What holds HBM back: in the replicated baseline **{big.name}** ({_gb(big.per_chip)} GB per "
            "chip); the "
            + (
                f"KV cache alone is {_gb(r.lower_bounds[0].item('kv_cache').per_chip)} GB in bf16 (the "
                f"shortest ring the schedule reads), so KV cache + one DiT weight copy is "
                f"{_gb(r.lower_bounds[0].per_chip)} GB whatever the placement"
                + (
                    f"; with the Wan VAE's causal cache and the other state every chunk keeps, the "
                    f"persistent floor is {_gb(floor_fp.per_chip)} GB"
                    if (floor_fp := floor_footprint(r, "bf16")) is not None
                    else ""
                )
                + ".\n"
                if r.lower_bounds
                else "\n"
            )
        )
    L.append("## Per-chunk budget (modelled, merged forward, sorted by the gap to the roofline)\n")
    L.append(
        "Every component of one chunk on one core at both ends, the engine (or HBM / collective) that bounds "
        "it, its roofline (its FLOPs at the dense bf16 peak or its compulsory HBM bytes at the per-core HBM "
        "bandwidth, whichever is larger; 0 for communication and overheads, which a schedule can hide) and "
        "the gap at the pessimistic end (`perf/e2e/budget.py`).\n"
    )
    L += budget_lines(mg_hi, mg_lo)
    L += before_after_lines(r)
    L.append("")
    L += layer_path_lines(mg_hi, mg_lo)
    L.append("")
    L += overlap_lines(mg_lo, mg_hi)  # pessimistic, optimistic
    L.append("## Per-chunk breakdown (modelled, merged forward, both ends)\n")
    L.append("| group | pessimistic ms | share | optimistic ms | share |")
    L.append("|---|---|---|---|---|")
    g_hi = mg_hi.by_group()
    for g, t in sorted(groups.items(), key=lambda kv: -kv[1]):
        th = g_hi.get(g, 0.0)
        L.append(f"| {g} | {_ms(t)} | {t / mg_lo.chunk_s:.1%} | {_ms(th)} | {th / mg_hi.chunk_s:.1%} |")
    L.append(f"| **total** | **{_ms(mg_lo.chunk_s)}** | | **{_ms(mg_hi.chunk_s)}** | |")
    L.append("")
    kgroups = ["attention", "cross_attention", "rope", "kv_write"]
    kdiff = mg_lo.time(kgroups) - mg_hi.time(kgroups)
    L.append(
        f"The NKI kernels' time differs by {_ms(kdiff)} ms between the ends: cost model v2's own ranges "
        "(`profile_range`: DMA-transpose efficiency, semaphore cost, in-order vs gap-filling engines, "
        "VectorE/GpSimd shared-port contention, the other unmeasured prices). The contention falls on the "
        "attention kernel, whose row max offloads halving passes from VectorE to GpSimd "
        "(`nki_kernels/attention.py` `_row_max`); cost model v2 charges it inside the schedule, and the "
        "end-to-end model adds nothing on top for a schedule-priced kernel. No public timing pins either; "
        "the range is the design risk.\n"
    )
    L.append(
        f"## Per-layer breakdown (modelled, pessimistic end, one of {r.model.num_layers} layers, critical "
        "core)\n"
    )
    L.append("| component | group | ms per layer | kernel calls | collectives | GFLOP (chip) | source |")
    L.append("|---|---|---|---|---|---|---|")
    for c in mg_lo.components:
        if c.per_layer:
            L.append(
                f"| {c.name} | {c.group} | {c.time_s * 1e3:.3f} | {c.launches} | {c.collectives} | "
                f"{c.flops / 1e9:,.1f} | {c.source} |"
            )
    L.append("")
    L.append(
        "Once per chunk: "
        + ", ".join(f"{c.name} {_ms(c.total_s)} ms" for c in mg_lo.components if not c.per_layer)
    )
    L.append("")
    L.append("## Two-pass variant (modelled, pessimistic end)\n")
    tw_lo, tw_hi = _pair(r, "two_pass")
    L.append("| group | merged ms | two-pass ms |")
    L.append("|---|---|---|")
    tg = tw_lo.by_group()
    for g in GROUPS:
        a, b = groups.get(g, 0.0), tg.get(g, 0.0)
        if a or b:
            L.append(f"| {g} | {_ms(a)} | {_ms(b)} |")
    L.append(f"| **total** | **{_ms(mg_lo.chunk_s)}** | **{_ms(tw_lo.chunk_s)}** |")
    L.append(
        f"| kernel calls / NEFFs / collectives | {mg_lo.kernel_calls:,} / {mg_lo.neffs} / "
        f"{mg_lo.collectives} | "
        f"{tw_lo.kernel_calls:,} / {tw_lo.neffs} / {tw_lo.collectives} |"
    )
    L.append("")
    L.append("## Time to first frame (modelled)\n")
    for end in ENDS:
        tt = r.ttff[end]
        L.append(
            f"- {end} end: warm-up windows "
            + " + ".join(_ms(x) for x in tt.warmup_s)
            + f" + first-frame decode {_ms(tt.first_decode_s)} = **{_ms(tt.total_s)} ms**; static padded "
            f"shapes {r.pipe.window_blocks} x DiT + decode = {_ms(tt.static_s)} ms."
        )
    L.append("")
    L.append("## Scaling with core count (modelled, merged forward, end to end)\n")
    L.append("| cores | plan | fps (pess.-opt.) | DiT-only fps (pess.-opt.) |")
    L.append("|---|---|---|---|")
    for nc, name, by_end in r.scaling:
        note = " (2 chips)" if nc > 8 else ""
        if not by_end:
            L.append(f"| {nc}{note} | {name} | - | - |")
            continue
        (fl, dl), (fh, dh) = by_end["pessimistic"], by_end["optimistic"]
        L.append(f"| {nc}{note} | {name} | {fl:.2f}-{fh:.2f} | {dl:.2f}-{dh:.2f} |")
    L.append("")
    if r.weight_variants:
        L.append("## Weight placement (modelled, merged forward)\n")
        L.append(
            "Replicated: every core holds all DiT weights. FSDP: each core holds 1/8 of every parameter; a "
            "block's weights are all-gathered just in time into a double buffer while the previous layer "
            "computes (exposed = max(0, gather - previous layer's compute) per layer). TP-sharded linears: "
            "Megatron column/row parallel inside each TP group, 3 activation all-reduces + 2 "
            "RMSNorm-statistics "
            "all-reduces per layer, the SP K/V all-gather kept, serial with compute. The collective model "
            "is the "
            "end's (`CommModel` optimistic / conservative).\n"
        )
        L.append(
            "| weights | end | chunk ms | fps | DiT fps | comm ms | weight comm ms | barrier ms | HBM bf16 "
            "GB | HBM fp8 KV GB |"
        )
        L.append("|---|---|---|---|---|---|---|---|---|---|")
        for wp, end, cm in r.weight_variants:
            gr = cm.by_group()
            fa, fb = by_label.get(f"bf16, {_WP_LABEL[wp]}"), by_label.get(f"fp8 KV cache, {_WP_LABEL[wp]}")
            L.append(
                f"| {_WP_NAMES[wp]} | {end} | {_ms(cm.chunk_s)} | {cm.fps:.2f} | {cm.dit_fps:.2f} | "
                f"{_ms(gr.get('comm', 0.0))} | {_ms(gr.get('weight_comm', 0.0))} | "
                f"{_ms(gr.get('barrier', 0.0))} | "
                f"{_gb(fa.per_chip) if fa else '-'} | {_gb(fb.per_chip) if fb else '-'} |"
            )
        L.append("")
        L.append(
            "The `one shared weight copy` lines are a bound, not a modelled placement: HBM is 4 stacks each "
            "shared by 2 physical cores and under LNC=1 every core's runtime holds its own tensors (AWS "
            "Neuron "
            "docs, logical-neuroncore-config); one copy read by all 8 cores needs cross-stack reads the cost "
            "model has no bandwidth figure for.\n"
        )
    L.append("## HBM footprint (modelled arithmetic; formulas in `perf/footprint.py`)\n")
    for fp in r.footprints:
        L.append(f"**{fp.label}**: {_gb(fp.per_core)} GB per core, {_gb(fp.per_chip)} GB per chip\n")
        L.append("| item | per core GB | per chip GB | formula |")
        L.append("|---|---|---|---|")
        for i in fp.items:
            L.append(f"| {i.name} | {_gb(i.per_core)} | {_gb(i.per_chip)} | {i.formula} |")
        L.append("")
    for lb in r.lower_bounds:
        L.append(f"**{lb.label}**: {_gb(lb.per_chip)} GB per chip\n")
        L.append("| item | per chip GB | formula |")
        L.append("|---|---|---|")
        for i in lb.items:
            L.append(f"| {i.name} | {_gb(i.per_chip)} | {i.formula} |")
        L.append("")
    L.append(
        "Not counted: the umT5-XXL text encoder (once per prompt; unload or run on the host), runtime "
        "reservations, instruction buffers.\n"
    )
    L += _footprint_check_lines()
    L.append("## Assumptions (all modelled)\n")
    L.append(
        "- kernels run back to back (no overlap between kernels); the sharded stream's per-layer collectives "
        "overlap compute only where the stream's data dependencies allow (`perf/e2e/overlap.py`, one graph "
        "per forward; serialised without `--compile` and for the FSDP / TP-linear variants), the FSDP "
        "weight prefetch as stated; inside one kernel cost model v2's schedule overlaps engines as far as "
        "the kernel's dependencies allow (read-after-write and write-after-read through its tiles) and "
        "prices the VectorE/GpSimd shared SBUF port; the end-to-end `vector_gpsimd_contention` applies only "
        "to kernels not priced by that schedule (the analytic fallback)."
    )
    L.append(f"- plots: {', '.join(png_names)}")
    L.append("")
    return "\n".join(L)
