"""RollingForcingPipeline against the independent reference loop (reference/rolling_forcing.py)."""

from __future__ import annotations

import math
import resource

import pytest
import torch

from rolling_forcing.config import PipelineConfig, get_preset
from rolling_forcing.model import CausalWanModel
from rolling_forcing.pipeline import NoiseSource, RollingForcingPipeline
from tests.numerics import FP32_ISSUE_BOUND, worst_of  # fp32 stream equivalence within 1e-5
from tests.pipeline_helpers import one_thread as one_thread  # autouse: one intra-op thread
from tests.pipeline_helpers import reference_latents, text_embeds, tiny_model

M = get_preset("tiny")
P = PipelineConfig()
NB = 8  # warm-up (5 windows), 4 steady windows incl. eviction-free, 4 tail windows
FP32_EPS = torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def model() -> CausalWanModel:
    return tiny_model(M)


@pytest.fixture(scope="module")
def reference_out(model: CausalWanModel) -> torch.Tensor:
    return reference_latents(model, P, NB)  # noise up front, as the original


def _stream(
    model: CausalWanModel, positions: str = "absolute", merged: bool | None = None, **kw: object
) -> list:
    pipe = RollingForcingPipeline(model, M, P, positions=positions, merged=merged)
    return list(pipe.stream(text_embeds(), NB, generator=torch.Generator().manual_seed(7), **kw))  # type: ignore[arg-type]


def _baseline_err(model: CausalWanModel, ref: torch.Tensor) -> float:
    out = torch.cat([c.latents for c in _stream(model)], dim=1)
    return float((out - ref).abs().max())


@pytest.mark.parametrize("merged", [False, True], ids=["two_pass", "merged"])
def test_pipeline_equals_reference_loop(
    model: CausalWanModel, reference_out: torch.Tensor, merged: bool
) -> None:
    """Both forward modes (each skipping the cache-only frames' last-layer work) equal the reference loop
    (which runs every pass in full)."""
    chunks = _stream(model, merged=merged)
    assert [c.block for c in chunks] == list(range(NB))
    assert all(c.final for c in chunks) and [c.last for c in chunks] == [False] * (NB - 1) + [True]
    assert [c.window for c in chunks] == list(range(4, NB + 4))
    out = torch.cat([c.latents for c in chunks], dim=1)
    assert out.shape == reference_out.shape
    # same RNG stream (initial noise up front, then one window-sized draw per re-noised block): equal
    # up to fp32 reordering (partials merged by log-sum-exp vs one concatenated softmax); measured 1.4e-06
    assert float((out - reference_out).abs().max()) < FP32_ISSUE_BOUND
    # non-trivial: blocks differ from each other and from the noise scale
    assert float((out[:, :3] - out[:, -3:]).abs().max()) > 1e-2


def test_each_chunk_is_final_when_yielded(model: CausalWanModel, reference_out: torch.Tensor) -> None:
    pipe = RollingForcingPipeline(model, M, P)
    seen = []
    for c in pipe.stream(text_embeds(), NB, generator=torch.Generator().manual_seed(7)):
        # the reference's *end-of-stream* latents of this block already equal what we got now
        ref = reference_out[:, c.block * 3 : (c.block + 1) * 3]
        assert float((c.latents - ref).abs().max()) < FP32_ISSUE_BOUND  # measured 1.4e-06
        assert pipe.state is not None and pipe.state.window == c.window
        seen.append(c.block)
    assert seen == sorted(seen)


def test_relative_positions_equal_absolute(model: CausalWanModel, reference_out: torch.Tensor) -> None:
    rel = torch.cat([c.latents for c in _stream(model, "relative")], dim=1)
    ab = torch.cat([c.latents for c in _stream(model, "absolute")], dim=1)
    # tolerance: 2 x (absolute pipeline vs reference: the fp32 reordering error of this stream), with a
    # floor of 8 fp32 ulps of the output magnitude
    base = worst_of(_baseline_err(model, reference_out), 8 * FP32_EPS * float(ab.abs().max()))
    assert math.isfinite(base)
    assert float((rel - ab).abs().max()) <= 2 * base


def test_injected_noise_source_equals_tensor(model: CausalWanModel) -> None:
    g = torch.Generator().manual_seed(11)
    noise = torch.randn(1, NB * 3, *M.latent_frame_shape(), generator=g)
    a = _stream(model, noise=noise)
    src = NoiseSource(1, M.latent_frame_shape(), 3, NB, torch.float32, initial_noise=noise,
                      generator=torch.Generator().manual_seed(7))  # fmt: skip
    pipe = RollingForcingPipeline(model, M, P)
    b = list(pipe.stream(text_embeds(), NB, noise=src))
    for ca, cb in zip(a, b):
        assert torch.equal(ca.latents, cb.latents)


