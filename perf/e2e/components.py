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

from perf.e2e.elementwise import compulsory_bytes, elementwise_plan, separate_pass
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
    per transformer layer, ``hbm_bytes`` the compulsory HBM traffic of one call on one core (every input
    read once, every output written once: the byte side of the roofline) and ``bound`` the engine (or
    ``hbm`` / ``collective``) that bounds it in the model.
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
    hbm_bytes: int = 0
    bound: str = ""

    def __post_init__(self) -> None:
        if self.group not in GROUPS:
            raise ValueError(f"Component.group must be one of {GROUPS}, got {self.group!r}")
        if min(self.time_s, self.calls, self.launches, self.collectives, self.hbm_bytes) < 0:
            raise ValueError(
                f"Component {self.name}: time_s, calls, launches, collectives, hbm_bytes must be >= 0"
            )

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


def busiest(busy: dict[str, float], default: str = "") -> str:
    """The engine with the largest busy time in ``busy`` (``default`` when empty)."""
    return max(busy, key=lambda e: busy[e]) if busy else default


def _elementwise(
    name: str, elems: int, read_b: float, write_b: float, ops: float, engine: str, p: E2EParams, calls: int
) -> Component:
    """An elementwise pass over ``elems`` elements on one core: ``max(HBM bytes / per-core HBM share,
    elements x ops / (128 lanes x engine clock))``, on VectorE (or ScalarE) alone, so no port contention."""
    hz = p.vector_hz if engine == "vector" else p.scalar_hz
    t_hbm, t_eng = elems * (read_b + write_b) / p.hbm_Bps_per_core, elems * ops / (p.lanes * hz)
    bound = "hbm" if t_hbm >= t_eng else engine
    return Component(
        name,
        "elementwise",
        max(t_hbm, t_eng),
        calls,
        0,
        1,
        True,
        f"{engine}/hbm-bound",
        hbm_bytes=int(elems * (read_b + write_b)),
        bound=bound,
    )


