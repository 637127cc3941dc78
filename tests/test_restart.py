"""A restarting prompt switch (``set_prompt(..., restart=True)``): the stream after it is a new stream of
the new prompt, checked against the reference loop (reference/rolling_forcing.py) run from scratch on the
noise the restarted blocks draw, and against a fresh pipeline stream where the reference loop cannot
replay the draws (a restart less than a window from the end, a sequential method)."""

from __future__ import annotations

import itertools

import pytest
import torch

from reference.rolling_forcing import rolling_forcing_reference
from rolling_forcing.config import PipelineConfig, get_preset
from rolling_forcing.model import CausalWanModel
from rolling_forcing.pipeline import NoiseSource, RollingForcingPipeline
from rolling_forcing.stream import Chunk, ShiftedNoise
from tests.numerics import FP32_ISSUE_BOUND  # fp32 stream equivalence within 1e-5
from tests.pipeline_helpers import one_thread as one_thread  # autouse: one intra-op thread
from tests.pipeline_helpers import text_embeds, tiny_model

M = get_preset("tiny")
P = PipelineConfig()
FPB = P.frames_per_block
NB = 9  # blocks of every stream here


@pytest.fixture(scope="module")
def model() -> CausalWanModel:
    return tiny_model(M)


def _noise(seed: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, NB * FPB, *M.latent_frame_shape(), generator=g)


def _run(
    pipe: RollingForcingPipeline,
    first: torch.Tensor,
    then: torch.Tensor,
    after: int,
    gen: torch.Generator,
    noise: torch.Tensor | NoiseSource,
    **switch: object,
) -> tuple[list[Chunk], torch.Tensor]:
    """The chunks of a stream of ``first`` switched to ``then`` after the chunk of block ``after``, and the
    generator's state at the switch."""
    chunks, state = [], gen.get_state()
    for c in pipe.stream(first, NB, generator=gen, noise=noise):
        chunks.append(c)
        if c.block == after:
            state = gen.get_state()
            pipe.set_prompt(then, **switch)  # type: ignore[arg-type]
    return chunks, state


def _reference(
    model: CausalWanModel, emb: torch.Tensor, noise: torch.Tensor, gen: torch.Generator
) -> torch.Tensor:
    sig, ts = P.scheduler_table()
    with torch.no_grad():
        return rolling_forcing_reference(
            model, emb, noise, denoising_timesteps=P.timesteps, sigmas=sig, timesteps=ts,
            tokens_per_frame=M.tokens_per_frame, num_heads=M.num_heads, generator=gen,
        )  # fmt: skip


@pytest.mark.parametrize("merged", [False, True], ids=["two_pass", "merged"])
def test_restart_is_a_new_stream_of_the_new_prompt(model: CausalWanModel, merged: bool) -> None:
    """Blocks 0..2 are the first prompt's stream; after the restart, blocks 3..8 are the reference loop's
    stream of the second prompt from scratch on the initial noise of blocks 3..8 and the generator as it
    stood at the switch; block numbers run on and only block 8 is the last."""
    a, b, noise = text_embeds(1, cfg=M), text_embeds(2, cfg=M), _noise()
    pipe = RollingForcingPipeline(model, M, P, merged=merged)
    gen = torch.Generator().manual_seed(11)
    chunks, state = _run(pipe, a, b, 2, gen, noise, restart=True)
    assert [c.block for c in chunks] == list(range(NB))
    assert [c.last for c in chunks] == [False] * (NB - 1) + [True]
    windows = [c.window for c in chunks]
    assert windows == sorted(windows) and len(set(windows)) == NB  # calls count on over the restart
    got = torch.cat([c.latents for c in chunks], dim=1)
    ref_a = _reference(model, a, noise, torch.Generator().manual_seed(11))
    g2 = torch.Generator()
    g2.set_state(state)
    ref_b = _reference(model, b, noise[:, 3 * FPB :].contiguous(), g2)
    err_a = (got[:, : 3 * FPB] - ref_a[:, : 3 * FPB]).abs().max().item()
    err_b = (got[:, 3 * FPB :] - ref_b).abs().max().item()
    assert err_a <= FP32_ISSUE_BOUND and err_b <= FP32_ISSUE_BOUND, (err_a, err_b)
    # not the continuing switch: with no restart the blocks after the switch differ
    pipe2 = RollingForcingPipeline(model, M, P, merged=merged)
    cont, _ = _run(pipe2, a, b, 2, torch.Generator().manual_seed(11), noise)
    assert (torch.cat([c.latents for c in cont[3:]], 1) - got[:, 3 * FPB :]).abs().max().item() > 1e-2


