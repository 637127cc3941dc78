"""The chunk model: the forwards of one steady-state chunk + VAE decode + the Neuron execution overheads.

Chunk time = sum over components of (modelled time per call x calls per chunk); kernels run back to
back.  The per-layer collectives of the sharded stream (replicated weights) are charged by
``comm_schedule`` (:data:`perf.e2e.overlap.COMM_SCHEDULES`): by default (one graph per forward) only
the part of them compute waits for (:mod:`perf.e2e.overlap`'s critical path over the collectives the
code issues, :func:`sharding.layer_comm.layer_collectives`, component ``sharding_comm``) plus their
DMA/HBM contention with the compute they run under (``comm_contention``); ``serial_split`` charges the
same collectives back to back, ``serial_plan`` the plan's three (the model before the overlap);
the FSDP prefetch overlaps as :func:`chunk_model` says.  On top of the kernels'
own times (:mod:`perf.e2e.components`), three overhead components, each counted, not guessed:

* ``kernel_fixed``: ``kernel_fixed_s`` x the chunk's kernel calls (sum of every component's
  ``launches x calls``);
* ``collective_barrier``: ``collective_barrier_s`` x the chunk's collectives (sum of ``collectives x
  calls``);
* ``neff_launch``: ``neff_launch_s`` x the NEFF launches of :func:`perf.e2e.launches.neffs_per_chunk`
  for the chunk's compile mode.

A :class:`ChunkModel` is evaluated at one end of the parameter ranges (``end``).  All *modelled*.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from perf.e2e.compact import KV_CACHES, text_kv_collective, vae_weight_gather
from perf.e2e.components import GROUPS, Component, Forward, forward_components, vae_components
from perf.e2e.kernels import KernelProvider
from perf.e2e.launches import LaunchPlan, neffs_per_chunk
from perf.e2e.overlap import (
    COMM_SCHEDULES,
    ESTIMATE,
    SUB_BLOCKS,
    CommAlternative,
    ForwardOverlap,
    forward_overlap,
    split_names,
)
from perf.e2e.params import E2EParams
from perf.e2e.weights import WEIGHT_VARIANTS, fsdp_gather, fsdp_linear_components, tp_linear_comm
from perf.footprint import GATHER_UNITS, VAE_WEIGHT_PLACEMENTS, VaeProbe, merged_tokens, vae_strides
from perf.matmul_model import MatmulProvider
from rolling_forcing.config import ModelConfig, PipelineConfig
from rolling_forcing.merged import copy_blocks
from sharding.layer_comm import LayerCollective

__all__ = [
    "OVERHEAD_GROUPS",
    "ChunkModel",
    "chunk_model",
    "steady_forwards",
    "warmup_forwards",
    "summarize",
]

OVERHEAD_GROUPS = ("kernel_fixed", "barrier", "launch")


@dataclass(frozen=True)
class ChunkModel:
    """Modelled chunk of one variant (``merged`` or ``two_pass``) on ``cores`` cores at one ``end``."""

    variant: str
    cores: int
    plan_name: str
    tp: int
    sp: int
    components: tuple[Component, ...]
    video_frames: int
    params: E2EParams
    end: str = "optimistic"
    launch_plan: LaunchPlan | None = None
    comm_schedule: str = "serial_plan"
    overlaps: tuple[ForwardOverlap, ...] = ()
    comm_alternatives: tuple[CommAlternative, ...] = ()

    def comm_alternative(self, schedule: str) -> CommAlternative:
        """The per-layer collectives' charge under ``schedule`` (one of ``COMM_SCHEDULES``)."""
        for a in self.comm_alternatives:
            if a.schedule == schedule:
                return a
        raise ValueError(f"chunk has no comm alternative {schedule!r} (has {self.comm_alternatives})")

    def chunk_s_under(self, schedule: str) -> float:
        """Chunk time with the per-layer collectives charged by ``schedule`` instead of
        :attr:`comm_schedule`: the components are additive, so the comm charge and the collective
        barriers of the difference in collectives are swapped (NEFF launches unchanged: exact for one
        graph per forward, where collectives do not cut graphs)."""
        cur, alt = self.comm_alternative(self.comm_schedule), self.comm_alternative(schedule)
        point = self.params.at(self.end)
        calls = (alt.extra_kernel_calls - cur.extra_kernel_calls) * point.kernel_fixed_s
        barrier = (alt.collectives - cur.collectives) * point.collective_barrier_s
        return self.chunk_s - cur.comm_s + alt.comm_s + barrier + calls

    def time(self, groups: Sequence[str] | None = None) -> float:
        return sum(c.total_s for c in self.components if groups is None or c.group in groups)

    @property
    def chunk_s(self) -> float:
        return self.time()

    @property
    def dit_s(self) -> float:
        """Everything but the VAE (the VAE's NEFF launch stays in, a small share)."""
        return self.time([g for g in GROUPS if g != "vae"])

    @property
    def flops(self) -> int:
        return sum(c.flops * c.calls for c in self.components)

    @property
    def dit_flops(self) -> int:
        return sum(c.flops * c.calls for c in self.components if c.group != "vae")

    @property
    def fps(self) -> float:
        return self.video_frames / self.chunk_s

    @property
    def dit_fps(self) -> float:
        return self.video_frames / self.dit_s

    @property
    def mfu(self) -> float:
        """Useful FLOPs / (chunk time x cores x per-core dense bf16 peak)."""
        return self.flops / (self.chunk_s * self.cores * self.params.peak_flops_per_core)

    @property
    def mfu_published_peak(self) -> float:
        """Useful FLOPs / (chunk time x the chips' published 667 TF)."""
        chips = math.ceil(self.cores / 8)
        return self.flops / (self.chunk_s * chips * self.params.chip_peak_flops_published)

    @property
    def launches(self) -> int:
        """Kernel calls per chunk (every component's ``launches x calls``)."""
        return sum(c.launches * c.calls for c in self.components)

    kernel_calls = launches

    @property
    def collectives(self) -> int:
        """Collectives per chunk on one rank."""
        return sum(c.collectives * c.calls for c in self.components)

    @property
    def neffs(self) -> int:
        """NEFF launches per chunk on one rank (0 when the chunk has no launch plan)."""
        return self.launch_plan.neffs if self.launch_plan is not None else 0

    def headroom(self, target_fps: float | None = None) -> float:
        """``1 - chunk time / deadline`` with deadline = video frames / target fps."""
        tf = self.params.target_fps if target_fps is None else target_fps
        return 1.0 - self.chunk_s / (self.video_frames / tf)

    def by_group(self) -> dict[str, float]:
        return {g: self.time([g]) for g in GROUPS if self.time([g]) > 0}

    def component_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.components)


