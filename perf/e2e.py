"""End-to-end performance model: modelled fps, MFU, time to first frame and HBM of Rolling Forcing on trn2.

``python -m perf.e2e`` (``rolling-forcing bench e2e``) models one steady-state chunk of the stream on one
Trainium2 chip and writes ``perf/REPORT.md``, ``perf/results/e2e.jsonl`` and two PNGs.  Every figure it
produces is **modelled** (trn2 cost model + documented assumptions), never measured; published figures
of other systems are marked *published*.  See ``docs/e2e_model.md`` for the method.

One chunk = one merged forward of ``frames_per_block + window_frames`` latent frames (3-frame cache update
at t=0 + 15-frame denoise window; issue 5) -> 3 finished latent frames -> 12 video frames after VAE
decode.  The two-pass variant of the original (a 15-frame denoise forward, then a 3-frame cache-update
forward) is modelled next to it.

Chunk time = sum over components of (modelled time per call x calls per chunk); components run one after
the other (no overlap between kernels; inside a kernel the cost model overlaps engines).  Per core, under
the sharding plan (``sharding.plan.plan``: ``tp`` head groups x ``sp`` query shards):

* linear layers: token-sharded (``ceil(N / cores)`` tokens per core, weights replicated), modelled by
  :mod:`perf.matmul_model` (traced tile kernel x block count, or the analytic fallback);
* self-attention: ``heads / tp`` heads x ``ceil(Lq / sp)`` queries over all ``Lk`` keys, update and denoise
  queries as two calls (different key sets), from a :class:`KernelProvider` (traced NKI kernel through
  the cost model, or the analytic fallback);
* cross-attention: token-sharded, all heads, over ``text_len`` cached text keys (no communication);
* RoPE on the core's token shard (q and k, all heads), the KV-cache write of the update block's clean
  k/v (``tokens_per_block / sp`` tokens x local heads);
* norms / modulation / gates / GELU: elementwise passes, each ``max(HBM bytes / per-core HBM share,
  elements x ops / (128 lanes x engine clock)) + per-call overhead``;
* communication: the plan's modelled per-layer all-to-all + all-gather time (serial with compute);
* launch overhead: one graph (NEFF) launch per forward at the measured ~150 us per-launch gap of the
  existing Trainium port, plus a fixed per-kernel-call cost inside the graph;
* VAE decode of the finished block: the Wan2.1 VAE decoder's convs as implicit GEMMs (one
  ``[pixels, C_in] @ [C_in, C_out]`` GEMM per kernel tap on the SBUF-resident input: the matmul model's
  TensorE time x taps, floored by the input/output/weight HBM traffic), its norms/activations as
  elementwise passes, split spatially over all cores (halo exchange ignored).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from perf.footprint import (
    Footprint,
    VaeProbe,
    dit_block_param_count,
    dit_outside_param_count,
    footprint,
    lower_bound_footprint,
    merged_tokens,
    model_at_resolution,
    vae_probe,
    vae_strides,
)
from perf.matmul_model import AnalyticMatmulProvider, MatmulProvider, default_matmul_provider, linear_profile
from rolling_forcing.config import ModelConfig, PipelineConfig, get_preset

__all__ = [
    "E2EParams",
    "KernelCost",
    "KernelProvider",
    "AnalyticKernels",
    "Component",
    "ChunkModel",
    "chunk_model",
    "forward_components",
    "vae_components",
    "summarize",
    "all_reduce_s",
    "fsdp_gather",
    "tp_linear_comm",
    "WEIGHT_VARIANTS",
    "PUBLISHED",
    "main",
]


# ---------------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class E2EParams:
    """End-to-end assumptions (sources: ``shared/docs/trn2_cost_model.md``, ``shared/docs/peers.md``).

    ``peak_flops_per_core`` 78.6e12 = 128 x 128 x 2 x 2.4 GHz (doc §1 "use 79 TF per core"); MFU is
    quoted against ``cores x`` that and against the chip's published 667 TF.  ``hbm_Bps_per_core``
    2.9 TB/s / 8 (doc §1, all cores streaming).  ``vector_hz`` 0.96 GHz, ``scalar_hz`` 1.2 GHz, 128 lanes,
    one element per lane per cycle (doc §2.1 safe default, no performance mode).  ``graph_launch_s``
    150 us per forward: the per-launch gap the existing Trainium port measured (peers §2a).
    ``kernel_call_s`` 2 us per kernel call inside the graph: 1.3 us DMA first-byte latency + 0.6 us
    hwdge issue (doc §3), i.e. one pipeline fill/drain.  ``target_fps`` 20 with ``target_headroom`` 0.2
    and ``target_hbm_bytes`` 9e9 (issue 7).
    """

    peak_flops_per_core: float = 128 * 128 * 2 * 2.4e9
    chip_peak_flops_published: float = 667e12
    hbm_Bps_per_core: float = 2.9e12 / 8
    vector_hz: float = 0.96e9
    scalar_hz: float = 1.2e9
    lanes: int = 128
    graph_launch_s: float = 150e-6
    kernel_call_s: float = 2e-6
    target_fps: float = 20.0
    target_headroom: float = 0.2
    target_hbm_bytes: float = 9e9


# ---------------------------------------------------------------------------------------------------
# Kernel providers (pluggable: traced NKI kernels via the cost model, or the analytic fallback)
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KernelCost:
    """Modelled cost of one kernel call on one core."""

    time_s: float
    flops: int = 0
    hbm_bytes: int = 0
    engine_busy_s: dict[str, float] = field(default_factory=dict)
    source: str = "analytic"


class KernelProvider(Protocol):
    """Source of per-core kernel costs.  Shapes are the per-core shapes (local heads, local queries)."""

    @property
    def name(self) -> str: ...

    def attention(self, lq: int, lk: int, heads: int, head_dim: int) -> KernelCost: ...

    def rope(self, tokens: int, heads: int, head_dim: int) -> KernelCost: ...

    def kv_write(self, tokens: int, heads: int, head_dim: int) -> KernelCost: ...


@dataclass(frozen=True)
class AnalyticKernels:
    """Hand-counted fallback (``shared/docs/trn2_cost_model.md`` §4) used until traced kernels plug in.

    Attention, per ``[128 queries x 512 keys]`` tile with head_dim 128 (flash form, fp32 statistics):
    TensorE QK^T ``max(64, 512)`` + 4 P transposes x 64 + PV 4 x ``max(64, 128)`` cycles at 2.4 GHz;
    ScalarE exp with row-sum ``512 + 64`` cycles at 1.2 GHz; VectorE row max ``512`` + output rescale
    ``head_dim`` cycles at 0.96 GHz; the 4 ``[128 x 128]`` P^T PSUM evictions go to whichever of
    VectorE / ScalarE balances the two.  Tile time = max(engines); q/k/v/out DMA is overlapped (k and v of
    a head stay in SBUF).  RoPE and the KV write are HBM-bound: bytes / per-core HBM share.  Each call
    adds ``kernel_call_s``.
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
        t = max(tiles * tile, qkvo / p.hbm_Bps_per_core) + p.kernel_call_s
        return KernelCost(t, 4 * lq * lk * heads * head_dim, qkvo, busy, "analytic")

    def rope(self, tokens: int, heads: int, head_dim: int) -> KernelCost:
        b = 2 * 2 * tokens * heads * head_dim * 2  # q and k, read + write, bf16
        return KernelCost(b / self.params.hbm_Bps_per_core + self.params.kernel_call_s, 0, b, {}, "analytic")

    def kv_write(self, tokens: int, heads: int, head_dim: int) -> KernelCost:
        b = 2 * 2 * tokens * heads * head_dim * 2  # k and v, read + write, bf16
        return KernelCost(b / self.params.hbm_Bps_per_core + self.params.kernel_call_s, 0, b, {}, "analytic")


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

    def _attn_exact(self, lq: int, lk: int, heads: int, d: int) -> float:
        import ml_dtypes

        from nki_kernels.attention import attention_kernel

        bf = ml_dtypes.bfloat16
        q, kv = self._spec((1, lq, heads, d), bf), self._spec((1, lk, heads, d), bf)
        prof = self._trace(attention_kernel, q, kv, kv, 1.0 / math.sqrt(d), False)
        return float(prof.latency_ns) * 1e-9

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

    def _traced_cost(self, kernel: Any, *args: Any) -> KernelCost:
        prof = self._trace(kernel, *args)
        return KernelCost(
            float(prof.latency_ns) * 1e-9 + self.params.kernel_call_s, 0, int(prof.hbm_bytes), {}, "traced"
        )

    def attention(self, lq: int, lk: int, heads: int, head_dim: int) -> KernelCost:
        def compute() -> KernelCost:
            flops = 4 * lq * lk * heads * head_dim
            if heads <= self.max_heads:
                t, src = self._attn_exact(lq, lk, heads, head_dim), "traced"
            else:
                h = max(x for x in range(1, self.max_heads + 1) if heads % x == 0)
                t = self._attn_exact(lq, lk, h, head_dim) * (heads // h)
                src = f"traced at {h} heads x {heads // h}"
            return KernelCost(t + self.params.kernel_call_s, flops, 0, {}, src)

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
            return self._traced_cost(rope3d_kernel, x, x, tab, tab)

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
            return self._traced_cost(kv_cache_write_kernel, cache, cache, new, new, slot)

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


# ---------------------------------------------------------------------------------------------------
# Components
# ---------------------------------------------------------------------------------------------------
GROUPS = (
    "linear",
    "attention",
    "cross_attention",
    "rope",
    "kv_write",
    "elementwise",
    "comm",
    "weight_comm",
    "launch",
    "vae",
)


@dataclass(frozen=True)
class Component:
    """One modelled item: ``time_s`` per call on the critical core, ``calls`` per chunk.

    ``flops`` is the chip-wide useful FLOPs of one call (all cores), ``launches`` the kernel calls it
    stands for, ``per_layer`` whether it repeats once per transformer layer.
    """

    name: str
    group: str
    time_s: float
    calls: int
    flops: int = 0
    launches: int = 1
    per_layer: bool = False
    source: str = "analytic"

    def __post_init__(self) -> None:
        if self.group not in GROUPS:
            raise ValueError(f"Component.group must be one of {GROUPS}, got {self.group!r}")
        if self.time_s < 0 or self.calls < 0:
            raise ValueError(f"Component {self.name}: time_s and calls must be >= 0")

    @property
    def total_s(self) -> float:
        return self.time_s * self.calls


def _elementwise(
    name: str, elems: int, read_b: float, write_b: float, ops: float, engine: str, p: E2EParams, calls: int
) -> Component:
    """An elementwise pass over ``elems`` elements on one core (see module docstring)."""
    hz = p.vector_hz if engine == "vector" else p.scalar_hz
    t = max(elems * (read_b + write_b) / p.hbm_Bps_per_core, elems * ops / (p.lanes * hz)) + p.kernel_call_s
    return Component(name, "elementwise", t, calls, 0, 1, True, f"{engine}/hbm-bound")


@dataclass(frozen=True)
class Forward:
    """Shapes of one forward: ``frames`` latent frames, attention calls ``(name, Lq, Lk)`` (chip-wide)."""

    name: str
    tokens: int
    attention: tuple[tuple[str, int, int], ...]


def forward_components(
    m: ModelConfig,
    fwd: Forward,
    *,
    tp: int,
    sp: int,
    comm_s: float,
    collectives: int,
    kernels: KernelProvider,
    matmul: MatmulProvider,
    params: E2EParams,
    linear_mode: str = "token",
    comm_source: str = "sharding.plan",
) -> list[Component]:
    """Per-core modelled components of one forward of ``fwd`` under a ``tp x sp`` plan (chunk-level calls).

    ``linear_mode="token"``: linear layers token-sharded (``ceil(N / cores)`` tokens, full weights).
    ``"tp_linear"``: Megatron column/row parallel inside the TP group: ``ceil(N / sp)`` tokens of the SP
    shard times ``1 / tp`` of the output (column: QKV, cross-Q, FFN up) or input (row: O, cross-O, FFN
    down) features; cross-attention and RoPE run on the local heads over the SP shard's tokens.  The
    per-block linears have the same FLOPs per core in both modes; only the GEMM shapes differ.
    ``comm_s`` / ``collectives`` are the caller's per-layer communication (seconds, collective count).
    """
    if linear_mode not in ("token", "tp_linear"):
        raise ValueError(f"linear_mode must be 'token' or 'tp_linear', got {linear_mode!r}")
    cores = tp * sp
    n = math.ceil(fwd.tokens / cores)
    ns = math.ceil(fwd.tokens / sp)
    d, f, L, hd = m.dim, m.ffn_dim, m.num_layers, m.head_dim
    hl = m.num_heads // tp
    out: list[Component] = []
    tpl = linear_mode == "tp_linear"

    def lin(name: str, k: int, nn: int, layered: bool = True, col: bool | None = None) -> None:
        rows, kk, cols = n, k, nn
        if tpl and col is not None:
            rows = ns
            kk, cols = (k, math.ceil(nn / tp)) if col else (math.ceil(k / tp), nn)
        prof = linear_profile(name, rows, kk, cols, matmul)
        calls = L if layered else 1
        out.append(
            Component(
                name, "linear", prof.latency_s, calls, 2 * fwd.tokens * k * nn, 1, layered, prof.block.source
            )
        )

    # embeddings and head (once per forward)
    _, ph, pw = m.patch_size
    lin("patch_embed", m.in_channels * ph * pw, d, layered=False)
    lin("qkv_proj", d, 3 * d, col=True)
    lin("o_proj", d, d, col=False)
    lin("cross_q_proj", d, d, col=True)
    lin("cross_o_proj", d, d, col=False)
    lin("ffn_up", d, f, col=True)
    lin("ffn_down", f, d, col=False)
    lin("head_proj", d, m.patch_out, layered=False)

    for name, lq, lk in fwd.attention:
        c = kernels.attention(math.ceil(lq / sp), lk, hl, hd)
        out.append(Component(f"attn_{name}", "attention", c.time_s, L, 4 * lq * lk * d, 1, True, c.source))
    c = (
        kernels.attention(ns, m.text_len, hl, hd)
        if tpl
        else kernels.attention(n, m.text_len, m.num_heads, hd)
    )
    out.append(
        Component(
            "cross_attn", "cross_attention", c.time_s, L, 4 * fwd.tokens * m.text_len * d, 1, True, c.source
        )
    )
    c = kernels.rope(ns, hl, hd) if tpl else kernels.rope(n, m.num_heads, hd)
    out.append(Component("rope3d", "rope", c.time_s, L, 0, 1, True, c.source))
    upd = [a for a in fwd.attention if a[0] == "update"]
    if upd:
        c = kernels.kv_write(math.ceil(upd[0][1] / sp), hl, hd)
        out.append(Component("kv_cache_write", "kv_write", c.time_s, L, 0, 1, True, c.source))

    ew = [  # name, elems, read B, write B, ALU ops per element, engine
        ("adaln_norm1_mod", n * d, 4, 2, 4, "vector"),
        ("rmsnorm_qk", 2 * n * d, 2, 2, 3, "vector"),
        ("gate_residual_sa", n * d, 6, 4, 2, "vector"),
        ("norm3_affine", n * d, 4, 2, 4, "vector"),
        ("rmsnorm_cross_q", n * d, 2, 2, 3, "vector"),
        ("residual_cross", n * d, 6, 4, 1, "vector"),
        ("adaln_norm2_mod", n * d, 4, 2, 4, "vector"),
        ("gelu_tanh", n * f, 2, 2, 1, "scalar"),
        ("gate_residual_ffn", n * d, 6, 4, 2, "vector"),
    ]
    for name, elems, rb, wb, ops, eng in ew:
        out.append(_elementwise(name, elems, rb, wb, ops, eng, params, L))
    if comm_s > 0:
        out.append(Component("sharding_comm", "comm", comm_s, L, 0, collectives, True, comm_source))
    out.append(Component("graph_launch", "launch", params.graph_launch_s, 1, 0, 0, False, "peers §2a"))
    return out


def vae_components(
    probe: VaeProbe, layers: Sequence[Any], cores: int, matmul: MatmulProvider, params: E2EParams, tag: str
) -> list[Component]:
    """VAE decoder layers as modelled components on ``cores`` cores (spatial split; halos ignored)."""
    gemm_t = 0.0
    gemm_flops = 0
    ew_t = 0.0
    attn_flops = 0
    launches = 0
    for r in layers:
        if r.kind in ("WanCausalConv3d", "Conv2d") and len(r.weight_shape) >= 4:
            cout, cin, *kern = r.weight_shape
            k = cin * math.prod(kern)
            pix = math.prod(r.out_shape[2:])
            mm = math.ceil(pix / cores)
            # implicit GEMM: one [M, Cin] @ [Cin, Cout] per kernel tap on the SBUF-resident input
            # (TensorE time of the matmul model x taps); HBM traffic = input + output once + weights
            taps = math.prod(kern)
            prof = linear_profile(r.kind, mm, cin, cout, matmul)
            tensor_s = prof.engine_busy_s.get("tensor", prof.latency_s) * taps
            io = (math.prod(r.in_shape) + math.prod(r.out_shape)) // cores * 2 + cout * k * 2
            gemm_t += max(tensor_s, io / params.hbm_Bps_per_core) + params.kernel_call_s
            gemm_flops += 2 * pix * k * cout
            launches += 1
            if r.kind == "Conv2d" and cout == 3 * cin:  # mid-block single-head spatial attention (qkv conv)
                hw = math.prod(r.in_shape[2:])
                attn_flops += 4 * hw * hw * cin
        elif r.kind in ("WanRMS_norm", "SiLU", "WanUpsample"):
            elems = math.prod(r.out_shape) // cores
            ops = 3 if r.kind == "WanRMS_norm" else 1
            ew_t += max(elems * 4 / params.hbm_Bps_per_core, elems * ops / (params.lanes * params.vector_hz))
            ew_t += params.kernel_call_s
            launches += 1
    # mid-block attention at the DiT attention's modelled efficiency is second-order; charge it at the
    # matmul model's efficiency of the convs
    eff = gemm_flops / (gemm_t * cores * params.peak_flops_per_core) if gemm_t else 1.0
    attn_t = attn_flops / (cores * params.peak_flops_per_core * max(eff, 1e-6))
    src = getattr(matmul, "name", "analytic")
    return [
        Component(f"vae_convs_{tag}", "vae", gemm_t, 1, gemm_flops, launches, False, src),
        Component(f"vae_mid_attention_{tag}", "vae", attn_t, 1, attn_flops, 1, False, "conv efficiency"),
        Component(f"vae_elementwise_{tag}", "vae", ew_t, 1, 0, 0, False, "vector/hbm-bound"),
    ]


# ---------------------------------------------------------------------------------------------------
# Weight placement: communication of the sharded-weight variants
# ---------------------------------------------------------------------------------------------------
WEIGHT_VARIANTS = ("replicated", "fsdp", "tp_linear")


def all_reduce_s(comm_model: Any, group: int, nbytes: int, spans_chips: bool) -> float:
    """Modelled ring all-reduce of ``nbytes`` per rank: a reduce-scatter then an all-gather, each moving
    ``(p - 1) / p x nbytes`` per rank, each timed as ``CommModel.all_gather_s`` (``sharding.plan``)."""
    if group <= 1:
        return 0.0
    moved = math.ceil(nbytes * (group - 1) / group)
    return 2 * comm_model.all_gather_s(group, moved, spans_chips)


def fsdp_gather(
    m: ModelConfig, cores: int, comm_model: Any, weight_bytes: float = 2
) -> tuple[int, float, int, float]:
    """FSDP all-gather of one block's weights (and of the non-block weights) over ``cores`` ranks.

    Returns ``(block_bytes_received, block_s, outside_bytes_received, outside_s)`` per rank: each rank
    holds ``1 / cores`` and receives the other ``(cores - 1) / cores`` of ``params x weight_bytes``
    (:func:`perf.footprint.dit_block_param_count`, :func:`perf.footprint.dit_outside_param_count`),
    timed as one ring all-gather of ``CommModel`` (``sharding.plan``).
    """
    spans = cores > comm_model.cores_per_chip
    out: list[Any] = []
    for n_par in (dit_block_param_count(m), dit_outside_param_count(m)):
        b = int(n_par * weight_bytes)
        recv = b - math.ceil(b / cores) if cores > 1 else 0
        out += [recv, comm_model.all_gather_s(cores, recv, spans)]
    return out[0], out[1], out[2], out[3]


def tp_linear_comm(
    m: ModelConfig, tokens: int, tp: int, sp: int, comm_model: Any, act_bytes: int = 2
) -> tuple[int, float, int]:
    """Per-layer extra communication of Megatron column/row parallel linears inside a TP group.

    Wan's block has three row-parallel outputs (self-attention O, cross-attention O, FFN down), each
    reduced over the ``tp`` ranks: one all-reduce (as reduce-scatter + all-gather, Megatron sequence
    parallelism; same bytes) of the SP shard's activations ``ceil(tokens / sp) x dim x act_bytes``.  Wan's
    RMSNorm of q and k (and of the cross-attention q) spans all heads, so their sums of squares need two
    small all-reduces of ``ceil(tokens / sp) x fp32`` (q and k fused; cross q).  Returns
    ``(bytes moved per rank, seconds, collectives)``.  The attention all-to-all of the token-sharded plan
    is not needed (the column-parallel QKV output already is head-sharded); the caller keeps the SP K/V
    all-gather.
    """
    if tp <= 1:
        return 0, 0.0, 0
    ns = math.ceil(tokens / sp)
    spans = tp > comm_model.cores_per_chip
    big = ns * m.dim * act_bytes
    small_q, small_x = 2 * ns * 4, ns * 4
    t = 3 * all_reduce_s(comm_model, tp, big, spans)
    t += all_reduce_s(comm_model, tp, small_q, spans) + all_reduce_s(comm_model, tp, small_x, spans)
    moved = sum(2 * math.ceil(b * (tp - 1) / tp) for b in (big, big, big, small_q, small_x))
    return moved, t, 5


# ---------------------------------------------------------------------------------------------------
# Chunk model
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChunkModel:
    """Modelled chunk of one variant (``merged`` or ``two_pass``) on ``cores`` cores."""

    variant: str
    cores: int
    plan_name: str
    tp: int
    sp: int
    components: tuple[Component, ...]
    video_frames: int
    params: E2EParams

    def time(self, groups: Sequence[str] | None = None) -> float:
        return sum(c.total_s for c in self.components if groups is None or c.group in groups)

    @property
    def chunk_s(self) -> float:
        return self.time()

    @property
    def dit_s(self) -> float:
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
        """Useful FLOPs / (chunk time x the chip's published 667 TF) (one-chip plans only)."""
        chips = math.ceil(self.cores / 8)
        return self.flops / (self.chunk_s * chips * self.params.chip_peak_flops_published)

    @property
    def launches(self) -> int:
        return sum(c.launches * c.calls for c in self.components)

    def headroom(self, target_fps: float | None = None) -> float:
        """``1 - chunk time / deadline`` with deadline = video frames / target fps."""
        tf = self.params.target_fps if target_fps is None else target_fps
        return 1.0 - self.chunk_s / (self.video_frames / tf)

    def by_group(self) -> dict[str, float]:
        return {g: self.time([g]) for g in GROUPS if self.time([g]) > 0}


def _plan(num_heads: int, cores: int, queries: int, keys: int, comm_model: Any = None) -> Any:
    from sharding.plan import AttentionShape, plan

    return plan(num_heads, cores, shape=AttentionShape(num_queries=queries, num_keys=keys), model=comm_model)


def steady_forwards(m: ModelConfig, p: PipelineConfig, variant: str) -> list[Forward]:
    """The forwards of one steady-state chunk (shapes from the config)."""
    blk = p.tokens_per_block(m)
    win = p.window_frames * m.tokens_per_frame
    keys = p.key_budget_tokens(m)
    if variant == "merged":
        return [Forward("merged", merged_tokens(m, p), (("update", blk, keys), ("denoise", win, keys)))]
    if variant == "two_pass":
        return [
            Forward("denoise", win, (("denoise", win, keys),)),
            Forward("update", blk, (("update", blk, keys),)),
        ]
    raise ValueError(f"variant must be 'merged' or 'two_pass', got {variant!r}")


def warmup_forwards(m: ModelConfig, p: PipelineConfig) -> list[Forward]:
    """Merged forwards of warm-up windows 0..window_blocks-1 (window w holds w+1 blocks; keys = window only;
    the update block (block 0) attends to itself), per ``shared/docs/rolling_forcing.md`` §3.4."""
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
    comm_model: Any = None,
    forwards: list[Forward] | None = None,
    vae_layers: str = "steady",
    weights: str = "replicated",
) -> ChunkModel:
    """Modelled chunk: the forwards (default: steady state of ``variant``) + VAE decode of the block.

    ``weights`` (one of :data:`WEIGHT_VARIANTS`; communication timed with ``comm_model``, default
    ``sharding.plan.CommModel()``, the conservative one):

    * ``"replicated"``: the plan as is (weights on every core; per-layer all-to-all + K/V all-gather).
    * ``"fsdp"``: as replicated, plus the just-in-time all-gather of each block's weights
      (:func:`fsdp_gather`) into a double buffer, prefetched while the previous layer computes: exposed
      time per layer ``max(0, gather - previous layer's compute)`` (compute = every per-layer component
      except the gather itself, i.e. including the plan's collectives); the first block's gather and
      the non-block weights' gather are charged in full once per forward (nothing to hide behind).
      Assumes the gather's DMA traffic does not slow the compute it overlaps.
    * ``"tp_linear"``: Megatron linears (:func:`forward_components` ``linear_mode="tp_linear"``); per
      layer the plan's SP K/V all-gather + :func:`tp_linear_comm`, serial with compute.
    """
    if weights not in WEIGHT_VARIANTS:
        raise ValueError(f"chunk_model: weights must be one of {WEIGHT_VARIANTS}, got {weights!r}")
    fwds = steady_forwards(m, p, variant) if forwards is None else forwards
    comps: list[Component] = []
    pl = None
    for fwd in fwds:
        lq = sum(a[1] for a in fwd.attention)
        lk = max(a[2] for a in fwd.attention)
        pl = _plan(m.num_heads, cores, max(fwd.tokens, lq), lk, comm_model)
        comm_s, n_coll, src, mode = pl.comm_time_s, pl.comm.collectives, "sharding.plan", "token"
        if weights == "tp_linear":
            _, t_tp, c_tp = tp_linear_comm(m, fwd.tokens, pl.tp, pl.sp, pl.model)
            comm_s = pl.comm.all_gather_s + t_tp
            n_coll = (1 if pl.sp > 1 else 0) + c_tp
            src, mode = f"K/V gather + {c_tp} TP all-reduces ({pl.model.name})", "tp_linear"
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
            linear_mode=mode,
            comm_source=src,
        )
        if weights == "fsdp":
            layer_s = sum(c.time_s for c in cs if c.per_layer)
            _, g_blk, _, g_out = fsdp_gather(m, pl.tp * pl.sp, pl.model)
            exposed = max(0.0, g_blk - layer_s)
            tag = f"FSDP all-gather ({pl.model.name})"
            cs += [
                Component("weight_gather_first", "weight_comm", g_blk + g_out, 1, 0, 2, False, tag),
                Component(
                    "weight_gather_exposed",
                    "weight_comm",
                    exposed,
                    m.num_layers - 1,
                    0,
                    1,
                    False,
                    f"{tag}: max(0, {g_blk * 1e3:.3f} - {layer_s * 1e3:.3f} ms)",
                ),
            ]
        comps += [replace(c, name=f"{c.name}" if len(fwds) == 1 else f"{fwd.name}:{c.name}") for c in cs]
    if vae is not None:
        layers = vae.steady if vae_layers == "steady" else vae.first
        comps += vae_components(vae, layers, cores, matmul, params, vae_layers)
    assert pl is not None
    t_stride = vae.temporal_stride if vae is not None else vae_strides()[0]
    return ChunkModel(
        variant, cores, pl.name, pl.tp, pl.sp, tuple(comps), p.frames_per_block * t_stride, params
    )


