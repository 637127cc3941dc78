"""The report's "per-layer critical path" section: which collectives of one layer hide behind which
compute, what still waits, and the chunk before / after the overlap at both ends (all *modelled*,
``perf.e2e.overlap``)."""

from __future__ import annotations

from perf.e2e.chunk import ChunkModel
from perf.e2e.overlap import ESTIMATE, SUB_BLOCKS, ForwardOverlap, Slot
from perf.e2e.report_fmt import _ms

__all__ = ["overlap_lines", "layer_table_lines", "schedule_rows_lines"]

_SCHEDULE_TEXT = {
    "serial_plan": "before: the plan's 3 collectives per layer (one fused K/V + cache all-gather priced at "
    "the plan's key shard: num_keys / sp), back to back with compute",
    "serial_split": "the code's 4 collectives per layer (the new keys' SP shard and every cache slot's "
    "share gathered apart), back to back",
    "overlap": "after (headline): the code's 4 collectives on the CC stream, compute waits only where "
    "its inputs are not there (+ DMA/HBM contention of the hidden ones)",
}
_SCHEDULE_TEXT[ESTIMATE] = (
    f"estimate, NOT built: {SUB_BLOCKS} token sub-blocks (projection + q/k norm, attention by queries and "
    "o_proj split, their collectives in parts; more kernel calls and collectives charged)"
)
_COLL_TEXT = {
    "kv_cache": "SP all-gather of the cached K/V share",
    "qkv_in": "TP all-to-all of q, k, v",
    "kv_fresh": "SP all-gather of the new k, v",
    "out": "TP all-to-all of the output",
}


def _fps(cm: ChunkModel, s: float) -> float:
    return cm.video_frames / s


def schedule_rows_lines(lo: ChunkModel, hi: ChunkModel) -> list[str]:
    """Before / after table: each comm schedule's charge, collectives and chunk time at both ends
    (``lo`` pessimistic, ``hi`` optimistic)."""
    out = [
        "| per-layer collectives charged as | MB per layer and rank | comm ms per chunk (pess.-opt.) | "
        "collectives per chunk | chunk ms (pess.-opt.) | fps (pess.-opt.) |",
        "|---|---|---|---|---|---|",
    ]
    for a_lo in lo.comm_alternatives:
        a_hi = hi.comm_alternative(a_lo.schedule)
        s_lo, s_hi = lo.chunk_s_under(a_lo.schedule), hi.chunk_s_under(a_lo.schedule)
        mark = "**" if a_lo.schedule == lo.comm_schedule else ""
        out.append(
            f"| {_SCHEDULE_TEXT[a_lo.schedule]} | {a_lo.bytes_per_layer / 1e6:.2f} | "
            f"{_ms(a_lo.comm_s)}-{_ms(a_hi.comm_s)} | "
            f"{a_lo.collectives} | {mark}{_ms(s_lo)}-{_ms(s_hi)}{mark} | "
            f"{mark}{_fps(lo, s_lo):.2f}-{_fps(hi, s_hi):.2f}{mark} |"
        )
    return out


def _layer_slots(fo: ForwardOverlap, layer: int) -> list[Slot]:
    tag = f"{layer}:"
    return sorted(
        (s for s in fo.sched.slots if s.op.name.startswith(tag)), key=lambda s: (s.start, s.op.engine)
    )


def layer_table_lines(lo: ChunkModel, hi: ChunkModel, layer: int = 1) -> list[str]:
    """One steady layer of the first forward on the two queues (``lo`` pessimistic, ``hi`` optimistic):
    every op, its time at both ends, when it starts (ms from the layer's first compute, pessimistic end)
    and what it overlaps or waits for."""
    f_lo, f_hi = lo.overlaps[0], hi.overlaps[0]
    if not 0 <= layer < f_lo.layers:
        raise ValueError(f"layer_table_lines: layer must be in [0, {f_lo.layers}), got {layer}")
    slots = _layer_slots(f_lo, layer)
    t0 = min(s.start for s in slots if s.op.engine == "compute")
    idx = {s.op.name: i for i, s in enumerate(f_lo.sched.on("compute"))}
    out = [
        "| op | engine | ms (pess.-opt.) | starts at ms (pess.) | overlaps / waits (pess.; opt.) |",
        "|---|---|---|---|---|",
    ]
    for s in slots:
        name = s.op.name.split(":", 1)[1]
        o_hi = f_hi.sched.slot(s.op.name)
        if s.op.engine == "comm":
            what = f"{_COLL_TEXT.get(name, name)}; "
            parts = []
            for f in (f_lo, f_hi):
                under = f.sched.under(s.op.name)
                hid = f.sched.hidden_s(s.op.name)
                exp = s.op.time_s if f is f_lo else o_hi.op.time_s
                parts.append(
                    f"under {', '.join(under)} ({_ms(hid)} ms hidden)"
                    if under
                    else f"hidden 0 of {_ms(exp)} ms"
                )
            what += "; ".join(parts)
        else:
            i = idx[s.op.name]
            waits = []
            for f in (f_lo, f_hi):
                c = f.sched.on("compute")
                gap = c[i].start - (c[i - 1].end if i else 0.0)
                waits.append(f"waits {_ms(gap)} ms for {', '.join(c[i].op.deps)}" if gap > 1e-12 else "")
            what = "; ".join(w or "no wait" for w in waits) if any(waits) else ""
        out.append(
            f"| {name} | {s.op.engine} | {_ms(s.op.time_s)}-{_ms(o_hi.op.time_s)} | {_ms(s.start - t0)} | "
            f"{what} |"
        )
    return out


