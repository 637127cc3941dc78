"""Classifier-free guidance of a stream (rolling_forcing/guidance.py) against the reference loop's own
guided stream (reference/rolling_forcing.py: a second stream state of its own, separate forwards)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from rolling_forcing.config import PipelineConfig, check_guidance, get_preset
from rolling_forcing.guidance import GuidedNoise, combine_x0, frame_scales, guided_embeds
from rolling_forcing.model import CausalWanModel
from rolling_forcing.pipeline import NoiseSource, RollingForcingPipeline
from tests.numerics import FP32_ISSUE_BOUND  # fp32 stream equivalence within 1e-5
from tests.pipeline_helpers import one_thread as one_thread  # autouse: one intra-op thread
from tests.pipeline_helpers import reference_latents, text_embeds, tiny_model

M = get_preset("tiny")
P = PipelineConfig()
NB = 7  # warm-up, steady windows and the tail


@pytest.fixture(scope="module")
def model() -> CausalWanModel:
    return tiny_model(M)


def _reference(
    model: CausalWanModel, scale: float, negative: torch.Tensor | None, sigma_min: float = 0.0
) -> torch.Tensor:
    return reference_latents(
        model, P, NB, guidance_scale=scale, negative_embeds=negative, guidance_sigma_min=sigma_min
    )


def _stream(
    model: CausalWanModel, scale: float | None, merged: bool | None = None, **kw: object
) -> torch.Tensor:
    pipe = RollingForcingPipeline(model, M, P, merged=merged, guidance_scale=scale)
    chunks = list(pipe.stream(text_embeds(), NB, generator=torch.Generator().manual_seed(7), **kw))  # type: ignore[arg-type]
    assert [c.block for c in chunks] == list(range(NB)) and all(c.latents.shape[0] == 1 for c in chunks)
    return torch.cat([c.latents for c in chunks], dim=1)


@pytest.mark.parametrize("merged", [False, True], ids=["two_pass", "merged"])
@pytest.mark.parametrize("negative", [None, 2], ids=["null", "prompt_seed2"])
def test_guided_stream_equals_reference_loop(
    model: CausalWanModel, merged: bool, negative: int | None
) -> None:
    """The doubled batch (one forward, two KV-cache halves, combined x0, repeated noise) equals the reference
    loop's two separate stream states to fp32 reordering; guidance changes the stream (not a no-op)."""
    neg = None if negative is None else text_embeds(negative)
    ref = _reference(model, 3.0, neg)
    out = _stream(model, 3.0, merged, negative_embeds=neg)
    assert float((out - ref).abs().max()) < FP32_ISSUE_BOUND
    assert float((out - _reference(model, 1.0, None)).abs().max()) > 1e-2


@pytest.mark.parametrize("sigma_min", [0.9, 0.6])
def test_guidance_interval_equals_reference_loop(model: CausalWanModel, sigma_min: float) -> None:
    """A guidance interval (levels whose sigma > sigma_min: 1 and 0.952 for 0.9; all but 0.556 for 0.6)
    equals the reference loop's, and differs from guiding every level and from none."""
    pipe = RollingForcingPipeline(model, M, P, guidance_scale=3.0, guidance_sigma_min=sigma_min)
    out = torch.cat(
        [c.latents for c in pipe.stream(text_embeds(), NB, generator=torch.Generator().manual_seed(7))], 1
    )
    ref = _reference(model, 3.0, None, sigma_min)
    assert float((out - ref).abs().max()) < FP32_ISSUE_BOUND
    assert float((out - _reference(model, 3.0, None)).abs().max()) > 1e-3
    assert float((out - _reference(model, 1.0, None)).abs().max()) > 1e-3


def test_negative_equal_to_prompt_is_the_unguided_stream(model: CausalWanModel) -> None:
    """With the prompt as its own negative both halves predict the same x0, so any scale gives the
    unguided stream: the halves' caches, noise rows and chunk slicing line up."""
    out = _stream(model, 4.0, negative_embeds=text_embeds())
    assert float((out - _stream(model, 1.0)).abs().max()) < FP32_ISSUE_BOUND


def test_guidance_default_comes_from_the_preset(model: CausalWanModel) -> None:
    demo = get_preset("demo")
    assert demo.guidance_scale > 1.0 and 0 < demo.guidance_sigma_min < 1 and M.guidance_scale == 1.0
    cfg = replace(M, guidance_scale=3.0)
    pipe = RollingForcingPipeline(model, cfg, P)
    assert pipe.guidance_scale == 3.0
    gen = torch.Generator().manual_seed(7)
    out = torch.cat([c.latents for c in pipe.stream(text_embeds(), NB, generator=gen)], 1)
    assert float((out - _reference(model, 3.0, None)).abs().max()) < FP32_ISSUE_BOUND
    assert RollingForcingPipeline(model, cfg, P, guidance_scale=1.0).guidance_scale == 1.0


