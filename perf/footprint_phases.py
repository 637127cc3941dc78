"""What of the HBM footprint persists across a chunk and what is live only in one phase (all *modelled*).

A chunk on one core runs the DiT forward(s), then the VAE decode of the finished block (the decode
follows the chunk's last forward, ``perf/e2e/chunk.py``).  :func:`perf.footprint.footprint`'s items fall in
three classes:

* **persistent** (held between chunks, :data:`PERSISTENT`): the DiT weights (or their FSDP shard), the
  rolling KV cache, the cached text k/v, the VAE weights (or shard) and the VAE decoder's causal feature
  cache (``CACHE_T = 2`` input frames of every causal conv, carried from one latent frame to the next);
* **DiT phase** (:data:`DIT_PHASE`): the FSDP weight gather buffer, the SP K/V gather buffer, the text k/v
  gather buffer and the forward's live activations;
* **VAE phase** (:data:`VAE_PHASE`): the decoder's largest single conv input + output
  (``vae_conv_workspace``) and the FSDP gather buffer of its weights.

``workspace="shared"`` (:func:`shared_workspace`): the two phases' transients in one region, per core
``max(DiT phase, VAE phase)`` instead of their sum.  Source: the Neuron Runtime allocates one *shared
scratchpad* per NeuronCore for all NEFFs loaded on it, sized to the largest NEFF's scratchpad, because
only one NEFF executes at a time on a core and no data passes between NEFFs through it (AWS Neuron SDK,
``neuron-runtime/explore/device-memory.rst``, "Shared scratchpad";
https://awsdocs-neuron.readthedocs-hosted.com/en/latest/neuron-runtime/explore/device-memory.html).  The
DiT forward and the VAE decode are separate NEFFs on the same cores (``perf/e2e/launches.py``), so their
scratchpads can be one.  Assumed, not measured: that the compiler places these transients in the shared
scratchpad (NEFF variables of type ``virtual``) and not in a per-NEFF ``tmp-buf``
(``neuron-runtime/explore/work-with-neff-files.rst``), and that the persistent items are NEFF inputs /
outputs (they must be: nothing passes between NEFFs through the scratchpad).  Not counted, as none of the
runtime's own reservations are: the same page says the shared scratchpad is allocated in pages, at LNC=1 on
trn2 (this 8-core plan) non-contiguous 512 MB pages by default (a multiple of 512 MB up to 3.5 GB), a
variable must fit in one page, and the scratchpad is rounded up to whole pages per core; at LNC=2,
contiguous 64 MB pages.  That rounding applies to any NEFF's scratchpad, shared or not.

:func:`persistent_floor` is the sum of the persistent items at their smallest (one weight copy, the
compact ring, the text k/v once, the VAE causal cache): no placement of the transients goes below it.
:func:`taehv_items` prices the same items for a tiny streaming decoder (TAEHV,
github.com/madebyollin/taehv) instead of the Wan VAE: a separate row, never the headline.
"""

from __future__ import annotations

import math

from perf.footprint import Footprint, FootprintItem, footprint, lower_bound_footprint
from perf.footprint_vae import VaeProbe
from rolling_forcing.config import ModelConfig, PipelineConfig

__all__ = [
    "WORKSPACES",
    "VAE_SPLITS",
    "PERSISTENT",
    "DIT_PHASE",
    "VAE_PHASE",
    "vae_items",
    "shared_workspace",
    "persistent_floor",
    "taehv_params",
    "taehv_state_elems",
    "taehv_peak_elems",
    "taehv_items",
    "taehv_footprint",
]