def overlap_lines(lo: ChunkModel, hi: ChunkModel) -> list[str]:
    """The report section (``lo`` / ``hi``: the merged chunk at the pessimistic / optimistic end)."""
    if not lo.overlaps or not hi.overlaps:
        return []
    f_lo, f_hi = lo.overlaps[0], hi.overlaps[0]
    L = f_lo.layers
    per = {c.role: (c, h) for c, h in zip(f_lo.collectives, f_hi.collectives, strict=True)}
    waits = [r for r in ("qkv_in", "kv_fresh", "out") if r in per]
    hidden_lo = sum(f_lo.sched.hidden_s(f"{ly}:kv_cache") for ly in range(L)) if "kv_cache" in per else 0.0
    out = [
        "## Per-layer critical path (modelled: collectives vs compute)\n",
        "On trn2 a collective runs on the chip's collective-communication cores over pre-built DMA rings, "
        "asynchronously to the compute engines (AWS Neuron SDK, `neuron-runtime/explore/"
        "compute-comm-overlap.rst`). `perf/e2e/overlap.py` places each forward's kernels on one in-order "
        "compute queue and its collectives on one in-order CC stream, with the sharded stream's data "
        "dependencies (`sharding/layer_comm.py`: the collectives `sharding.attention.sharded_attention` "
        "issues, in order, with the code's bytes); compute waits only for collectives whose results it "
        "needs. A collective running under compute adds its HBM traffic to that compute at the pessimistic "
        "end (shared DMA engines and HBM; unmeasured, 0 at the optimistic end).\n",
        schedule_rows_lines(lo, hi)[0],
        *schedule_rows_lines(lo, hi)[1:],
        "",
        "The before row charged one fused SP gather at the plan's key shard; the code's gathers (the new "
        "keys' SP shard of every token of the forward + every cache slot's share) move "
        "more bytes, so serialised they would cost more (middle row); hiding the cache share's gather "
        "brings the charge back near the old figure, below it at the optimistic end. Both gathers move "
        "what the local step reads (the cache ring in place, the new keys).\n",
        f"One steady layer (layer 1 of {L}) of the merged forward; the cache share's gather of a layer runs "
        "under the previous layer's tail (its buffer is free once the previous layer's attention has read "
        "it: one gather buffer, as `perf.footprint` counts):\n",
        *layer_table_lines(lo, hi),
        "",
    ]
    still = " + ".join(f"{r} {_ms(per[r][0].time_s)}-{_ms(per[r][1].time_s)}" for r in waits)
    out.append(
        f"What overlaps: the cached K/V share's all-gather ({_ms(per['kv_cache'][0].time_s)}-"
        f"{_ms(per['kv_cache'][1].time_s)} ms per layer; {_ms(hidden_lo)} of "
        f"{_ms(L * per['kv_cache'][0].time_s)} ms per forward hidden at the pessimistic end) under the "
        "previous layer's work after its output all-to-all (and this layer's projection when that is "
        "short). What still waits (per layer, pess.-opt.): "
        f"{still} ms: the all-to-all needs the projection and q/k norm, the new keys' gather needs the "
        "all-to-all, RoPE and the attention need the new keys, and everything after the attention needs "
        "its output all-to-all; only splitting the tokens into sub-blocks (projection of block i+1 under "
        "the collectives of block i; attention output by query blocks) could hide them (not built). "
        f"The estimate row prices that split at {SUB_BLOCKS} sub-blocks: chunk "
        f"{_ms(lo.chunk_s_under(ESTIMATE) - lo.chunk_s)} / {_ms(hi.chunk_s_under(ESTIMATE) - hi.chunk_s)} ms "
        "(pess. / opt.) against the headline. "
        f"Exposed per layer {_ms(f_lo.exposed_s / L)}-{_ms(f_hi.exposed_s / L)} ms + contention "
        f"{_ms(f_lo.contention_s / L)}-{_ms(f_hi.contention_s / L)} ms, vs "
        f"{_ms(f_lo.serial_s / L)}-{_ms(f_hi.serial_s / L)} ms for the same collectives serialised.\n"
    )
    return out