def test_restart_near_the_end_shows_only_the_blocks_left(model: CausalWanModel) -> None:
    """A restart 2 blocks before the end runs a window's worth (5 blocks) and shows 2: they equal the first
    2 chunks of a fresh 5-block stream of the new prompt drawing its noise per block from the generator
    as it stood at the switch (lazy noise draws every block from the generator in order)."""
    a, b = text_embeds(1, cfg=M), text_embeds(2, cfg=M)
    gen = torch.Generator().manual_seed(3)
    src = NoiseSource(1, M.latent_frame_shape(), FPB, NB, torch.float32, generator=gen, upfront=False)
    pipe = RollingForcingPipeline(model, M, P)
    chunks, state = _run(pipe, a, b, NB - 3, gen, src, restart=True)
    assert [c.block for c in chunks] == list(range(NB)) and chunks[-1].last
    g2 = torch.Generator()
    g2.set_state(state)
    src2 = NoiseSource(
        1, M.latent_frame_shape(), FPB, P.window_blocks, torch.float32, generator=g2, upfront=False
    )
    fresh = [c.latents for c in RollingForcingPipeline(model, M, P).stream(b, P.window_blocks, noise=src2)]
    for c, f in zip(chunks[NB - 2 :], fresh[:2], strict=True):
        assert torch.equal(c.latents, f)
    assert pipe.state is None  # the stream ended


def test_two_restarts_number_their_blocks_on(model: CausalWanModel) -> None:
    """Restarts after blocks 1 and 6 of a 9-block stream: blocks 0..8 once each, only the last marked last,
    and the last segment (2 blocks) is a fresh stream of the third prompt on the generator as it stood."""
    a, b, c = (text_embeds(s, cfg=M) for s in (1, 2, 3))
    gen = torch.Generator().manual_seed(4)
    src = NoiseSource(1, M.latent_frame_shape(), FPB, NB, torch.float32, generator=gen, upfront=False)
    pipe = RollingForcingPipeline(model, M, P)
    chunks, state = [], gen.get_state()
    for ch in itertools.islice(pipe.stream(a, NB, noise=src), NB + 1):  # bounded: a wrong count must fail
        chunks.append(ch)
        if ch.block == 1:
            pipe.set_prompt(b, restart=True)
        if ch.block == 6:
            state = gen.get_state()
            pipe.set_prompt(c, restart=True)
    assert [ch.block for ch in chunks] == list(range(NB))
    assert [ch.last for ch in chunks] == [False] * (NB - 1) + [True]
    g2 = torch.Generator()
    g2.set_state(state)
    src2 = NoiseSource(
        1, M.latent_frame_shape(), FPB, P.window_blocks, torch.float32, generator=g2, upfront=False
    )
    fresh = list(RollingForcingPipeline(model, M, P).stream(c, P.window_blocks, noise=src2))
    assert all(torch.equal(x.latents, y.latents) for x, y in zip(chunks[7:], fresh[:2], strict=True))


def test_guided_restart_is_a_new_guided_stream(model: CausalWanModel) -> None:
    """A guided stream restarts guided: the blocks after the restart are the reference loop's guided
    stream of the new prompt and its negative from scratch."""
    a, b, neg, noise = text_embeds(1, cfg=M), text_embeds(2, cfg=M), text_embeds(4, cfg=M), _noise()
    pipe = RollingForcingPipeline(model, M, P, guidance_scale=2.0, guidance_sigma_min=0.6)
    gen = torch.Generator().manual_seed(5)
    chunks, state = _run(pipe, a, b, 3, gen, noise, restart=True, negative_embeds=neg)
    got = torch.cat([c.latents for c in chunks[4:]], dim=1)
    g2 = torch.Generator()
    g2.set_state(state)
    sig, ts = P.scheduler_table()
    with torch.no_grad():
        ref = rolling_forcing_reference(
            model, b, noise[:, 4 * FPB :].contiguous(), denoising_timesteps=P.timesteps, sigmas=sig,
            timesteps=ts, tokens_per_frame=M.tokens_per_frame, num_heads=M.num_heads, generator=g2,
            guidance_scale=2.0, negative_embeds=neg, guidance_sigma_min=0.6,
        )  # fmt: skip
    assert (got - ref).abs().max().item() <= FP32_ISSUE_BOUND