def _plan(num_heads: int, cores: int, queries: int, keys: int, comm_model: Any) -> Any:
    from sharding.plan import AttentionShape, plan

    return plan(num_heads, cores, shape=AttentionShape(num_queries=queries, num_keys=keys), model=comm_model)


def steady_forwards(m: ModelConfig, p: PipelineConfig, variant: str) -> list[Forward]:
    """The forwards of one steady-state chunk (shapes from the config)."""
    blk = p.tokens_per_block(m)
    win = p.window_frames * m.tokens_per_frame
    keys = p.key_budget_tokens(m)
    if variant == "merged":
        groups = (("update", blk, keys), ("denoise", win, keys))
        copies = copy_blocks(p, p.positions) * blk  # roped copies per layer (absolute: the sink block)
        return [Forward("merged", merged_tokens(m, p), groups, block_tokens=blk, copy_tokens=copies)]
    if variant == "two_pass":
        return [
            Forward("denoise", win, (("denoise", win, keys),)),
            Forward("update", blk, (("update", blk, keys),)),
        ]
    raise ValueError(f"variant must be 'merged' or 'two_pass', got {variant!r}")


def warmup_forwards(m: ModelConfig, p: PipelineConfig) -> list[Forward]:
    """Merged forwards of warm-up windows 0..window_blocks-1 (window w holds w+1 blocks; keys = window only;
    the update block (block 0) attends to itself)."""
    blk = p.tokens_per_block(m)
    out = []
    for w in range(p.window_blocks):
        win = (w + 1) * blk
        out.append(Forward(f"warmup{w}", blk + win, (("update", blk, blk), ("denoise", win, win))))
    return out