def test_guided_prompt_switch_with_recache_equals_two_states(model: CausalWanModel) -> None:
    """A switch (re-cache) in a guided stream re-encodes both halves' clean blocks, each under its own
    text: equal to a guided stream whose negative half is switched too, by construction of the batch."""

    def run(neg2: torch.Tensor | None) -> torch.Tensor:
        pipe = RollingForcingPipeline(model, M, P, guidance_scale=2.5)
        out = []
        for c in pipe.stream(text_embeds(), NB, generator=torch.Generator().manual_seed(7)):
            out.append(c.latents)
            if c.block == 3:
                pipe.set_prompt(text_embeds(5), recache=True, negative_embeds=neg2)
        return torch.cat(out, 1)

    null, explicit = run(None), run(torch.zeros_like(text_embeds()))
    assert float((null - explicit).abs().max()) == 0.0  # the default negative is the zero prompt
    # the switch changed the rest of the stream, and the guided switch differs from the unguided one
    assert float((null[:, 15:] - _stream(model, 2.5)[:, 15:]).abs().max()) > 1e-3


def test_bad_guidance_and_negatives_are_refused(model: CausalWanModel) -> None:
    for bad in (0.5, 0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="guidance_scale must be a finite number >= 1"):
            RollingForcingPipeline(model, M, P, guidance_scale=bad)
    with pytest.raises(TypeError, match="guidance_scale must be a number"):
        RollingForcingPipeline(model, M, P, guidance_scale=True)
    with pytest.raises(ValueError, match="ModelConfig.guidance_scale must be a finite number >= 1"):
        replace(M, guidance_scale=0.9)
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match=r"guidance_sigma_min must be in \[0, 1\)"):
            RollingForcingPipeline(model, M, P, guidance_scale=2.0, guidance_sigma_min=bad)
    with pytest.raises(TypeError, match="ModelConfig.guidance_sigma_min must be a number"):
        replace(M, guidance_sigma_min=True)
    pipe = RollingForcingPipeline(model, M, P, guidance_scale=2.0)
    with pytest.raises(ValueError, match="negative_embeds must have the prompt's shape"):
        next(pipe.stream(text_embeds(), NB, negative_embeds=torch.zeros(1, 3, M.text_dim)))
    with pytest.raises(ValueError, match="negative_embeds applies to a guided stream"):
        RollingForcingPipeline(model, M, P).set_prompt(text_embeds(), negative_embeds=text_embeds())
    assert check_guidance(2) == 2.0


def test_combine_and_noise_helpers() -> None:
    """The formula on known numbers, both halves equal; the noise wrapper repeats the unguided draws."""
    c, u = torch.tensor([[1.0, 2.0]]), torch.tensor([[0.5, 4.0]])
    got = combine_x0(torch.cat([c, u]), 3.0)
    assert torch.equal(got, torch.tensor([[2.0, -2.0], [2.0, -2.0]]))
    per_frame = combine_x0(torch.cat([c, u]), torch.tensor([3.0, 1.0]))  # frame 1 unguided: the prompt's
    assert torch.equal(per_frame, torch.tensor([[2.0, 2.0], [2.0, 2.0]]))
    table = P.scheduler_table()
    t = torch.tensor([[1000.0, 952.381, 882.353, 769.231, 555.556]]).repeat_interleave(3, dim=1)
    assert frame_scales(t, table, 3.0, 0.85).tolist() == [3.0] * 9 + [1.0] * 6  # sigma 1, .952, .882 guided
    assert frame_scales(t, table, 3.0, 0.0).tolist() == [3.0] * 15
    with pytest.raises(ValueError, match="2B rows"):
        combine_x0(torch.zeros(3, 2), 2.0)
    e = torch.ones(2, 4, 5)
    assert torch.equal(guided_embeds(e), torch.cat([e, torch.zeros_like(e)]))
    shape = (4, 2, 2)

    def src() -> NoiseSource:
        return NoiseSource(2, shape, 3, 4, torch.float32, generator=torch.Generator().manual_seed(3))

    plain, guided = src(), GuidedNoise(src())
    assert guided.batch == 4
    assert torch.equal(guided.initial(1), torch.cat([plain.initial(1)] * 2))
    r, rg = plain.renoise(6).unflatten(0, (2, 6)), guided.renoise(6).unflatten(0, (4, 6))
    assert torch.equal(rg, torch.cat([r, r]))


@pytest.mark.distributed
def test_2_ranks_guided_stream_with_switch_equals_unsharded(model: CausalWanModel) -> None:
    """The sharded stream (TP1 x SP2, merged) takes the guidance of its model config: the doubled batch on
    every rank, the repeated noise, both halves' caches re-encoded at a re-cache switch; equal to the
    unsharded guided stream to fp32 reordering (the sharded tests' bound)."""
    from sharding.pipeline import ShardedRollingForcingPipeline

    cfg = replace(M, guidance_scale=2.5)
    pipe = RollingForcingPipeline(model, cfg, P)
    ref = []
    for c in pipe.stream(text_embeds(), NB, generator=torch.Generator().manual_seed(7)):
        ref.append(c.latents)
        if c.window + 1 == 7:
            pipe.set_prompt(text_embeds(99), recache=True)
    sharded = ShardedRollingForcingPipeline(model, M, P, cores=2, guidance_scale=2.5, timeout_s=60.0)
    assert sharded.guidance_scale == 2.5
    sharded.set_prompt(text_embeds(99), True, window=7)
    got = [c.latents for c in sharded.stream(text_embeds(), NB, generator=torch.Generator().manual_seed(7))]
    want = torch.cat(ref, 1)
    assert all(g.shape[0] == 1 for g in got)
    assert float((torch.cat(got, 1) - want).abs().max()) < FP32_ISSUE_BOUND
    assert float((want - _stream(model, 1.0)).abs().max()) > 1e-2
