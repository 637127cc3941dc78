"""Inputs and fixtures shared by the stream tests (test_pipeline, test_merged, test_sharding_pipeline).

``one_thread`` is an autouse fixture: a test module applies it by importing it
(``from tests.pipeline_helpers import one_thread as one_thread``: the redundant alias marks the
re-export, so linters keep the import).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from reference.rolling_forcing import rolling_forcing_reference
from rolling_forcing.config import ModelConfig, PipelineConfig, get_preset
from rolling_forcing.model import CausalWanModel

TINY = get_preset("tiny")  # 12 heads, 16 tokens per frame, 48 per block


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Run the test with one intra-op thread (the CI box has 2 cores shared by several jobs)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_model(cfg: ModelConfig = TINY, seed: int = 0) -> CausalWanModel:
    """A randomly initialised DiT of ``cfg`` (fp32, eval mode), the same weights for the same seed."""
    return CausalWanModel(cfg).init_random(seed).eval()


def text_embeds(seed: int = 1, dtype: torch.dtype = torch.float32, cfg: ModelConfig = TINY) -> torch.Tensor:
    """A prompt ``[1, text_len, text_dim]``: standard-normal values drawn from ``seed``, cast to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, cfg.text_len, cfg.text_dim, generator=g).to(dtype)


def reference_latents(
    model: CausalWanModel, pipe_cfg: PipelineConfig, num_blocks: int, cfg: ModelConfig = TINY, **kw: object
) -> torch.Tensor:
    """The reference loop's whole stream (reference/rolling_forcing.py) of :func:`text_embeds`, its initial
    noise drawn up front from seed 7 as the original draws it, the re-noising from the same generator:
    ``[1, num_blocks * fpb, C, H, W]``. ``kw``: the loop's guidance arguments."""
    g = torch.Generator().manual_seed(7)
    noise = torch.randn(1, num_blocks * pipe_cfg.frames_per_block, *cfg.latent_frame_shape(), generator=g)
    sig, ts = pipe_cfg.scheduler_table()
    with torch.no_grad():
        return rolling_forcing_reference(
            model, text_embeds(cfg=cfg), noise, denoising_timesteps=pipe_cfg.timesteps, sigmas=sig,
            timesteps=ts, tokens_per_frame=cfg.tokens_per_frame, num_heads=cfg.num_heads, generator=g,
            **kw,
        )  # fmt: skip
