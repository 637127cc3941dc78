"""The per-chunk budget: every component's modelled time at both ends, its bound, its roofline and the gap.

For each component of a :class:`~perf.e2e.chunk.ChunkModel` (one core's view of one chunk; components run
back to back):

* ``ms`` at the optimistic and the pessimistic end (per chunk: time per call x calls);
* ``bound``: the engine (``tensor``, ``vector``, ``scalar``, ``gpsimd``, ``dma``), ``hbm`` or
  ``collective`` that bounds it in the model (the busiest engine of its traced kernel, the larger term of
  an analytic one);
* ``roofline``: what the work requires at peak on one core, ``max(FLOPs / (cores x dense bf16 peak),
  compulsory HBM bytes / per-core HBM bandwidth)`` per call (the larger of the two is the roofline's
  ``kind``); communication, collective barriers, per-kernel fixed time and NEFF launches have a roofline
  of 0 (work a better schedule hides or removes, not work the model requires);
* ``gap``: pessimistic ms minus roofline ms, the time a better kernel or schedule could win back at most.

Rows are sorted by gap, largest first.  All *modelled*.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from perf.e2e.chunk import ChunkModel
from perf.e2e.components import Component

__all__ = ["BudgetRow", "budget_rows", "budget_lines", "layer_path_lines", "OVERHEAD_BOUNDS", "LAYER_ORDER"]

OVERHEAD_BOUNDS = {"kernel_fixed": "fixed time", "barrier": "barrier", "launch": "host launch"}
"""Bound label of the overhead groups (no roofline: they are not work the model requires)."""

LAYER_ORDER = (
    "adaln_norm1_mod",
    "qkv_proj",
    "rmsnorm_qk",
    "rope3d",
    "kv_cache_write",
    "sharding_comm",
    "comm_contention",
    "attn_merged",
    "attn_update",
    "attn_denoise",
    "o_proj",
    "gate_residual_sa",
    "norm3_affine",
    "cross_q_proj",
    "rmsnorm_cross_q",
    "cross_attn",
    "cross_o_proj",
    "residual_cross",
    "adaln_norm2_mod",
    "ffn_up",
    "gelu_tanh",
    "ffn_down",
    "gate_residual_ffn",
)
"""Execution order of one Wan DiT block's components (attention block, cross-attention block, FFN)."""


@dataclass(frozen=True)
class BudgetRow:
    """One component of the chunk at both ends (ms per chunk on the critical core)."""

    name: str
    group: str
    bound: str
    ms_opt: float
    ms_pess: float
    roofline_ms: float
    roofline_kind: str
    tflop: float

    @property
    def gap_ms(self) -> float:
        """Pessimistic-end time above the roofline."""
        return self.ms_pess - self.roofline_ms

    @property
    def gap_x(self) -> float | None:
        """Pessimistic-end time over the roofline (``None`` when the roofline is 0)."""
        return self.ms_pess / self.roofline_ms if self.roofline_ms > 0 else None


def _roofline_s(c: Component, cm: ChunkModel) -> tuple[float, str]:
    """Roofline seconds of one call of ``c`` on one core and which side bounds it."""
    if c.group in OVERHEAD_BOUNDS or c.group in ("comm", "weight_comm"):
        return 0.0, "overhead"
    p = cm.params
    t_flop = c.flops / (cm.cores * p.peak_flops_per_core)
    t_byte = c.hbm_bytes / p.hbm_Bps_per_core
    return (t_flop, "flops") if t_flop >= t_byte else (t_byte, "bytes")


