"""Classifier-free guidance of a stream: the rule, the doubled prompt batch, the x0 combination, the noise.

A model trained by regression (not distilled) follows its prompt more firmly when every denoising step
moves *away* from what it would draw without the prompt: ``x0 = x0_u + s (x0_c - x0_u)``, with ``x0_c``
the prediction under the prompt, ``x0_u`` under a *negative* prompt (default: the null prompt, all-zero
embeddings, which a model trained with text dropout knows as "no prompt") and ``s`` the guidance scale
(Ho & Salimans, https://arxiv.org/abs/2207.12598), applied to the frames whose noise level sigma exceeds
``sigma_min`` (a guidance interval, Kynkaanniemi et al., https://arxiv.org/abs/2404.07724; 1 elsewhere).
Rolling Forcing's originals are distilled and stream without it (scale 1); the demo model streams with it
(``ModelConfig.guidance_scale`` and ``guidance_sigma_min`` of its preset).

In a stream the two predictions need two KV caches: a clean block's keys and values depend on the text
the block was encoded under. So a guided stream runs the batch twice, ``[prompt rows | negative rows]``
(:func:`guided_embeds`), in one forward per call; after each denoise forward the driver combines the two
halves' x0 (:func:`combine_x0`) and gives both halves the result, so the re-noised inputs, the clean blocks
written to both caches and the chunks are one stream's. Both halves draw the same noise
(:class:`GuidedNoise`: the unguided stream's draws, repeated), so a stream with ``s = 1`` would equal the
unguided one; the driver does not double the batch then.

Pure functions and one small noise wrapper; no model here.
"""

from __future__ import annotations

import torch

from rolling_forcing.config import check_guidance
from rolling_forcing.stream import NoiseSource

__all__ = [
    "GuidedNoise",
    "check_guidance",
    "combine_x0",
    "frame_scales",
    "guidance_text",
    "guided_embeds",
]


def guidance_text(scale: float, sigma_min: float) -> str:
    """The guidance in words, for headers and the served page: ``"3 (classifier-free, where sigma >
    0.85)"``, ``"2 (classifier-free)"`` or ``"1 (none)"``."""
    if scale <= 1.0:
        return f"{scale:g} (none)"
    return f"{scale:g} (classifier-free" + (f", where sigma > {sigma_min:g})" if sigma_min > 0 else ")")


def guided_embeds(text_embeds: torch.Tensor, negative_embeds: torch.Tensor | None = None) -> torch.Tensor:
    """The doubled batch ``[2B, L, D]``: ``text_embeds`` ``[B, L, D]`` then ``negative_embeds`` (same shape;
    None: zeros, the null prompt). Raises ``ValueError`` for a negative prompt of another shape."""
    if negative_embeds is None:
        negative_embeds = torch.zeros_like(text_embeds)
    elif tuple(negative_embeds.shape) != tuple(text_embeds.shape):
        raise ValueError(
            f"negative_embeds must have the prompt's shape {tuple(text_embeds.shape)} ([B, L, D]), got "
            f"{tuple(negative_embeds.shape)}"
        )
    return torch.cat([text_embeds, negative_embeds.to(text_embeds.dtype)], dim=0)


def frame_scales(
    t: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor], scale: float, sigma_min: float = 0.0
) -> torch.Tensor:
    """The guidance scale of every frame of a call, float32 ``[F]`` from its timesteps ``t`` ``[B, F]``
    (every row alike): ``scale`` where the frame's sigma (the scheduler ``table``'s, nearest timestep) is
    above ``sigma_min``, else 1 (the guidance interval)."""
    sig, ts = table
    idx = torch.argmin((ts[None, :] - t[0].float()[:, None]).abs(), dim=1)
    return torch.where(sig[idx] > sigma_min, float(scale), 1.0).float()


def combine_x0(x0: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """``x0`` ``[2B, F, ...]`` (prompt rows, then negative rows) -> ``[2B, F, ...]`` whose both halves are
    ``x0_u + scale * (x0_c - x0_u)``, computed in float32 and returned in ``x0``'s dtype; ``scale`` a
    number or one per frame ``[F]`` (:func:`frame_scales`)."""
    if x0.shape[0] % 2:
        raise ValueError(f"a guided batch has 2B rows (prompt, negative), got {x0.shape[0]}")
    c, u = x0.float().chunk(2, dim=0)
    if isinstance(scale, torch.Tensor):
        scale = scale.to(c.device).view(1, -1, *([1] * (c.dim() - 2)))
    g = (u + scale * (c - u)).to(x0.dtype)
    return torch.cat([g, g], dim=0)


class GuidedNoise(NoiseSource):
    """The noise of a guided stream: ``inner``'s draws (batch ``B``, its RNG order) repeated for the
    negative half, so a guided stream draws exactly the noise of the unguided one (batch ``2B``)."""

    def __init__(self, inner: NoiseSource) -> None:  # noqa: D107 - no super().__init__: nothing to draw
        self.inner = inner
        self.batch, self.frame_shape, self.fpb, self.dtype = (
            2 * inner.batch, inner.frame_shape, inner.fpb, inner.dtype,
        )  # fmt: skip
        self.generator = inner.generator

    def initial(self, block: int) -> torch.Tensor:
        """``inner.initial(block)`` ``[B, fpb, C, H, W]`` twice: ``[2B, fpb, C, H, W]``."""
        x = self.inner.initial(block)
        return torch.cat([x, x], dim=0)

    def upfront_blocks(self) -> int | None:
        return self.inner.upfront_blocks()

    def renoise(self, num_frames: int) -> torch.Tensor:
        """``inner.renoise(num_frames)`` ``[B * n, C, H, W]`` with each row repeated for the negative half:
        ``[2B * n, C, H, W]`` (row-major ``[2B, n]``)."""
        x = self.inner.renoise(num_frames).unflatten(0, (self.inner.batch, num_frames))
        return torch.cat([x, x], dim=0).flatten(0, 1)
