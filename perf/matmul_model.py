"""Modelled trn2 time of the dense (linear) layers: one traced tile-level NKI kernel, scaled.

A linear layer ``y[M, N] = x[M, K] @ w[K, N]`` (bf16 in, fp32 PSUM accumulation, bf16 out) on one
NeuronCore-v3 is modelled as a grid of identical *blocks*: ``ceil(M / block_m) x ceil(N / block_n)``
launches of the tile-level kernel :func:`matmul_block_kernel`, each computing a ``[block_m, block_n]`` output
block over the full ``K``.  One block is either

* **traced** (:class:`TracedMatmulProvider`): the NKI kernel below runs trace-only in the project's
  emulator (``nki_kernels.emulator.run``) and the trace goes through the trn2 cost model
  (``nki_kernels.emulator.cost.profile``); or
* **analytic** (:class:`AnalyticMatmulProvider`, the fallback while the emulator or cost model is not
  importable): the same instruction mix counted by hand with the documented v3 instruction costs (AWS Neuron
  SDK, github.com/aws-neuron/aws-neuron-sdk @ 77a1c5a83f, ``nki/api/nki/isa/__init__.py``): ``nc_matmul``
  ``max(64, N_moving)`` TensorE cycles at 2.4 GHz, ``nc_transpose`` 128x128 at 64 cycles, PSUM eviction
  ``max(64, N)`` cycles on VectorE at 0.96 GHz, DMA at the per-core HBM share, block latency ``max(engine
  busy) + fixed``.

Both providers return a :class:`BlockProfile`; :func:`linear_profile` scales a block profile to the
whole GEMM (block count x block time; a partial edge block is charged as a full block, which is what a
kernel with static tile shapes does).  Every time here is *modelled*, never measured.

Kernel layout (per block): ``x`` rows ``[block_m, K]`` are DMA'd row-contiguous into SBUF (``K * 2`` byte
runs), each ``[128, 128]`` piece is transposed on TensorE into ``x^T`` (K on partitions) and evicted to
SBUF; ``w`` ``[K, block_n]`` is DMA'd as ``K / 128`` tiles of ``[128, block_n]`` (``block_n * 2`` byte
runs); for every 128-token tile, ``K / 128`` matmuls (stationary ``x^T`` ``[128 K, 128 tok]``, moving ``w``
``[128 K, block_n]``) accumulate ``[128 tok, block_n]`` in one PSUM bank, which is evicted to SBUF (bf16) and
stored row-contiguously.  The transposes run :data:`TRANSPOSE_AHEAD` = 2 tiles ahead of the matmuls (every
x^T tile its own PSUM / SBUF tile), so under cost model v2's in-order schedule TensorE does not wait for each
eviction: a ``[1024, 5120] x [5120, 512]`` block models at 135 us instead of 234 us (``profile`` of its trace,
nominal; TensorE busy 91 us; bitwise-identical output).  ``block_m <= 1024`` keeps all 8 PSUM banks busy;
``block_n <= 512`` is the moving free-size limit.  This tile-level model reloads and re-transposes ``x``
per block, so it is conservative by that traffic; the default provider (:class:`TracedLinearProvider`)
prices every linear as one call of the project's kernel :func:`nki_kernels.linear.linear_kernel`, which keeps
``x^T`` resident per m-block across all output panels.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from nki_kernels.emulator.cost import DMA_EFFICIENCY_POINTS

__all__ = [
    "MatmulHw",
    "BlockProfile",
    "LinearProfile",
    "MatmulProvider",
    "AnalyticMatmulProvider",
    "TracedMatmulProvider",
    "TracedLinearProvider",
    "LINEAR_TRACE_TOKENS",
    "profile_block",
    "default_matmul_provider",
    "linear_profile",
    "matmul_block_kernel",
]


@dataclass(frozen=True)
class MatmulHw:
    """v3 constants of the analytic block model (AWS Neuron SDK docs, aws-neuron-sdk @ 81ce03ae26:
    ``about-neuron/arch/neuron-hardware/{trainium2,neuron-core-v3}.rst``,
    ``nki/deep-dives/nki-dma-bandwidth-guide.rst``; instruction costs @ 77a1c5a83f ``nki/api/nki/isa``).

    ``tensor_hz`` 2.4 GHz TensorE; ``vector_hz`` 0.96 GHz VectorE; ``pmax`` 128 partitions;
    ``min_cycles`` 64 (MIN_II / matmul floor, v2 prior); ``transpose_cycles`` 64 per 128x128 TensorE
    transpose (profiler accounting); ``dma_peak_Bps`` 435 GB/s per core (16 engines x 27.2 GB/s, the
    profiler's ``dma_ddr_bandwidth``) derated by the published efficiency curve of the contiguous run
    length (:meth:`dma_eff`), capped at ``hbm_Bps_per_core`` 362 GB/s = 2.9 TB/s / 8 cores streaming at
    once; ``fixed_s`` 2 us per block = 1.3 us DMA first-byte latency + 0.6 us hwdge issue (pipeline
    fill and drain of one block).
    """

    tensor_hz: float = 2.4e9
    vector_hz: float = 0.96e9
    pmax: int = 128
    min_cycles: int = 64
    transpose_cycles: int = 64
    hbm_Bps_per_core: float = 2.9e12 / 8
    dma_peak_Bps: float = 435e9
    fixed_s: float = 2.0e-6
    peak_flops_per_core: float = 128 * 128 * 2 * 2.4e9

    def dma_eff(self, run_bytes: int) -> float:
        """Published trn2 DMA efficiency vs bytes per partition (doc section 3), step-interpolated."""
        table = DMA_EFFICIENCY_POINTS
        eff = table[0][1]
        for size, e in table:
            if run_bytes >= size:
                eff = e
        return eff

    def dma_s(self, nbytes: int, run_bytes: int) -> float:
        """Modelled DMA time of ``nbytes`` moved in contiguous HBM runs of ``run_bytes``."""
        return nbytes / min(self.hbm_Bps_per_core, self.dma_peak_Bps * self.dma_eff(run_bytes))


@dataclass(frozen=True)
class BlockProfile:
    """Modelled profile of one ``[block_m, block_n]`` output block over the full K (one core)."""

    block_m: int
    block_n: int
    k: int
    latency_s: float
    engine_busy_s: dict[str, float]
    dma_bytes: int
    flops: int
    instructions: int
    source: str  # "traced" or "analytic"
    latency_high_s: float | None = None
    fixed_s: float = 0.0
    fixed_high_s: float | None = None
    model: str = ""
    engine_busy_high_s: dict[str, float] | None = None

    def busy_at(self, end: str) -> dict[str, float]:
        """Per-engine busy seconds at ``end`` (``engine_busy_high_s`` at the pessimistic end when set)."""
        if end == "pessimistic" and self.engine_busy_high_s is not None:
            return self.engine_busy_high_s
        return self.engine_busy_s

    def at(self, end: str) -> float:
        """Block time at ``end`` (``"optimistic"``: ``latency_s``; ``"pessimistic"``: ``latency_high_s``,
        else ``latency_s``) without the cost model's fixed per-kernel time of that end (``fixed_s`` /
        ``fixed_high_s``): the blocks of one linear run inside ONE kernel call, whose fixed time the
        end-to-end model charges once (``perf/e2e``, ``kernel_fixed_s``)."""
        if end not in ("optimistic", "pessimistic"):
            raise ValueError(f"BlockProfile.at: end must be 'optimistic' or 'pessimistic', got {end!r}")
        if end == "optimistic" or self.latency_high_s is None:
            return max(0.0, self.latency_s - self.fixed_s)
        fixed = self.fixed_s if self.fixed_high_s is None else self.fixed_high_s
        return max(0.0, self.latency_high_s - fixed)


@dataclass(frozen=True)
class LinearProfile:
    """One GEMM ``[M, K] @ [K, N]`` on one core, as ``blocks`` x one :class:`BlockProfile`."""

    name: str
    m: int
    k: int
    n: int
    blocks: int
    block: BlockProfile
    latency_s: float
    flops: int  # useful FLOPs 2*M*K*N (padding of the edge blocks excluded)
    dma_bytes: int
    engine_busy_s: dict[str, float] = field(default_factory=dict)

    @property
    def tensor_util(self) -> float:
        """Useful FLOPs over (latency x one core's dense bf16 peak)."""
        return self.flops / (self.latency_s * MatmulHw().peak_flops_per_core) if self.latency_s else 0.0


class MatmulProvider(Protocol):
    """Pluggable source of block profiles (traced or analytic)."""

    @property
    def name(self) -> str: ...

    def block(self, block_m: int, k: int, block_n: int) -> BlockProfile: ...


def _check_dims(block_m: int, k: int, block_n: int, pmax: int = 128) -> None:
    if block_m < 1 or block_m > 8 * pmax or block_m % pmax:
        raise ValueError(f"block_m must be a multiple of {pmax} in [{pmax}, {8 * pmax}], got {block_m}")
    if k < 1 or k % pmax:
        raise ValueError(f"k must be a positive multiple of {pmax} (pad K first), got {k}")
    if block_n < 1 or block_n > 512:
        raise ValueError(f"block_n must be in [1, 512] (TensorE moving free-size limit), got {block_n}")


@dataclass(frozen=True)
class AnalyticMatmulProvider:
    """Hand-counted instruction mix of :func:`matmul_block_kernel` with documented v3 costs (modelled)."""

    hw: MatmulHw = MatmulHw()
    name: str = "analytic"

    def block(self, block_m: int, k: int, block_n: int) -> BlockProfile:
        _check_dims(block_m, k, block_n, self.hw.pmax)
        hw, p = self.hw, self.hw.pmax
        m_tiles, k_tiles = block_m // p, k // p
        n_mm = m_tiles * k_tiles
        n_tr = m_tiles * k_tiles
        tensor_cyc = n_mm * max(hw.min_cycles, block_n) + n_tr * hw.transpose_cycles
        # evictions: transposes [128,128] and outputs [128, block_n], VectorE max(64, N) cycles
        vector_cyc = n_tr * max(hw.min_cycles, p) + m_tiles * max(hw.min_cycles, block_n)
        x_bytes, w_bytes, o_bytes = block_m * k * 2, k * block_n * 2, block_m * block_n * 2
        # x: [128, K] slices of full rows are contiguous; w: stored pre-blocked [N/bn, K, bn] offline
        # (static weights), so a block is contiguous; out: rows of bn elements inside [M, N] rows.
        dma_s = hw.dma_s(x_bytes, x_bytes) + hw.dma_s(w_bytes, w_bytes) + hw.dma_s(o_bytes, block_n * 2)
        busy = {"tensor": tensor_cyc / hw.tensor_hz, "vector": vector_cyc / hw.vector_hz, "dma": dma_s}
        latency = max(busy.values()) + hw.fixed_s
        return BlockProfile(
            block_m=block_m,
            block_n=block_n,
            k=k,
            latency_s=latency,
            engine_busy_s=busy,
            dma_bytes=x_bytes + w_bytes + o_bytes,
            flops=2 * block_m * k * block_n,
            instructions=n_mm + 2 * n_tr + m_tiles * 2 + m_tiles + k_tiles,
            source="analytic",
        )


TRANSPOSE_AHEAD = 2
"""x^T tiles :func:`matmul_block_kernel` transposes ahead of the matmul consuming them (each in its own PSUM /
SBUF tile; modelled, cost model v2: see the module docstring)."""


def matmul_block_kernel(x: Any, w: Any) -> Any:
    """NKI tile-level kernel: ``out[Mb, Nb] = x[Mb, K] @ w[K, Nb]``, bf16 in/out, fp32 PSUM.

    Layouts: ``x`` ``[Mb, K]`` row-major HBM (tokens x features, the layout activations have), ``w``
    ``[K, Nb]`` row-major HBM, ``out`` ``[Mb, Nb]`` row-major HBM.  Limits: ``Mb`` a multiple of 128 and
    at most 1024 (8 PSUM banks); ``K`` a multiple of 128; ``Nb <= 512``.  Used trace-only to profile one
    block of a linear layer (see the module docstring).
    """
    from nki_kernels._nki import nisa, nl

    mb, k = x.shape
    nb = w.shape[1]
    p = 128
    out = nl.ndarray((mb, nb), dtype=x.dtype, buffer=nl.shared_hbm)
    # weight block resident: K/128 tiles [128 K, nb]
    w_tiles = []
    for kt in range(k // p):
        wt = nl.ndarray((p, nb), dtype=w.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=wt, src=w[kt * p : (kt + 1) * p, 0:nb])
        w_tiles.append(wt)
    nk = k // p
    for mt in range(mb // p):
        xs = nl.ndarray((p, k), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=xs, src=x[mt * p : (mt + 1) * p, 0:k])
        acc = nl.ndarray((p, nb), dtype=nl.float32, buffer=nl.psum)
        xts: dict[int, Any] = {}

        def prep(kt: int, xs: Any = xs, xts: dict[int, Any] = xts) -> None:
            # x^T tile kt: TensorE transpose into its own PSUM tile, evicted to its own SBUF tile
            tp = nl.ndarray((p, p), dtype=x.dtype, buffer=nl.psum)
            nisa.nc_transpose(dst=tp, data=xs[0:p, kt * p : (kt + 1) * p])
            xt = nl.ndarray((p, p), dtype=x.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=xt, src=tp)
            xts[kt] = xt

        # software pipeline: the transposes run TRANSPOSE_AHEAD tiles ahead of the matmuls, so the in-order
        # TensorE never waits for the eviction of the x^T tile it is about to use
        for kt in range(min(TRANSPOSE_AHEAD, nk)):
            prep(kt)
        for kt in range(nk):
            if kt + TRANSPOSE_AHEAD < nk:
                prep(kt + TRANSPOSE_AHEAD)
            nisa.nc_matmul(dst=acc, stationary=xts.pop(kt), moving=w_tiles[kt], accumulate=(kt > 0))
        ob = nl.ndarray((p, nb), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=ob, src=acc)
        nisa.dma_copy(dst=out[mt * p : (mt + 1) * p, 0:nb], src=ob)
    return out


def profile_block(
    lo: Any, hi: Any, trace: Any, dims: tuple[int, int, int], flops: int, source: str, scale: float = 1.0
) -> BlockProfile:
    """A :class:`BlockProfile` from cost model v2's ``(low, high)`` profiles of one trace (``profile_range``):
    ``dims = (block_m, block_n, k)``; times in seconds; ``scale`` multiplies everything but the fixed
    per-kernel time (a trace of ``1 / scale`` of the work, priced for all of it)."""

    def lat(ns: float, fixed_ns: float) -> float:
        return (fixed_ns + (ns - fixed_ns) * scale) * 1e-9

    def busy(p: Any) -> dict[str, float]:
        return {str(e): float(v) * 1e-9 * scale for e, v in p.engine_busy_ns.items()}

    return BlockProfile(
        block_m=dims[0],
        block_n=dims[1],
        k=dims[2],
        latency_s=lat(lo.latency_ns, lo.fixed_ns),
        engine_busy_s=busy(lo),
        dma_bytes=int(hi.dma_bytes * scale),
        flops=flops,
        instructions=int(trace.num_instructions * scale),
        source=source,
        latency_high_s=lat(max(lo.latency_ns, hi.latency_ns), hi.fixed_ns),
        fixed_s=lo.fixed_ns * 1e-9,
        fixed_high_s=hi.fixed_ns * 1e-9,
        model=lo.model,
        engine_busy_high_s=busy(hi),
    )


@dataclass
class TracedMatmulProvider:
    """Block profiles from a trace-only emulator run of :func:`matmul_block_kernel` + the trn2 cost model.

    ``run`` / ``tensor_spec`` / ``profile`` default to ``nki_kernels.emulator.run``, ``TensorSpec`` and
    ``nki_kernels.emulator.cost.profile``; construction raises ``ImportError`` when they are missing.
    Profiles are cached per ``(block_m, k, block_n)`` for the lifetime of the provider.  With the default
    ``profile`` (cost model v2) the block is traced with its event log and priced by
    ``cost.profile_range`` (the dependency-aware schedule at both ends): ``latency_s`` / ``latency_high_s``
    are the low / high latencies and ``fixed_s`` / ``fixed_high_s`` their ``fixed_ns`` (stripped by
    :meth:`BlockProfile.at`); ``model`` says which cost model priced it.
    """

    run: Callable[..., Any] | None = None
    tensor_spec: Callable[..., Any] | None = None
    profile: Callable[..., Any] | None = None
    params: Any = None
    name: str = "traced"
    _cache: dict[tuple[int, int, int], BlockProfile] = field(default_factory=dict)
    _range: Callable[..., Any] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.run is None or self.tensor_spec is None:
            import nki_kernels.emulator as emu

            self.run = self.run or emu.run
            self.tensor_spec = self.tensor_spec or emu.TensorSpec
        if self.profile is None:
            from nki_kernels.emulator import cost

            self.profile = cost.profile
            self._range = cost.profile_range

    def block(self, block_m: int, k: int, block_n: int) -> BlockProfile:
        _check_dims(block_m, k, block_n)
        key = (block_m, k, block_n)
        if key not in self._cache:
            assert self.run is not None and self.tensor_spec is not None and self.profile is not None
            import ml_dtypes

            bf16 = ml_dtypes.bfloat16
            specs = (self.tensor_spec((block_m, k), bf16), self.tensor_spec((k, block_n), bf16))
            if self._range is not None:
                _, trace = self.run(matmul_block_kernel, *specs, trace_only=True, keep_events=True)
                lo, hi = self._range(trace, self.params, schedule=True)
                self._cache[key] = profile_block(
                    lo, hi, trace, (block_m, block_n, k), int(hi.flops), f"traced ({lo.model})"
                )
                return self._cache[key]
            _, trace = self.run(matmul_block_kernel, *specs, trace_only=True)
            prof = self.profile(trace) if self.params is None else self.profile(trace, params=self.params)
            busy = {str(e): float(v) for e, v in _get(prof, "engine_busy_s", {}).items()}
            self._cache[key] = BlockProfile(
                block_m=block_m,
                block_n=block_n,
                k=k,
                latency_s=float(_get(prof, "latency_s")),
                engine_busy_s=busy,
                dma_bytes=int(_get(prof, "dma_bytes", 0)),
                flops=int(_get(prof, "flops", 2 * block_m * k * block_n)),
                instructions=int(trace.num_instructions),
                source="traced",
            )
        return self._cache[key]


def _get(obj: Any, name: str, default: Any = None) -> Any:
    """Read a field of a cost-model profile, tolerating the aliases its contract allows."""
    aliases = {
        "latency_s": ("latency_s", "modelled_latency_s", "latency"),
        "engine_busy_s": ("engine_busy_s", "busy_s", "engine_busy"),
        "dma_bytes": ("dma_bytes", "bytes", "hbm_bytes"),
        "flops": ("flops",),
    }
    for a in aliases.get(name, (name,)):
        if hasattr(obj, a):
            return getattr(obj, a)
        ns = a.replace("_s", "_ns")
        if hasattr(obj, ns):
            v = getattr(obj, ns)
            return {k: x * 1e-9 for k, x in v.items()} if isinstance(v, dict) else v * 1e-9
    if default is None:
        raise AttributeError(f"cost-model profile has no field {name!r} (or aliases)")
    return default


LINEAR_TRACE_TOKENS = 8192
"""Most tokens :class:`TracedLinearProvider` traces; a longer GEMM is traced at this many tokens (a whole
number of the kernel's m-blocks) and its time without the fixed part scaled by the token ratio."""


@dataclass
class TracedLinearProvider:
    """Whole linear layers as ONE call of the project's kernel :func:`nki_kernels.linear.linear_kernel`
    (x^T resident per m-block across every output panel, weights double-buffered, bias in the eviction),
    traced trace-only with its event log and priced by cost model v2 at both ends (``profile_range``).

    :meth:`linear` gives the :class:`BlockProfile` of the whole ``[m, k] @ [k, n]`` (+ bias) on one core
    (``block_m = m``, ``block_n = n``); :func:`linear_profile` uses it as a single block.  GEMMs longer than
    :data:`LINEAR_TRACE_TOKENS` are traced at that length (a multiple of the kernel's ``bm``) and their
    latency and engine times without the fixed part scaled by ``m / traced``.  :meth:`block` serves the
    tile-level model (:class:`TracedMatmulProvider`) for callers that want blocks.  Cached per shape.
    """

    params: Any = None
    name: str = "traced (linear kernel)"
    _cache: dict[tuple[Any, ...], BlockProfile] = field(default_factory=dict)
    _blocks: TracedMatmulProvider | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        from nki_kernels.emulator import TensorSpec, run
        from nki_kernels.emulator.cost import profile_range

        self._run, self._spec, self._range = run, TensorSpec, profile_range

    def block(self, block_m: int, k: int, block_n: int) -> BlockProfile:
        if self._blocks is None:
            self._blocks = TracedMatmulProvider(params=self.params)
        return self._blocks.block(block_m, k, block_n)

    def linear(self, m: int, k: int, n: int) -> BlockProfile:
        for arg, v in (("m", m), ("k", k), ("n", n)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"TracedLinearProvider.linear: {arg} must be a positive int, got {v!r}")
        key = (m, k, n)
        if key in self._cache:
            return self._cache[key]
        import ml_dtypes

        from nki_kernels.linear import linear_kernel, plan_tiles

        bm = plan_tiles(m, k, n, 2)[0]
        mt = m if m <= LINEAR_TRACE_TOKENS else max(bm, LINEAR_TRACE_TOKENS // bm * bm)
        bf16 = ml_dtypes.bfloat16
        specs = (self._spec((mt, k), bf16), self._spec((k, n), bf16), self._spec((n,), "float32"))
        _, trace = self._run(linear_kernel, *specs, trace_only=True, keep_events=True)
        lo, hi = self._range(trace, self.params, schedule=True)
        f = m / mt
        src = f"traced linear kernel ({lo.model})" + (f", {mt} of {m} tokens scaled" if f != 1 else "")
        self._cache[key] = profile_block(lo, hi, trace, (m, n, k), 2 * m * k * n, src, f)
        return self._cache[key]

    def conv(
        self, c_in: int, c_out: int, frames: int, h: int, w: int, ksize: tuple[int, int, int]
    ) -> BlockProfile:
        """One call of :func:`nki_kernels.conv3d.conv3d_causal_kernel` (bf16, with bias) producing ``frames``
        output frames of ``h x w`` (one core's rows), priced at both ends; cached per shape."""
        key = ("conv", c_in, c_out, frames, h, w, *ksize)
        if key in self._cache:
            return self._cache[key]
        import ml_dtypes

        from nki_kernels.conv3d import conv3d_causal_kernel

        bf16 = ml_dtypes.bfloat16
        taps = ksize[0] * ksize[1] * ksize[2]
        specs = (
            self._spec((c_in, frames + ksize[0] - 1, h, w), bf16),
            self._spec((taps, c_in, c_out), bf16),
            self._spec((c_out,), "float32"),
        )
        _, trace = self._run(conv3d_causal_kernel, *specs, tuple(ksize), trace_only=True, keep_events=True)
        lo, hi = self._range(trace, self.params, schedule=True)
        flops = 2 * frames * h * w * c_in * taps * c_out
        dims = (frames * h * w, c_out, c_in * taps)
        prof = profile_block(lo, hi, trace, dims, flops, f"traced conv3d kernel ({lo.model})")
        self._cache[key] = prof
        return prof


def default_matmul_provider() -> MatmulProvider:
    """:class:`TracedLinearProvider` (whole linears as the project's linear kernel) when the emulator and
    cost model import, else :class:`AnalyticMatmulProvider`."""
    try:
        return TracedLinearProvider()
    except (ImportError, AttributeError):
        return AnalyticMatmulProvider()


def linear_profile(
    name: str,
    m: int,
    k: int,
    n: int,
    provider: MatmulProvider,
    *,
    block_m: int = 1024,
    block_n: int = 512,
    end: str | None = None,
) -> LinearProfile:
    """Modelled time of ``[m, k] @ [k, n]`` on one core: block count x one block's modelled latency.

    ``end``: ``None`` = the block's ``latency_s`` as is; ``"optimistic"`` / ``"pessimistic"`` = the
    block's :meth:`BlockProfile.at` of that end (the cost model's fixed per-kernel time stripped, for a
    caller that charges one per linear) and its :meth:`BlockProfile.busy_at` engine times.

    ``k`` is padded up to a multiple of 128 (zero rows cost the same as real ones).  The M blocking uses
    ``ceil(m / block_m)`` blocks of equal size (a multiple of 128, at most ``block_m``), which keeps the
    padding below 128 rows per block; ``block_n`` shrinks to ``n`` for small ``n``.  A provider with a
    ``linear(m, k, n)`` method (:class:`TracedLinearProvider`) prices the whole GEMM as one kernel call
    instead (``blocks = 1``, no padding).
    """
    for arg, v in (("m", m), ("k", k), ("n", n)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"linear_profile: {arg} must be a positive int, got {v!r}")
    whole = getattr(provider, "linear", None)
    if whole is not None:  # the provider prices the whole GEMM as one kernel call
        blk = whole(m, k, n)
        busy1 = blk.engine_busy_s if end is None else blk.busy_at(end)
        return LinearProfile(
            name=name,
            m=m,
            k=k,
            n=n,
            blocks=1,
            block=blk,
            latency_s=blk.latency_s if end is None else blk.at(end),
            flops=2 * m * k * n,
            dma_bytes=blk.dma_bytes,
            engine_busy_s=dict(busy1),
        )
    kp = math.ceil(k / 128) * 128
    nbm = math.ceil(m / block_m)
    bm = math.ceil(m / nbm / 128) * 128
    bn = min(block_n, n)
    blk = provider.block(bm, kp, bn)
    blocks = math.ceil(m / bm) * math.ceil(n / bn)
    busy = {e: t * blocks for e, t in (blk.engine_busy_s if end is None else blk.busy_at(end)).items()}
    return LinearProfile(
        name=name,
        m=m,
        k=k,
        n=n,
        blocks=blocks,
        block=blk,
        latency_s=(blk.latency_s if end is None else blk.at(end)) * blocks,
        flops=2 * m * k * n,
        dma_bytes=blk.dma_bytes * blocks,
        engine_busy_s=busy,
    )