def summarize(components: Sequence[Component]) -> dict[str, float]:
    """Total seconds per group (the summation the chunk time is made of)."""
    out: dict[str, float] = {}
    for c in components:
        out[c.group] = out.get(c.group, 0.0) + c.total_s
    return out


# ---------------------------------------------------------------------------------------------------
# Published figures (other systems)
# ---------------------------------------------------------------------------------------------------
PUBLISHED: tuple[dict[str, str], ...] = (
    {
        "system": "Published Trainium result (Amazon; article not found, unverified)",
        "figure": "> 16 fps on one trn2 chip, 11 GB HBM",
        "kind": "published",
        "source": "issue 7; shared/docs/trn2_cost_model.md §5.3",
    },
    {
        "system": "yahavb/rolling_forcing, TP4xSP2 on 8 cores (one chip), 480x640",
        "figure": "8.1-10.8 fps, 4-11 % MFU",
        "kind": "published (measured by them)",
        "source": "shared/docs/peers.md §2a",
    },
    {
        "system": "Physical limit, Wan2.1-1.3B 480x832",
        "figure": "~33 fps: ~242 TFLOP per 12-frame chunk at 667 dense bf16 TFLOPS",
        "kind": "published (derived)",
        "source": "shared/docs/trn2_cost_model.md §6",
    },
)


