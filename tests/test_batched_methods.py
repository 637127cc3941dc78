"""Every method at batch 2, in every forward mode: merged, two-pass, and sharded over 2 gloo ranks.

A token slice of a ``[B, 2T, H, D]`` tensor is strided when B > 1, and the ops read ``[B, L, H, D]``
row-major: the batched (sequential methods' merged) forward once passed such a slice of v and crashed at
batch 2 only. Each batch-2 stream is compared with its method's independent reference loop at batch 2
(each batch element its own prompt; the loops draw the same noise), and the sharded stream with the
unsharded one. Bound: tests.numerics.FP32_ISSUE_BOUND, the fp32 stream-equivalence bound (measured
differences are fp32 reorderings of partial attention, ~1e-6)."""

from __future__ import annotations

import pytest
import torch

from reference.rolling_forcing import rolling_forcing_reference
from reference.sequential import sequential_reference
from rolling_forcing.config import PipelineConfig, get_preset
from rolling_forcing.methods import METHODS
from rolling_forcing.model import CausalWanModel
from rolling_forcing.pipeline import RollingForcingPipeline
from sharding.pipeline import ShardedRollingForcingPipeline
from tests.numerics import FP32_ISSUE_BOUND  # fp32 stream equivalence (1e-5)
from tests.pipeline_helpers import one_thread as one_thread  # autouse: one intra-op thread
from tests.pipeline_helpers import text_embeds, tiny_model

M = get_preset("tiny")
P = PipelineConfig()
NB = {"rolling-forcing": 6, "self-forcing": 4, "causvid": 4, "longlive": 5}  # LongLive evicts at block 4
REF_KW = {"longlive": {"local_attn_frames": 12, "sink_frames": 3}}


@pytest.fixture(scope="module")
def model() -> CausalWanModel:
    return tiny_model(M)


def _prompts() -> torch.Tensor:
    return torch.cat([text_embeds(1), text_embeds(2)])  # [2, L, text_dim]: a prompt per batch element


def _drive(model: CausalWanModel, method: str, merged: bool) -> torch.Tensor:
    pipe = RollingForcingPipeline(model, M, P, method=method, merged=merged, positions="absolute")
    chunks = pipe.stream(_prompts(), NB[method], generator=torch.Generator().manual_seed(7))
    return torch.cat([c.latents for c in chunks], dim=1)


def _reference(model: CausalWanModel, method: str) -> torch.Tensor:
    m, nb = METHODS[method], NB[method]
    g = torch.Generator().manual_seed(7)
    noise = torch.randn(2, nb * 3, *M.latent_frame_shape(), generator=g)  # up front, as the originals
    sig, ts = m.scheduler_table()
    common = dict(
        sigmas=sig, timesteps=ts, tokens_per_frame=M.tokens_per_frame, num_heads=M.num_heads, generator=g
    )
    with torch.no_grad():
        if method == "rolling-forcing":
            return rolling_forcing_reference(
                model, _prompts(), noise, denoising_timesteps=m.timesteps, **common
            )  # type: ignore[arg-type]
        return sequential_reference(
            model,
            _prompts(),
            noise,
            denoising_timesteps=m.timesteps,
            **common,
            **REF_KW.get(method, {}),  # type: ignore[arg-type]
        )


@pytest.mark.parametrize("merged", [True, False], ids=["merged", "two-pass"])
@pytest.mark.parametrize("method", sorted(NB))
def test_batch_2_equals_the_reference_loop(model: CausalWanModel, method: str, merged: bool) -> None:
    got, ref = _drive(model, method, merged), _reference(model, method)
    assert got.shape == ref.shape == (2, NB[method] * 3, *M.latent_frame_shape())
    assert float((got - ref).abs().max()) <= FP32_ISSUE_BOUND
    # the two batch elements are different streams (a mix-up of the elements' caches or prompts shows)
    assert float((got[0] - got[1]).abs().max()) > 1e-2


@pytest.mark.parametrize("merged", [True, False], ids=["merged", "two-pass"])
@pytest.mark.parametrize("method", sorted(NB))
def test_batch_2_sharded_equals_unsharded(model: CausalWanModel, method: str, merged: bool) -> None:
    pipe = ShardedRollingForcingPipeline(
        model, M, P, cores=2, method=method, merged=merged, positions="absolute"
    )
    chunks = pipe.stream(_prompts(), NB[method], generator=torch.Generator().manual_seed(7))
    got = torch.cat([c.latents for c in chunks], dim=1)
    assert float((got - _drive(model, method, merged)).abs().max()) <= FP32_ISSUE_BOUND