WORKSPACES = ("separate", "shared")
"""``footprint(workspace=...)``: the DiT-phase and VAE-phase transients summed, or in one shared region."""
VAE_SPLITS = ("latent_frame", "output_frame")
"""``footprint(vae_split=...)``: the decoder's calls per latent frame (as diffusers' ``AutoencoderKLWan``
decodes), or the stages after the last temporal upsampling one output frame at a time
(:func:`perf.footprint_vae.vae_frame_split`)."""
PERSISTENT = ("dit_weights", "kv_cache", "text_kv", "vae_weights", "vae_causal_cache")
DIT_PHASE = ("weight_gather_buffer", "kv_gather_buffer", "text_kv_gather_buffer", "activations")
VAE_PHASE = ("vae_conv_workspace", "vae_gather_buffer")


def vae_items(vae: VaeProbe, act_bytes: int, cores: int) -> list[FootprintItem]:
    """The VAE workspace as two items, split spatially over ``cores``: ``vae_causal_cache`` (persistent:
    ``feat_cache_elems x act_bytes``) and ``vae_conv_workspace`` (VAE phase: ``peak_layer_elems x
    act_bytes``, the largest single layer call's input + output)."""
    cache = int(vae.feat_cache_elems * act_bytes)
    conv = int(vae.peak_layer_elems * act_bytes)
    per_call = "late stages one output frame per call" if vae.frame_split else "one latent frame per call"
    return [
        FootprintItem(
            "vae_causal_cache",
            math.ceil(cache / cores),
            cache,
            f"CACHE_T 2 frames x every causal conv's input ({vae.feat_cache_elems:,} elems) x {act_bytes} B, "
            f"/ {cores} cores",
        ),
        FootprintItem(
            "vae_conv_workspace",
            math.ceil(conv / cores),
            conv,
            f"largest layer call in+out ({per_call}: {vae.peak_layer_elems:,} elems) x {act_bytes} B, "
            f"/ {cores} cores",
        ),
    ]


def shared_workspace(items: list[FootprintItem]) -> list[FootprintItem]:
    """``items`` with the DiT-phase and VAE-phase transients (:data:`DIT_PHASE`, :data:`VAE_PHASE`)
    replaced by one ``phase_workspace`` item: per core ``max(sum of DiT-phase per core, sum of VAE-phase
    per core)``, per chip the same max of the per-chip sums (module docstring for the source and the
    assumption).  ``items`` must hold ``vae_conv_workspace`` (not the joint ``vae_workspace``)."""
    names = [i.name for i in items]
    if "vae_workspace" in names:
        raise ValueError("shared_workspace: split vae_workspace first (vae_items): its causal cache persists")
    dit = [i for i in items if i.name in DIT_PHASE]
    vae = [i for i in items if i.name in VAE_PHASE]
    if not dit or not vae:
        raise ValueError(f"shared_workspace: needs items of both phases, got {names}")

    def parts(xs: list[FootprintItem]) -> str:
        return " + ".join(f"{i.name} {i.per_core / 1e6:.1f}" for i in xs)

    d_core, v_core = sum(i.per_core for i in dit), sum(i.per_core for i in vae)
    d_chip, v_chip = sum(i.per_chip for i in dit), sum(i.per_chip for i in vae)
    merged = FootprintItem(
        "phase_workspace",
        max(d_core, v_core),
        max(d_chip, v_chip),
        f"max(DiT phase {parts(dit)} = {d_core / 1e6:.1f} MB, VAE phase {parts(vae)} = {v_core / 1e6:.1f} "
        "MB) per core: one shared scratchpad (the decode follows the forward; runtime page rounding not "
        "counted)",
    )
    keep = [i for i in items if i.name not in DIT_PHASE + VAE_PHASE]
    return [*keep, merged]


