"""Kernel providers: per-core cost of one NKI kernel call, the seam through which the cost model enters.

:class:`TracedKernels` runs the project's NKI kernels trace-only in the emulator and prices the trace with
cost model v2: each kernel is recorded with its ordered event log (``keep_events=True``) and priced by
``nki_kernels.emulator.cost.profile_range``, i.e. by the dependency-aware schedule at both ends of every
unmeasured cost-model parameter; :class:`AnalyticKernels` is the hand-counted fallback.

One source of truth for the fixed per-kernel time: the chunk model charges
:class:`~perf.e2e.params.E2EParams` ``kernel_fixed_s`` once per kernel call (its pessimistic end *is*
the cost model's ``Trn2CostParams.high().kernel_fixed_ns``); the cost model's own fixed time, inside
every profile's latency (``KernelProfile.fixed_ns``, at each end its own value), is reported in
``KernelCost.fixed_s`` / ``fixed_high_s`` and stripped by :meth:`KernelCost.at`, so no call pays it
twice.  All times *modelled*.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from perf.e2e.params import E2EParams

__all__ = [
    "KernelCost",
    "KernelProvider",
    "AnalyticKernels",
    "TracedKernels",
    "default_kernel_provider",
    "every_guard_trips",
]


@dataclass(frozen=True)
class KernelCost:
    """Modelled cost of one kernel call on one core.

    ``time_s``: the cost model's latency (optimistic end); ``time_high_s``: its pessimistic end when the
    cost model prices an unmeasured parameter as a range (``None`` = same as ``time_s``); ``fixed_s``: the
    per-kernel fixed time already inside ``time_s`` and ``fixed_high_s`` the one inside ``time_high_s``
    (``None`` = ``fixed_s``); both are stripped by :meth:`at` (the chunk model charges its own);
    ``engine_busy_s``: per-engine busy seconds (``vector`` and ``gpsimd`` feed the shared-port term);
    ``model``: what priced it (``"schedule"``: cost model v2's dependency-aware schedule over the event
    log; ``"bound"``: its bound model; ``"analytic"``: :class:`AnalyticKernels`).
    """

    time_s: float
    flops: int = 0
    hbm_bytes: int = 0
    engine_busy_s: dict[str, float] = field(default_factory=dict)
    source: str = "analytic"
    fixed_s: float = 0.0
    time_high_s: float | None = None
    fixed_high_s: float | None = None
    model: str = "analytic"

    def __post_init__(self) -> None:
        if self.time_s < 0 or self.fixed_s < 0 or (self.fixed_high_s or 0.0) < 0:
            raise ValueError(
                f"KernelCost: time_s, fixed_s and fixed_high_s must be >= 0, got {self.time_s}, "
                f"{self.fixed_s}, {self.fixed_high_s}"
            )
        if self.time_high_s is not None and self.time_high_s < self.time_s:
            raise ValueError(f"KernelCost: time_high_s {self.time_high_s} < time_s {self.time_s}")

    def at(self, end: str) -> float:
        """Latency without the fixed part at ``end`` (``"optimistic"`` or ``"pessimistic"``):
        ``time_s - fixed_s`` or ``time_high_s - fixed_high_s`` (each end strips its own fixed time)."""
        if end not in ("optimistic", "pessimistic"):
            raise ValueError(f"KernelCost.at: end must be 'optimistic' or 'pessimistic', got {end!r}")
        if end == "optimistic":
            return max(0.0, self.time_s - self.fixed_s)
        t = self.time_s if self.time_high_s is None else self.time_high_s
        fixed = self.fixed_s if self.fixed_high_s is None else self.fixed_high_s
        return max(0.0, t - fixed)


class KernelProvider(Protocol):
    """Source of per-core kernel costs.  Shapes are the per-core shapes (local heads, local queries)."""

    @property
    def name(self) -> str: ...

    def attention(self, lq: int, lk: int, heads: int, head_dim: int) -> KernelCost: ...

    def rope(self, tokens: int, heads: int, head_dim: int) -> KernelCost: ...

    def kv_write(self, tokens: int, heads: int, head_dim: int) -> KernelCost: ...


@dataclass(frozen=True)
class AnalyticKernels:
    """Hand-counted fallback (trn2 architecture guide instruction rates) used until traced kernels plug in.

    Attention, per ``[128 queries x 512 keys]`` tile with head_dim 128 (flash form, fp32 statistics):
    TensorE QK^T ``max(64, 512)`` + 4 P transposes x 64 + PV 4 x ``max(64, 128)`` cycles at 2.4 GHz;
    ScalarE exp with row-sum ``512 + 64`` cycles at 1.2 GHz; VectorE row max ``512`` + output rescale
    ``head_dim`` cycles at 0.96 GHz; the 4 ``[128 x 128]`` P^T PSUM evictions go to whichever of
    VectorE / ScalarE balances the two.  Tile time = max(engines); q/k/v/out DMA is overlapped (k and v of
    a head stay in SBUF).  RoPE and the KV write are HBM-bound: bytes / per-core HBM share.  No fixed
    per-kernel time (``fixed_s`` = 0): the chunk model charges it.
    """

    params: E2EParams = E2EParams()
    name: str = "analytic"

    def attention(self, lq: int, lk: int, heads: int, head_dim: int) -> KernelCost:
        p = self.params
        if min(lq, lk, heads, head_dim) < 1:
            raise ValueError(
                f"attention: shapes must be >= 1, got lq={lq} lk={lk} heads={heads} d={head_dim}"
            )
        q_tiles, k_tiles, kw = math.ceil(lq / 128), math.ceil(lk / 512), 512
        d_tiles = math.ceil(head_dim / 128)
        tensor = (d_tiles * max(64, kw) + 4 * 64 + 4 * max(64, head_dim)) / 2.4e9
        scalar = (kw + 64) / p.scalar_hz
        vector = (kw + head_dim) / p.vector_hz
        evict_v, evict_s = 128 / p.vector_hz, 128 / p.scalar_hz
        best = min(max(vector + a * evict_v, scalar + (4 - a) * evict_s) for a in range(5))  # eviction split
        tile = max(tensor, best)
        tiles = heads * q_tiles * k_tiles
        busy = {"tensor": tiles * tensor, "scalar+vector": tiles * best}
        qkvo = (2 * lq + 2 * lk) * heads * head_dim * 2
        t = max(tiles * tile, qkvo / p.hbm_Bps_per_core)
        return KernelCost(t, 4 * lq * lk * heads * head_dim, qkvo, busy, "analytic")

    def rope(self, tokens: int, heads: int, head_dim: int) -> KernelCost:
        b = 2 * 2 * tokens * heads * head_dim * 2  # q and k, read + write, bf16
        return KernelCost(b / self.params.hbm_Bps_per_core, 0, b, {}, "analytic")

    def rope_one(self, tokens: int, heads: int, head_dim: int) -> KernelCost:
        """RoPE of one tensor (the keys of a roped copy): half of :meth:`rope`'s q/k bytes."""
        b = 2 * tokens * heads * head_dim * 2  # x, read + write, bf16
        return KernelCost(b / self.params.hbm_Bps_per_core, 0, b, {}, "analytic")

    def kv_write(self, tokens: int, heads: int, head_dim: int) -> KernelCost:
        b = 2 * 2 * tokens * heads * head_dim * 2  # k and v, read + write, bf16
        return KernelCost(b / self.params.hbm_Bps_per_core, 0, b, {}, "analytic")


