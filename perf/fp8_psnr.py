"""The FP8 gate's second half: the decoded video of a stream with FP8 linears against
the bf16 stream of the same model, prompt and noise, PSNR >= 35 dB over a 30 s stream.  **PENDING**: it
is meant for the project's trained demo model, which has not landed; :func:`psnr_gate` is written and
tested on the tiny preset's random weights (plumbing only: a random model says nothing about quality).

Run it (the lead, once the demo model exists): build the model, its config, the pipeline config, the
prompt embeddings and the streaming decoder as the demo does, then
``psnr_gate(model, model_cfg, pipe_cfg, text_embeds, decoder, seconds=30.0)``; the report's figure is
``PsnrGate.psnr_db`` (**measured**, CPU) and ``PsnrGate.passed``.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch

from rolling_forcing.fp8 import FP8_MIN_FEATURES, KV_FP8, use_fp8_linears
from rolling_forcing.pipeline import RollingForcingPipeline
from rolling_forcing.stream import NoiseSource
from rolling_forcing.video import VideoSpec

__all__ = ["PSNR_THRESHOLD_DB", "PsnrGate", "kv_cache_gate", "psnr", "psnr_gate", "stream_video"]

PSNR_THRESHOLD_DB = 35.0
"""Pass mark of the decoded-video PSNR against the bf16 stream (the project's FP8 gate)."""


@dataclass(frozen=True)
class PsnrGate:
    """Result of :func:`psnr_gate` (**measured**)."""

    psnr_db: float
    frames: int
    blocks: int
    replaced: tuple[str, ...]
    threshold_db: float = PSNR_THRESHOLD_DB

    @property
    def passed(self) -> bool:
        return self.psnr_db >= self.threshold_db


def psnr(a: torch.Tensor, b: torch.Tensor, peak_to_peak: float = 2.0) -> float:
    """PSNR in dB of video ``a`` against ``b`` (same shape, values in a range of ``peak_to_peak``: 2 for
    the decoders' ``[-1, 1]``); ``inf`` when equal."""
    if a.shape != b.shape:
        raise ValueError(f"videos must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    mse = float((a.double() - b.double()).pow(2).mean())
    return math.inf if mse == 0 else 10 * math.log10(peak_to_peak**2 / mse)


@torch.no_grad()
def stream_video(
    model: Any, model_cfg: Any, pipe_cfg: Any, text_embeds: torch.Tensor, decoder: Any, num_blocks: int,
    *, seed: int = 0, backend: str | None = None, kv_dtype: str | None = None, merged: bool | None = None,
) -> torch.Tensor:  # fmt: skip
    """The decoded video ``[B, T, 3, H, W]`` (float32, ``[-1, 1]``) of ``num_blocks`` blocks streamed with
    noise drawn per block from ``seed`` (relative positions: any length); ``kv_dtype`` and ``merged`` as
    :class:`~rolling_forcing.pipeline.RollingForcingPipeline` takes them."""
    pipe = RollingForcingPipeline(
        model, model_cfg, pipe_cfg, backend=backend, positions="relative", kv_dtype=kv_dtype, merged=merged
    )
    gen = torch.Generator().manual_seed(seed)
    noise = NoiseSource(
        text_embeds.shape[0], model_cfg.latent_frame_shape(), pipe_cfg.frames_per_block, num_blocks,
        pipe_cfg.torch_dtype, generator=gen, upfront=False,
    )  # fmt: skip
    decoder.reset()
    frames = [decoder.decode(c.latents.float()) for c in pipe.stream(text_embeds, num_blocks, noise=noise)]
    return torch.cat(frames, dim=1)


def psnr_gate(
    model: Any,
    model_cfg: Any,
    pipe_cfg: Any,
    text_embeds: torch.Tensor,
    decoder: Any,
    *,
    seconds: float = 30.0,
    num_blocks: int | None = None,
    seed: int = 0,
    backend: str | None = None,
    min_features: int = FP8_MIN_FEATURES,
    threshold_db: float = PSNR_THRESHOLD_DB,
) -> PsnrGate:
    """Stream ``model`` (bf16 linears, as given) and a deep copy with FP8 linears
    (:func:`rolling_forcing.fp8.use_fp8_linears`) on the same prompt and noise, decode both with
    ``decoder`` and return the PSNR of the FP8 video against the bf16 one.

    ``num_blocks``: blocks to stream; ``None`` = the blocks of ``seconds`` of video at the project's
    video spec (``VideoSpec().blocks_for_seconds``).  ``model`` is not modified.
    """
    blocks = num_blocks or VideoSpec().blocks_for_seconds(seconds, pipe_cfg.frames_per_block)
    ref = stream_video(model, model_cfg, pipe_cfg, text_embeds, decoder, blocks, seed=seed, backend=backend)
    m8 = copy.deepcopy(model)
    names = use_fp8_linears(m8, backend=backend, min_features=min_features)
    out = stream_video(m8, model_cfg, pipe_cfg, text_embeds, decoder, blocks, seed=seed, backend=backend)
    return PsnrGate(psnr(out, ref), int(ref.shape[1]), blocks, tuple(names), threshold_db)


def kv_cache_gate(
    model: Any,
    model_cfg: Any,
    pipe_cfg: Any,
    text_embeds: torch.Tensor,
    decoder: Any,
    *,
    num_blocks: int,
    seed: int = 0,
    backend: str | None = None,
    merged: bool | None = None,
    threshold_db: float = PSNR_THRESHOLD_DB,
) -> PsnrGate:
    """The FP8 KV cache's gate: the decoded video with ``kv_dtype="float8_e4m3"`` against the same stream
    with the cache in ``pipe_cfg.dtype`` (same model, prompt, noise), PSNR >= ``threshold_db``."""
    kw: dict[str, Any] = {"seed": seed, "backend": backend, "merged": merged}
    ref = stream_video(model, model_cfg, pipe_cfg, text_embeds, decoder, num_blocks, **kw)
    out = stream_video(model, model_cfg, pipe_cfg, text_embeds, decoder, num_blocks, kv_dtype=KV_FP8, **kw)
    return PsnrGate(psnr(out, ref), int(ref.shape[1]), num_blocks, ("kv_cache",), threshold_db)