# ---------------------------------------------------------------------------------------------------
# Command
# ---------------------------------------------------------------------------------------------------
@dataclass
class E2EResult:
    model: ModelConfig
    pipe: PipelineConfig
    height: int
    width: int
    merged: ChunkModel
    two_pass: ChunkModel
    ttff_s: float
    ttff_static_s: float
    warmup_s: list[float]
    first_decode_s: float
    footprints: list[Footprint]
    scaling: list[tuple[int, str, float, float]]
    kernels_name: str
    matmul_name: str
    wall_s: float = 0.0
    command: str = ""
    weight_variants: list[tuple[str, str, ChunkModel]] = field(default_factory=list)
    lower_bounds: list[Footprint] = field(default_factory=list)


def run_model(
    preset: str = "wan2.1-1.3b",
    height: int = 480,
    width: int = 832,
    cores: int = 8,
    *,
    quick: bool = False,
    params: E2EParams | None = None,
    kernels: KernelProvider | None = None,
    matmul: MatmulProvider | None = None,
    scaling_cores: Sequence[int] = (1, 2, 4, 8, 16),
) -> E2EResult:
    """Build every modelled figure of the report (no I/O)."""
    t0 = time.perf_counter()
    params = params or E2EParams()
    kernels = kernels or default_kernel_provider(params)
    matmul = matmul or default_matmul_provider()
    _, s_stride = vae_strides()
    m = model_at_resolution(get_preset(preset), height, width, s_stride)
    pipe = PipelineConfig(dtype="bfloat16")
    vae = vae_probe(m.latent_height, m.latent_width, pipe.frames_per_block)
    kw: dict[str, Any] = {"vae": vae, "kernels": kernels, "matmul": matmul, "params": params}
    merged = chunk_model(m, pipe, cores=cores, variant="merged", **kw)
    two = chunk_model(m, pipe, cores=cores, variant="two_pass", **kw)
    warm = [
        chunk_model(m, pipe, cores=cores, forwards=[f], **{**kw, "vae": None}).chunk_s
        for f in warmup_forwards(m, pipe)
    ]
    first_dec = sum(c.total_s for c in vae_components(vae, vae.first, cores, matmul, params, "first"))
    ttff = sum(warm) + first_dec
    ttff_static = pipe.window_blocks * merged.dit_s + first_dec
    fps_list: list[tuple[int, str, float, float]] = []
    for c in scaling_cores:
        try:
            cm = chunk_model(m, pipe, cores=c, variant="merged", **kw)
            fps_list.append((c, cm.plan_name, cm.fps, cm.dit_fps))
        except ValueError as e:  # no balanced plan for this core count
            fps_list.append((c, f"no plan: {e}".split("\n")[0][:60], float("nan"), float("nan")))
    fps_ = []
    for kvb, lab in ((2, "bf16"), (1, "fp8 KV cache")):
        for copies, wl in ((None, "weights per core"), (1, "one shared weight copy")):
            fps_.append(
                footprint(
                    m,
                    pipe,
                    tp=merged.tp,
                    sp=merged.sp,
                    kv_bytes=kvb,
                    weight_copies=copies,
                    vae=vae,
                    label=f"{lab}, {wl}",
                )
            )
    for wp, wl in (("fsdp", "FSDP-sharded weights"), ("tp_linear", "TP-sharded linears")):
        for kvb, lab in ((2, "bf16"), (1, "fp8 KV cache")):
            fps_.append(
                footprint(
                    m,
                    pipe,
                    tp=merged.tp,
                    sp=merged.sp,
                    kv_bytes=kvb,
                    weights=wp,
                    vae=vae,
                    label=f"{lab}, {wl}",
                )
            )
    lower = [lower_bound_footprint(m, pipe, cores=cores, kv_bytes=kvb) for kvb in (2, 1)]
    from sharding.plan import CommModel

    wv: list[tuple[str, str, ChunkModel]] = []
    for cmod in (CommModel.conservative(), CommModel.optimistic()):
        for wp in WEIGHT_VARIANTS:
            if wp == "replicated" and cmod.name == "conservative":
                cm = merged
            else:
                cm = chunk_model(m, pipe, cores=cores, variant="merged", weights=wp, comm_model=cmod, **kw)
            wv.append((wp, cmod.name, cm))
    return E2EResult(
        m,
        pipe,
        height,
        width,
        merged,
        two,
        ttff,
        ttff_static,
        warm,
        first_dec,
        fps_,
        fps_list,
        kernels.name,
        getattr(matmul, "name", type(matmul).__name__),
        time.perf_counter() - t0,
        weight_variants=wv,
        lower_bounds=lower,
    )


