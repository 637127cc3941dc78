"""HBM footprint arithmetic of Rolling Forcing on one trn2 chip (all figures *modelled*, i.e. computed).

Every item is a closed formula of the model/pipeline config (``rolling_forcing.config``), the sharding
plan (``tp`` heads groups x ``sp`` query shards over ``cores``) and the storage dtypes; the formula is
stored next to the value so the report can print it.  Items:

* ``dit_weights``: parameter count of the Wan2.1 DiT (:func:`dit_param_count`) x weight bytes.  The plan
  replicates weights on every core (``sharding/plan.py``: "weights replicated, not split"), so per core it is
  the full model and per chip ``weight_copies`` copies (default: one per core; ``weight_copies=1`` is the
  shared-buffer variant, which needs every core to read one HBM copy: NOT argued feasible, see below).
  ``weights="fsdp"`` (ZeRO-3 style): each core keeps ``1 / cores`` of every parameter and all-gathers one
  block's full weights just in time into a double buffer (item ``weight_gather_buffer``: 2 x the
  largest gather unit, the DiT block or the non-block weights).  ``weights="tp_linear"`` (Megatron
  column/row parallel inside the TP group): the block's linear weights (:func:`dit_block_param_split`)
  are split ``/ tp`` and replicated ``sp`` times; norms, modulation, row-parallel biases and the
  non-block weights stay replicated per core; cross-attention runs head-sharded, so ``text_kv`` is
  ``/ tp`` per core and ``x sp`` per chip.
* one shared copy (``weight_copies=1``): the HBM is 4 stacks, each shared by 2 physical cores (AWS Neuron
  SDK, ``about-neuron/arch/neuron-features/logical-neuroncore-config.rst``), and under LNC=1 the runtime
  gives every core its own tensors; one copy read by all 8 cores would need cross-stack reads the cost model
  has no figure for. The line is kept as a bound, not as a modelled placement.
* ``kv_cache``: the rolling buffer (sink + ring slots) of self-attention k and v for every layer:
  ``buffer_tokens x dim x 2 (k, v) x layers x kv_bytes`` per chip.  ``kv_cache="sp_sharded"`` (the
  sharded stream's default, ``sharding/kv_shard.py``): split over head groups (TP) and, within every
  block, over the SP ranks, so per core (busiest rank) ``slots x ceil(T / sp) x (H / tp) x hd x 2 x
  layers x kv_bytes`` (``/ cores`` when ``sp`` divides the block's ``T`` tokens).  ``"replicated"``:
  every SP rank of a head group keeps the whole key range (per chip ``x sp``).
* ``kv_cache="sp_compact"`` (the sharded stream's compact layout, ``sharding/kv_shard.py``; ``sp > 1``): the
  SP-sharded cache with ``slots - 1`` slots (the ring one slot shorter: a write lands in the slot of the
  oldest block the same forward reads, after its reads, through the transient gather buffer), and the
  text k/v token-sharded over all cores: ``text_kv`` per core ``ceil(text_len / cores) x dim x 2 x layers
  x act_bytes`` (per chip the whole text k/v once) plus ``text_kv_gather_buffer``, one layer's whole text
  k/v per core (gathered just before the layer's cross-attention).  With ``weights="tp_linear"`` only the
  ring applies (its cross-attention is head-sharded already).
* ``kv_gather_buffer`` (SP-sharded cache, ``sp > 1``): each attention layer all-gathers the layer's
  whole key range of the local heads from the SP group before its kernel runs: ``gather_buffers x
  buffer_tokens x (H / tp) x hd x 2 (k, v) x kv_bytes`` per core.  One buffer (the default) matches the
  chunk model, which does not overlap that all-gather with compute; hiding it under the previous layer's
  attention needs 2.
* ``text_kv``: cached cross-attention k and v: ``text_len x dim x 2 x layers x act_bytes``; cross-attention
  runs token-sharded over all heads (no communication), so every core keeps all of it (per chip ``x cores``).
* ``activations``: peak per core of the merged forward's live tensors (:func:`activation_peak_bytes`),
  per chip ``x cores``.
* ``vae_weights``: decoder parameters (counted from diffusers' ``AutoencoderKLWan``, the Wan2.1 VAE) x
  weight bytes, replicated like the DiT weights; ``vae_weights="fsdp"``: ``1 / cores`` of them per core
  plus ``vae_gather_buffer``, a double buffer of the largest decoder layer's weights per core (the VAE's
  layers gathered just in time as the DiT's blocks are; a formula only: the CPU stream decodes outside
  the ranks).
* ``vae_workspace``: the streaming decoder's causal feature cache (``CACHE_T = 2`` input frames of every
  causal 3-D conv) + the largest single conv's input+output while decoding one latent frame, from the
  decoder's layer table (``perf/wan_vae_table.py``, derived from a shape-only run of diffusers'
  ``AutoencoderKLWan``) at the target resolution; split spatially over cores.  With ``workspace="shared"``
  or ``vae_split="output_frame"`` it is two items, ``vae_causal_cache`` (persistent) and
  ``vae_conv_workspace`` (the largest call's in+out; per output frame in the late stages with
  ``"output_frame"``), and ``"shared"`` replaces the DiT-phase and VAE-phase transients by one
  ``phase_workspace`` = their max (``perf/footprint_phases.py``: the classes, the source, the assumption,
  and :func:`perf.footprint_phases.persistent_floor`, the floor of the persistent items).

Not included: the umT5-XXL text encoder (run once per prompt; it can be unloaded or run on the host),
the runtime's own reservations, NEFF/instruction buffers, and fragmentation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from perf.footprint_vae import VaeLayer, VaeProbe, vae_probe, vae_strides
from rolling_forcing.config import ModelConfig, PipelineConfig

__all__ = [
    "FootprintItem",
    "Footprint",
    "VaeLayer",
    "VaeProbe",
    "dit_param_count",
    "dit_block_param_count",
    "dit_block_param_split",
    "dit_outside_param_count",
    "WEIGHT_PLACEMENTS",
    "weight_gather_unit_bytes",
    "linear_param_counts",
    "GATHER_UNITS",
    "lower_bound_footprint",
    "model_at_resolution",
    "kv_cache_bytes",
    "activation_peak_bytes",
    "activation_peak_bytes_tp_linear",
    "vae_probe",
    "vae_strides",
    "footprint",
    "KV_CACHE_LAYOUTS",
    "VAE_WEIGHT_PLACEMENTS",
]

GB = 1e9

WEIGHT_PLACEMENTS = ("replicated", "fsdp", "tp_linear")
KV_CACHE_LAYOUTS = ("sp_sharded", "replicated", "sp_compact")  # as sharding.kv_shard.KV_CACHE_LAYOUTS
VAE_WEIGHT_PLACEMENTS = ("replicated", "fsdp")


def dit_block_param_count(m: ModelConfig) -> int:
    """Parameters of one Wan2.1 DiT block (github.com/Wan-Video/Wan2.1 @ 9737cba, ``wan/modules/model.py``).

    Self-attn q,k,v,o ``4 (d^2 + d)`` + RMSNorm q,k ``2d``; cross-attn q,k,v,o ``4 (d^2 + d)`` + RMSNorm
    q,k ``2d``; LN3 affine ``2d``; FFN ``d f + f + f d + d``; modulation ``6d``.
    """
    d, f = m.dim, m.ffn_dim
    return 4 * (d * d + d) + 2 * d + 4 * (d * d + d) + 2 * d + 2 * d + (d * f + f + f * d + d) + 6 * d


def dit_block_param_split(m: ModelConfig) -> tuple[int, int]:
    """``(tp_sharded, replicated)`` parameters of one block under Megatron column/row parallel linears.

    Column parallel (weight and bias split by output features): self q,k,v, cross q,k,v, FFN up:
    ``6 (d^2 + d) + d f + f``.  Row parallel (weight split by input features, bias added once, so
    replicated): self o, cross o, FFN down: ``2 d^2 + f d`` sharded, ``3 d`` replicated.  Replicated
    too: the four RMSNorm weights ``4d``, LN3 affine ``2d``, modulation ``6d``.
    """
    d, f = m.dim, m.ffn_dim
    sharded = 6 * (d * d + d) + d * f + f + 2 * d * d + f * d
    return sharded, dit_block_param_count(m) - sharded


def dit_outside_param_count(m: ModelConfig) -> int:
    """Parameters outside the blocks: patch embedding ``C_in ph pw d + d``, text embedding
    ``T d + d + d^2 + d``, time embedding ``F d + d + d^2 + d``, time projection ``6 d^2 + 6d``, head
    ``d p + p`` + head modulation ``2d``."""
    d = m.dim
    _, ph, pw = m.patch_size
    return (
        m.in_channels * ph * pw * d
        + d
        + (m.text_dim * d + d + d * d + d)
        + (m.freq_dim * d + d + d * d + d)
        + (6 * d * d + 6 * d)
        + (d * m.patch_out + m.patch_out + 2 * d)
    )


def dit_param_count(m: ModelConfig) -> int:
    """Parameters of the Wan2.1 causal DiT: ``layers x`` :func:`dit_block_param_count` ``+``
    :func:`dit_outside_param_count`."""
    return m.num_layers * dit_block_param_count(m) + dit_outside_param_count(m)


GATHER_UNITS = ("block", "linear")
"""FSDP gather granularity: a whole DiT block (and all non-block weights at once), or one linear layer."""


def linear_param_counts(m: ModelConfig) -> tuple[int, ...]:
    """Parameters (weight + bias) of every distinct linear layer of the DiT, a block's and the non-block
    ones (:func:`dit_block_param_count`, :func:`dit_outside_param_count`): q, k, v, o ``d^2 + d``, FFN up
    ``d f + f`` and down ``f d + d``; patch embedding ``C_in ph pw d + d``, text embedding ``T d + d`` and
    ``d^2 + d``, time embedding ``F d + d`` and ``d^2 + d``, time projection ``6 d^2 + 6 d``, head ``d p +
    p``. The norms and modulation vectors (< d^2) travel with a neighbouring linear."""
    d, f = m.dim, m.ffn_dim
    _, ph, pw = m.patch_size
    return (
        d * d + d,
        d * f + f,
        f * d + d,
        m.in_channels * ph * pw * d + d,
        m.text_dim * d + d,
        m.freq_dim * d + d,
        6 * d * d + 6 * d,
        d * m.patch_out + m.patch_out,
    )


def weight_gather_unit_bytes(m: ModelConfig, weight_bytes: float = 2, unit: str = "block") -> int:
    """Bytes of the largest FSDP gather unit: the size of one half of the per-core double buffer.
    ``unit="block"``: one block, or all non-block weights; ``"linear"``: one linear layer
    (:func:`linear_param_counts`)."""
    if unit not in GATHER_UNITS:
        raise ValueError(f"unit must be one of {GATHER_UNITS}, got {unit!r}")
    if unit == "linear":
        return int(max(linear_param_counts(m)) * weight_bytes)
    return int(max(dit_block_param_count(m), dit_outside_param_count(m)) * weight_bytes)


def model_at_resolution(m: ModelConfig, height: int, width: int, vae_spatial_stride: int) -> ModelConfig:
    """``m`` with its latent grid set for ``height x width`` pixels (must divide by stride x patch)."""
    _, ph, pw = m.patch_size
    for name, v, p in (("height", height, ph), ("width", width, pw)):
        if not isinstance(v, int) or v < 1 or v % (vae_spatial_stride * p):
            raise ValueError(
                f"{name}={v!r} must be a positive multiple of VAE stride x patch = {vae_spatial_stride * p}"
            )
    return replace(m, latent_height=height // vae_spatial_stride, latent_width=width // vae_spatial_stride)


def kv_cache_bytes(m: ModelConfig, p: PipelineConfig, kv_bytes: float) -> int:
    """Self-attention KV buffer of all layers: ``buffer_tokens x dim x 2 x layers x kv_bytes``."""
    return int(p.buffer_tokens(m) * m.dim * 2 * m.num_layers * kv_bytes)


def merged_tokens(m: ModelConfig, p: PipelineConfig) -> int:
    """Tokens of one merged forward: cache-update block + window (18 frames x tokens per frame)."""
    return (p.frames_per_block + p.window_frames) * m.tokens_per_frame


def activation_peak_bytes(
    m: ModelConfig, p: PipelineConfig, tp: int, sp: int, act_bytes: int = 2
) -> dict[str, int]:
    """Live activation bytes per core in the two heaviest phases of one layer of the merged forward.

    ``n = ceil(N / (tp sp))`` tokens per core (N = :func:`merged_tokens`); residual stream kept in fp32.
    attention phase: residual ``4 n d`` + token-shard q,k,v ``3 n d b`` + regrouped local queries
    ``ceil(N / sp) (H / tp) hd b`` + gathered new keys and values ``2 N (H / tp) hd b`` + attention output
    ``ceil(N / sp) (H / tp) hd b``.  FFN phase: residual ``4 n d`` + normed input ``n d b`` + hidden
    ``n f b`` + output ``n d b``.  Cached keys are not activations: they are read from the
    ``kv_cache`` item (replicated layout) or the ``kv_gather_buffer`` item (SP-sharded).
    """
    cores = tp * sp
    n_tot = merged_tokens(m, p)
    n = math.ceil(n_tot / cores)
    hl = m.num_heads // tp
    q_loc = math.ceil(n_tot / sp)
    attn = 4 * n * m.dim + 3 * n * m.dim * act_bytes + q_loc * hl * m.head_dim * act_bytes
    attn += 2 * n_tot * hl * m.head_dim * act_bytes + q_loc * hl * m.head_dim * act_bytes
    ffn = 4 * n * m.dim + n * m.dim * act_bytes + n * m.ffn_dim * act_bytes + n * m.dim * act_bytes
    return {"attention": attn, "ffn": ffn, "peak": max(attn, ffn)}


def activation_peak_bytes_tp_linear(
    m: ModelConfig, p: PipelineConfig, tp: int, sp: int, act_bytes: int = 2
) -> dict[str, int]:
    """Live activation bytes per core of one layer with Megatron column/row parallel linears.

    Residual stream token-sharded in fp32 ``4 n d`` (``n = ceil(N / (tp sp))``, Megatron sequence
    parallelism); ``N_s = ceil(N / sp)`` tokens of the SP shard are all-gathered before every column
    parallel linear.  Attention phase: residual + gathered normed input ``N_s d b`` + local q,k,v
    ``3 N_s (d / tp) b`` + gathered new keys and values ``2 N (H / tp) hd b`` + attention output
    ``N_s (d / tp) b`` + the row-parallel partial output ``N_s d b`` (before its reduce-scatter).  FFN
    phase: residual + gathered input ``N_s d b`` + local hidden ``N_s (f / tp) b`` + partial output
    ``N_s d b``.
    """
    cores = tp * sp
    n_tot = merged_tokens(m, p)
    n = math.ceil(n_tot / cores)
    ns = math.ceil(n_tot / sp)
    dl, fl = m.dim // tp, math.ceil(m.ffn_dim / tp)
    hl = m.num_heads // tp
    attn = 4 * n * m.dim + ns * m.dim * act_bytes + 3 * ns * dl * act_bytes
    attn += 2 * n_tot * hl * m.head_dim * act_bytes + ns * dl * act_bytes + ns * m.dim * act_bytes
    ffn = 4 * n * m.dim + ns * m.dim * act_bytes + ns * fl * act_bytes + ns * m.dim * act_bytes
    return {"attention": attn, "ffn": ffn, "peak": max(attn, ffn)}


@dataclass(frozen=True)
class FootprintItem:
    name: str
    per_core: int
    per_chip: int
    formula: str


@dataclass(frozen=True)
class Footprint:
    """HBM footprint of one configuration (bytes; *modelled* = computed, not measured)."""

    label: str
    cores: int
    items: tuple[FootprintItem, ...]

    @property
    def per_core(self) -> int:
        return sum(i.per_core for i in self.items)

    @property
    def per_chip(self) -> int:
        return sum(i.per_chip for i in self.items)

    def item(self, name: str) -> FootprintItem:
        for i in self.items:
            if i.name == name:
                return i
        raise KeyError(name)


def footprint(
    m: ModelConfig,
    p: PipelineConfig,
    *,
    tp: int,
    sp: int,
    kv_bytes: float = 2,
    weight_bytes: float = 2,
    act_bytes: int = 2,
    weight_copies: int | None = None,
    weights: str = "replicated",
    vae: VaeProbe | None = None,
    label: str = "",
    kv_cache: str = "sp_sharded",
    gather_buffers: int = 1,
    vae_weights: str = "replicated",
    gather_unit: str = "block",
    workspace: str = "separate",
    vae_split: str = "latent_frame",
) -> Footprint:
    """HBM footprint per core and per chip (see the module docstring for every formula).

    ``tp x sp`` cores (the sharding plan); ``kv_bytes`` 2 (bf16) or 1 (fp8 KV cache); ``weight_copies``
    copies of the weights on the chip (default ``tp x sp``: replicated per core; only with
    ``weights="replicated"``); ``weights`` one of :data:`WEIGHT_PLACEMENTS` (module docstring); ``vae``
    a :func:`vae_probe` result (omit to leave the VAE out; VAE weights are replicated per core in every
    placement unless ``vae_weights="fsdp"``, :data:`VAE_WEIGHT_PLACEMENTS`); ``kv_cache`` one of
    :data:`KV_CACHE_LAYOUTS` (``"sp_compact"`` needs ``sp > 1``) and ``gather_buffers`` (>= 1) the
    per-layer gather buffers of the SP-sharded cache (module docstring); ``gather_unit`` one of
    :data:`GATHER_UNITS`: the FSDP gather granularity (``"linear"``: priced by ``chunk_model(...,
    gather_unit="linear")``, :func:`perf.e2e.weights.fsdp_linear_components`).  ``workspace`` one of
    ``perf.footprint_phases.WORKSPACES``: ``"shared"`` puts the DiT-phase and VAE-phase transients in one
    region, ``phase_workspace`` = max of the two (needs ``vae``; the Neuron runtime's shared scratchpad,
    ``perf/footprint_phases.py``); ``vae_split`` one of ``perf.footprint_phases.VAE_SPLITS``:
    ``"output_frame"`` runs the decoder's stages after its last temporal upsampling one output frame per
    call (:func:`perf.footprint_vae.vae_frame_split`; needs ``vae``).  With either option the VAE's
    workspace is two items, ``vae_causal_cache`` (persistent) + ``vae_conv_workspace`` (transient).
    """
    from perf.footprint_phases import VAE_SPLITS, WORKSPACES, shared_workspace, vae_items
    from perf.footprint_vae import vae_frame_split

    for name, v in (("tp", tp), ("sp", sp)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"footprint: {name} must be a positive int, got {v!r}")
    if m.num_heads % tp:
        raise ValueError(f"footprint: tp={tp} must divide num_heads={m.num_heads}")
    if kv_bytes <= 0 or weight_bytes <= 0:
        raise ValueError("footprint: kv_bytes and weight_bytes must be > 0")
    if weights not in WEIGHT_PLACEMENTS:
        raise ValueError(f"footprint: weights must be one of {WEIGHT_PLACEMENTS}, got {weights!r}")
    if kv_cache not in KV_CACHE_LAYOUTS:
        raise ValueError(f"footprint: kv_cache must be one of {KV_CACHE_LAYOUTS}, got {kv_cache!r}")
    if kv_cache == "sp_compact" and sp < 2:
        raise ValueError(
            f"footprint: kv_cache='sp_compact' needs sp > 1 (the SP gather's buffer), got sp={sp}"
        )
    if vae_weights not in VAE_WEIGHT_PLACEMENTS:
        raise ValueError(
            f"footprint: vae_weights must be one of {VAE_WEIGHT_PLACEMENTS}, got {vae_weights!r}"
        )
    if isinstance(gather_buffers, bool) or not isinstance(gather_buffers, int) or gather_buffers < 1:
        raise ValueError(f"footprint: gather_buffers must be an int >= 1, got {gather_buffers!r}")
    if gather_unit not in GATHER_UNITS:
        raise ValueError(f"footprint: gather_unit must be one of {GATHER_UNITS}, got {gather_unit!r}")
    if gather_unit != "block" and weights != "fsdp":
        raise ValueError(
            f"footprint: gather_unit={gather_unit!r} only applies to weights='fsdp', not {weights!r}"
        )
    if workspace not in WORKSPACES:
        raise ValueError(f"footprint: workspace must be one of {WORKSPACES}, got {workspace!r}")
    if vae_split not in VAE_SPLITS:
        raise ValueError(f"footprint: vae_split must be one of {VAE_SPLITS}, got {vae_split!r}")
    if vae is None and (workspace, vae_split) != ("separate", "latent_frame"):
        raise ValueError(
            f"footprint: workspace={workspace!r} / vae_split={vae_split!r} need vae (the decode's transients)"
        )
    if weight_copies is not None and weights != "replicated":
        raise ValueError(f"footprint: weight_copies only applies to weights='replicated', not {weights!r}")
    cores = tp * sp
    copies = cores if weight_copies is None else weight_copies
    if not 1 <= copies <= cores:
        raise ValueError(f"footprint: weight_copies must be in [1, {cores}], got {copies}")
    n_par = dit_param_count(m)
    w = int(n_par * weight_bytes)
    text = int(m.text_len * m.dim * 2 * m.num_layers * act_bytes)
    text_core, text_note = text, "on every core"
    act = activation_peak_bytes(m, p, tp, sp, act_bytes)["peak"]
    act_note = "max(attention, FFN) phase live tensors per core x cores"
    extra: list[FootprintItem] = []
    if weights == "replicated":
        w_item = FootprintItem(
            "dit_weights", w, w * copies, f"params {n_par:,} x {weight_bytes} B x {copies} copies"
        )
    elif weights == "fsdp":
        wc = math.ceil(w / cores)
        w_item = FootprintItem(
            "dit_weights",
            wc,
            wc * cores,
            f"params {n_par:,} x {weight_bytes} B, 1/{cores} per core (FSDP shard)",
        )
        buf = 2 * weight_gather_unit_bytes(m, weight_bytes, gather_unit)
        unit = (
            f"max(block {dit_block_param_count(m):,}, non-block {dit_outside_param_count(m):,})"
            if gather_unit == "block"
            else f"largest linear {max(linear_param_counts(m)):,}"
        )
        extra.append(
            FootprintItem(
                "weight_gather_buffer",
                buf,
                buf * cores,
                f"2 (double buffer) x {unit} params x {weight_bytes} B, per core",
            )
        )
    else:
        sh, rep = dit_block_param_split(m)
        wc = int((m.num_layers * (math.ceil(sh / tp) + rep) + dit_outside_param_count(m)) * weight_bytes)
        w_item = FootprintItem(
            "dit_weights",
            wc,
            wc * cores,
            f"({m.num_layers} x ({sh:,} linear / {tp} + {rep:,} repl.) + {dit_outside_param_count(m):,} "
            f"non-block) x {weight_bytes} B per core, x {cores} cores",
        )
        text_core, text_note = math.ceil(text / tp), f"heads / {tp} per core (TP cross-attention)"
        act = activation_peak_bytes_tp_linear(m, p, tp, sp, act_bytes)["peak"]
        act_note = "max(attention, FFN) live tensors per core, Megatron-SP layout, x cores"
    items = [w_item, *extra, *_kv_items(m, p, tp, sp, kv_bytes, kv_cache, gather_buffers)]
    text_chip = text_core * cores
    if kv_cache == "sp_compact" and weights != "tp_linear":
        text_core, text_chip = math.ceil(m.text_len / cores) * m.dim * 2 * m.num_layers * act_bytes, text
        text_note = f"ceil({m.text_len} / {cores}) tok per core (token-sharded, whole once per chip)"
        layer = m.text_len * m.dim * 2 * act_bytes
        text_gather = [
            FootprintItem(
                "text_kv_gather_buffer",
                layer,
                layer * cores,
                f"one layer's whole text k/v: {m.text_len} tok x {m.dim} x 2 x {act_bytes} B per core",
            )  # fmt: skip
        ]
        text_tok = f"{math.ceil(m.text_len / cores)} of {m.text_len} tok"
    else:
        text_gather, text_tok = [], f"{m.text_len} tok"
    items += [
        FootprintItem(
            "text_kv",
            text_core,
            text_chip,
            f"{text_tok} x {m.dim} x 2 x {m.num_layers} x {act_bytes} B, {text_note}",
        ),
        *text_gather,
        FootprintItem("activations", act, act * cores, act_note),
    ]
    if vae is not None:
        if vae_split == "output_frame":
            vae = vae_frame_split(vae)
        vw = int(vae.decoder_params * weight_bytes)
        ws = int((vae.feat_cache_elems + vae.peak_layer_elems) * act_bytes)
        if vae_weights == "fsdp":
            vc, vbuf = math.ceil(vw / cores), int(2 * vae.largest_weight_elems * weight_bytes)
            items += [
                FootprintItem(
                    "vae_weights", vc, vc * cores,
                    f"decoder params {vae.decoder_params:,} x {weight_bytes} B, 1/{cores} per core (FSDP)",
                ),
                FootprintItem(
                    "vae_gather_buffer", vbuf, vbuf * cores,
                    f"2 (double buffer) x largest decoder layer {vae.largest_weight_elems:,} params x "
                    f"{weight_bytes} B, per core",
                ),
            ]  # fmt: skip
        else:
            items.append(
                FootprintItem(
                    "vae_weights",
                    vw,
                    vw * (copies if weights == "replicated" else cores),
                    f"decoder params {vae.decoder_params:,} x {weight_bytes} B"
                    + ("" if weights == "replicated" else ", replicated per core"),
                )
            )
        if (workspace, vae_split) == ("separate", "latent_frame"):
            items.append(
                FootprintItem(
                    "vae_workspace",
                    math.ceil(ws / cores),
                    ws,
                    "(causal feat cache 2 frames x every conv input + largest conv in+out) x act bytes, "
                    "/ cores",
                )
            )
        else:
            items += vae_items(vae, act_bytes, cores)
    if workspace == "shared":
        items = shared_workspace(items)
    return Footprint(label=label, cores=cores, items=tuple(items))


def _kv_items(
    m: ModelConfig, p: PipelineConfig, tp: int, sp: int, kv_bytes: float, layout: str, buffers: int
) -> list[FootprintItem]:
    """The ``kv_cache`` item and, for the SP-sharded cache with ``sp > 1``, ``kv_gather_buffer``."""
    slots, t, hl = p.buffer_slots, p.tokens_per_block(m), m.num_heads // tp
    row = hl * m.head_dim * 2 * kv_bytes  # one token's k and v of the local heads, one layer
    kv = kv_cache_bytes(m, p, kv_bytes)
    held = slots - 1 if layout == "sp_compact" else slots  # slots kept between forwards
    if layout == "sp_compact":
        kv = int(held * t * m.dim * 2 * m.num_layers * kv_bytes)
    cores = tp * sp
    if layout == "replicated" or sp == 1:
        core = math.ceil(slots * t * row * m.num_layers)
        where = "whole key range per head group" if sp > 1 else "heads / tp per core"
        return [
            FootprintItem(
                "kv_cache",
                core,
                core * cores,
                f"{slots} slots x {t:,} tok x {hl} heads x {m.head_dim} x 2 (k,v) x {m.num_layers} layers x "
                f"{kv_bytes:g} B per core ({where})",
            )  # fmt: skip
        ]
    full, slots = slots, held  # the gather buffer holds every schedule slot, the cache the held ones
    core = math.ceil(slots * math.ceil(t / sp) * row * m.num_layers)
    buf = math.ceil(buffers * full * t * row)
    return [
        FootprintItem(
            "kv_cache", core, kv,
            f"{slots} slots x ceil({t:,} / sp {sp}) tok x {hl} heads x {m.head_dim} x 2 (k,v) x "
            f"{m.num_layers} layers x {kv_bytes:g} B per core (SP-sharded; per chip the whole cache)",
        ),
        FootprintItem(
            "kv_gather_buffer", buf, buf * cores,
            f"{buffers} x one layer's whole key range: {full * t:,} tok x {hl} heads x {m.head_dim} x 2 "
            f"(k,v) x {kv_bytes:g} B per core (the per-layer SP all-gather)",
        ),
    ]  # fmt: skip


def lower_bound_footprint(
    m: ModelConfig,
    p: PipelineConfig,
    *,
    cores: int,
    kv_bytes: float = 2,
    weight_bytes: float = 2,
    compact: bool = False,
) -> Footprint:
    """The floor no weight placement can go below: the faithful ring KV cache + ONE copy of the DiT
    weights on the chip (no text k/v, activations, VAE, buffers).  Per core is the chip total / cores.
    ``compact``: the ring of ``buffer_slots - 1`` slots the sharded stream's ``"sp_compact"`` layout keeps
    (the fewest slots that hold every block a later forward reads)."""
    if not isinstance(cores, int) or cores < 1:
        raise ValueError(f"lower_bound_footprint: cores must be a positive int, got {cores!r}")
    slots = p.buffer_slots - 1 if compact else p.buffer_slots
    tokens = slots * p.tokens_per_block(m)
    kv = int(tokens * m.dim * 2 * m.num_layers * kv_bytes)
    w = int(dit_param_count(m) * weight_bytes)
    items = (
        FootprintItem(
            "kv_cache",
            math.ceil(kv / cores),
            kv,
            f"{tokens:,} tok ({slots} slots) x {m.dim} x 2 (k,v) x {m.num_layers} layers x {kv_bytes:g} B",
        ),
        FootprintItem(
            "dit_weights",
            math.ceil(w / cores),
            w,
            f"params {dit_param_count(m):,} x {weight_bytes:g} B, one copy",
        ),
    )
    kvl = "bf16" if kv_bytes == 2 else "fp8 KV cache"
    return Footprint(f"lower bound ({kvl}): {slots}-slot KV cache + one DiT weight copy", cores, items)
