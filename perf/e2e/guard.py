"""Guard sensitivity: the chunk time and fps when the static softmax offset's guard trips (all *modelled*).

What a trip runs (``nki_kernels.attention._guarded_rows``; docs/kernels/attention.md, "Static softmax
offset"): the static pass of one guard unit, a (b, h) of ``attention_kernel`` or a (b, h, query group) of
the block-table kernel, then, if any of its rows' denominator ``l`` left ``[GUARD_L_MIN, GUARD_L_MAX]``,
the SAME queries again with the running max (``_flash_rows(static=False)``) over the K/V the unit already
holds in SBUF: no K/V reload, no extra kernel call, NEFF or collective.  So a trip is priced by tracing
the call with every guard tripping (:func:`perf.e2e.kernels.every_guard_trips`, the instruction stream a
NEFF runs then) and charging, per call, ``fraction x (tripped - static)`` on top of the static call.
``fraction`` = the share of the critical core's heads (guard units) that trip: heads are independent
iterations of the kernel's head loop, so the extra is linear in it; the cores wait for each other at
every layer's collectives, so one tripping head of a layer costs its core(s) ``1 / local heads`` of the
all-tripping extra, and the whole chunk waits for that core.

Pure part (:func:`extra_s`, :func:`guard_rows`): numbers in, numbers out.  :func:`trip_terms` /
:func:`guard_sensitivity` ask a kernel provider with the ``guard_trips`` flag
(:class:`~perf.e2e.kernels.TracedKernels`) for the two costs of each attention call of a chunk and check
that the static one is the chunk's own component (same shapes, same price).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from perf.e2e.chunk import ChunkModel, steady_forwards
from perf.e2e.components import contended_s
from perf.e2e.params import ENDS, E2EParams
from rolling_forcing.config import ModelConfig, PipelineConfig

__all__ = [
    "FRACTIONS",
    "SCOPES",
    "GuardRow",
    "GuardSensitivity",
    "TripTerm",
    "extra_s",
    "guard_rows",
    "guard_sensitivity",
    "trip_terms",
]

FRACTIONS = (0.0, 0.1, 1.0)
"""Shares of the critical core's heads whose guard trips, in every layer, that the report prices."""
SCOPES = ("self_attention", "cross_attention")
"""The attention calls a trip can hit: the self-attention (merged forward: the block-table call) and the
cross-attention (the same ``attention_kernel``)."""


@dataclass(frozen=True)
class TripTerm:
    """One attention component of a chunk at one end: ``calls`` per chunk, ``static_s`` per call (the
    chunk's own price, every guard passing) and ``tripped_s`` per call (every guard tripping), seconds on
    the critical core without the per-kernel fixed time (charged once per call either way)."""

    component: str
    scope: str
    calls: int
    static_s: float
    tripped_s: float
    local_heads: int
    source: str = ""

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise ValueError(f"TripTerm.scope must be one of {SCOPES}, got {self.scope!r}")
        if self.calls < 0 or self.local_heads < 1 or min(self.static_s, self.tripped_s) < 0:
            raise ValueError(
                f"TripTerm {self.component}: calls >= 0, local_heads >= 1 and times >= 0 required, got "
                f"{self.calls}, {self.local_heads}, {self.static_s}, {self.tripped_s}"
            )

    @property
    def extra_s(self) -> float:
        """Seconds one call costs more when every guard of it trips."""
        return self.tripped_s - self.static_s


def _check_fraction(fraction: float) -> None:
    if not (isinstance(fraction, (int, float)) and 0.0 <= fraction <= 1.0):
        raise ValueError(f"fraction must be a number in [0, 1] (share of heads tripping), got {fraction!r}")


def extra_s(terms: Sequence[TripTerm], fraction: float, scopes: Sequence[str] = SCOPES) -> float:
    """Extra seconds per chunk when ``fraction`` of the heads of the calls in ``scopes`` trip:
    ``fraction x sum(calls x (tripped_s - static_s))`` over those terms."""
    _check_fraction(fraction)
    bad = [s for s in scopes if s not in SCOPES]
    if bad:
        raise ValueError(f"scopes must be drawn from {SCOPES}, got {bad}")
    return fraction * sum(t.calls * t.extra_s for t in terms if t.scope in scopes)


@dataclass(frozen=True)
class GuardRow:
    """Chunk time and fps of ``variant`` at ``end`` when ``fraction`` of the heads trip in ``scopes``."""

    variant: str
    end: str
    label: str
    fraction: float
    scopes: tuple[str, ...]
    base_chunk_s: float
    extra_s: float
    video_frames: int

    @property
    def chunk_s(self) -> float:
        return self.base_chunk_s + self.extra_s

    @property
    def fps(self) -> float:
        return self.video_frames / self.chunk_s


def guard_rows(
    variant: str,
    end: str,
    base_chunk_s: float,
    video_frames: int,
    terms: Sequence[TripTerm],
    fractions: Sequence[float] = FRACTIONS,
) -> list[GuardRow]:
    """Rows of one chunk (``base_chunk_s`` with every guard passing): for each fraction, self-attention
    tripping alone and self- plus cross-attention; then one tripping head per layer (self-attention:
    ``1 / local heads`` of the critical core, the self-attention terms' ``local_heads``)."""
    if base_chunk_s <= 0 or video_frames < 1:
        raise ValueError(
            f"guard_rows: base_chunk_s > 0 and video_frames >= 1, got {base_chunk_s}, {video_frames}"
        )
    rows = []
    both = SCOPES
    for f in fractions:
        for scopes in (("self_attention",), both):
            label = f"{f:.0%} of heads"
            rows.append(
                GuardRow(
                    variant, end, label, f, scopes, base_chunk_s, extra_s(terms, f, scopes), video_frames
                )
            )
    heads = {t.local_heads for t in terms if t.scope == "self_attention"}
    if len(heads) == 1:
        hl = heads.pop()
        f = 1.0 / hl
        rows.append(
            GuardRow(
                variant,
                end,
                f"1 head per layer (1 of the core's {hl})",
                f,
                ("self_attention",),
                base_chunk_s,
                extra_s(terms, f, ("self_attention",)),
                video_frames,
            )
        )
    return rows