def test_prompt_switch_takes_effect_at_next_window(model: CausalWanModel) -> None:
    base = _stream(model)
    for recache in (False, True):
        pipe = RollingForcingPipeline(model, M, P)
        out = []
        for c in pipe.stream(text_embeds(), NB, generator=torch.Generator().manual_seed(7)):
            out.append(c)
            if c.block == 2:
                pipe.set_prompt(text_embeds(99), recache=recache)
        for i in range(3):
            assert torch.equal(out[i].latents, base[i].latents)
        assert float((out[3].latents - base[3].latents).abs().max()) > 1e-3
    # re-caching under the *same* prompt before any eviction reproduces the stream
    pipe = RollingForcingPipeline(model, M, P)
    same = []
    for c in pipe.stream(text_embeds(), NB, generator=torch.Generator().manual_seed(7)):
        same.append(c)
        if c.block == 1:
            pipe.set_prompt(text_embeds(), recache=True)
    for a, b in zip(same, base):
        assert float((a.latents - b.latents).abs().max()) < FP32_ISSUE_BOUND  # measured 1.2e-06


def test_bad_input_raises(model: CausalWanModel) -> None:
    pipe = RollingForcingPipeline(model, M, P)
    with pytest.raises(ValueError, match="num_blocks=4 is too short"):
        next(pipe.stream(text_embeds(), 4))
    with pytest.raises(ValueError, match="text embeddings must be"):
        next(pipe.stream(torch.randn(1, M.text_len, M.text_dim + 1), NB))
    with pytest.raises(ValueError, match="text embeddings must be"):
        next(pipe.stream(torch.randn(1, M.text_len + 1, M.text_dim), NB))
    with pytest.raises(ValueError, match="noise latents must be"):
        next(pipe.stream(text_embeds(), NB, noise=torch.randn(1, NB * 3 - 1, *M.latent_frame_shape())))
    with pytest.raises(ValueError, match="beyond the 1024-position table"):
        next(pipe.stream(text_embeds(), 1024 // 3 + 1))
    with pytest.raises(ValueError, match="positions must be"):
        RollingForcingPipeline(model, M, P, positions="rotary")
    with pytest.raises(ValueError, match="text embeddings must be"):
        pipe.set_prompt(torch.randn(1, 3))


def _long_relative(num_blocks: int) -> None:
    mc = get_preset("micro")
    model = tiny_model(mc)
    pipe = RollingForcingPipeline(model, mc, P, positions="relative")
    text = torch.randn(1, mc.text_len, mc.text_dim)
    src = NoiseSource(1, mc.latent_frame_shape(), 3, num_blocks, torch.float32,
                      generator=torch.Generator().manual_seed(0), upfront=False)  # fmt: skip
    rss = []
    n = 0
    for c in pipe.stream(text, num_blocks, noise=src):
        st = pipe.state
        assert st is not None
        assert len(st.noisy) <= P.window_blocks and len(st.clean) <= P.buffer_slots
        assert torch.isfinite(c.latents).all()
        n += 1
        if n % 50 == 0:
            rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    assert n == num_blocks
    assert rss[-1] - rss[0] < 20_000, rss  # KiB: flat (fixed-size cache, bounded state)


def test_relative_stream_past_the_rope_table() -> None:
    _long_relative(1050 // 3)  # 1,050 latent frames > 1,024 positions


@pytest.mark.slow
def test_relative_stream_3000_frames() -> None:
    _long_relative(3000 // 3)


@pytest.mark.parametrize(
    ("steps", "merged"),
    [((1000, 666, 333), True), ((1000, 750, 500, 250), False), ((1000, 833, 666, 500, 333, 166), True)],
    ids=["3-steps-merged", "4-steps-two-pass", "6-steps-merged"],
)
def test_other_step_lists_equal_the_reference_loop(
    model: CausalWanModel, steps: tuple[int, ...], merged: bool
) -> None:
    """A step list other than the released 5 keeps the original's 21-frame attention budget by default
    (working cache of 3, 2, 0 blocks): the stream equals the reference loop, whose budget is the original's
    constant. Measured 1.2e-06..2.0e-06; the former fixed one-block working cache erred 0.076..0.13."""
    p = PipelineConfig(window_blocks=len(steps), denoising_steps=steps)
    nb = 10  # steady windows with eviction (buffer of 8 slots) and the tail
    ref = reference_latents(model, p, nb)
    with torch.no_grad():
        pipe = RollingForcingPipeline(model, M, p, merged=merged)
        out = torch.cat(
            [c.latents for c in pipe.stream(text_embeds(), nb, generator=torch.Generator().manual_seed(7))], 1
        )
    assert float((out - ref).abs().max()) < FP32_ISSUE_BOUND