def chunk_model(
    m: ModelConfig,
    p: PipelineConfig,
    *,
    cores: int,
    variant: str = "merged",
    vae: VaeProbe | None,
    kernels: KernelProvider,
    matmul: MatmulProvider,
    params: E2EParams,
    end: str = "optimistic",
    comm_model: Any = None,
    forwards: list[Forward] | None = None,
    vae_layers: str = "steady",
    weights: str = "replicated",
    compile_mode: str = "fullgraph",
    comm_schedule: str | None = None,
    kv_cache: str = "sp_sharded",
    vae_weights: str = "replicated",
    gather_unit: str = "block",
) -> ChunkModel:
    """Modelled chunk at ``end``: the forwards (default: steady state of ``variant``) + VAE decode of the
    block + kernel fixed costs, collective barriers and NEFF launches (module docstring).

    ``comm_model`` overrides the end's ``sharding.plan.CommModel``.  ``compile_mode`` is one of
    :data:`perf.e2e.launches.COMPILE_MODES` (``"peer"`` uses ``params.peer_neffs_per_forward``).
    ``weights`` (one of :data:`WEIGHT_VARIANTS`):

    * ``"replicated"``: the plan as is (weights on every core; per-layer all-to-all + K/V all-gather).
    * ``"fsdp"``: plus the just-in-time all-gather of each block's weights (:func:`fsdp_gather`) into a
      double buffer, prefetched while the previous layer computes: exposed time per layer
      ``max(0, gather - previous layer's compute)``; the first block's gather and the non-block weights'
      gather are charged in full once per forward.  Assumes the gather's DMA does not slow compute.
    * ``"tp_linear"``: Megatron linears (``linear_mode="tp_linear"``); per layer the plan's SP K/V
      all-gather + :func:`tp_linear_comm`, serial with compute.

    ``comm_schedule`` (one of :data:`perf.e2e.overlap.COMM_SCHEDULES`; replicated weights only, the
    others are ``serial_plan``): None picks ``overlap`` for ``compile_mode="fullgraph"`` (collectives
    inside the one graph, issued asynchronously) and ``serial_split`` otherwise (host collectives cut
    the graph).  Every choice's charge is kept in :attr:`ChunkModel.comm_alternatives`.

    ``kv_cache`` (:data:`perf.e2e.compact.KV_CACHES`): ``"sp_compact"`` (needs ``sp > 1`` and weights
    ``"replicated"`` or ``"fsdp"``) prices the compact layout's collectives: the cache-share gather of
    a ring one slot shorter and the per-layer text k/v all-gather
    (:func:`perf.e2e.compact.text_kv_collective`, component ``text_kv_gather``: the time it adds to the
    forward's critical path + its contention, or its time under ``serial_split``), scheduled with the
    stream's own collectives (``overlap`` or ``serial_split``, also with ``weights="fsdp"``, whose weight
    gathers stay priced as above).  ``vae_weights="fsdp"`` adds ``vae_weight_gather``
    (:func:`perf.e2e.compact.vae_weight_gather`, charged in full once per decode).  ``gather_unit``
    (``perf.footprint.GATHER_UNITS``; ``"linear"`` only with ``weights="fsdp"``): the FSDP gathers per
    linear layer instead of per block (:func:`perf.e2e.weights.fsdp_linear_components`).
    """
    if gather_unit not in GATHER_UNITS or (gather_unit != "block" and weights != "fsdp"):
        raise ValueError(
            f"chunk_model: gather_unit must be one of {GATHER_UNITS} ('linear' only with weights='fsdp')"
        )
    if weights not in WEIGHT_VARIANTS:
        raise ValueError(f"chunk_model: weights must be one of {WEIGHT_VARIANTS}, got {weights!r}")
    if kv_cache not in KV_CACHES:
        raise ValueError(f"chunk_model: kv_cache must be one of {KV_CACHES}, got {kv_cache!r}")
    if vae_weights not in VAE_WEIGHT_PLACEMENTS:
        raise ValueError(
            f"chunk_model: vae_weights must be one of {VAE_WEIGHT_PLACEMENTS}, got {vae_weights!r}"
        )
    compact = kv_cache == "sp_compact"
    if compact and weights == "tp_linear":
        raise ValueError("chunk_model: kv_cache='sp_compact' is priced with weights 'replicated' or 'fsdp'")
    if compact and comm_schedule == "serial_plan":
        raise ValueError("chunk_model: kv_cache='sp_compact' takes comm_schedule 'overlap' or 'serial_split'")
    if comm_schedule is None:
        if weights != "replicated" and not compact:
            comm_schedule = "serial_plan"
        else:
            comm_schedule = "overlap" if compile_mode == "fullgraph" else "serial_split"
    if comm_schedule not in COMM_SCHEDULES:
        raise ValueError(f"chunk_model: comm_schedule must be one of {COMM_SCHEDULES}, got {comm_schedule!r}")
    if weights != "replicated" and comm_schedule != "serial_plan" and not compact:
        raise ValueError(
            f"chunk_model: comm_schedule={comm_schedule!r} models the sharded stream's own collectives "
            f"(weights='replicated'); weights={weights!r} takes 'serial_plan'"
        )
    point = params.at(end)
    cmodel = point.comm_model if comm_model is None else comm_model
    fwds = steady_forwards(m, p, variant) if forwards is None else forwards
    comps: list[Component] = []
    overlaps: list[ForwardOverlap] = []
    alts: list[CommAlternative] = []
    pl = None
    for fwd in fwds:
        lq = sum(a[1] for a in fwd.attention)
        lk = max(a[2] for a in fwd.attention)
        pl = _plan(m.num_heads, cores, max(fwd.tokens, lq), lk, cmodel)
        comm_s, n_coll, src, mode = pl.comm_time_s, pl.comm.collectives, "sharding.plan", "token"
        if weights == "tp_linear":
            _, t_tp, c_tp = tp_linear_comm(m, fwd.tokens, pl.tp, pl.sp, pl.model)
            comm_s = pl.comm.all_gather_s + t_tp
            n_coll = (1 if pl.sp > 1 else 0) + c_tp
            src, mode = f"K/V gather + {c_tp} TP all-reduces ({pl.model.name})", "tp_linear"
        has_head = any(a[0] != "update" for a in fwd.attention)
        spans = cores > pl.model.cores_per_chip
        head_bytes = fwd.tokens * m.patch_out * 2
        head_s = pl.model.all_gather_s(cores, head_bytes - math.ceil(head_bytes / cores), spans)
        cs = forward_components(
            m,
            fwd,
            tp=pl.tp,
            sp=pl.sp,
            comm_s=comm_s,
            collectives=n_coll,
            kernels=kernels,
            matmul=matmul,
            params=params,
            point=point,
            linear_mode=mode,
            comm_source=f"{src} ({pl.model.name})" if weights != "tp_linear" else src,
            head_gather_s=head_s,
        )
        if not has_head:
            cs = [c for c in cs if c.name != "head_gather"]
        if compact and pl.sp < 2:
            raise ValueError(f"chunk_model: kv_cache='sp_compact' needs sp > 1, the plan is {pl.name}")
        text = text_kv_collective(m, pl.tp * pl.sp, pl.model) if compact else None
        if (weights == "replicated" or compact) and comm_s > 0:
            cs, fo, alt = _stream_comm(
                m, p, fwd, pl, cs, comm_schedule, point.end, params.hbm_Bps_per_core, text
            )
            overlaps.append(fo)
            alts = _add_alternatives(alts, alt)
        if weights == "fsdp" and gather_unit == "linear":
            cs += fsdp_linear_components(m, cs, pl.tp * pl.sp, pl.model)
        elif weights == "fsdp":
            layer_s = sum(c.time_s for c in cs if c.per_layer)
            _, g_blk, _, g_out = fsdp_gather(m, pl.tp * pl.sp, pl.model)
            exposed = max(0.0, g_blk - layer_s)
            tag = f"FSDP all-gather ({pl.model.name})"
            cs += [
                Component("weight_gather_first", "weight_comm", g_blk + g_out, 1, 0, 0, False, tag, 2),
                Component(
                    "weight_gather_exposed",
                    "weight_comm",
                    exposed,
                    m.num_layers - 1,
                    0,
                    0,
                    False,
                    f"{tag}: max(0, {g_blk * 1e3:.3f} - {layer_s * 1e3:.3f} ms)",
                    1,
                ),
            ]
        comps += [replace(c, name=c.name if len(fwds) == 1 else f"{fwd.name}:{c.name}") for c in cs]
    if vae is not None:
        layers = vae.steady if vae_layers == "steady" else vae.first
        comps += vae_components(vae, layers, cores, matmul, params, vae_layers, end)
        if vae_weights == "fsdp":
            vb, vt = vae_weight_gather(vae.decoder_params, cores, cmodel)
            src = f"FSDP all-gather of the decoder weights, {vb / 1e6:.1f} MB/core, unhidden ({cmodel.name})"
            comps.append(Component("vae_weight_gather", "vae", vt, 1, 0, 0, False, src, 1))
    assert pl is not None
    kernel_calls = sum(c.launches * c.calls for c in comps)
    collectives = sum(c.collectives * c.calls for c in comps)
    lp = neffs_per_chunk(
        compile_mode,
        forwards=len(fwds),
        collectives=collectives,
        peer_neffs_per_forward=params.peer_neffs_per_forward,
    )
    if vae is None and compile_mode != "peer":  # no decode in this chunk: no VAE NEFF
        lp = replace(lp, neffs=lp.neffs - 1, terms=tuple((w, n) for w, n in lp.terms if w != "VAE decode"))
    comps += [
        Component(
            "kernel_fixed",
            "kernel_fixed",
            point.kernel_fixed_s,
            kernel_calls,
            0,
            0,
            False,
            f"{point.end}: kernel_fixed_s x kernel calls",
        ),
        Component(
            "collective_barrier",
            "barrier",
            point.collective_barrier_s,
            collectives,
            0,
            0,
            False,
            f"{point.end}: collective_barrier_s x collectives",
        ),
        Component(
            "neff_launch",
            "launch",
            params.neff_launch_s,
            lp.neffs,
            0,
            0,
            False,
            f"neff_launch_s x NEFFs ({compile_mode})",
        ),
    ]
    t_stride = vae.temporal_stride if vae is not None else vae_strides()[0]
    return ChunkModel(
        variant,
        cores,
        pl.name,
        pl.tp,
        pl.sp,
        tuple(comps),
        p.frames_per_block * t_stride,
        params,
        end,
        lp,
        comm_schedule if overlaps else "serial_plan",
        tuple(overlaps),
        tuple(alts),
    )


