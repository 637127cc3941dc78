"""Kernel providers: per-core cost of one NKI kernel call, the seam through which the cost model enters.

:class:`TracedKernels` runs the project's NKI kernels trace-only in the emulator and prices the trace with
``nki_kernels.emulator.cost.profile`` (whatever version of the cost model is installed);
:class:`AnalyticKernels` is the hand-counted fallback.  Both return a :class:`KernelCost` *without* the
end-to-end per-kernel fixed cost, which the chunk model charges once per kernel call from
:class:`~perf.e2e.params.E2EParams` (``kernel_fixed_s``); a provider whose time already contains a fixed
part says how much in ``KernelCost.fixed_s`` and the chunk model strips it.  All times *modelled*.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from perf.e2e.params import E2EParams

__all__ = ["KernelCost", "KernelProvider", "AnalyticKernels", "TracedKernels", "default_kernel_provider"]


@dataclass(frozen=True)
class KernelCost:
    """Modelled cost of one kernel call on one core.

    ``time_s``: the cost model's latency (optimistic end); ``time_high_s``: its pessimistic end when the
    cost model prices an unmeasured parameter as a range (``None`` = same as ``time_s``); ``fixed_s``: the
    per-kernel fixed time already inside both (stripped by the chunk model, which charges its own);
    ``engine_busy_s``: per-engine busy seconds (``vector`` and ``gpsimd`` feed the shared-port term).
    """

    time_s: float
    flops: int = 0
    hbm_bytes: int = 0
    engine_busy_s: dict[str, float] = field(default_factory=dict)
    source: str = "analytic"
    fixed_s: float = 0.0
    time_high_s: float | None = None

    def __post_init__(self) -> None:
        if self.time_s < 0 or self.fixed_s < 0:
            raise ValueError(
                f"KernelCost: time_s and fixed_s must be >= 0, got {self.time_s}, {self.fixed_s}"
            )
        if self.time_high_s is not None and self.time_high_s < self.time_s:
            raise ValueError(f"KernelCost: time_high_s {self.time_high_s} < time_s {self.time_s}")

    def at(self, end: str) -> float:
        """Latency without the fixed part at ``end`` (``"optimistic"`` or ``"pessimistic"``)."""
        t = self.time_s if end == "optimistic" or self.time_high_s is None else self.time_high_s
        return max(0.0, t - self.fixed_s)


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

    def kv_write(self, tokens: int, heads: int, head_dim: int) -> KernelCost:
        b = 2 * 2 * tokens * heads * head_dim * 2  # k and v, read + write, bf16
        return KernelCost(b / self.params.hbm_Bps_per_core, 0, b, {}, "analytic")


def _profile_cost(prof: Any, flops: int, source: str, scale: float = 1.0) -> KernelCost:
    """:class:`KernelCost` of a cost-model profile (``scale`` x, for independent repeated head groups).

    The fixed part is the profile's ``fixed_ns`` when the cost model reports one (cost model v2), else
    its ``non_overlap_ns`` (v1: the exposed DMA first-byte latency, the only fixed term it charges).
    A ``latency_high_ns`` attribute (a v2 range) becomes ``time_high_s``.
    """
    fixed_ns = getattr(prof, "fixed_ns", None)
    if fixed_ns is None:
        fixed_ns = getattr(prof, "non_overlap_ns", 0.0) or 0.0
    high = getattr(prof, "latency_high_ns", None)
    busy = {k: float(v) * 1e-9 * scale for k, v in getattr(prof, "engine_busy_ns", {}).items()}
    return KernelCost(
        float(prof.latency_ns) * 1e-9 * scale,
        flops,
        int(getattr(prof, "hbm_bytes", 0) * scale),
        busy,
        source,
        float(fixed_ns) * 1e-9 * scale,
        None if high is None else float(high) * 1e-9 * scale,
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
    :class:`AnalyticKernels` and says so in ``source``.
    """

    params: E2EParams = field(default_factory=E2EParams)
    max_heads: int = 3
    name: str = "traced"
    _cache: dict[tuple[Any, ...], KernelCost] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from nki_kernels.emulator import TensorSpec, run
        from nki_kernels.emulator.cost import profile

        self._run, self._spec, self._profile = run, TensorSpec, profile
        self._fallback = AnalyticKernels(self.params)

    def _trace(self, kernel: Any, *args: Any) -> Any:
        _, tr = self._run(kernel, *args, trace_only=True)
        return self._profile(tr)

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

    def attention(self, lq: int, lk: int, heads: int, head_dim: int) -> KernelCost:
        def compute() -> KernelCost:
            import ml_dtypes

            from nki_kernels.attention import attention_kernel

            flops = 4 * lq * lk * heads * head_dim
            h = heads
            if heads > self.max_heads:
                h = max(x for x in range(1, self.max_heads + 1) if heads % x == 0)
            bf = ml_dtypes.bfloat16
            q, kv = self._spec((1, lq, h, head_dim), bf), self._spec((1, lk, h, head_dim), bf)
            prof = self._trace(attention_kernel, q, kv, kv, 1.0 / math.sqrt(head_dim), False)
            src = "traced" if h == heads else f"traced at {h} heads x {heads // h}"
            return _profile_cost(prof, flops, src, heads // h)

        return self._cached(
            ("attn", lq, lk, heads, head_dim),
            compute,
            lambda: self._fallback.attention(lq, lk, heads, head_dim),
        )

    def rope(self, tokens: int, heads: int, head_dim: int) -> KernelCost:
        def compute() -> KernelCost:
            import ml_dtypes

            from nki_kernels.rope3d import rope3d_kernel

            x = self._spec((1, tokens, heads, head_dim), ml_dtypes.bfloat16)
            tab = self._spec((tokens, head_dim // 2), "float32")
            return _profile_cost(self._trace(rope3d_kernel, x, x, tab, tab), 0, "traced")

        return self._cached(
            ("rope", tokens, heads, head_dim), compute, lambda: self._fallback.rope(tokens, heads, head_dim)
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
                self._trace(kv_cache_write_kernel, cache, cache, new, new, slot), 0, "traced"
            )

        return self._cached(
            ("kvw", tokens, heads, head_dim),
            compute,
            lambda: self._fallback.kv_write(tokens, heads, head_dim),
        )


def default_kernel_provider(params: E2EParams) -> KernelProvider:
    """:class:`TracedKernels` when the emulator and cost model import, else :class:`AnalyticKernels`."""
    try:
        return TracedKernels(params)
    except (ImportError, AttributeError):
        return AnalyticKernels(params)