@dataclass
class GuardSensitivity:
    """The report's guard rows and the terms they come from (``note``: why nothing was priced)."""

    rows: list[GuardRow] = field(default_factory=list)
    terms: dict[tuple[str, str], list[TripTerm]] = field(default_factory=dict)
    note: str = ""

    def row(self, variant: str, end: str, fraction: float, scopes: Sequence[str]) -> GuardRow:
        for r in self.rows:
            if (r.variant, r.end, r.fraction, r.scopes) == (variant, end, fraction, tuple(scopes)):
                return r
        raise KeyError(f"no guard row {variant}/{end} at {fraction} for {tuple(scopes)}")


def _takes_guard_flag(fn: Any) -> bool:
    try:
        return "guard_trips" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def trip_terms(
    m: ModelConfig, pipe: PipelineConfig, cm: ChunkModel, kernels: Any, params: E2EParams
) -> list[TripTerm]:
    """The attention terms of chunk ``cm`` (a steady ``merged`` or ``two_pass`` chunk, token-sharded
    linears as the headline) from ``kernels``: the static call as the chunk priced it and the same call
    with every guard tripping.  Raises ``ValueError`` if the provider has no ``guard_trips`` flag or if a
    static price differs from the chunk's component (the shapes drifted from
    :func:`perf.e2e.components.forward_components`)."""
    point = params.at(cm.end)
    comps = {c.name: c for c in cm.components}
    fwds = steady_forwards(m, pipe, cm.variant)
    hl, hd = m.num_heads // cm.tp, m.head_dim
    terms: list[TripTerm] = []

    def add(name: str, scope: str, heads: int, price: Any) -> None:
        if name not in comps:
            raise ValueError(f"guard pricing: the chunk has no component {name!r}")
        c = comps[name]
        static, tripped = price(False), price(True)
        t_static = contended_s(static, point)
        if not math.isclose(t_static, c.time_s, rel_tol=1e-9, abs_tol=1e-15):
            raise ValueError(
                f"guard pricing: {name} priced {t_static:.6e} s, the chunk's component {c.time_s:.6e} s "
                "(the shapes drifted from perf.e2e.components)"
            )
        terms.append(
            TripTerm(name, scope, c.calls, t_static, contended_s(tripped, point), heads, tripped.source)
        )

    groups = getattr(kernels, "attention_groups", None)
    cross = getattr(kernels, "cross_attention", None)
    if not _takes_guard_flag(kernels.attention) or (groups is not None and not _takes_guard_flag(groups)):
        raise ValueError(
            f"guard pricing: kernel provider {getattr(kernels, 'name', kernels)!r} has no guard_trips flag"
        )
    if cross is not None and not _takes_guard_flag(cross):
        raise ValueError("guard pricing: the provider's cross_attention has no guard_trips flag")
    cross_fn = cross if cross is not None else kernels.attention
    for fwd in fwds:
        pre = "" if len(fwds) == 1 else f"{fwd.name}:"
        if fwd.block_tokens and groups is not None and len(fwd.attention) > 1:
            lqs = tuple(math.ceil(lq / cm.sp) for _, lq, _ in fwd.attention)
            nb = max(math.ceil(lk / fwd.block_tokens) for _, _, lk in fwd.attention)
            add(
                f"{pre}attn_merged",
                "self_attention",
                hl,
                lambda t, lqs=lqs, nb=nb, bt=fwd.block_tokens: groups(lqs, nb, bt, hl, hd, guard_trips=t),
            )
        else:
            for name, lq, lk in fwd.attention:
                lql = math.ceil(lq / cm.sp)
                add(
                    f"{pre}attn_{name}",
                    "self_attention",
                    hl,
                    lambda t, lql=lql, lk=lk: kernels.attention(lql, lk, hl, hd, guard_trips=t),
                )
        cq = math.ceil(fwd.tokens / cm.cores)  # token-sharded: every head, the core's token share
        add(
            f"{pre}cross_attn",
            "cross_attention",
            m.num_heads,
            lambda t, cq=cq: cross_fn(cq, m.text_len, m.num_heads, hd, guard_trips=t),
        )
    return terms


def guard_sensitivity(
    m: ModelConfig,
    pipe: PipelineConfig,
    chunks: Mapping[tuple[str, str], ChunkModel],
    kernels: Any,
    params: E2EParams,
    variants: Sequence[str] = ("merged", "merged_eager"),
) -> GuardSensitivity:
    """:func:`guard_rows` of ``variants`` (keys of ``chunks``, at both ends) priced by ``kernels``; a
    provider that cannot price a trip gives no rows and the reason in ``note``."""
    out = GuardSensitivity()
    try:
        for v in variants:
            for end in ENDS:
                if (v, end) not in chunks:
                    continue
                cm = chunks[(v, end)]
                terms = trip_terms(m, pipe, cm, kernels, params)
                out.terms[(v, end)] = terms
                out.rows += guard_rows(v, end, cm.chunk_s, cm.video_frames, terms)
    except ValueError as e:
        return GuardSensitivity(note=str(e))
    return out