@dataclass(frozen=True)
class Forward:
    """Shapes of one forward: ``tokens`` (chip-wide), attention calls ``(name, Lq, Lk)`` (chip-wide).

    ``block_tokens`` > 0: the forward runs its attention groups as ONE block-table kernel call over key
    blocks of that many tokens (the merged forward's ``attention_block_table``); 0: one attention call per
    group. ``copy_tokens`` > 0: per layer one more RoPE call ropes that many cached key tokens (keys only)
    at a pass-specific position (the merged forward's roped copies: the sink in absolute mode); every core
    ropes all of them for its heads (they are not token-sharded)."""

    name: str
    tokens: int
    attention: tuple[tuple[str, int, int], ...]
    block_tokens: int = 0
    copy_tokens: int = 0


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
    attention call, cross-attention, RoPE, the KV write when the forward has an update group, the
    elementwise work (:func:`perf.e2e.elementwise.elementwise_plan`: with a provider that has
    ``kernels.elementwise``, the project's fused kernels including the residual + next-norm pairs; else
    the 9 components as one separate HBM pass each), the per-layer communication (when ``comm_s > 0``) and
    the head gather.
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
                name,
                "linear",
                prof.latency_s,
                calls,
                2 * fwd.tokens * k * nn,
                1,
                layered,
                prof.block.source,
                hbm_bytes=2 * (rows * kk + kk * cols + rows * cols),
                bound=busiest(prof.engine_busy_s, "tensor"),
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
            out.append(
                Component(
                    name,
                    group,
                    contended_s(lc, point),
                    L,
                    0,
                    0,
                    True,
                    lc.source,
                    hbm_bytes=int(lc.hbm_bytes),
                    bound=busiest(lc.engine_busy_s, "dma"),
                )
            )

    groups_fn = getattr(kernels, "attention_groups", None)
    if fwd.block_tokens and groups_fn is not None and len(fwd.attention) > 1:
        lqs = tuple(math.ceil(lq / sp) for _, lq, _ in fwd.attention)
        nb = max(math.ceil(lk / fwd.block_tokens) for _, _, lk in fwd.attention)
        c = groups_fn(lqs, nb, fwd.block_tokens, hl, hd)
        out.append(
            Component(
                "attn_merged",
                "attention",
                contended_s(c, point),
                L,
                sum(4 * lq * lk * d for _, lq, lk in fwd.attention),
                1,
                True,
                c.source,
                hbm_bytes=2 * (2 * sum(lqs) + 2 * len(lqs) * nb * fwd.block_tokens) * hl * hd,
                bound=busiest(c.engine_busy_s, "tensor"),
            )
        )
        for name, lq, lk in fwd.attention:
            add_layout(f"attn_{name}_layout", "attention", math.ceil(lq / sp), lk, hl, True)
    else:
        for name, lq, lk in fwd.attention:
            lql = math.ceil(lq / sp)
            c = kernels.attention(lql, lk, hl, hd)
            t = contended_s(c, point)
            out.append(
                Component(
                    f"attn_{name}",
                    "attention",
                    t,
                    L,
                    4 * lq * lk * d,
                    1,
                    True,
                    c.source,
                    hbm_bytes=2 * (2 * lql + 2 * lk) * hl * hd,
                    bound=busiest(c.engine_busy_s, "tensor"),
                )
            )
            add_layout(f"attn_{name}_layout", "attention", lql, lk, hl, True)
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
            hbm_bytes=2 * (2 * cq + 2 * m.text_len) * ch * hd,
            bound=busiest(c.engine_busy_s, "tensor"),
        )
    )
    add_layout("cross_attn_layout", "cross_attention", cq, m.text_len, ch, False)
    # token mode: the sharded stream's ops.rope3d_tables on the rank's own token shard, all heads, before the
    # TP all-to-all (sharding.rank_attention.RankAttention._rope_shard); tp_linear: the SP shard, local heads
    c = kernels.rope(cq, ch, hd)
    rope_bytes = 2 * 2 * 2 * cq * ch * hd + 2 * 4 * cq * (hd // 2)  # q, k read + written; cos/sin fp32
    out.append(
        Component(
            "rope3d",
            "rope",
            contended_s(c, point),
            L,
            0,
            1,
            True,
            c.source,
            hbm_bytes=rope_bytes,
            bound=busiest(c.engine_busy_s, "dma"),
        )
    )
    if fwd.copy_tokens:
        # the copies' keys alone (ops.rope3d_positions_one); a provider without rope_one prices q and k
        rope_one = getattr(kernels, "rope_one", None)
        c = rope_one(fwd.copy_tokens, hl, hd) if rope_one else kernels.rope(fwd.copy_tokens, hl, hd)
        n_x = 1 if rope_one else 2
        out.append(
            Component(
                "rope3d_copies",
                "rope",
                contended_s(c, point),
                L,
                0,
                1,
                True,
                c.source,
                hbm_bytes=n_x * 2 * 2 * fwd.copy_tokens * hl * hd + 2 * 4 * fwd.copy_tokens * (hd // 2),
                bound=busiest(c.engine_busy_s, "dma"),
            )
        )
    upd = [a for a in fwd.attention if a[0] == "update"]
    if upd:
        blk = math.ceil(upd[0][1] / sp)
        c = kernels.kv_write(blk, hl, hd)
        out.append(
            Component(
                "kv_cache_write",
                "kv_write",
                contended_s(c, point),
                L,
                0,
                1,
                True,
                c.source,
                hbm_bytes=2 * 2 * 2 * blk * hl * hd,  # k and v: read once, written once
                bound=busiest(c.engine_busy_s, "dma"),
            )
        )

    fused = getattr(kernels, "elementwise", None)
    tpf = math.prod(m.grid_hw)
    for name, calls, per_layer in elementwise_plan(L, pairs=fused is not None):
        if fused is None:  # one separate pass per component
            out.append(_elementwise(name, *separate_pass(name, n, d, f), params, calls))
            continue
        c, launches = fused(name, n, d, f, tpf)
        out.append(
            Component(
                name,
                "elementwise",
                contended_s(c, point),
                calls,
                0,
                launches,
                per_layer,
                c.source,
                hbm_bytes=compulsory_bytes(name, n, d, f),
                bound=busiest(c.engine_busy_s, "dma"),
            )
        )
    if comm_s > 0:
        out.append(
            Component(
                "sharding_comm", "comm", comm_s, L, 0, 0, True, comm_source, collectives, bound="collective"
            )
        )
    if cores > 1:
        out.append(
            Component(
                "head_gather",
                "comm",
                head_gather_s,
                1,
                0,
                0,
                False,
                "sharding.plan all-gather",
                1,
                bound="collective",
            )
        )
    return out


def _conv_dims(r: Any) -> tuple[int, int, int, int]:
    """``(c_out, c_in, taps, output positions)`` of a conv layer record; positions count every frame:
    ``prod(out_shape) / c_out`` (Conv2d carries the frames in its batch dimension, Conv3d in dim 2)."""
    cout, cin, *kern = r.weight_shape
    return cout, cin, math.prod(kern), math.prod(r.out_shape) // cout


def _conv_geometry(r: Any) -> tuple[int, int, int, tuple[int, int, int]] | None:
    """``(output frames, H, W, (kt, kh, kw))`` of a conv record the conv kernel takes (extents 1 or 3,
    stride 1, same spatial size), else ``None``."""
    ks = tuple(r.weight_shape[2:])
    if r.kind == "Conv2d" and len(ks) == 2:
        frames, hw_in, hw_out = r.out_shape[0], tuple(r.in_shape[2:]), tuple(r.out_shape[2:])
        ks3 = (1, *ks)
    elif r.kind == "WanCausalConv3d" and len(ks) == 3:
        frames, hw_in, hw_out = r.out_shape[2], tuple(r.in_shape[3:]), tuple(r.out_shape[3:])
        ks3 = ks
    else:
        return None
    if hw_in != hw_out or any(k not in (1, 3) for k in ks3):
        return None
    return int(frames), int(hw_out[0]), int(hw_out[1]), (int(ks3[0]), int(ks3[1]), int(ks3[2]))


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

    Convs: with a provider that has ``conv(...)`` (:class:`perf.matmul_model.TracedLinearProvider`), one
    call of the project's causal conv kernel (``nki_kernels/conv3d.py``, a packed implicit GEMM) on this
    core's ``ceil(H / cores)`` rows (halos ignored); otherwise as implicit GEMMs: one ``[positions / cores,
    C_in] @ [C_in, C_out]`` GEMM per kernel tap (the matmul model's TensorE time x taps), floored by the
    input + output + weight HBM traffic; norms / activations / upsampling as elementwise passes; the
    mid-block single-head attention at the convs' modelled efficiency.  ``launches`` counts one kernel call
    per layer.
    """
    conv = getattr(matmul, "conv", None)
    src_conv = ""
    gemm_t = tensor_t = 0.0
    gemm_flops = gemm_bytes = ew_bytes = 0
    ew_t = ew_eng_t = 0.0
    attn_flops = 0
    n_conv = n_ew = 0
    for r in layers:
        if r.kind in ("WanCausalConv3d", "Conv2d") and len(r.weight_shape) >= 4:
            cout, cin, taps, pix = _conv_dims(r)
            io = (math.prod(r.in_shape) + math.prod(r.out_shape)) // cores * 2 + cout * cin * taps * 2
            geo = _conv_geometry(r)
            if conv is not None and geo is not None:  # the project's conv kernel on this core's rows
                frames, h, w, ks = geo
                cp = conv(cin, cout, frames, math.ceil(h / cores), w, ks)
                gemm_t += cp.at(end)
                tensor_t += cp.busy_at(end).get("tensor", 0.0)
                src_conv = cp.source
            else:  # a GEMM per tap on the SBUF-resident input
                prof = linear_profile(r.kind, math.ceil(pix / cores), cin, cout, matmul, end=end)
                tensor_s = prof.engine_busy_s.get("tensor", prof.latency_s) * taps
                gemm_t += max(tensor_s, io / params.hbm_Bps_per_core)
                tensor_t += tensor_s
            gemm_bytes += io
            gemm_flops += 2 * pix * cin * taps * cout
            n_conv += 1
            if r.kind == "Conv2d" and cout == 3 * cin:  # mid-block single-head spatial attention (qkv conv)
                frames, hw = r.in_shape[0], math.prod(r.in_shape[2:])
                attn_flops += frames * 4 * hw * hw * cin
        elif r.kind in ("WanRMS_norm", "SiLU", "WanUpsample"):
            elems = math.prod(r.out_shape) // cores
            ops = 3 if r.kind == "WanRMS_norm" else 1
            eng = elems * ops / (params.lanes * params.vector_hz)
            ew_t += max(elems * 4 / params.hbm_Bps_per_core, eng)
            ew_eng_t += eng
            ew_bytes += elems * 4
            n_ew += 1
    eff = gemm_flops / (gemm_t * cores * params.peak_flops_per_core) if gemm_t else 1.0
    attn_t = attn_flops / (cores * params.peak_flops_per_core * max(eff, 1e-6))
    src = src_conv or getattr(matmul, "name", "analytic")
    conv_bound = "tensor" if tensor_t >= gemm_bytes / params.hbm_Bps_per_core else "hbm"
    ew_bound = "vector" if ew_eng_t >= ew_bytes / params.hbm_Bps_per_core else "hbm"
    return [
        Component(
            f"vae_convs_{tag}",
            "vae",
            gemm_t,
            1,
            gemm_flops,
            n_conv,
            False,
            src,
            hbm_bytes=gemm_bytes,
            bound=conv_bound,
        ),
        Component(
            f"vae_mid_attention_{tag}",
            "vae",
            attn_t,
            1,
            attn_flops,
            1,
            False,
            "conv efficiency",
            bound="tensor",
        ),
        Component(
            f"vae_elementwise_{tag}",
            "vae",
            ew_t,
            1,
            0,
            n_ew,
            False,
            "vector/hbm-bound",
            hbm_bytes=ew_bytes,
            bound=ew_bound,
        ),
    ]
