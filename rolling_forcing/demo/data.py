"""Procedural training clips for the demo model: pixel clips as float tensors and latent clips for the DiT.

Clip ``i`` of a seed is drawn from its own generator ``numpy.random.default_rng([seed, i])``: a scene
(:func:`rolling_forcing.procedural.sample_scene`) and a random start frame in ``[0, MAX_START)`` (so clips
see every phase of the bouncing motion), rendered by :func:`rolling_forcing.procedural.render`. Clip ``i``
is therefore the same whatever ``n`` is asked for, and different seeds give independent clips (training
uses seeds ``>= 0`` offsets of the run seed, held-out checks a separate seed).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

from rolling_forcing.procedural import (
    Scene,
    SceneConfig,
    check_sizes,
    prompt_layout,
    render,
    sample_scene,
    scene_prompt,
)

if TYPE_CHECKING:
    from rolling_forcing.demo.autoencoder import DemoAutoencoder

__all__ = ["MAX_START", "clip_frames", "encode_clips", "make_clips"]

MAX_START = 100_000
"""Clips start at a uniform random frame in ``[0, MAX_START)``."""


def clip_frames(latent_frames: int) -> int:
    """Pixel frames of a clip of ``latent_frames`` latent frames: ``1 + 4 (F - 1)`` (Wan's causal count)."""
    if isinstance(latent_frames, bool) or not isinstance(latent_frames, int) or latent_frames < 1:
        raise ValueError(f"latent_frames must be an int >= 1, got {latent_frames!r}")
    return 1 + 4 * (latent_frames - 1)


def make_clips(
    n: int,
    frames: int,
    *,
    seed: int,
    first: int = 0,
    scene_config: SceneConfig | None = None,
    layout: str = "random",
    prompt_speed: float | None = None,
    prompt_sizes: Mapping[str, float] | None = None,
) -> tuple[torch.Tensor, list[str], list[Scene]]:
    """Clips ``first .. first + n - 1`` of ``seed``.

    Args:
        n: clip count, >= 1.
        frames: pixel frames per clip ``T = 1 + 4k`` (k >= 0).
        seed: int >= 0; clip ``i`` uses ``numpy.random.default_rng([seed, i])``.
        first: index of the first clip (>= 0), so batches of a long run need not regenerate earlier clips.
        scene_config: frame size and scene ranges (``None``: ``SceneConfig()``, 64 x 64).
        layout: ``"random"`` (random sizes, start points, velocities and start frame) or ``"prompt"``
            (:func:`rolling_forcing.procedural.prompt_layout` from frame 0: the prompt names the video).
        prompt_speed: the prompt layout's speed in pixels per frame at 64 x 64 (``None``:
            :data:`rolling_forcing.procedural.PROMPT_SPEED`); only with ``layout="prompt"``.
        prompt_sizes: the prompt layout's size per kind at 64 x 64 (``None``:
            :data:`rolling_forcing.procedural.PROMPT_SIZES`; :func:`~rolling_forcing.procedural.check_sizes`);
            only with ``layout="prompt"``.

    Returns:
        ``(video, prompts, scenes)``: float32 ``[n, T, 3, H, W]`` in [-1, 1] (``uint8 / 127.5 - 1``), the
        scenes' prompts and the scenes.
    """
    for name, v, lo in (("n", n, 1), ("frames", frames, 1), ("seed", seed, 0), ("first", first, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    if (frames - 1) % 4:
        raise ValueError(f"frames must be 1 + 4k (Wan's causal frame count), got {frames}")
    if layout not in ("random", "prompt"):
        raise ValueError(f"layout must be 'random' or 'prompt', got {layout!r}")
    for name, given in (("prompt_speed", prompt_speed), ("prompt_sizes", prompt_sizes)):
        if given is not None and layout != "prompt":
            raise ValueError(f"{name} applies to layout='prompt' only, got layout={layout!r}")
    if prompt_sizes is not None:
        prompt_sizes = check_sizes(prompt_sizes, "prompt_sizes")
    scene_config = scene_config if scene_config is not None else SceneConfig()
    video = np.empty((n, frames, scene_config.height, scene_config.width, 3), dtype=np.uint8)
    prompts, scenes = [], []
    for j in range(n):
        rng = np.random.default_rng([seed, first + j])
        scene = sample_scene(rng, scene_config)
        start = int(rng.integers(0, MAX_START))
        if layout == "prompt":
            scene, start = prompt_layout(scene, prompt_speed, prompt_sizes), 0
        video[j] = render(scene, start, frames)
        scenes.append(scene)
        prompts.append(scene_prompt(scene))
    out = torch.from_numpy(video).permute(0, 1, 4, 2, 3).float() / 127.5 - 1.0
    return out.contiguous(), prompts, scenes


@torch.no_grad()
def encode_clips(
    ae: DemoAutoencoder,
    n: int,
    latent_frames: int,
    *,
    seed: int,
    first: int = 0,
    batch_size: int = 32,
    scene_config: SceneConfig | None = None,
    layout: str = "random",
    prompt_speed: float | None = None,
    prompt_sizes: Mapping[str, float] | None = None,
) -> tuple[torch.Tensor, list[str]]:
    """Latent clips for the DiT trainer: ``encode_clips(ae, n, latent_frames, *, seed, first=0,
    batch_size=32, scene_config=SceneConfig()) -> (latents, prompts)``.

    Args:
        ae: a :class:`rolling_forcing.demo.autoencoder.DemoAutoencoder` (its ``encode`` is used).
        n: clip count >= 1; latent_frames: ``F`` >= 1 latent frames per clip (``1 + 4 (F - 1)`` pixel
            frames are rendered); seed, first, scene_config, layout, prompt_speed, prompt_sizes: as
            :func:`make_clips`
            (clip ``i`` of a seed is the same whatever ``n`` or ``batch_size``).
        batch_size: clips encoded per call (memory only; the result does not depend on it beyond fp32
            rounding of the batched convolutions).

    Returns:
        ``(latents, prompts)``: NORMALISED latents float32 ``[n, F, 16, H/8, W/8]`` (per-channel mean 0,
        std 1 on training data) and the ``n`` prompts.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    frames = clip_frames(latent_frames)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    outs, prompts = [], []
    for lo in range(0, n, batch_size):
        video, p, _ = make_clips(
            min(batch_size, n - lo),
            frames,
            seed=seed,
            first=first + lo,
            scene_config=scene_config,
            layout=layout,
            prompt_speed=prompt_speed,
            prompt_sizes=prompt_sizes,
        )
        outs.append(ae.encode(video))
        prompts += p
    return torch.cat(outs), prompts