def _profile_cost(low: Any, high: Any, flops: int, source: str, scale: float = 1.0) -> KernelCost:
    """:class:`KernelCost` of a cost-model v2 profile pair ``(low, high)`` (``profile_range``), ``scale``
    x for independent repeated head groups.

    ``time_s`` / ``time_high_s`` = the low / high profile's ``latency_ns``; ``fixed_s`` / ``fixed_high_s``
    = their ``fixed_ns`` (the cost model's fixed per-kernel time, stripped by :meth:`KernelCost.at`);
    ``engine_busy_s`` from the high profile; ``model`` = the profiles' ``model`` (``"schedule"`` or
    ``"bound"``), also appended to ``source``.  A high latency below the low one (a list-scheduling
    anomaly ``profile_range`` documents) is clamped to the low one and said in ``source``.
    """
    if low.model != high.model:
        raise ValueError(f"_profile_cost: low and high priced by different models: {low.model}, {high.model}")
    t_low, t_high = float(low.latency_ns) * 1e-9 * scale, float(high.latency_ns) * 1e-9 * scale
    src = f"{source} ({low.model})"
    if t_high < t_low:
        t_high, src = t_low, f"{src}, high clamped to low"
    busy = {k: float(v) * 1e-9 * scale for k, v in high.engine_busy_ns.items()}
    return KernelCost(
        t_low,
        flops,
        int(high.hbm_bytes * scale),
        busy,
        src,
        float(low.fixed_ns) * 1e-9 * scale,
        t_high,
        float(high.fixed_ns) * 1e-9 * scale,
        low.model,
    )