def budget_rows(opt: ChunkModel, pess: ChunkModel) -> list[BudgetRow]:
    """One :class:`BudgetRow` per component of ``opt`` / ``pess`` (the same chunk at its two ends), sorted
    by gap (largest first).  Raises ``ValueError`` when the two chunks do not have the same components."""
    if opt.component_names() != pess.component_names():
        raise ValueError("budget_rows: opt and pess must be the same chunk model at its two ends")
    rows = []
    for co, cp in zip(opt.components, pess.components, strict=True):
        roof_s, kind = _roofline_s(cp, pess)
        bound = OVERHEAD_BOUNDS.get(cp.group, cp.bound or cp.group)
        rows.append(
            BudgetRow(
                cp.name,
                cp.group,
                bound,
                co.total_s * 1e3,
                cp.total_s * 1e3,
                roof_s * cp.calls * 1e3,
                kind,
                cp.flops * cp.calls / 1e12,
            )
        )
    return sorted(rows, key=lambda r: r.gap_ms, reverse=True)


def budget_lines(opt: ChunkModel, pess: ChunkModel) -> list[str]:
    """Markdown table of :func:`budget_rows` plus a total line with the roofline's fps."""
    rows = budget_rows(opt, pess)
    tot_o, tot_p = opt.chunk_s * 1e3, pess.chunk_s * 1e3
    roof = sum(r.roofline_ms for r in rows)
    out = [
        "| component | group | bound | ms per chunk (pess.) | ms (opt.) | share (pess.) | roofline ms "
        "(kind) | gap ms (pess.) | x roofline |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gx = f"x{r.gap_x:.1f}" if r.gap_x is not None else "-"
        out.append(
            f"| {r.name} | {r.group} | {r.bound} | {r.ms_pess:,.2f} | {r.ms_opt:,.2f} | "
            f"{r.ms_pess / tot_p:.1%} | {r.roofline_ms:,.2f} ({r.roofline_kind}) | {r.gap_ms:,.2f} | {gx} |"
        )
    frames = pess.video_frames
    out.append(
        f"| **total** | | | **{tot_p:,.2f}** | **{tot_o:,.2f}** | 100% | **{roof:,.2f}** "
        f"(= {frames / (roof / 1e3):.1f} fps) | {tot_p - roof:,.2f} | x{tot_p / roof:.1f} |"
    )
    return out


def _per_layer(cm: ChunkModel) -> dict[str, float]:
    layers = max((c.calls for c in cm.components if c.per_layer), default=1)
    return {c.name: c.time_s * 1e3 * c.calls / layers for c in cm.components if c.per_layer}


def layer_path_lines(opt: ChunkModel, pess: ChunkModel, order: Sequence[str] = LAYER_ORDER) -> list[str]:
    """The critical path of one DiT layer on one core (ms per layer, pess.-opt.), in execution order, with
    the points where every core waits for every other (collectives)."""
    po, pp = _per_layer(opt), _per_layer(pess)
    names = [n for n in order if n in pp] + [n for n in pp if n not in order]
    steps = []
    for n in names:
        sync = " [all cores wait]" if n in ("sharding_comm",) else ""
        steps.append(f"{n} {pp[n]:.2f}-{po[n]:.2f}{sync}")
    total_p, total_o = sum(pp.values()), sum(po.values())

    def grp(cm: ChunkModel, groups: Sequence[str]) -> float:
        return cm.time(groups) * 1e3

    rest = [c for c in pess.components if not c.per_layer and c.group not in ("vae", *OVERHEAD_BOUNDS)]
    rest_names = ", ".join(sorted({c.name for c in rest})) or "none"
    return [
        f"Per layer on each core (ms, pess.-opt.; {total_p:.2f}-{total_o:.2f} ms per layer): "
        + " -> ".join(steps)
        + ".",
        "",
        f"Per chunk: the layers above x their calls, then the once-per-forward items ({rest_names}; the "
        "head gather is a collective every core waits on), then the VAE decode of the new block "
        f"({grp(pess, ['vae']):,.2f}-{grp(opt, ['vae']):,.2f} ms, spatially split over the cores, waiting "
        "for the last forward); per-kernel fixed time, collective barriers and NEFF launches "
        f"({grp(pess, list(OVERHEAD_BOUNDS)):,.2f}-{grp(opt, list(OVERHEAD_BOUNDS)):,.2f} ms) are spread "
        "over the path. The SP shards are equal in size, so the model charges no imbalance at the sync "
        "points: every core runs the same path.",
    ]
