"""Stage 3 of the demo DiT (rolling_forcing/demo/train_stage3.py): the chain rollout is the stream.

The rollout must be what ``RollingForcingPipeline`` runs (relative positions, two-pass): with its own
outputs as context and the pipeline's own noise, every window's input and every chunk must be the
pipeline's. The noise is read back from the pipeline's recorded windows: a block's input at level 0 *is*
its noise, and at level L > 0 the pipeline's input minus ``(1 - sigma_L)`` times the x0 the pipeline
predicted for that block one level earlier, over ``sigma_L`` (the pipeline's outputs, not the rollout's).
"""

from __future__ import annotations

import pytest
import torch

from rolling_forcing import schedule
from rolling_forcing.config import PipelineConfig, get_preset
from rolling_forcing.demo.text_encoder import DemoTextEncoder
from rolling_forcing.demo.train_attention import training_forward, training_layout
from rolling_forcing.demo.train_dit import DitTrainConfig, DitTrainResult, LatentClips
from rolling_forcing.demo.train_stage3 import (
    ChainWindow,
    Stage3Config,
    chain_rollout,
    chain_target,
    train_stage3,
)
from rolling_forcing.model import CausalWanModel
from rolling_forcing.pipeline import RollingForcingPipeline

PIPE = PipelineConfig(positions="relative")


def _pipeline_run(n: int):  # type: ignore[no-untyped-def]
    mc = get_preset("tiny")
    model = CausalWanModel(mc).init_random(3).eval()
    text = torch.randn(1, 6, mc.text_dim, generator=torch.Generator().manual_seed(4))
    calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    forward = model.forward_with

    def recording(x, t, tkv, fn, **kw):  # type: ignore[no-untyped-def]
        out = forward(x, t, tkv, fn, **kw)
        if kw.get("context_frames", 0) == 0:
            calls.append((x.clone(), t.clone(), out.clone()))
        return out

    model.forward_with = recording  # type: ignore[method-assign]
    pipe = RollingForcingPipeline(model, mc, PIPE, merged=False, backend="reference")
    chunks = torch.cat(
        [c.latents for c in pipe.stream(text, n, generator=torch.Generator().manual_seed(5))], 1
    )
    del model.forward_with
    return model, model.text_kv(text), calls, chunks


def _pipeline_noise(calls, n: int):  # type: ignore[no-untyped-def]
    """(block, level) -> the noise the pipeline drew, read back from its windows (module docstring)."""
    fpb, sig = PIPE.frames_per_block, PIPE.sigmas
    noise: dict[tuple[int, int], torch.Tensor] = {}
    x0_prev: dict[int, torch.Tensor] = {}
    for w, (x_win, _t, flow) in enumerate(calls):
        lay = training_layout(PIPE, n, w)
        for i, level in enumerate(lay.levels):
            b, blk = lay.start + i, slice(i * fpb, (i + 1) * fpb)
            xin = x_win[:, blk]
            noise[(b, level)] = xin if level == 0 else (xin - (1 - sig[level]) * x0_prev[b]) / sig[level]
            x0_prev[b] = xin - sig[level] * flow[:, blk]
    return noise


def test_chain_rollout_with_own_context_is_the_pipeline() -> None:
    n = 9
    model, text_kv, calls, chunks = _pipeline_run(n)
    noise = _pipeline_noise(calls, n)
    assert len(calls) == schedule.num_windows(PIPE, n) and len(noise) == n * len(PIPE.timesteps)
    context = torch.full_like(chunks, float("nan"))  # never read with own_context: every block is produced
    windows, outputs = chain_rollout(
        model, text_kv, context, PIPE, n, lambda b, lv, shape: noise[(b, lv)], own_context=True
    )
    assert [w.layout.window for w in windows] == list(range(len(calls)))
    fpb = PIPE.frames_per_block
    for win, (x_win, t_win, _flow) in zip(windows, calls):
        lo = win.layout.start * fpb
        # fp32 rounding: LSE-merged partial attention vs one softmax, fp64 vs fp32 RoPE factors, carried
        # through the chain (test_demo_train's bound on one window, 2e-5 on outputs ~5, with headroom)
        torch.testing.assert_close(win.x[:, lo:], x_win, rtol=0, atol=1e-4, msg=f"window {win.layout.window}")
        torch.testing.assert_close(win.t[:, lo:], t_win, rtol=0, atol=0)
        assert win.t[:, :lo].eq(0).all()
        torch.testing.assert_close(win.x[:, :lo], chunks[:, :lo], rtol=0, atol=1e-4)
    torch.testing.assert_close(outputs, chunks, rtol=0, atol=1e-4)


