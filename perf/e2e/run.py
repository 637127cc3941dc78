"""Build every modelled figure of the report (no I/O): our configuration and the peer's, at both ends."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from perf.e2e.chunk import ChunkModel, chunk_model, warmup_forwards
from perf.e2e.components import vae_components
from perf.e2e.fp8 import VARIANT as FP8_VARIANT
from perf.e2e.fp8 import fp8_linear_chunks
from perf.e2e.guard import GuardSensitivity, guard_sensitivity
from perf.e2e.kernels import KernelProvider, TracedKernels, default_kernel_provider
from perf.e2e.params import ENDS, E2EParams
from perf.e2e.peer import PEER_CONFIGS, PEER_PRESET, PeerConfig, PeerMeasured, measured_for
from perf.e2e.peer_kernels import PeerKernels
from perf.e2e.peer_matmul import peer_matmul
from perf.e2e.weights import WEIGHT_VARIANTS
from perf.footprint import (
    Footprint,
    footprint,
    lower_bound_footprint,
    model_at_resolution,
    vae_probe,
    vae_strides,
)
from perf.footprint_phases import persistent_floor, taehv_footprint
from perf.footprint_vae import vae_frame_split
from perf.matmul_model import MatmulProvider, TracedLinearProvider, default_matmul_provider
from rolling_forcing.config import ModelConfig, PipelineConfig, get_preset
from rolling_forcing.fp8 import kv_fp8_bytes_per_element

__all__ = [
    "E2EResult",
    "PeerRow",
    "Ttff",
    "run_model",
    "peer_provider",
    "OUR_VARIANTS",
    "COMPACT",
    "COMPACT_MODES",
    "LEAN",
    "LEAN_LABEL",
]

OUR_VARIANTS = ("merged", "two_pass", "merged_eager")
"""Our chunk variants: merged and two-pass compiled one graph per forward (``fullgraph``), and the merged
forward of the sharded stream without ``compile=`` (``eager_sharded``: host collectives cut the graph)."""


COMPACT: dict[str, Any] = {"weights": "fsdp", "vae_weights": "fsdp", "kv_cache": "sp_compact"}
"""The block-gather compact placement (perf/footprint.py): FSDP-sharded DiT + VAE weights, the compact KV
layout (:data:`LEAN` goes below it)."""
LEAN: dict[str, dict[str, Any]] = {
    "shared": {**COMPACT, "gather_unit": "linear", "workspace": "shared"},
    "per_frame": {**COMPACT, "gather_unit": "linear", "vae_split": "output_frame"},
}
"""The placements below :data:`COMPACT` (``perf/footprint_phases.py``): per-linear FSDP gathers and either
one scratchpad for the DiT and VAE phases' transients (``"shared"``) or, without it, the VAE's late
stages one output frame per call (``"per_frame"``)."""
LEAN_LABEL = {
    "shared": "FSDP per-linear DiT + VAE weights, compact KV cache, one DiT/VAE scratchpad",
    "per_frame": "FSDP per-linear DiT + VAE weights, compact KV cache, per-frame VAE",
}
COMPACT_MODES = ("fullgraph", "eager_sharded")
"""Compile modes :data:`COMPACT` is priced in: one graph per forward (collectives on the CC stream, the
overlap schedule; the sharded stream's ``compile=`` with ``kv_cache="sp_compact"`` builds it, one graph
per rank) and the eager stream (without ``compile=``: host collectives, serialised)."""


_CHUNK_KEYS = ("weights", "vae_weights", "kv_cache", "gather_unit")
"""The placement arguments ``chunk_model`` takes (the footprint-only ones are HBM arithmetic)."""


@dataclass(frozen=True)
class Ttff:
    """Time to first frame at one end: warm-up windows (growing shapes) + first-frame decode."""

    total_s: float
    static_s: float
    warmup_s: tuple[float, ...]
    first_decode_s: float


@dataclass(frozen=True)
class PeerRow:
    """One peer configuration: the modelled chunk at each end and the peer's measurement (if any)."""

    config: PeerConfig
    chunks: dict[str, ChunkModel]
    measured: PeerMeasured | None
    error: str = ""

    def ratio(self, end: str) -> float | None:
        """Predicted / measured fps at ``end`` (None without a measurement or a model)."""
        if self.measured is None or end not in self.chunks:
            return None
        return self.chunks[end].fps / self.measured.fps


@dataclass
class E2EResult:
    model: ModelConfig
    pipe: PipelineConfig
    height: int
    width: int
    cores: int
    chunks: dict[tuple[str, str], ChunkModel]
    ttff: dict[str, Ttff]
    footprints: list[Footprint]
    scaling: list[tuple[int, str, dict[str, tuple[float, float]]]]
    kernels_name: str
    matmul_name: str
    params: E2EParams
    wall_s: float = 0.0
    command: str = ""
    weight_variants: list[tuple[str, str, ChunkModel]] = field(default_factory=list)
    lower_bounds: list[Footprint] = field(default_factory=list)
    peer: list[PeerRow] = field(default_factory=list)
    peer_kernels_name: str = ""
    guard: GuardSensitivity = field(default_factory=GuardSensitivity)
    compact: dict[tuple[str, str], ChunkModel] = field(default_factory=dict)
    """The block-gather compact placement (:data:`COMPACT`) per (compile mode of :data:`COMPACT_MODES`,
    end)."""
    lean: dict[tuple[str, str, str], ChunkModel] = field(default_factory=dict)
    """The :data:`LEAN` placements per (name, compile mode of :data:`COMPACT_MODES`, end)."""

    def chunk(self, variant: str, end: str) -> ChunkModel:
        return self.chunks[(variant, end)]