@pytest.mark.parametrize("method", ["self-forcing", "longlive"])
def test_sequential_method_restart_is_a_fresh_stream(model: CausalWanModel, method: str) -> None:
    """A sequential method restarts too (a stream of one block and up): the blocks after the restart equal
    a fresh stream of the new prompt on the shifted noise."""
    pc = PipelineConfig(positions="relative")
    a, b = text_embeds(1, cfg=M), text_embeds(2, cfg=M)
    gen = torch.Generator().manual_seed(9)
    src = NoiseSource(1, M.latent_frame_shape(), FPB, NB, torch.float32, generator=gen)
    pipe = RollingForcingPipeline(model, M, pc, method=method)
    chunks, state = _run(pipe, a, b, NB - 2, gen, src, restart=True)
    assert [c.block for c in chunks] == list(range(NB)) and chunks[-1].last
    g2 = torch.Generator()
    g2.set_state(state)
    src.generator = g2
    fresh = list(
        RollingForcingPipeline(model, M, pc, method=method).stream(b, 1, noise=ShiftedNoise(src, NB - 1))
    )
    assert torch.equal(chunks[-1].latents, fresh[0].latents)


def test_restart_switch_rules(model: CausalWanModel) -> None:
    """recache and restart together are refused; a later set_prompt replaces a pending restart (and a
    restart a pending switch); a new stream() drops a pending restart; a restart with another batch is
    refused at set_prompt."""
    a, b = text_embeds(1, cfg=M), text_embeds(2, cfg=M)
    pipe = RollingForcingPipeline(model, M, P)
    with pytest.raises(ValueError, match="recache=True and restart=True"):
        pipe.set_prompt(b, recache=True, restart=True)
    plain, _ = _run(pipe, a, b, 2, torch.Generator().manual_seed(1), _noise())

    class Twice(RollingForcingPipeline):
        def set_prompt(self, text_embeds: torch.Tensor, recache: bool = False, **kw: object) -> None:
            super().set_prompt(text_embeds, restart=True)
            super().set_prompt(text_embeds, recache)  # the later call wins

    twice, _ = _run(Twice(model, M, P), a, b, 2, torch.Generator().manual_seed(1), _noise())
    assert all(torch.equal(x.latents, y.latents) for x, y in zip(plain, twice, strict=True))
    pipe.set_prompt(b, restart=True)  # pending, then dropped by the new stream
    again = [
        c.latents for c in pipe.stream(a, NB, generator=torch.Generator().manual_seed(1), noise=_noise())
    ]
    unswitched = [c.latents for c in RollingForcingPipeline(model, M, P).stream(
        a, NB, generator=torch.Generator().manual_seed(1), noise=_noise())]  # fmt: skip
    assert all(torch.equal(x, y) for x, y in zip(again, unswitched, strict=True))
    it = pipe.stream(a, NB, generator=torch.Generator().manual_seed(1), noise=_noise())
    next(it)
    with pytest.raises(ValueError, match="restart: new prompt batch 2 != stream batch 1"):
        pipe.set_prompt(torch.cat([b, b]), restart=True)
    it.close()


def test_shifted_noise() -> None:
    """Block b of the shifted source is the inner source's block offset + b; past the inner's up-front
    blocks it draws fresh from the inner's generator; re-noise draws are the inner's."""
    g = torch.Generator().manual_seed(0)
    inner = NoiseSource(1, (2, 2, 2), 3, 4, torch.float32, generator=g)
    s = ShiftedNoise(inner, 1)
    assert torch.equal(s.initial(0), inner.initial(1)) and torch.equal(s.initial(2), inner.initial(3))
    assert s.upfront_blocks() == 3 and ShiftedNoise(inner, 6).upfront_blocks() == 0
    state = g.get_state()
    past = s.initial(3)  # inner block 4 does not exist: a fresh draw
    g2 = torch.Generator()
    g2.set_state(state)
    assert torch.equal(past, torch.randn(1, 3, 2, 2, 2, generator=g2))
    assert torch.equal(s.renoise(2), torch.randn(2, 2, 2, 2, generator=g2))
    with pytest.raises(ValueError, match="offset must be >= 0"):
        ShiftedNoise(inner, -1)