def persistent_floor(
    m: ModelConfig,
    p: PipelineConfig,
    *,
    cores: int,
    vae: VaeProbe,
    kv_bytes: float = 2,
    weight_bytes: float = 2,
    act_bytes: int = 2,
) -> Footprint:
    """The persistent state at its smallest (module docstring): the compact ring of ``buffer_slots - 1``
    slots, one DiT weight copy, the text k/v once (``text_len x dim x 2 x layers x act_bytes``), one VAE
    decoder weight copy and the VAE causal feature cache (``vae.feat_cache_elems x act_bytes``).  Per core
    is the chip total / ``cores`` (rounded up); per chip the sum.  Everything else (buffers, activations,
    the decoder's layer workspace) is transient and comes on top."""
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
        raise ValueError(f"persistent_floor: cores must be a positive int, got {cores!r}")
    if kv_bytes <= 0 or weight_bytes <= 0 or act_bytes <= 0:
        raise ValueError("persistent_floor: kv_bytes, weight_bytes and act_bytes must be > 0")
    # the compact ring + one DiT weight copy: the lower bound's two items
    base = lower_bound_footprint(
        m, p, cores=cores, kv_bytes=kv_bytes, weight_bytes=weight_bytes, compact=True
    )
    slots = p.buffer_slots - 1
    text = int(m.text_len * m.dim * 2 * m.num_layers * act_bytes)
    vw = int(vae.decoder_params * weight_bytes)
    cache = int(vae.feat_cache_elems * act_bytes)
    rows = (
        ("text_kv", text, f"{m.text_len} tok x {m.dim} x 2 x {m.num_layers} x {act_bytes} B, once"),
        ("vae_weights", vw, f"decoder params {vae.decoder_params:,} x {weight_bytes:g} B, one copy"),
        ("vae_causal_cache", cache, f"CACHE_T 2 frames x every causal conv's input "
         f"({vae.feat_cache_elems:,} elems at latent {vae.latent_hw[0]}x{vae.latent_hw[1]}) x {act_bytes} B"),
    )  # fmt: skip
    items = base.items + tuple(FootprintItem(n, math.ceil(b / cores), b, f) for n, b, f in rows)
    kvl = "bf16" if kv_bytes == 2 else "fp8 KV cache"
    return Footprint(
        f"floor ({kvl}): persistent state ({slots}-slot KV cache, one DiT + VAE weight copy, text k/v, "
        "VAE causal cache)",
        cores,
        items,
    )


# --- a tiny streaming decoder (TAEHV design, perf/e2e/taehv.py) --------------------------------------------
# Which convs carry a bias, from the published architecture (github.com/madebyollin/taehv, taehv.py): the
# first conv, the memory blocks' three convs and the last conv do; the time-grow 1x1 convs and the stage
# input projections after an upsampling do not.


def _tae_biased(name: str) -> bool:
    return name in ("s0_in", "to_rgb") or name.endswith(("_a", "_b", "_c"))


def taehv_params() -> int:
    """Parameters of the TAEHV decoder (:func:`perf.e2e.taehv.taehv_decoder`): ``c_in c_out k^2`` per conv
    + ``c_out`` for the biased ones (the memory blocks' skips are identities: same widths in and out)."""
    from perf.e2e.taehv import taehv_decoder

    convs, _ = taehv_decoder()
    return sum(c.c_in * c.c_out * c.k**2 + (c.c_out if _tae_biased(c.name) else 0) for c in convs)


def taehv_state_elems(latent_h: int, latent_w: int) -> int:
    """TAEHV's streaming state: every memory block keeps its previous input frame (``n`` channels at its
    stage's scale): ``sum over blocks n x (scale h) x (scale w)`` elements."""
    from perf.e2e.taehv import taehv_decoder

    for name, v in (("latent_h", latent_h), ("latent_w", latent_w)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"taehv_state_elems: {name} must be a positive int, got {v!r}")
    convs, _ = taehv_decoder()
    return sum(c.c_out * c.scale**2 * latent_h * latent_w for c in convs if c.name.endswith("_a"))


def taehv_peak_elems(latent_h: int, latent_w: int) -> int:
    """The largest single conv call's input + output, one frame per call (TAEHV decodes a frame at a
    time): ``max over convs (c_in + c_out) x (scale h) x (scale w)`` (a time-grow call reads one frame and
    writes its grown frames as channels)."""
    from perf.e2e.taehv import taehv_decoder

    taehv_state_elems(latent_h, latent_w)  # input checks
    convs, _ = taehv_decoder()
    return max((c.c_in + c.c_out) * c.scale**2 * latent_h * latent_w for c in convs)