def _add_alternatives(a: list[CommAlternative], b: list[CommAlternative]) -> list[CommAlternative]:
    """Per-schedule sums of two forwards' charges (``a`` empty: ``b``)."""
    if not a:
        return b
    return [
        replace(
            x,
            comm_s=x.comm_s + y.comm_s,
            collectives=x.collectives + y.collectives,
            bytes_per_layer=x.bytes_per_layer + y.bytes_per_layer,
            extra_kernel_calls=x.extra_kernel_calls + y.extra_kernel_calls,
        )
        for x, y in zip(a, b, strict=True)
    ]


def _stream_comm(
    m: ModelConfig,
    p: PipelineConfig,
    fwd: Forward,
    pl: Any,
    cs: list[Component],
    schedule: str,
    end: str,
    hbm_Bps: float,
    text: LayerCollective | None = None,
) -> tuple[list[Component], ForwardOverlap, list[CommAlternative]]:
    """One forward's per-layer collectives as the stream's code issues them
    (:func:`sharding.layer_comm.layer_collectives`, SP-sharded cache), charged by ``schedule``: the
    ``sharding_comm`` component replaced (and ``comm_contention`` added for ``overlap``); returns the
    forward's overlap and the three schedules' charges (per forward).

    ``text`` (the compact layout, :func:`perf.e2e.compact.text_kv_collective`): the cache share is a ring
    one slot shorter, ``text`` joins the layer's collectives and the component ``text_kv_gather`` takes
    what it adds (``overlap``: the forward's exposed time + contention minus those of the same program
    without it; ``serial_split``: its time)."""
    from sharding.layer_comm import layer_collectives

    L = m.num_layers
    slots = p.buffer_slots - (1 if text is not None else 0)
    base = layer_collectives(pl, tokens=fwd.tokens, cache_slots=slots, tokens_per_block=p.tokens_per_block(m))
    colls = (*base, text) if text is not None else base
    times = {c.name: c.time_s * c.calls / L for c in cs if c.per_layer and c.group != "comm"}
    fo = forward_overlap(fwd.name, times, colls, L, end=end, hbm_Bps=hbm_Bps)
    fb = forward_overlap(fwd.name, times, base, L, end=end, hbm_Bps=hbm_Bps) if text is not None else fo
    n = len(colls)
    moved = sum(c.bytes for c in colls)
    # the not-built estimate: token sub-blocks (perf.e2e.overlap.layer_program pieces); its split kernels
    # are more kernel calls, its split collectives more collectives
    sub = forward_overlap(fwd.name, times, colls, L, end=end, hbm_Bps=hbm_Bps, pieces=SUB_BLOCKS)
    split = set(split_names(times))
    more_calls = (SUB_BLOCKS - 1) * L * sum(c.launches for c in cs if c.per_layer and c.name in split)
    n_sub = n + (SUB_BLOCKS - 1) * sum(c.role not in ("kv_cache", "text_kv") for c in colls)
    alts = [
        CommAlternative("overlap", fo.charge_s, n * L, moved),
        CommAlternative("serial_split", fo.serial_s, n * L, moved),
        CommAlternative(
            "serial_plan",
            (pl.comm_time_s + (text.time_s if text is not None else 0.0)) * L,
            (pl.comm.collectives + (text is not None)) * L,
            pl.comm.total_bytes + (text.bytes if text is not None else 0),
        ),
        CommAlternative(ESTIMATE, sub.charge_s, n_sub * L, moved, more_calls),
    ]
    if schedule == "serial_plan":
        return cs, fo, alts
    src = f"{len(base)} collectives per layer ({'/'.join(c.role for c in base)}; {pl.model.name})"
    out: list[Component] = []
    nb = len(base)
    for c in cs:
        if c.name != "sharding_comm":
            out.append(c)
        elif schedule == "serial_split":
            out.append(replace(c, time_s=fb.serial_s / L, collectives=nb, source=f"serialised: {src}"))
        else:
            tag = f"overlap critical path: {src}"
            out.append(replace(c, time_s=fb.exposed_s / L, collectives=nb, source=tag))
            out.append(
                Component(
                    "comm_contention", "comm", fb.contention_s / L, L, 0, 0, True,
                    f"hidden collectives' HBM time x {end} contention", bound="collective",
                )
            )  # fmt: skip
    if text is not None:
        if schedule == "serial_split":
            t_text, how = text.time_s, "serialised"
        else:
            t_text = (fo.charge_s - fb.charge_s) / L
            how = "overlap: exposed time + contention it adds to the forward"
        mb = text.bytes / 1e6
        src_t = f"text k/v all-gather, {mb:.2f} MB per core per layer, {how} ({pl.model.name})"
        out.append(Component("text_kv_gather", "comm", t_text, L, 0, 0, True, src_t, 1, bound="collective"))
    return out, fo, alts


def summarize(components: Sequence[Component]) -> dict[str, float]:
    """Total seconds per group (the summation the chunk time is made of)."""
    out: dict[str, float] = {}
    for c in components:
        out[c.group] = out.get(c.group, 0.0) + c.total_s
    return out
