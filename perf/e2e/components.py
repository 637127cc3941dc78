"""Modelled components of one forward and of the VAE decode (per core, one end of the parameter ranges).

A :class:`Component` is one modelled item: ``time_s`` per call on the critical core, ``calls`` per
chunk, the kernel calls (``launches``) and collectives it stands for.  Kernel times here carry no
per-kernel fixed cost: the chunk model (:mod:`perf.e2e.chunk`) charges ``kernel_fixed_s`` once per
kernel call, ``neff_launch_s`` per NEFF and ``collective_barrier_s`` per collective.  All *modelled*.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from perf.e2e.kernels import KernelCost, KernelProvider
from perf.e2e.params import E2EParams, EndPoint
from perf.footprint import VaeProbe
from perf.matmul_model import MatmulProvider, linear_profile
from rolling_forcing.config import ModelConfig

__all__ = [
    "GROUPS",
    "Component",
    "Forward",
    "forward_components",
    "vae_components",
    "vae_conv_flops",
    "contended_s",
]

GROUPS = (
    "linear",
    "attention",
    "cross_attention",
    "rope",
    "kv_write",
    "elementwise",
    "comm",
    "weight_comm",
    "barrier",
    "kernel_fixed",
    "launch",
    "vae",
)


@dataclass(frozen=True)
class Component:
    """One modelled item: ``time_s`` per call on the critical core, ``calls`` per chunk.

    ``flops`` is the chip-wide useful FLOPs of one call (all cores), ``launches`` the kernel calls one
    call stands for, ``collectives`` the collectives it stands for, ``per_layer`` whether it repeats once
    per transformer layer.
    """

    name: str
    group: str
    time_s: float
    calls: int
    flops: int = 0
    launches: int = 1
    per_layer: bool = False
    source: str = "analytic"
    collectives: int = 0

    def __post_init__(self) -> None:
        if self.group not in GROUPS:
            raise ValueError(f"Component.group must be one of {GROUPS}, got {self.group!r}")
        if self.time_s < 0 or self.calls < 0 or self.launches < 0 or self.collectives < 0:
            raise ValueError(f"Component {self.name}: time_s, calls, launches, collectives must be >= 0")

    @property
    def total_s(self) -> float:
        return self.time_s * self.calls


def contended_s(cost: KernelCost, point: EndPoint) -> float:
    """Kernel time at ``point.end`` with VectorE/GpSimd sharing the SBUF port.

    A kernel priced by cost model v2's schedule (``cost.model == "schedule"``) already carries the
    contention at each end (``Trn2CostParams.vector_gpsimd_contention``, 1.0-2.0: the overlapping part of
    a VectorE/GpSimd instruction runs that much longer), in its latency and in its busy times: its time is
    ``cost.at(end)``, nothing added (adding the end-to-end term too charged it twice at the pessimistic
    end).  Any other pricing (``"analytic"``, ``"bound"``: no contention in it) gets
    ``max(latency, max(v, g) + c x min(v, g))`` with ``v``, ``g`` the VectorE and GpSimd busy times and
    ``c`` = ``point.vector_gpsimd_contention`` (0: the engines overlap freely; 1: their SBUF accesses
    serialise).  Kernels that use only one of them are unchanged.
    """
    t = cost.at(point.end)
    if cost.model == "schedule":
        return t
    v, g = cost.engine_busy_s.get("vector", 0.0), cost.engine_busy_s.get("gpsimd", 0.0)
    return max(t, max(v, g) + point.vector_gpsimd_contention * min(v, g))


def _elementwise(
    name: str, elems: int, read_b: float, write_b: float, ops: float, engine: str, p: E2EParams, calls: int
) -> Component:
    """An elementwise pass over ``elems`` elements on one core: ``max(HBM bytes / per-core HBM share,
    elements x ops / (128 lanes x engine clock))``, on VectorE (or ScalarE) alone, so no port contention."""
    hz = p.vector_hz if engine == "vector" else p.scalar_hz
    t = max(elems * (read_b + write_b) / p.hbm_Bps_per_core, elems * ops / (p.lanes * hz))
    return Component(name, "elementwise", t, calls, 0, 1, True, f"{engine}/hbm-bound")


@dataclass(frozen=True)
class Forward:
    """Shapes of one forward: ``tokens`` (chip-wide), attention calls ``(name, Lq, Lk)`` (chip-wide)."""

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
    point: EndPoint,
    linear_mode: str = "token",
    comm_source: str = "sharding.plan",
    head_gather_s: float = 0.0,
) -> list[Component]:
    """Per-core modelled components of one forward of ``fwd`` under a ``tp x sp`` plan (chunk-level calls).

    ``linear_mode="token"``: linear layers token-sharded (``ceil(N / cores)`` tokens, full weights).
    ``"tp_linear"``: Megatron column/row parallel inside the TP group: ``ceil(N / sp)`` tokens of the SP
    shard times ``1 / tp`` of the output (column: QKV, cross-Q, FFN up) or input (row: O, cross-O, FFN
    down) features; cross-attention and RoPE run on the local heads over the SP shard's tokens.
    ``comm_s`` / ``collectives`` are the caller's per-layer communication (seconds, collective count);
    ``head_gather_s`` the all-gather of the head's output once per forward (0 on one core).
    Cross-attention is priced by ``kernels.cross_attention`` when the provider has it (else
    ``kernels.attention``); a provider with ``attention_layout`` adds the layout changes before each
    attention call (``attn_<name>_layout``, ``cross_attn_layout``; no kernel calls).
    Component set per forward: 8 linears (patch embed and head once, 6 per layer), self-attention per
    attention call, cross-attention, RoPE, the KV write when the forward has an update group, 9
    elementwise passes, the per-layer communication (when ``comm_s > 0``) and the head gather.
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
        prof = linear_profile(name, rows, kk, cols, matmul, end=point.end)
        calls = L if layered else 1
        out.append(
            Component(
                name, "linear", prof.latency_s, calls, 2 * fwd.tokens * k * nn, 1, layered, prof.block.source
            )
        )

    _, ph, pw = m.patch_size
    lin("patch_embed", m.in_channels * ph * pw, d, layered=False)
    lin("qkv_proj", d, 3 * d, col=True)
    lin("o_proj", d, d, col=False)
    lin("cross_q_proj", d, d, col=True)
    lin("cross_o_proj", d, d, col=False)
    lin("ffn_up", d, f, col=True)
    lin("ffn_down", f, d, col=False)
    lin("head_proj", d, m.patch_out, layered=False)

    layout = getattr(kernels, "attention_layout", None)

    def add_layout(name: str, group: str, lq: int, lk: int, heads: int, self_attention: bool) -> None:
        """The layout changes a provider says its attention needs before the call (the peer's D-major
        permutes, :class:`perf.e2e.peer_kernels.PeerKernels`): XLA ops, no kernel call (``launches`` 0)."""
        lc = layout(lq, lk, heads, hd, self_attention) if layout is not None else None
        if lc is not None:
            out.append(Component(name, group, contended_s(lc, point), L, 0, 0, True, lc.source))

    for name, lq, lk in fwd.attention:
        c = kernels.attention(math.ceil(lq / sp), lk, hl, hd)
        t = contended_s(c, point)
        out.append(Component(f"attn_{name}", "attention", t, L, 4 * lq * lk * d, 1, True, c.source))
        add_layout(f"attn_{name}_layout", "attention", math.ceil(lq / sp), lk, hl, True)
    cq, ch = (ns, hl) if tpl else (n, m.num_heads)
    c = getattr(kernels, "cross_attention", kernels.attention)(cq, m.text_len, ch, hd)
    out.append(
        Component(
            "cross_attn",
            "cross_attention",
            contended_s(c, point),
            L,
            4 * fwd.tokens * m.text_len * d,
            1,
            True,
            c.source,
        )
    )
    add_layout("cross_attn_layout", "cross_attention", cq, m.text_len, ch, False)
    c = kernels.rope(ns, hl, hd) if tpl else kernels.rope(n, m.num_heads, hd)
    out.append(Component("rope3d", "rope", contended_s(c, point), L, 0, 1, True, c.source))
    upd = [a for a in fwd.attention if a[0] == "update"]
    if upd:
        c = kernels.kv_write(math.ceil(upd[0][1] / sp), hl, hd)
        out.append(Component("kv_cache_write", "kv_write", contended_s(c, point), L, 0, 1, True, c.source))

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
        out.append(Component("sharding_comm", "comm", comm_s, L, 0, 0, True, comm_source, collectives))
    if cores > 1:
        out.append(
            Component("head_gather", "comm", head_gather_s, 1, 0, 0, False, "sharding.plan all-gather", 1)
        )
    return out