def test_chain_rollout_with_given_context_keeps_it() -> None:
    n = 7
    model, text_kv, calls, chunks = _pipeline_run(n)
    context = torch.randn(chunks.shape, generator=torch.Generator().manual_seed(9))
    windows, _ = chain_rollout(
        model, text_kv, context, PIPE, n, lambda b, lv, shape: torch.zeros(shape), own_context=False
    )
    fpb = PIPE.frames_per_block
    for win in windows:
        lo = win.layout.start * fpb
        assert torch.equal(win.x[:, :lo], context[:, :lo])
        first = win.layout.levels.index(0) if 0 in win.layout.levels else None
        if first is not None:  # a block entering the window is its noise (zeros here)
            b = win.layout.start + first
            assert win.x[:, b * fpb : (b + 1) * fpb].eq(0).all()


def test_chain_target_gives_the_true_latent_through_flow_to_x0() -> None:
    n = 8
    lay = training_layout(PIPE, n, 6)  # a full window: blocks 2..6
    fpb = PIPE.frames_per_block
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, (lay.end + 1) * fpb, 4, 2, 2, generator=g)
    t = torch.zeros(2, (lay.end + 1) * fpb)
    truth = torch.randn(2, n * fpb, 4, 2, 2, generator=g)
    unused_x0 = torch.full((2, len(lay.levels) * fpb, 4, 2, 2), float("nan"))  # chain_target reads no x0
    target = chain_target(ChainWindow(lay, x, t, unused_x0), truth, PIPE)
    for i, level in enumerate(lay.levels):
        b = lay.start + i
        sigma = PIPE.sigmas[level]
        x0 = x[:, b * fpb : (b + 1) * fpb] - sigma * target[:, i * fpb : (i + 1) * fpb]
        torch.testing.assert_close(x0, truth[:, b * fpb : (b + 1) * fpb], rtol=1e-6, atol=1e-6)


def test_chain_rollout_rejects_a_context_of_the_wrong_length() -> None:
    mc = get_preset("tiny")
    model = CausalWanModel(mc).init_random(0).eval()
    text_kv = model.text_kv(torch.zeros(1, 6, mc.text_dim))
    with pytest.raises(ValueError, match="context must be"):
        chain_rollout(model, text_kv, torch.zeros(1, 7, 16, 4, 4), PIPE, 3, lambda b, lv, s: torch.zeros(s))


