"""The quality gate for numerics: two streams of the same prompt and noise, compared by decoded-video PSNR
and by metrics (a) and (b) side by side (the demo model's numerics gate, docs/quality.md).

:data:`COMPARISONS` lists the variants against their baselines: merged vs two-pass forward, sharded
(``cores=2``, gloo) vs unsharded, the emulator backend vs the reference (a short stream: the emulator is
slow), bf16 vs fp32. Both streams of a pair draw the same noise (float32, cast to the stream dtype), so the
PSNR measures the numerics alone. Later variants (FP8, other decoders) add a row here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from perf.quality.detect import detect, read_backgrounds
from perf.quality.metrics import (
    MIN_SPEED,
    chunk_starts,
    continuity,
    longest_vanish,
    presence,
    prompt_background,
    prompt_objects,
    speeds,
    track,
)
from perf.quality.streams import StreamModel, StreamResult, StreamSpec, run_stream

__all__ = ["COMPARISONS", "MOTION_TAIL_FRAMES", "Comparison", "Pair", "evaluate", "psnr", "run_pair"]

MOTION_TAIL_FRAMES = 160
""":func:`evaluate`'s motion window: the last 10 s of a stream at 16 fps."""


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio (dB, peak 255) between uint8 videos of equal shape, over every pixel and
    channel; ``inf`` when they are equal."""
    for name, x in (("a", a), ("b", b)):
        if not isinstance(x, np.ndarray) or x.dtype != np.uint8:
            raise ValueError(f"psnr: {name} must be a uint8 numpy array, got {getattr(x, 'dtype', type(x))}")
    if a.shape != b.shape:
        raise ValueError(f"psnr: a and b must have the same shape, got {a.shape} and {b.shape}")
    if a.size == 0:
        raise ValueError("psnr: empty videos")
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10.0 * math.log10(255.0**2 / mse)


def evaluate(
    result: StreamResult, prompt: str, motion_tail_frames: int = MOTION_TAIL_FRAMES
) -> dict[str, Any]:
    """Metrics (a) presence (objects and background), (b) continuity and (e) the longest vanish (frames, the
    worst object) of one decoded stream of ``prompt``, the continuity ratio at every latent-frame
    boundary (a diagnostic, no target) and the motion over the last ``motion_tail_frames`` (>= 1):
    each object's :func:`~perf.quality.metrics.speeds` (px per frame; None where it was never seen twice
    a chunk apart) and ``moving``, every object at least :data:`~perf.quality.metrics.MIN_SPEED`."""
    if motion_tail_frames < 1:
        raise ValueError(f"evaluate: motion_tail_frames must be >= 1, got {motion_tail_frames}")
    objects = prompt_objects(prompt)
    dets = detect(result.frames)
    bgs = read_backgrounds(result.frames)
    first = result.chunk_frames[0] if result.chunk_frames else 9
    per = result.chunk_frames[1] if len(result.chunk_frames) > 1 else 12
    pos = track(dets, objects)
    cont = continuity(pos, chunk_starts(len(dets), first, per))
    # the same ratio at every latent-frame boundary (pixel frames 1, 5, 9, ...): a jump there that is
    # not at chunk boundaries comes from the decoder's 4-frame groups, not from the stream
    latent = continuity(pos, chunk_starts(len(dets), 1, 4))
    tail_v = speeds(pos[max(0, len(dets) - motion_tail_frames) :])
    return {
        "presence": presence(dets, objects, bgs, prompt_background(prompt)),
        "continuity_ratio": cont.ratio,
        "boundary_px": cont.boundary,
        "within_px": cont.within,
        "latent_boundary_ratio": latent.ratio,
        "vanish_frames": max(longest_vanish(dets, objects)),
        "tail_speeds_px_per_frame": [None if math.isnan(v) else v for v in tail_v],
        "moving": all(v >= MIN_SPEED for v in tail_v),  # NaN compares False
    }


@dataclass(frozen=True)
class Pair:
    """A comparison: ``name``, the baseline's and the variant's :class:`StreamSpec` field overrides, and
    the number of blocks (None: the bench's default length)."""

    name: str
    base: dict[str, Any]
    variant: dict[str, Any]
    num_blocks: int | None = None


COMPARISONS: tuple[Pair, ...] = (
    Pair("merged_vs_two_pass", {"merged": False}, {"merged": True}),
    Pair("sharded2_vs_unsharded", {"cores": 1}, {"cores": 2}, num_blocks=6),
    Pair("emulator_vs_reference", {"backend": "reference", "merged": False},
         {"backend": "emulator", "merged": False}, num_blocks=5),
    Pair("bf16_vs_fp32", {"dtype": "float32"}, {"dtype": "bfloat16"}),
)  # fmt: skip


@dataclass(frozen=True)
class Comparison:
    """Result of one :class:`Pair`: PSNR (dB; inf = identical frames), both streams' metrics and measured
    wall clock (s)."""

    name: str
    psnr_db: float
    base: dict[str, Any]
    variant: dict[str, Any]
    base_wall_s: float
    variant_wall_s: float
    frames: int


def run_pair(sm: StreamModel, pair: Pair, spec: StreamSpec) -> Comparison:
    """Stream ``spec`` with ``pair.base`` and with ``pair.variant`` (and ``pair.num_blocks`` if set) and
    compare them."""
    if pair.num_blocks is not None:
        spec = replace(spec, num_blocks=pair.num_blocks)
    a = run_stream(sm, replace(spec, **pair.base))
    b = run_stream(sm, replace(spec, **pair.variant))
    ma, mb = evaluate(a, spec.prompt), evaluate(b, spec.prompt)
    return Comparison(pair.name, psnr(a.frames, b.frames), ma, mb, a.wall_s, b.wall_s, int(a.frames.shape[0]))
