"""The Wan2.1 VAE decoder's layer shapes for the HBM footprint (``perf.footprint``, which re-exports these):
:func:`vae_probe` evaluates the carried layer table ``perf/wan_vae_table.py`` at a latent size."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["VaeLayer", "VaeProbe", "vae_probe", "vae_strides", "vae_frame_split", "layer_frames"]


@dataclass(frozen=True)
class VaeLayer:
    """One leaf module call of the VAE decoder: kind, input and output shapes, weight shape (or ())."""

    kind: str
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    weight_shape: tuple[int, ...]


@dataclass(frozen=True)
class VaeProbe:
    """Layer shapes of the Wan2.1 VAE decoder (diffusers ``AutoencoderKLWan`` defaults, carried table).

    ``steady`` are the layer calls of ``frames`` steady-state latent frames (after the first, which the
    causal decoder treats specially); ``first`` those of the first latent frame.
    """

    latent_hw: tuple[int, int]
    frames: int
    decoder_params: int
    spatial_stride: int
    temporal_stride: int
    first: tuple[VaeLayer, ...]
    steady: tuple[VaeLayer, ...]
    feat_cache_elems: int
    peak_layer_elems: int
    frame_split: bool = False
    """True after :func:`vae_frame_split`: the late stages' calls are one output frame each."""

    @property
    def largest_weight_elems(self) -> int:
        """Parameters of the decoder's largest single layer weight (its FSDP gather unit)."""
        return max(_numel(r.weight_shape) for r in (*self.first, *self.steady) if r.weight_shape)


def _numel(shape: tuple[int, ...]) -> int:
    return int(math.prod(shape))


def _eval_dim(token: str, h: int, w: int) -> int:
    """One table dimension ``"ah+bw+c"`` (terms optional, unit coefficients bare) at latent ``h x w``."""
    total = 0
    for term in token.split("+"):
        if term.endswith("h"):
            total += int(term[:-1] or 1) * h
        elif term.endswith("w"):
            total += int(term[:-1] or 1) * w
        else:
            total += int(term)
    return total


def _eval_layers(table: tuple[Any, ...], h: int, w: int) -> tuple[VaeLayer, ...]:
    def shape(tok: str) -> tuple[int, ...]:
        return tuple(_eval_dim(d, h, w) for d in tok.split(","))

    return tuple(VaeLayer(kind, shape(ins), shape(outs), tuple(ws)) for kind, ins, outs, ws in table)


@functools.lru_cache(maxsize=8)
def vae_probe(latent_h: int, latent_w: int, frames: int) -> VaeProbe:
    """The VAE decoder's layer shapes for ``1 + frames`` latent frames of ``latent_h x latent_w``.

    Evaluated from the carried table ``perf/wan_vae_table.py`` (derived once from diffusers'
    ``AutoencoderKLWan``; ``tests/test_wan_vae_table.py`` checks it against diffusers), so no diffusers is
    needed. ``latent_h``, ``latent_w`` and ``frames`` must be positive integers.
    """
    from perf import wan_vae_table as t

    for name, v in (("latent_h", latent_h), ("latent_w", latent_w), ("frames", frames)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"vae_probe: {name} must be a positive integer, got {v!r}")
    first = _eval_layers(t.FIRST, latent_h, latent_w)
    steady = _eval_layers(t.STEADY, latent_h, latent_w) * frames
    causal = [r for r in first if r.kind == "WanCausalConv3d" and len(r.weight_shape) == 5]
    # causal feature cache: CACHE_T = 2 input frames of every causal conv (per frame: C x H x W)
    feat = sum(2 * r.in_shape[1] * _numel(r.in_shape[3:]) for r in causal)
    peak = max(_numel(r.in_shape) + _numel(r.out_shape) for r in steady)
    return VaeProbe(
        latent_hw=(latent_h, latent_w),
        frames=frames,
        decoder_params=t.DECODER_PARAMS,
        spatial_stride=t.SPATIAL_STRIDE,
        temporal_stride=t.TEMPORAL_STRIDE,
        first=first,
        steady=steady,
        feat_cache_elems=feat,
        peak_layer_elems=peak,
    )


def layer_frames(shape: tuple[int, ...]) -> int:
    """Frames of one activation shape of the table: ``(T, C, H, W)`` (2-D layers fold the frames into the
    batch) or ``(B, C, T, H, W)``; any other rank raises."""
    if len(shape) == 4:
        return shape[0]
    if len(shape) == 5:
        return shape[2]
    raise ValueError(f"layer_frames: shape must be (T, C, H, W) or (B, C, T, H, W), got {shape!r}")


def _one_frame(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (1, *shape[1:]) if len(shape) == 4 else (*shape[:2], 1, *shape[3:])


def vae_frame_split(probe: VaeProbe) -> VaeProbe:
    """``probe`` with every steady layer whose input and output both hold ``temporal_stride`` frames (the
    stages after the last temporal upsampling: half and full resolution) run once per output frame: each
    such call becomes ``temporal_stride`` calls of one frame, and ``peak_layer_elems`` is recomputed over
    the split calls (the causal feature cache is unchanged: a causal conv fed one frame keeps its
    ``CACHE_T = 2`` cached frames, so the frames it outputs are the same in exact arithmetic).  The first
    latent frame's calls (one video frame) are unchanged."""
    t = probe.temporal_stride
    steady: list[VaeLayer] = []
    for r in probe.steady:
        if layer_frames(r.in_shape) == t and layer_frames(r.out_shape) == t:
            steady += [VaeLayer(r.kind, _one_frame(r.in_shape), _one_frame(r.out_shape), r.weight_shape)] * t
        else:
            steady.append(r)
    peak = max(_numel(r.in_shape) + _numel(r.out_shape) for r in steady)
    return dataclasses.replace(probe, steady=tuple(steady), peak_layer_elems=peak, frame_split=True)


def vae_strides() -> tuple[int, int]:
    """``(temporal, spatial)`` strides of the Wan2.1 VAE (carried table ``perf/wan_vae_table.py``)."""
    from perf import wan_vae_table as t

    return t.TEMPORAL_STRIDE, t.SPATIAL_STRIDE