def _conv_dims(r: Any) -> tuple[int, int, int, int]:
    """``(c_out, c_in, taps, output positions)`` of a conv layer record; positions count every frame:
    ``prod(out_shape) / c_out`` (Conv2d carries the frames in its batch dimension, Conv3d in dim 2)."""
    cout, cin, *kern = r.weight_shape
    return cout, cin, math.prod(kern), math.prod(r.out_shape) // cout


def vae_conv_flops(layers: Sequence[Any]) -> int:
    """Dense FLOPs of the VAE decoder's convolutions: ``2 x positions x c_in x taps x c_out`` per conv."""
    total = 0
    for r in layers:
        if r.kind in ("WanCausalConv3d", "Conv2d") and len(r.weight_shape) >= 4:
            cout, cin, taps, pix = _conv_dims(r)
            total += 2 * pix * cin * taps * cout
    return total


def vae_components(
    probe: VaeProbe,
    layers: Sequence[Any],
    cores: int,
    matmul: MatmulProvider,
    params: E2EParams,
    tag: str,
    end: str = "optimistic",
) -> list[Component]:
    """VAE decoder layers as modelled components on ``cores`` cores (spatial split; halos ignored), at
    ``end`` (the matmul blocks' engine times of that end).

    Convs as implicit GEMMs: one ``[positions / cores, C_in] @ [C_in, C_out]`` GEMM per kernel tap on the
    SBUF-resident input (the matmul model's TensorE time x taps), floored by the input + output + weight
    HBM traffic; norms / activations / upsampling as elementwise passes; the mid-block single-head
    attention at the convs' modelled efficiency.  ``launches`` counts one kernel call per layer.
    """
    gemm_t = 0.0
    gemm_flops = 0
    ew_t = 0.0
    attn_flops = 0
    n_conv = n_ew = 0
    for r in layers:
        if r.kind in ("WanCausalConv3d", "Conv2d") and len(r.weight_shape) >= 4:
            cout, cin, taps, pix = _conv_dims(r)
            mm = math.ceil(pix / cores)
            prof = linear_profile(r.kind, mm, cin, cout, matmul, end=end)
            tensor_s = prof.engine_busy_s.get("tensor", prof.latency_s) * taps
            io = (math.prod(r.in_shape) + math.prod(r.out_shape)) // cores * 2 + cout * cin * taps * 2
            gemm_t += max(tensor_s, io / params.hbm_Bps_per_core)
            gemm_flops += 2 * pix * cin * taps * cout
            n_conv += 1
            if r.kind == "Conv2d" and cout == 3 * cin:  # mid-block single-head spatial attention (qkv conv)
                frames, hw = r.in_shape[0], math.prod(r.in_shape[2:])
                attn_flops += frames * 4 * hw * hw * cin
        elif r.kind in ("WanRMS_norm", "SiLU", "WanUpsample"):
            elems = math.prod(r.out_shape) // cores
            ops = 3 if r.kind == "WanRMS_norm" else 1
            ew_t += max(elems * 4 / params.hbm_Bps_per_core, elems * ops / (params.lanes * params.vector_hz))
            n_ew += 1
    eff = gemm_flops / (gemm_t * cores * params.peak_flops_per_core) if gemm_t else 1.0
    attn_t = attn_flops / (cores * params.peak_flops_per_core * max(eff, 1e-6))
    src = getattr(matmul, "name", "analytic")
    return [
        Component(f"vae_convs_{tag}", "vae", gemm_t, 1, gemm_flops, n_conv, False, src),
        Component(f"vae_mid_attention_{tag}", "vae", attn_t, 1, attn_flops, 1, False, "conv efficiency"),
        Component(f"vae_elementwise_{tag}", "vae", ew_t, 1, 0, n_ew, False, "vector/hbm-bound"),
    ]