def _model(preset: str, height: int, width: int) -> ModelConfig:
    return model_at_resolution(get_preset(preset), height, width, vae_strides()[1])


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
    peer: bool = True,
    peer_kernels: KernelProvider | None = None,
) -> E2EResult:
    """Every modelled figure of the report at both ends (``peer``: also the peer's configurations, which
    are Wan2.1-1.3B whatever ``preset`` is).

    ``peer_kernels`` prices the peer rows only (default: :class:`~perf.e2e.peer_kernels.PeerKernels`, the
    peer's own attention and layout permutes, around ``kernels`` when ``kernels`` is traced; ``kernels``
    itself when it is not, e.g. ``--analytic``)."""
    t0 = time.perf_counter()
    params = params or E2EParams()
    kernels = kernels or default_kernel_provider(params)
    matmul = matmul or default_matmul_provider()
    m = _model(preset, height, width)
    pipe = PipelineConfig(dtype="bfloat16")
    vae = vae_probe(m.latent_height, m.latent_width, pipe.frames_per_block)
    kw: dict[str, Any] = {"vae": vae, "kernels": kernels, "matmul": matmul, "params": params}
    chunks: dict[tuple[str, str], ChunkModel] = {}
    ttff: dict[str, Ttff] = {}
    for end in ENDS:
        chunks[("merged", end)] = chunk_model(m, pipe, cores=cores, variant="merged", end=end, **kw)
        chunks[("two_pass", end)] = chunk_model(m, pipe, cores=cores, variant="two_pass", end=end, **kw)
        chunks[("merged_eager", end)] = chunk_model(
            m, pipe, cores=cores, variant="merged", end=end, compile_mode="eager_sharded", **kw
        )
        warm = tuple(
            chunk_model(m, pipe, cores=cores, forwards=[f], end=end, **{**kw, "vae": None}).chunk_s
            for f in warmup_forwards(m, pipe)
        )
        first = vae_components(vae, vae.first, cores, matmul, params, "first", end)
        fixed = params.at(end).kernel_fixed_s * sum(c.launches for c in first) + params.neff_launch_s
        first_dec = sum(c.total_s for c in first) + fixed
        static = pipe.window_blocks * chunks[("merged", end)].dit_s + first_dec
        ttff[end] = Ttff(sum(warm) + first_dec, static, warm, first_dec)
    guard = guard_sensitivity(m, pipe, chunks, kernels, params)  # perf/e2e/guard.py
    if isinstance(matmul, TracedLinearProvider):  # the FP8-linear variant (perf/e2e/fp8.py); traced only
        for end, cm in fp8_linear_chunks(m, pipe, cores=cores, kw=kw).items():
            chunks[(FP8_VARIANT, end)] = cm
    scaling: list[tuple[int, str, dict[str, tuple[float, float]]]] = []
    for c in scaling_cores:
        try:
            by_end = {}
            name = ""
            for end in ENDS:
                cm = chunk_model(m, pipe, cores=c, variant="merged", end=end, **kw)
                by_end[end] = (cm.fps, cm.dit_fps)
                name = cm.plan_name
            scaling.append((c, name, by_end))
        except ValueError as e:  # no balanced plan for this core count
            scaling.append((c, f"no plan: {e}".split("\n")[0][:60], {}))
    merged = chunks[("merged", "pessimistic")]
    fps_: list[Footprint] = []
    kv8 = kv_fp8_bytes_per_element(m.head_dim)  # FP8 KV layout: e4m3 + an fp32 scale per token-head
    kvs = ((2, "bf16"), (kv8, "fp8 KV cache"))
    # (kv bytes, kv label, placement arguments, placement label), in the report's row order
    specs: list[tuple[float, str, dict[str, Any], str]] = [
        (kvb, lab, {"weight_copies": copies}, wl)
        for kvb, lab in kvs
        for copies, wl in ((None, "weights per core"), (1, "one shared weight copy"))
    ] + [
        (kvb, lab, {"weights": wp}, wl)
        for wp, wl in (("fsdp", "FSDP-sharded weights"), ("tp_linear", "TP-sharded linears"))
        for kvb, lab in kvs
    ]
    specs += [(kvb, lab, COMPACT, "FSDP-sharded DiT + VAE weights, compact KV cache") for kvb, lab in kvs]
    if merged.sp > 1:  # the compact layout needs SP ranks (perf/footprint.py)
        specs += [(kvb, lab, LEAN[n], LEAN_LABEL[n]) for n in LEAN for kvb, lab in kvs]
    for kvb, lab, placement, wl in specs:
        fps_.append(
            footprint(
                m, pipe, tp=merged.tp, sp=merged.sp, kv_bytes=kvb, vae=vae, label=f"{lab}, {wl}", **placement
            )
        )
    if merged.sp > 1:
        fps_ += [
            taehv_footprint(m, pipe, tp=merged.tp, sp=merged.sp, kv_bytes=kvb, **LEAN["shared"])
            for kvb, _ in kvs
        ]
    lower = [lower_bound_footprint(m, pipe, cores=cores, kv_bytes=kvb, compact=True) for kvb in (2, kv8)]
    lower += [persistent_floor(m, pipe, cores=cores, vae=vae, kv_bytes=kvb) for kvb in (2, kv8)]
    wv: list[tuple[str, str, ChunkModel]] = []
    for end in ENDS:
        for wp in WEIGHT_VARIANTS:
            cm = (
                chunks[("merged", end)]
                if wp == "replicated"
                else chunk_model(m, pipe, cores=cores, variant="merged", weights=wp, end=end, **kw)
            )
            wv.append((wp, end, cm))
    compact = {
        (mode, end): chunk_model(
            m, pipe, cores=cores, variant="merged", end=end, compile_mode=mode, **COMPACT, **kw
        )
        for mode in COMPACT_MODES
        for end in ENDS
        if merged.sp > 1  # the compact layout needs SP ranks (perf/footprint.py)
    }
    split = vae_frame_split(vae)
    lean = {
        (name, mode, end): chunk_model(
            m,
            pipe,
            cores=cores,
            variant="merged",
            end=end,
            compile_mode=mode,
            **{k: v for k, v in LEAN[name].items() if k in _CHUNK_KEYS},
            **{**kw, "vae": split if LEAN[name].get("vae_split") == "output_frame" else vae},
        )  # fmt: skip
        for name in LEAN
        for mode in COMPACT_MODES
        for end in ENDS
        if merged.sp > 1
    }
    if peer and peer_kernels is None:
        peer_kernels = peer_provider(kernels)
    peers = _peer_rows(pipe, peer_kernels or kernels, peer_matmul(matmul, params), params) if peer else []
    return E2EResult(
        m,
        pipe,
        height,
        width,
        cores,
        chunks,
        ttff,
        fps_,
        scaling,
        kernels.name,
        getattr(matmul, "name", type(matmul).__name__),
        params,
        time.perf_counter() - t0,
        weight_variants=wv,
        lower_bounds=lower,
        peer=peers,
        peer_kernels_name=getattr(peer_kernels, "name", "") if peer else "",
        guard=guard,
        compact=compact,
        lean=lean,
    )