def test_train_stage3_is_seeded_keeps_its_start_and_trains() -> None:
    mc = get_preset("demo")
    torch.manual_seed(0)
    start = DitTrainResult(
        CausalWanModel(mc).init_random(1).eval(), DemoTextEncoder(mc.text_len, mc.text_dim, 1, 2)
    )
    before = {k: v.clone() for k, v in start.model.state_dict().items()}
    g = torch.Generator().manual_seed(2)
    prompts = ["a red circle bouncing on a gray background", "a blue square bouncing on a navy background"]
    clips = LatentClips(torch.randn(3, 18, 16, 8, 8, generator=g), [prompts[i % 2] for i in range(3)])
    tcfg = DitTrainConfig(batch=2, max_clean_blocks=1)
    rcfg = Stage3Config(steps=4, warmup_steps=1, windows_per_rollout=3)
    runs = [train_stage3(start, clips, mc, PIPE, tcfg, rcfg, progress=False) for _ in range(2)]
    assert len(runs[0].losses) == 4 and runs[0].losses == runs[1].losses
    for k, v in start.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    moved = [k for k, v in runs[0].model.state_dict().items() if not torch.equal(v, before[k])]
    assert moved, "stage 3 did not change the weights"
    for a, b in zip(runs[0].model.state_dict().values(), runs[1].model.state_dict().values()):
        assert torch.equal(a, b)
    assert train_stage3(start, clips, mc, PIPE, tcfg, Stage3Config(steps=0)) is start
    with pytest.raises(ValueError, match="stage 3 needs"):
        train_stage3(
            start, LatentClips(clips.latents[:, :15], clips.prompts), mc, PIPE, tcfg, rcfg, progress=False
        )


@pytest.mark.parametrize(
    "bad",
    [
        dict(steps=-1),
        dict(windows_per_rollout=0),
        dict(lr=0.0),
        dict(tail_fraction=1.5),
        dict(own_context_fraction=-0.1),
    ],
)
def test_stage3_config_rejects_bad_values(bad: dict) -> None:
    with pytest.raises(ValueError, match="Stage3Config"):
        Stage3Config(**bad)


def test_training_forward_of_a_chain_window_is_the_rollouts_own_prediction() -> None:
    """The gradient step sees exactly the input the rollout saw (the window is stored, not rebuilt), and
    the window's x0 is that forward's, every block at its own level's sigma."""
    n = 6
    model, text_kv, calls, chunks = _pipeline_run(n)
    windows, outputs = chain_rollout(
        model, text_kv, torch.zeros_like(chunks), PIPE, n, lambda b, lv, s: torch.ones(s), own_context=False
    )
    fpb = PIPE.frames_per_block
    last = len(PIPE.timesteps) - 1
    for win in windows:
        with torch.no_grad():
            flow = training_forward(model, win.layout, PIPE, win.x, win.t, text_kv)
        for i, level in enumerate(win.layout.levels):
            b = win.layout.start + i
            x0 = win.x[:, b * fpb : (b + 1) * fpb] - PIPE.sigmas[level] * flow[:, i * fpb : (i + 1) * fpb]
            torch.testing.assert_close(win.x0[:, i * fpb : (i + 1) * fpb], x0, rtol=0, atol=0)
            if level == last:
                torch.testing.assert_close(x0, outputs[:, b * fpb : (b + 1) * fpb], rtol=0, atol=0)


@pytest.mark.parametrize("tail_fraction", [0.0, 1.0])
def test_pick_windows_draws_distinct_main_windows_and_a_tail_window_at_its_rate(tail_fraction: float) -> None:
    from rolling_forcing.demo.train_stage3 import _pick_windows

    n = 13  # windows 0..12 warm-up/full, 13..16 tail (window_blocks - 1 = 4 of them)
    kinds = [training_layout(PIPE, n, w).kind for w in range(schedule.num_windows(PIPE, n))]
    n_main = sum(k != "tail" for k in kinds)
    rcfg = Stage3Config(windows_per_rollout=6, tail_fraction=tail_fraction)
    g = torch.Generator().manual_seed(0)
    seen_main: set[int] = set()
    for _ in range(200):
        picks = _pick_windows(PIPE, n, rcfg, g)
        assert len(picks) == 6 and len(set(picks)) == 6
        assert all(kinds[w] != "tail" for w in picks[:-1])
        assert (kinds[picks[-1]] == "tail") == (tail_fraction == 1.0)
        seen_main.update(w for w in picks if kinds[w] != "tail")
    assert seen_main == set(range(n_main))  # every warm-up and full window is drawn
    capped = _pick_windows(PIPE, n, Stage3Config(windows_per_rollout=50, tail_fraction=0.0), g)
    assert sorted(capped) == list(range(n_main))