def _ms(s: float) -> str:
    return f"{s * 1e3:,.2f}"


def _gb(b: float) -> str:
    return f"{b / 1e9:,.2f}"


def _blocker(r: E2EResult) -> str:
    groups = r.merged.by_group()
    top = max(groups, key=lambda g: groups[g])
    return f"{top} ({_ms(groups[top])} ms of {_ms(r.merged.chunk_s)} ms per chunk)"


_WP_NAMES = {"replicated": "replicated", "fsdp": "FSDP-sharded", "tp_linear": "TP-sharded linears"}
_WP_LABEL = {
    "replicated": "weights per core",
    "fsdp": "FSDP-sharded weights",
    "tp_linear": "TP-sharded linears",
}


def render_report(r: E2EResult, png_names: Sequence[str]) -> str:
    """``perf/REPORT.md`` text (generated; every figure labelled)."""
    mg, tw, prm = r.merged, r.two_pass, r.merged.params
    cmd = r.command or "python -m perf.e2e"
    deadline = mg.video_frames / prm.target_fps
    fp_bf16 = r.footprints[0]
    fps_ok = mg.headroom() >= prm.target_headroom
    # "one shared weight copy" is a bound, not a modelled placement: excluded from the best line
    bf16_lines = [fp for fp in r.footprints if fp.label.startswith("bf16") and "shared" not in fp.label]
    best = min(bf16_lines, key=lambda fp: fp.per_chip)
    hbm_ok = best.per_chip <= prm.target_hbm_bytes
    by_label = {fp.label: fp for fp in r.footprints}
    L = []
    L.append("# nki-ardiff performance report (GENERATED by `python -m perf.e2e`; do not edit)\n")
    L.append(
        f"Model: {r.model.name} at {r.height}x{r.width} "
        f"({r.model.tokens_per_frame} tokens per latent frame), "
        f"{mg.cores} NeuronCore-v3 ({mg.plan_name}), one chunk = one merged forward of "
        f"{r.pipe.frames_per_block + r.pipe.window_frames} latent frames -> {mg.video_frames} video frames. "
        f"Kernel costs: **{r.kernels_name}**; linear layers: **{r.matmul_name}**. "
        f"All nki-ardiff figures are **modelled** (trn2 cost model; no Trainium was used); the only "
        f"measured figure is this command's CPU wall time ({r.wall_s:.1f} s). Reproduce every number "
        f"with `{cmd}`.\n"
    )
    L.append("## Headline\n")
    L.append("| system | figure | kind | reproduce / source |")
    L.append("|---|---|---|---|")
    L.append(
        f"| nki-ardiff merged forward, {mg.cores} cores | **{mg.fps:.1f} fps** end to end "
        f"(DiT {mg.dit_fps:.1f} fps), MFU {mg.mfu:.1%} of {mg.cores}x78.6 TF "
        f"({mg.mfu_published_peak:.1%} of 667 TF) | modelled | `{cmd}` |"
    )
    L.append(
        f"| nki-ardiff two-pass (original), {tw.cores} cores | {tw.fps:.1f} fps (DiT {tw.dit_fps:.1f} fps), "
        f"MFU {tw.mfu:.1%} | modelled | `{cmd}` |"
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
    for wp, cname, cm in r.weight_variants:
        if wp != "replicated":
            L.append(
                f"| nki-ardiff merged forward, {_WP_NAMES[wp]}, {cname} comm | {cm.fps:.1f} fps end to end "
                f"(DiT {cm.dit_fps:.1f} fps) | modelled | `{cmd}` |"
            )
    L.append(
        f"| nki-ardiff time to first frame | {_ms(r.ttff_s)} ms (warm-up windows with growing shapes); "
        f"{_ms(r.ttff_static_s)} ms (static padded shapes) | modelled | `{cmd}` |"
    )
    for p in PUBLISHED:
        L.append(f"| {p['system']} | {p['figure']} | {p['kind']} | {p['source']} |")
    L.append("")
    L.append("## Targets (issue 7; modelled, one trn2 chip)\n")
    L.append("| target | modelled | met? |")
    L.append("|---|---|---|")
    L.append(
        f"| >= {prm.target_fps:.0f} fps with >= {prm.target_headroom:.0%} deadline headroom "
        f"(chunk <= {_ms(deadline * (1 - prm.target_headroom))} ms of the {_ms(deadline)} ms deadline) | "
        f"{mg.fps:.1f} fps, chunk {_ms(mg.chunk_s)} ms, headroom {mg.headroom():.1%} | "
        f"{'yes' if fps_ok else 'no'} |"
    )
    lb_txt = (
        f"; floor (KV cache + one DiT weight copy) {_gb(r.lower_bounds[0].per_chip)} GB"
        if r.lower_bounds
        else ""
    )
    L.append(
        f"| HBM <= {_gb(prm.target_hbm_bytes)} GB in bf16 | baseline {_gb(fp_bf16.per_chip)} GB "
        f"({fp_bf16.label}); best modelled placement {_gb(best.per_chip)} GB ({best.label}){lb_txt} | "
        f"{'yes' if hbm_ok else 'no'} |"
    )
    L.append("")
    if not fps_ok:
        L.append(
            f"What holds the frame rate back: the largest component group is **{_blocker(r)}**. "
            f"At 100% of {mg.cores}x78.6 TF the chunk's {mg.flops / 1e12:.0f} TFLOP (DiT "
            f"{mg.dit_flops / 1e12:.0f} + VAE {(mg.flops - mg.dit_flops) / 1e12:.0f}) would take "
            f"{_ms(mg.flops / (mg.cores * prm.peak_flops_per_core))} ms; the target needs an MFU of "
            f"{mg.flops / (deadline * (1 - prm.target_headroom) * mg.cores * prm.peak_flops_per_core):.0%}.\n"
        )
    if not hbm_ok:
        big = max(fp_bf16.items, key=lambda i: i.per_chip)
        bbig = max(best.items, key=lambda i: i.per_chip)
        txt = (
            f"What holds HBM back: in the replicated baseline **{big.name}** ({_gb(big.per_chip)} GB per "
            f"chip in {fp_bf16.label}); in the best bf16 line ({best.label}, {_gb(best.per_chip)} GB) "
            f"**{bbig.name}** ({_gb(bbig.per_chip)} GB). The KV cache alone is "
            f"{_gb(fp_bf16.item('kv_cache').per_chip)} GB in bf16 (sink + ring slots, needed because the "
            f"cache-update pass attends to the most recent blocks)"
        )
        if r.lower_bounds:
            lb = r.lower_bounds[0]
            verdict = "above" if lb.per_chip > prm.target_hbm_bytes else "below"
            txt += (
                f", so KV cache + one DiT weight copy = {_gb(lb.per_chip)} GB is already {verdict} the "
                f"{_gb(prm.target_hbm_bytes)} GB target in bf16, whatever the weight placement"
            )
            if len(r.lower_bounds) > 1:
                txt += f" (with an fp8 KV cache the floor is {_gb(r.lower_bounds[1].per_chip)} GB)"
        fp8_lines = [fp for fp in r.footprints if fp.label.startswith("fp8") and "shared" not in fp.label]
        if fp8_lines:
            b8 = min(fp8_lines, key=lambda fp: fp.per_chip)
            ok8 = "meets" if b8.per_chip <= prm.target_hbm_bytes else "misses"
            txt += f". Best fp8-KV line: {b8.label}, {_gb(b8.per_chip)} GB ({ok8} the target)"
        L.append(txt + ".\n")
    L.append("## Per-chunk breakdown (modelled, merged forward)\n")
    L.append("| group | ms per chunk | share |")
    L.append("|---|---|---|")
    for g, t in sorted(mg.by_group().items(), key=lambda kv: -kv[1]):
        L.append(f"| {g} | {_ms(t)} | {t / mg.chunk_s:.1%} |")
    L.append(f"| **total** | **{_ms(mg.chunk_s)}** | launches per chunk: {mg.launches:,} |")
    L.append("")
    L.append(f"## Per-layer breakdown (modelled, one of {r.model.num_layers} layers, critical core)\n")
    L.append("| component | group | ms per layer | GFLOP (chip) | source |")
    L.append("|---|---|---|---|---|")
    for c in mg.components:
        if c.per_layer:
            L.append(f"| {c.name} | {c.group} | {c.time_s * 1e3:.3f} | {c.flops / 1e9:,.1f} | {c.source} |")
    L.append("")
    L.append(
        "Once per chunk: "
        + ", ".join(f"{c.name} {_ms(c.total_s)} ms" for c in mg.components if not c.per_layer)
    )
    L.append("")
    L.append("## Two-pass variant (modelled, the original's two forwards per chunk)\n")
    L.append("| group | merged ms | two-pass ms |")
    L.append("|---|---|---|")
    tg = tw.by_group()
    for g in GROUPS:
        a, b = mg.by_group().get(g, 0.0), tg.get(g, 0.0)
        if a or b:
            L.append(f"| {g} | {_ms(a)} | {_ms(b)} |")
    L.append(f"| **total** | **{_ms(mg.chunk_s)}** | **{_ms(tw.chunk_s)}** |")
    L.append(f"| launches | {mg.launches:,} | {tw.launches:,} |")
    L.append("")
    L.append("## Time to first frame (modelled)\n")
    L.append(
        "Warm-up windows 0..4 (window w holds w+1 blocks; keys = window only), then the VAE decode of the "
        "first latent frame: " + " + ".join(_ms(t) for t in r.warmup_s) + f" + {_ms(r.first_decode_s)} = "
        f"**{_ms(r.ttff_s)} ms**. With static padded shapes (issue 5: every forward has the steady "
        f"shape) it is {r.pipe.window_blocks} x {_ms(mg.dit_s)} + {_ms(r.first_decode_s)} = "
        f"{_ms(r.ttff_static_s)} ms.\n"
    )
    L.append("## Scaling with core count (modelled, merged forward, end to end)\n")
    L.append("| cores | plan | fps | DiT-only fps |")
    L.append("|---|---|---|---|")
    for nc, name, f, df in r.scaling:
        note = " (2 chips)" if nc > 8 else ""
        L.append(f"| {nc}{note} | {name} | {f:.2f} | {df:.2f} |")
    L.append("")
    if r.weight_variants:
        L.append("## Weight placement (modelled, merged forward, 8 cores)\n")
        L.append(
            "Replicated: every core holds all DiT weights (the plan of issue 6). FSDP: each core holds 1/8 "
            "of every parameter; a block's full weights are all-gathered just in time into a double buffer "
            "while the previous layer computes (exposed = max(0, gather - previous layer's compute) per "
            "layer; the first block and the non-block weights are charged in full once per forward; the "
            "gather's DMA is assumed not to slow the overlapped compute). TP-sharded linears: Megatron "
            "column/row parallel inside each TP group (weights / tp per core, x sp replicas), 3 activation "
            "all-reduces per layer (self-attention O, cross-attention O, FFN down: Wan has cross-attention, "
            "so one more than a plain transformer's 2) + 2 small RMSNorm-statistics all-reduces, no "
            "attention all-to-all, the SP K/V all-gather kept; serial with compute. Collective times from "
            "`sharding.plan.CommModel` (conservative: 40.7 GB/s measured 2-rank all-reduce bus bandwidth; "
            "optimistic: 400 GB/s uncited die-to-die figure); all-reduce = reduce-scatter + all-gather.\n"
        )
        by_wp = {
            wp: (by_label.get(f"bf16, {_WP_LABEL[wp]}"), by_label.get(f"fp8 KV cache, {_WP_LABEL[wp]}"))
            for wp in WEIGHT_VARIANTS
        }
        L.append(
            "| weights | comm model | chunk ms | fps | DiT fps | comm ms | weight comm ms | HBM bf16 GB | "
            "HBM fp8 KV GB |"
        )
        L.append("|---|---|---|---|---|---|---|---|---|")
        for wp, cname, cm in r.weight_variants:
            groups = cm.by_group()
            fa, fb = by_wp[wp]
            L.append(
                f"| {_WP_NAMES[wp]} | {cname} | {_ms(cm.chunk_s)} | {cm.fps:.2f} | {cm.dit_fps:.2f} | "
                f"{_ms(groups.get('comm', 0.0))} | {_ms(groups.get('weight_comm', 0.0))} | "
                f"{_gb(fa.per_chip) if fa else '-'} | {_gb(fb.per_chip) if fb else '-'} |"
            )
        L.append("")
        fs = [
            c
            for wp, _, cm in r.weight_variants
            if wp == "fsdp"
            for c in cm.components
            if c.group == "weight_comm"
        ]
        if fs:
            L.append(
                "FSDP gather terms: "
                + "; ".join(f"{c.name} {_ms(c.time_s)} ms x {c.calls} ({c.source})" for c in fs)
                + ".\n"
            )
        L.append(
            "The `one shared weight copy` lines are a bound, not a modelled placement: HBM is 4 stacks each "
            "shared by 2 physical cores and under LNC=1 every core's runtime holds its own tensors "
            "(shared/docs/trn2_cost_model.md §1); one copy read by all 8 cores needs cross-stack reads the "
            "cost model has no bandwidth figure for.\n"
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
    L.append("## Assumptions (all modelled)\n")
    for k, v in prm.__dict__.items():
        L.append(f"- `{k}` = {v}")
    L.append(
        "- components run back to back (no overlap between kernels or with communication; the one "
        "exception is the FSDP weight prefetch, see Weight placement); inside one kernel the cost model "
        "overlaps engines."
    )
    L.append(f"- plots: {', '.join(png_names)}")
    L.append("")
    return "\n".join(L)


def write_plots(r: E2EResult, out_dir: Path, stem: str = "e2e") -> list[Path]:
    """Stacked per-component bar (merged vs two-pass) and fps vs core count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5))
    variants = [("merged", r.merged), ("two-pass", r.two_pass)]
    variants += [
        (f"{_WP_NAMES[wp].replace('-sharded', '')} (cons.)", cm)
        for wp, cname, cm in r.weight_variants
        if wp != "replicated" and cname == "conservative"
    ]
    bottoms = [0.0] * len(variants)
    for g in GROUPS:
        vals = [cm.by_group().get(g, 0.0) * 1e3 for _, cm in variants]
        if any(vals):
            ax1.bar([v for v, _ in variants], vals, bottom=bottoms, label=g)
            bottoms = [b + v for b, v in zip(bottoms, vals)]
    deadline = r.merged.video_frames / r.merged.params.target_fps * 1e3
    ax1.axhline(deadline, color="k", ls="--", lw=1, label=f"{r.merged.params.target_fps:.0f} fps deadline")
    ax1.axhline(
        deadline * (1 - r.merged.params.target_headroom), color="r", ls=":", lw=1, label="with 20% headroom"
    )
    ax1.set_ylabel("modelled ms per chunk")
    ax1.set_title(f"{r.model.name} {r.height}x{r.width}, {r.merged.cores} cores (MODELLED)")
    ax1.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    cs = [c for c, _, f, _ in r.scaling if f == f]
    ax2.plot(cs, [f for _, _, f, _ in r.scaling if f == f], "o-", label="end to end")
    ax2.plot(cs, [d for _, _, f, d in r.scaling if f == f], "s--", label="DiT only")
    ax2.axhline(r.merged.params.target_fps, color="k", ls="--", lw=1)
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(cs, [str(c) for c in cs])
    ax2.set_xlabel("NeuronCore-v3 cores (16 = 2 chips)")
    ax2.set_ylabel("modelled fps")
    ax2.set_title("modelled fps vs cores")
    ax2.legend()
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


def _rows(r: E2EResult) -> list[Any]:
    from perf.runner import BenchRow

    cfg = {"preset": r.model.name, "height": r.height, "width": r.width}
    rows = []
    for cm in (r.merged, r.two_pass):
        rows.append(
            BenchRow(
                op="e2e_chunk",
                variant=cm.variant,
                config={**cfg, "cores": cm.cores, "plan": cm.plan_name},
                kind="modelled",
                latency_us=cm.chunk_s * 1e6,
                fps=cm.fps,
                tensore_util=cm.mfu,
                memory_bytes=r.footprints[0].per_chip,
                extra={
                    "dit_fps": cm.dit_fps,
                    "mfu_vs_667": cm.mfu_published_peak,
                    "headroom_at_target": cm.headroom(),
                    "launches_per_chunk": cm.launches,
                    "tflop_per_chunk": cm.flops / 1e12,
                    "groups_ms": {g: t * 1e3 for g, t in cm.by_group().items()},
                    "kernels": r.kernels_name,
                    "matmul": r.matmul_name,
                },
            )
        )
    rows.append(
        BenchRow(
            op="e2e_ttff",
            variant="growing",
            config=cfg,
            kind="modelled",
            latency_us=r.ttff_s * 1e6,
            extra={"static_us": r.ttff_static_s * 1e6, "warmup_ms": [t * 1e3 for t in r.warmup_s]},
        )
    )
    for fp in r.footprints:
        rows.append(
            BenchRow(
                op="e2e_hbm",
                variant=fp.label,
                config={**cfg, "cores": fp.cores},
                kind="modelled",
                memory_bytes=fp.per_chip,
                extra={"per_core": fp.per_core, "items": {i.name: i.per_chip for i in fp.items}},
            )
        )
    for wp, cname, cm in r.weight_variants:
        if wp == "replicated" and cname == "conservative":
            continue  # the merged row above
        rows.append(
            BenchRow(
                op="e2e_chunk",
                variant=f"merged/{wp}/{cname}",
                config={**cfg, "cores": cm.cores, "plan": cm.plan_name, "weights": wp, "comm": cname},
                kind="modelled",
                latency_us=cm.chunk_s * 1e6,
                fps=cm.fps,
                tensore_util=cm.mfu,
                extra={"dit_fps": cm.dit_fps, "groups_ms": {g: t * 1e3 for g, t in cm.by_group().items()}},
            )
        )
    for lb in r.lower_bounds:
        rows.append(
            BenchRow(
                op="e2e_hbm",
                variant=lb.label,
                config={**cfg, "cores": lb.cores},
                kind="modelled",
                memory_bytes=lb.per_chip,
                extra={"items": {i.name: i.per_chip for i in lb.items}},
            )
        )
    for c, name, f, df in r.scaling:
        rows.append(
            BenchRow(
                op="e2e_scaling",
                variant=name,
                config={**cfg, "cores": c},
                kind="modelled",
                status="ok" if f == f else "error",
                message="" if f == f else name,
                fps=f if f == f else None,
                extra={"dit_fps": df if df == df else None},
            )
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m perf.e2e [--quick] [--out-dir DIR] [--cores N] [--preset P] [--height H] [--width W]``."""
    ap = argparse.ArgumentParser(prog="python -m perf.e2e", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="wan2.1-1.3b")
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--cores", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="tiny preset at 64x64 (smoke test)")
    ap.add_argument("--analytic", action="store_true", help="force the analytic kernel/matmul providers")
    ap.add_argument("--out-dir", default=None, help="where REPORT.md, results/ and PNGs go (default perf/)")
    a = ap.parse_args(argv)
    if a.quick:
        a.preset, a.height, a.width = "tiny", 64, 64
    out = Path(a.out_dir) if a.out_dir else Path(__file__).resolve().parent
    params = E2EParams()
    kernels = AnalyticKernels(params) if a.analytic else None
    matmul = AnalyticMatmulProvider() if a.analytic else None
    r = run_model(a.preset, a.height, a.width, a.cores, params=params, kernels=kernels, matmul=matmul)
    from perf.runner import append_rows, current_command, print_table

    argv_s = list(sys.argv[1:] if argv is None else argv)
    r.command = (
        " ".join(["python -m perf.e2e", *argv_s]) if argv_s or argv is not None else "python -m perf.e2e"
    )
    del current_command  # rows keep the runner's exact command line
    stem = "e2e_quick" if a.quick else "e2e"
    pngs = write_plots(r, out / "results", stem)
    rows = _rows(r)
    append_rows(rows, out / "results" / f"{stem}.jsonl")
    print_table(rows)
    report = render_report(r, [str(p.relative_to(out)) for p in pngs])
    (out / ("REPORT_quick.md" if a.quick else "REPORT.md")).write_text(report)
    print(
        f"wrote {out / ('REPORT_quick.md' if a.quick else 'REPORT.md')} "
        f"(measured {r.wall_s:.1f} s CPU wall time)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