@dataclass
class TracedKernels:
    """Per-core costs from trace-only emulator runs of the project's NKI kernels through the cost model.

    Kernels: ``nki_kernels.attention.attention_kernel`` (``[1, Lq, H, D]`` over ``[1, Lk, H, D]``),
    ``nki_kernels.rope3d.rope3d_kernel`` (q and k ``[1, L, H, D]``, fp32 tables ``[L, D/2]``) and
    ``nki_kernels.kv_cache.kv_cache_write_kernel`` (one block into a ``[1, S, H, D]`` ring buffer).
    Costs are cached per shape.  Attention is traced at its exact per-core shape when it has at most
    ``max_heads`` local heads; with more heads (the 1- and 2-core points of the scaling sweep) it is
    traced at the largest divisor ``h <= max_heads`` of the head count and multiplied by ``heads / h``
    (heads are independent loop iterations of the kernel).  Anything that fails to trace falls back to
    :class:`AnalyticKernels` and says so in ``source``.  Every trace keeps its event log, so the cost is
    the v2 schedule's (``KernelCost.model == "schedule"``) at both ends (``profile_range``).
    """

    params: E2EParams = field(default_factory=E2EParams)
    max_heads: int = 3
    name: str = "traced"
    _cache: dict[tuple[Any, ...], KernelCost] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from nki_kernels.emulator import TensorSpec, run
        from nki_kernels.emulator.cost import profile_range

        self._run, self._spec, self._profile_range = run, TensorSpec, profile_range
        self._fallback = AnalyticKernels(self.params)

    def _trace(self, kernel: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """``(low, high)`` cost-model profiles of one trace-only run with the event log."""
        _, tr = self._run(kernel, *args, trace_only=True, keep_events=True, **kwargs)
        return self._profile_range(tr, schedule=True)

    def _cached(
        self, key: tuple[Any, ...], compute: Callable[[], KernelCost], fallback: Callable[[], KernelCost]
    ) -> KernelCost:
        """``compute()`` once per ``key``; any emulator failure gives the labelled analytic ``fallback()``."""
        if key not in self._cache:
            try:
                self._cache[key] = compute()
            except Exception as e:  # noqa: BLE001 - any emulator failure -> labelled fallback
                self._cache[key] = replace(fallback(), source=f"analytic (trace failed: {type(e).__name__})")
        return self._cache[key]

    def attention(
        self, lq: int, lk: int, heads: int, head_dim: int, static: bool = True, guard_trips: bool = False
    ) -> KernelCost:
        """One call of ``nki_kernels.attention.attention_kernel``: q ``[1, lq, heads, head_dim]`` over k/v
        ``[1, lk, heads, head_dim]``, bf16.  ``static`` (the kernel's default): the guarded static softmax
        offset, priced on its fast path (no guard trips); False: the running max.  ``guard_trips``
        (``static`` only): the static call in which EVERY (b, h) guard trips, i.e. the static pass plus the
        running-max recompute of each head from its K/V already in SBUF (what a trip runs,
        :func:`every_guard_trips`)."""
        _check_guard_flags(static, guard_trips)

        def compute() -> KernelCost:
            import ml_dtypes

            from nki_kernels.attention import attention_kernel

            flops = 4 * lq * lk * heads * head_dim
            h = heads
            if heads > self.max_heads:
                h = max(x for x in range(1, self.max_heads + 1) if heads % x == 0)
            bf = ml_dtypes.bfloat16
            q, kv = self._spec((1, lq, h, head_dim), bf), self._spec((1, lk, h, head_dim), bf)
            args = (attention_kernel, q, kv, kv, 1.0 / math.sqrt(head_dim), False)
            with _guard_context(guard_trips, h) as forced:
                prof = self._trace(*args, static=static)
            src = "traced" if h == heads else f"traced at {h} heads x {heads // h}"
            return _profile_cost(*prof, flops, src + forced.label, heads // h)

        return self._cached(
            ("attn", lq, lk, heads, head_dim, static, guard_trips),
            compute,
            lambda: _analytic_variant(self._fallback.attention(lq, lk, heads, head_dim), guard_trips),
        )

    def attention_groups(
        self,
        lqs: tuple[int, ...],
        blocks: int,
        block_tokens: int,
        heads: int,
        head_dim: int,
        static: bool = True,
        guard_trips: bool = False,
    ) -> KernelCost:
        """One call of ``nki_kernels.attention_block_table.attention_block_table_kernel``: query groups of
        ``lqs`` tokens, each over ``blocks`` key blocks of ``block_tokens`` (the merged forward's attention).
        Traced with ONE key source holding every block (what moves on hardware: the kernel's other sources'
        loads are skipped out of bounds, which the trace would charge); heads, ``static`` and
        ``guard_trips`` as :meth:`attention` (a guard per (b, h, group): with ``guard_trips`` every group of
        every head is recomputed from the group's K/V already in SBUF)."""
        _check_guard_flags(static, guard_trips)

        def compute() -> KernelCost:
            import ml_dtypes
            import numpy as np

            from nki_kernels.attention_block_table import attention_block_table_kernel

            lq = sum(lqs)
            flops = 4 * lq * blocks * block_tokens * heads * head_dim
            h = heads
            if heads > self.max_heads:
                h = max(x for x in range(1, self.max_heads + 1) if heads % x == 0)
            bf = ml_dtypes.bfloat16
            q = self._spec((1, lq, h, head_dim), bf)
            src = [self._spec((1, blocks * block_tokens, h, head_dim), bf)]
            table = self._spec((len(lqs), blocks, 2), np.int32)
            scale = 1.0 / math.sqrt(head_dim)
            args = (attention_block_table_kernel, q, src, src, table, lqs, block_tokens, scale, False)
            with _guard_context(guard_trips, h * len(lqs)) as forced:
                prof = self._trace(*args, static=static)
            what = "traced block table" if h == heads else f"traced block table at {h} heads x {heads // h}"
            return _profile_cost(*prof, flops, what + forced.label, heads // h)

        def fallback() -> KernelCost:
            parts = [self._fallback.attention(n, blocks * block_tokens, heads, head_dim) for n in lqs]
            both = replace(
                parts[0],
                time_s=sum(c.time_s for c in parts),
                flops=sum(c.flops for c in parts),
                time_high_s=None,
            )
            return _analytic_variant(both, guard_trips)

        key = ("attn_groups", lqs, blocks, block_tokens, heads, head_dim, static, guard_trips)
        return self._cached(key, compute, fallback)

    def rope(self, tokens: int, heads: int, head_dim: int) -> KernelCost:
        def compute() -> KernelCost:
            import ml_dtypes

            from nki_kernels.rope3d import rope3d_kernel

            x = self._spec((1, tokens, heads, head_dim), ml_dtypes.bfloat16)
            tab = self._spec((tokens, head_dim // 2), "float32")
            return _profile_cost(*self._trace(rope3d_kernel, x, x, tab, tab), 0, "traced")

        return self._cached(
            ("rope", tokens, heads, head_dim), compute, lambda: self._fallback.rope(tokens, heads, head_dim)
        )

    def rope_one(self, tokens: int, heads: int, head_dim: int) -> KernelCost:
        """One call of ``nki_kernels.rope3d.rope3d_one_kernel`` (one tensor ``[1, tokens, heads, head_dim]``
        bf16, fp32 tables): the roped copies' keys."""

        def compute() -> KernelCost:
            import ml_dtypes

            from nki_kernels.rope3d import rope3d_one_kernel

            x = self._spec((1, tokens, heads, head_dim), ml_dtypes.bfloat16)
            tab = self._spec((tokens, head_dim // 2), "float32")
            return _profile_cost(*self._trace(rope3d_one_kernel, x, tab, tab), 0, "traced")

        return self._cached(
            ("rope_one", tokens, heads, head_dim),
            compute,
            lambda: self._fallback.rope_one(tokens, heads, head_dim),
        )

    def kv_write(self, tokens: int, heads: int, head_dim: int) -> KernelCost:
        def compute() -> KernelCost:
            import ml_dtypes

            from nki_kernels.kv_cache import kv_cache_write_kernel

            bf = ml_dtypes.bfloat16
            cache = self._spec((1, 8 * tokens, heads, head_dim), bf)
            new = self._spec((1, tokens, heads, head_dim), bf)
            slot = self._spec((1, 1), "int32")
            return _profile_cost(
                *self._trace(kv_cache_write_kernel, cache, cache, new, new, slot), 0, "traced"
            )

        return self._cached(
            ("kvw", tokens, heads, head_dim),
            compute,
            lambda: self._fallback.kv_write(tokens, heads, head_dim),
        )

    def elementwise(
        self, name: str, tokens: int, dim: int, ffn_dim: int, tokens_per_frame: int, residual: str = "float32"
    ) -> tuple[KernelCost, int]:
        """Elementwise component ``name`` as the project's fused kernels (:mod:`perf.e2e.elementwise`,
        residual stream in ``residual``): the summed cost of its kernel calls on one core and their count.
        A call that fails to trace is priced as the separate pass (:func:`perf.e2e.elementwise.separate_pass`)
        and says so."""
        from perf.e2e.elementwise import PAIRS, fused_calls, separate_pass, trace_args

        total: KernelCost | None = None
        calls = fused_calls(name, tokens, dim, ffn_dim, tokens_per_frame, residual)
        for call in calls:

            def compute(call: Any = call) -> KernelCost:
                kernel, args = trace_args(call, self._spec)
                return _profile_cost(*self._trace(kernel, *args), 0, f"traced fused {call.kernel}")

            def fallback() -> KernelCost:
                t = nbytes = 0.0
                for part in PAIRS.get(name, (name,)):
                    elems, rb, wb, ops, eng = separate_pass(part, tokens, dim, ffn_dim, residual)
                    p = self.params
                    hz = p.vector_hz if eng == "vector" else p.scalar_hz
                    t += max(elems * (rb + wb) / p.hbm_Bps_per_core, elems * ops / (p.lanes * hz))
                    nbytes += elems * (rb + wb)
                return KernelCost(t / len(calls), 0, int(nbytes) // len(calls), {}, "separate pass")

            c = self._cached(("ew", call), compute, fallback)
            total = c if total is None else _add_costs(total, c)
        assert total is not None
        return total, len(calls)


def _check_guard_flags(static: object, guard_trips: object) -> None:
    """``static`` and ``guard_trips`` are bools, and a guard trip needs the static offset."""
    for name, v in (("static", static), ("guard_trips", guard_trips)):
        if not isinstance(v, bool):
            raise TypeError(f"attention pricing: {name} must be a bool, got {type(v).__name__}")
    if guard_trips and not static:
        raise ValueError(
            "attention pricing: guard_trips=True needs static=True (the running max has no guard)"
        )


@dataclass
class _Forced:
    """What :func:`every_guard_trips` did: guard loops forced (``count``) and the ``source`` suffix."""

    count: int = 0
    label: str = ""


@contextlib.contextmanager
def every_guard_trips() -> Iterator[_Forced]:
    """While active, every static-offset guard of the attention kernels trips in a trace-only run.

    The guard's recompute (``nki_kernels.attention._guarded_rows``) is a runtime loop
    ``nl.fori_loop(0, reg, recompute)`` whose bound is loaded from the guard's count; a trace-only run has
    no data, reads the bound as 0 and takes the fast path.  Here the attention module's ``nl.fori_loop``
    runs its body once instead: the instruction stream a NEFF runs when every guard trips (tested equal
    to a data run whose every row trips, ``tests/test_e2e_guard.py``).  Yields the forced-loop count."""
    import nki_kernels.attention as att

    real, forced = att.nl, _Forced()

    class _TripAll:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def fori_loop(self, lower: Any, upper: Any, body: Callable[[Any], None], step: int = 1) -> None:
            forced.count += 1
            real.fori_loop(lower, int(lower) + 1, body, step)

    att.nl = _TripAll()  # trace-time instrumentation for this run only
    try:
        yield forced
    finally:
        att.nl = real


@contextlib.contextmanager
def _guard_context(trips: bool, units: int) -> Iterator[_Forced]:
    """:func:`every_guard_trips` when ``trips`` (checking that exactly ``units`` guards were forced, one
    per (b, h) or block-table group), else nothing."""
    if not trips:
        yield _Forced()
        return
    with every_guard_trips() as forced:
        yield forced
    if forced.count != units:
        raise RuntimeError(f"every_guard_trips: forced {forced.count} guard loops, expected {units}")
    forced.label = ", every guard tripping"


def _analytic_variant(c: KernelCost, guard_trips: bool) -> KernelCost:
    """The analytic attention (one running-max design for both offsets) for ``guard_trips``: the call run
    twice (a static pass, then the recompute)."""
    if not guard_trips:
        return c
    return replace(_add_costs(c, c), source=f"{c.source}, every guard tripping (x2)")


def _add_costs(a: KernelCost, b: KernelCost) -> KernelCost:
    """Two kernel calls back to back: times, fixed times, bytes and busy times add (a pure function)."""
    keys = {**a.engine_busy_s, **b.engine_busy_s}
    busy = {k: a.engine_busy_s.get(k, 0.0) + b.engine_busy_s.get(k, 0.0) for k in keys}

    def hi(c: KernelCost) -> float:
        return c.time_s if c.time_high_s is None else c.time_high_s

    def fhi(c: KernelCost) -> float:
        return c.fixed_s if c.fixed_high_s is None else c.fixed_high_s

    src = a.source if a.source == b.source else f"{a.source} + {b.source}"
    return KernelCost(
        a.time_s + b.time_s,
        a.flops + b.flops,
        a.hbm_bytes + b.hbm_bytes,
        busy,
        src,
        a.fixed_s + b.fixed_s,
        hi(a) + hi(b),
        fhi(a) + fhi(b),
        a.model if a.model == b.model else "mixed",
    )


def default_kernel_provider(params: E2EParams) -> KernelProvider:
    """:class:`TracedKernels` when the emulator and cost model import, else :class:`AnalyticKernels`."""
    try:
        return TracedKernels(params)
    except (ImportError, AttributeError):
        return AnalyticKernels(params)