def peer_provider(kernels: KernelProvider) -> KernelProvider:
    """The provider of the peer rows: :class:`~perf.e2e.peer_kernels.PeerKernels` around ``kernels`` when
    ``kernels`` traces (:class:`~perf.e2e.kernels.TracedKernels`), else ``kernels`` itself (the hand-counted
    ``--analytic`` fallback has no peer kernel)."""
    return PeerKernels(kernels) if isinstance(kernels, TracedKernels) else kernels


def _peer_rows(
    pipe: PipelineConfig, kernels: KernelProvider, matmul: MatmulProvider, params: E2EParams
) -> list[PeerRow]:
    """The peer's configurations (:data:`PEER_CONFIGS`) at both ends: Megatron TP linears, ~370 NEFFs
    per rank per forward, ``kernels`` = the peer's provider (:class:`~perf.e2e.peer_kernels.PeerKernels`:
    its attention and layout permutes; our RoPE and KV write) and ``matmul`` = the peer's dense layers
    (:class:`~perf.e2e.peer_matmul.PeerMatmul`: its measured matmul and VAE efficiency)."""
    rows: list[PeerRow] = []
    probes: dict[tuple[int, int], Any] = {}
    for cfg in PEER_CONFIGS:
        m = _model(PEER_PRESET, cfg.height, cfg.width)
        if (cfg.height, cfg.width) not in probes:
            probes[(cfg.height, cfg.width)] = vae_probe(
                m.latent_height, m.latent_width, pipe.frames_per_block
            )
        chunks: dict[str, ChunkModel] = {}
        err = ""
        for end in ENDS:
            try:
                cm = chunk_model(
                    m,
                    pipe,
                    cores=cfg.cores,
                    variant=cfg.variant,
                    vae=probes[(cfg.height, cfg.width)],
                    kernels=kernels,
                    matmul=matmul,
                    params=params,
                    end=end,
                    weights="tp_linear",
                    compile_mode="peer",
                )
            except ValueError as e:
                err = str(e).split("\n")[0]
                break
            if cm.plan_name != cfg.plan:
                err = f"our planner chose {cm.plan_name}, the peer runs {cfg.plan}"
            chunks[end] = cm
        rows.append(PeerRow(cfg, chunks, measured_for(cfg), err))
    return rows