def taehv_items(
    latent_h: int, latent_w: int, cores: int, act_bytes: int = 2, weight_bytes: float = 2
) -> list[FootprintItem]:
    """TAEHV in place of the Wan VAE's items, placed as the Wan VAE's with ``vae_weights="fsdp"``:
    ``vae_weights`` (1 / ``cores`` per core), ``vae_gather_buffer`` (2 x its largest conv's weights per
    core), ``vae_causal_cache`` (:func:`taehv_state_elems`) and ``vae_conv_workspace``
    (:func:`taehv_peak_elems`), both split spatially over ``cores``."""
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
        raise ValueError(f"taehv_items: cores must be a positive int, got {cores!r}")
    from perf.e2e.taehv import taehv_decoder

    n = taehv_params()
    w = int(n * weight_bytes)
    big = max(c.c_in * c.c_out * c.k**2 for c in taehv_decoder()[0])
    g = int(2 * big * weight_bytes)
    st, pk = taehv_state_elems(latent_h, latent_w), taehv_peak_elems(latent_h, latent_w)
    s, k = st * act_bytes, pk * act_bytes
    return [
        FootprintItem(
            "vae_weights", math.ceil(w / cores), w,
            f"TAEHV decoder params {n:,} x {weight_bytes:g} B, 1/{cores} per core (FSDP)",
        ),
        FootprintItem(
            "vae_gather_buffer", g, g * cores,
            f"2 (double buffer) x largest TAEHV conv {big:,} params x {weight_bytes:g} B, per core",
        ),
        FootprintItem(
            "vae_causal_cache", math.ceil(s / cores), s,
            f"TAEHV: previous input frame of each of 9 memory blocks ({st:,} elems) x {act_bytes} B",
        ),
        FootprintItem(
            "vae_conv_workspace", math.ceil(k / cores), k,
            f"TAEHV: largest conv call in+out, one frame ({pk:,} elems) x {act_bytes} B",
        ),
    ]  # fmt: skip


def taehv_footprint(
    m: ModelConfig,
    p: PipelineConfig,
    *,
    tp: int,
    sp: int,
    kv_bytes: float = 2,
    act_bytes: int = 2,
    weight_bytes: float = 2,
    workspace: str = "shared",
    label: str = "",
    **placement: str,
) -> Footprint:
    """The DiT placement ``placement`` (``footprint`` arguments, e.g. ``weights``, ``kv_cache``,
    ``gather_unit``; the Wan VAE's ``vae_weights`` / ``vae_split`` are ignored) with :func:`taehv_items`
    as its decoder at ``m``'s latent size and ``workspace`` (:data:`WORKSPACES`) as in ``footprint``."""
    if workspace not in WORKSPACES:
        raise ValueError(f"taehv_footprint: workspace must be one of {WORKSPACES}, got {workspace!r}")
    dit = {k: v for k, v in placement.items() if k not in ("vae_weights", "vae_split")}
    base = footprint(
        m,
        p,
        tp=tp,
        sp=sp,
        kv_bytes=kv_bytes,
        act_bytes=act_bytes,
        weight_bytes=weight_bytes,
        **dit,  # type: ignore[arg-type]
    )
    items = [*base.items, *taehv_items(m.latent_height, m.latent_width, tp * sp, act_bytes, weight_bytes)]
    if workspace == "shared":
        items = shared_workspace(items)
    kvl = "bf16" if kv_bytes == 2 else "fp8 KV cache"
    return Footprint(
        label or f"tiny decoder (TAEHV design, quality unmeasured) instead of the Wan VAE, {kvl}",
        tp * sp,
        tuple(items),
    )
