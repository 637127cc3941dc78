"""A tiny streaming decoder priced as a SEPARATE row of the end-to-end model: never the headline.

The design is TAEHV's (github.com/madebyollin/taehv, "Tiny AutoEncoder for Hunyuan Video"; its Wan2.1
weights are ``taew2_1``), described here in this project's own terms from reading that repository (no code
or weights of it are used):

* per latent frame, three stages of widths 256, 128 and 64 (from the 16 latent channels), each: a 3x3
  conv into the stage width (ReLU), three *memory blocks* and a nearest x2 spatial upsampling followed by
  a 1x1 "time grow" conv that multiplies the frames by 1, 2 and 2 (4 video frames per latent frame);
* a memory block: ``relu(conv3(relu(conv3(relu(conv3(cat(x, x_prev)))))) + x)``, the three 3x3 convs
  ``2n -> n``, ``n -> n``, ``n -> n``; ``x_prev`` is the block's input one frame earlier (its streaming
  memory: one frame per block, carried across chunks);
* a tanh clamp of the latent first, a 3x3 ``64 -> 64`` conv after the last upsampling, ReLU, and a 3x3
  ``64 -> 3`` conv to RGB.

**Quality cost: unknown.** This project has not measured TAEHV's decoded video against the Wan VAE (no
PSNR or perceptual figure here); its authors state it does not match the full-size VAEs' quality. The
row is what the decode would cost on trn2 if that quality were acceptable, nothing more.

Pricing (all **modelled**, same rules as the Wan VAE rows, :func:`perf.e2e.components.vae_components`):
every conv as one call of the project's conv kernel (``nki_kernels/conv3d.py``, ``ksize (1, k, k)``) per
latent frame on one core's ``ceil(H / cores)`` rows (halos ignored); a memory block's first conv as a
``2n``-channel conv over the concatenation (the copy is one more elementwise pass); ReLUs, the clamp, the
residual adds, the concatenations and the upsamplings as elementwise passes at the VectorE / HBM bound
(fp32 bytes, as the VAE's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from perf.e2e.components import Component

__all__ = ["TAEHV_WIDTHS", "TaeConv", "TaePass", "taehv_components", "taehv_conv_flops", "taehv_decoder"]

TAEHV_WIDTHS = (256, 128, 64, 64)
"""Stage widths of the (non-"super") TAEHV decoder: three stages and the last conv's input."""

TIME_GROW = (1, 2, 2)
"""Frames multiplied by each stage's time-grow conv (Wan2.1: 1 latent frame -> 4 video frames)."""


@dataclass(frozen=True)
class TaeConv:
    """One conv of the decoder, per latent frame: ``frames`` output frames at ``scale`` x the latent size."""

    name: str
    c_in: int
    c_out: int
    k: int
    frames: int
    scale: int


@dataclass(frozen=True)
class TaePass:
    """One elementwise pass per latent frame: ``channels`` x ``frames`` frames at ``scale`` x the latent size,
    ``ops`` ALU operations per element."""

    name: str
    channels: int
    frames: int
    scale: int
    ops: int = 1


def taehv_decoder(latent_channels: int = 16) -> tuple[list[TaeConv], list[TaePass]]:
    """The decoder's convs and elementwise passes per latent frame (module docstring)."""
    convs: list[TaeConv] = []
    passes: list[TaePass] = [TaePass("clamp", latent_channels, 1, 1, 2)]
    c_prev, frames, scale = latent_channels, 1, 1
    for i, n in enumerate(TAEHV_WIDTHS[:3]):
        convs.append(TaeConv(f"s{i}_in", c_prev, n, 3, frames, scale))
        if i == 0:
            passes.append(TaePass(f"s{i}_in_relu", n, frames, scale))
        for b in range(3):
            passes.append(TaePass(f"s{i}_mem{b}_cat", 2 * n, frames, scale))
            convs += [
                TaeConv(f"s{i}_mem{b}_a", 2 * n, n, 3, frames, scale),
                TaeConv(f"s{i}_mem{b}_b", n, n, 3, frames, scale),
                TaeConv(f"s{i}_mem{b}_c", n, n, 3, frames, scale),
            ]
            passes += [TaePass(f"s{i}_mem{b}_relu", n, frames, scale) for _ in range(2)]
            passes.append(TaePass(f"s{i}_mem{b}_add_relu", n, frames, scale, 2))
        scale *= 2
        passes.append(TaePass(f"s{i}_upsample", n, frames, scale))
        convs.append(TaeConv(f"s{i}_time_grow", n, n * TIME_GROW[i], 1, frames, scale))
        frames *= TIME_GROW[i]
        c_prev = n  # the next stage's input conv reads this stage's grown frames
    convs.append(TaeConv("out_conv", TAEHV_WIDTHS[2], TAEHV_WIDTHS[3], 3, frames, scale))
    passes.append(TaePass("out_relu", TAEHV_WIDTHS[3], frames, scale))
    convs.append(TaeConv("to_rgb", TAEHV_WIDTHS[3], 3, 3, frames, scale))
    return convs, passes


def taehv_conv_flops(latent_h: int, latent_w: int, latent_frames: int) -> int:
    """Dense conv FLOPs of decoding ``latent_frames`` latent frames of ``latent_h x latent_w``:
    ``2 x output positions x C_in x k^2 x C_out`` per conv."""
    convs, _ = taehv_decoder()
    per = sum(2 * c.frames * c.scale**2 * latent_h * latent_w * c.c_in * c.k**2 * c.c_out for c in convs)
    return latent_frames * per


def taehv_components(
    latent_h: int,
    latent_w: int,
    latent_frames: int,
    cores: int,
    matmul: Any,
    params: Any,
    end: str = "optimistic",
) -> list[Component]:
    """The decode of ``latent_frames`` latent frames on ``cores`` cores (spatial split, halos ignored) at
    ``end``: ``taehv_convs`` (``matmul.conv``, :class:`perf.matmul_model.TracedLinearProvider`) and
    ``taehv_elementwise``, one call each per chunk, group ``vae``.  Not part of any chunk model."""
    convs, passes = taehv_decoder()
    conv_t = 0.0
    for c in convs:
        h, w = c.scale * latent_h, c.scale * latent_w
        prof = matmul.conv(c.c_in, c.c_out, c.frames, math.ceil(h / cores), w, (1, c.k, c.k))
        conv_t += latent_frames * prof.at(end)
    ew_t = 0.0
    ew_bytes = 0
    for p in passes:
        elems = p.channels * p.frames * math.ceil(p.scale * latent_h / cores) * p.scale * latent_w
        eng = elems * p.ops / (params.lanes * params.vector_hz)
        ew_t += latent_frames * max(elems * 4 / params.hbm_Bps_per_core, eng)
        ew_bytes += latent_frames * elems * 4
    src = getattr(matmul, "name", "traced")
    return [
        Component(
            "taehv_convs",
            "vae",
            conv_t,
            1,
            taehv_conv_flops(latent_h, latent_w, latent_frames),
            len(convs) * latent_frames,
            False,
            f"TAEHV design, {src} (quality vs the Wan VAE: unknown)",
            bound="tensor",
        ),
        Component(
            "taehv_elementwise",
            "vae",
            ew_t,
            1,
            0,
            len(passes) * latent_frames,
            False,
            "vector/hbm-bound",
            hbm_bytes=ew_bytes,
            bound="hbm",
        ),
    ]
