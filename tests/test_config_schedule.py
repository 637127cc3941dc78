"""Config presets, derived sizes and the scheduler maths against independent recomputation."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rolling_forcing.config import ModelConfig, PipelineConfig, get_preset
from rolling_forcing.schedule import block_levels, frame_timesteps, num_windows, window_plan, window_range


def _shift(s: float, shift: float = 5.0) -> float:
    return shift * s / (1 + (shift - 1) * s)


def test_wan_preset_derived_sizes() -> None:
    m = get_preset("wan2.1-1.3b")
    p = PipelineConfig()
    assert (m.num_layers, m.dim, m.num_heads, m.ffn_dim, m.text_dim, m.text_len) == (
        30,
        1536,
        12,
        8960,
        4096,
        512,
    )
    assert m.head_dim == 128
    assert m.tokens_per_frame == (480 // 8 // 2) * (832 // 8 // 2)  # 8x VAE, 2x2 patch
    assert p.tokens_per_block(m) == 3 * m.tokens_per_frame
    assert p.key_budget_frames == 3 + 3 + 15
    assert p.buffer_slots == 8 and p.buffer_tokens(m) == 24 * m.tokens_per_frame
    assert p.key_budget_tokens(m) == 21 * m.tokens_per_frame


def test_tiny_preset_has_12_heads() -> None:
    m = get_preset("tiny")
    assert m.num_heads == 12 and m.head_dim % 2 == 0
    assert m.tokens_per_frame == (m.latent_height // 2) * (m.latent_width // 2)


def test_warped_timesteps_match_flow_match_formula() -> None:
    p = PipelineConfig()
    # independent float64 recomputation: t = 1000 * shift(1 - i/1000) at i = 1000 - t_nominal
    expect = [1000 * _shift((1000 - (1000 - t)) / 1000) for t in p.denoising_steps]
    assert [round(x, 2) for x in p.timesteps] == [1000.0, 952.38, 882.35, 769.23, 555.56]
    # The config follows the original's float32 scheduler table; 1e-6 relative is ~8 fp32 ulps of float64.
    for got, want in zip(p.timesteps, expect):
        assert math.isclose(got, want, rel_tol=1e-6)
    for s, t in zip(p.sigmas, p.timesteps):
        assert math.isclose(s * 1000, t, rel_tol=1e-6)


def test_bad_configs_raise() -> None:
    with pytest.raises(ValueError, match="divisible by num_heads"):
        ModelConfig("x", 1, 100, 12, 8, 8, 8, 4, 8, 8)
    with pytest.raises(ValueError, match="one window block per denoising step"):
        PipelineConfig(window_blocks=4)
    with pytest.raises(ValueError, match="positions"):
        PipelineConfig(positions="rotary")
    with pytest.raises(ValueError, match="unknown model preset"):
        get_preset("wan-14b")


STEP_LISTS = {
    3: (1000, 666, 333),
    4: (1000, 750, 500, 250),
    5: (1000, 800, 600, 400, 200),
    6: (1000, 833, 666, 500, 333, 166),
}
"""Step lists of 3..6 steps (the released 5, Self-Forcing's 4, two more) for the budget tests."""


@pytest.mark.parametrize("steps", sorted(STEP_LISTS))
def test_default_context_follows_the_original_21_frame_budget(steps: int) -> None:
    """The original's denoise pass attends max_attention_size = 21 frames for every step list: the working
    cache is what the 3-frame sink and the window leave (3, 2, 1, 0 blocks for 3, 4, 5, 6 steps)."""
    p = PipelineConfig(window_blocks=steps, denoising_steps=STEP_LISTS[steps])
    assert p.context_blocks == 21 // 3 - 1 - steps
    assert p.key_budget_frames == 21 and p.buffer_slots == 8  # the original's 21 / 24 frames
    assert (
        PipelineConfig(
            window_blocks=steps, denoising_steps=STEP_LISTS[steps], context_blocks=1
        ).context_blocks
        == 1
    )


def test_step_lists_beyond_the_budget_and_bad_context_refused() -> None:
    seven = (1000, 857, 714, 571, 428, 285, 142)
    with pytest.raises(
        ValueError, match=r"sink and the window alone take 24 frames \(> 21\).*at most 6 steps"
    ):
        PipelineConfig(window_blocks=7, denoising_steps=seven)
    assert PipelineConfig(window_blocks=7, denoising_steps=seven, context_blocks=0).key_budget_frames == 24
    with pytest.raises(ValueError, match="21 is not a whole number of blocks"):
        PipelineConfig(frames_per_block=2)
    for bad in (-1, True, 1.0):
        with pytest.raises(ValueError, match="context_blocks must be an int >= 0 or None"):
            PipelineConfig(context_blocks=bad)  # type: ignore[arg-type]
    assert PipelineConfig() == PipelineConfig(context_blocks=1)  # the derived value is the field's value


def test_too_few_blocks_raise() -> None:
    with pytest.raises(ValueError, match="num_blocks=4 is too short"):
        window_plan(PipelineConfig(), 4, 0)


@given(st.integers(5, 40))
def test_levels_walk_each_block_through_every_step_once(num_blocks: int) -> None:
    p = PipelineConfig()
    seen: dict[int, list[int]] = {}
    finished = []
    for w in range(num_windows(p, num_blocks)):
        s, e = window_range(p, num_blocks, w)
        for b, lv in zip(range(s, e + 1), block_levels(p, num_blocks, w)):
            seen.setdefault(b, []).append(lv)
        plan = window_plan(p, num_blocks, w)
        if plan.finished_block is not None:
            finished.append(plan.finished_block)
        assert len(frame_timesteps(p, plan.levels)) == plan.num_blocks * p.frames_per_block
    assert finished == list(range(num_blocks))
    for b in range(num_blocks):
        assert seen[b] == list(range(p.window_blocks)), (b, seen[b])
