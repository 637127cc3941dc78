"""Late windows of a long stream as short training sequences (``long_layout``) and their batches.

The independent reference is the full training layout (``training_layout``, itself checked against the
real pipeline in ``tests/test_demo_train.py``) over the whole long sequence: for a DiT of up to two
layers the short sequence's window prediction must equal it (every key the window reads, directly or
through the working block's update pass, is kept); from three layers on the older clean blocks' dropped
keys reach the window, which the last test measures so the approximation stays visible.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from rolling_forcing import schedule
from rolling_forcing.config import PipelineConfig, get_preset
from rolling_forcing.demo.train_attention import long_layout, training_forward, training_layout
from rolling_forcing.demo.train_dit import DitTrainConfig, LatentClips, make_batch, sample_layout
from rolling_forcing.model import CausalWanModel

PIPE = PipelineConfig(positions="relative")
FPB = PIPE.frames_per_block


def _late_windows(n: int) -> list[int]:
    return [w for w in range(schedule.num_windows(PIPE, n)) if schedule.window_range(PIPE, n, w)[0] > 8]


def _oldest_kept(s: int, n_win: int) -> int:
    """Hand count: the denoise pass reads 7 - 1 - n_win working blocks (s - that .. s - 1); the oldest one's
    update pass reads the 7 blocks ending at it."""
    return s - (6 - n_win) - 6


def test_early_windows_are_the_training_layout() -> None:
    n = 16
    for w in range(schedule.num_windows(PIPE, n)):
        s, e = schedule.window_range(PIPE, n, w)
        if _oldest_kept(s, e - s + 1) <= 1:  # everything after the sink is kept
            assert long_layout(PIPE, n, w) == training_layout(PIPE, n, w), w


def test_late_window_keeps_the_sink_and_the_key_budget() -> None:
    n = 40
    late = _late_windows(n)
    assert {training_layout(PIPE, n, w).kind for w in late} == {"full", "tail"}
    for w in late:
        full, lay = training_layout(PIPE, n, w), long_layout(PIPE, n, w)
        s, e = full.start, full.end
        first = _oldest_kept(s, e - s + 1)
        assert lay.stream_blocks == (0, *range(first, e + 1)) and lay.sequence_blocks <= 13
        assert (lay.start, lay.end) == (1 + s - first, e - first + 1)
        assert (lay.levels, lay.kind, lay.num_blocks, lay.window) == (full.levels, full.kind, n, w)
        sb = lay.stream_blocks
        back = {
            (sb[p.query_block], p.query_blocks, p.query_position): tuple((sb[b], pos) for b, pos in p.keys)
            for p in lay.passes
        }
        want = {(p.query_block, p.query_blocks, p.query_position): p.keys for p in full.passes}
        # the window's denoise pass, the working cache's and the sink's update passes: the stream's, exactly
        exact = [(s, e - s + 1, full.passes[-1].query_position), (0, 1, 0)]
        exact += [(b, 1, 18) for b in range(s - (6 - (e - s + 1)), s)]
        for q in exact:
            assert back[q] == want[q], q
        # older clean blocks: the stream's keys restricted to the sequence, positions unchanged
        for q, keys in back.items():
            assert [k for k in want[q] if k[0] in sb] == list(keys)
        assert len(back) == lay.start + 1  # one pass per clean block, one for the window


@pytest.mark.parametrize("layers, exact", [(2, True), (3, False)])
def test_window_prediction_against_the_full_sequence(layers: int, exact: bool) -> None:
    mc = replace(get_preset("tiny"), num_layers=layers)
    model = CausalWanModel(mc).init_random(11).eval()
    g = torch.Generator().manual_seed(12)
    text_kv = model.text_kv(torch.randn(1, 6, mc.text_dim, generator=g))
    n = 20
    worst, shortened = 0.0, 0
    for w in _late_windows(n):
        full, lay = training_layout(PIPE, n, w), long_layout(PIPE, n, w)
        shortened += lay.sequence_blocks < full.sequence_blocks
        shape = (1, (full.end + 1) * FPB, mc.in_channels, mc.latent_height, mc.latent_width)
        x = torch.randn(shape, generator=g)
        t = torch.zeros(1, x.shape[1])
        levels = torch.tensor([PIPE.timesteps[lv] for lv in full.levels])
        t[:, full.start * FPB :] = levels.repeat_interleave(FPB)
        idx = torch.tensor([b * FPB + f for b in lay.stream_blocks for f in range(FPB)])
        with torch.no_grad():
            want = training_forward(model, full, PIPE, x, t, text_kv)
            got = training_forward(model, lay, PIPE, x[:, idx], t[:, idx], text_kv)
        diff = float((got - want).abs().max())
        worst = max(worst, diff)
        if exact:  # same keys in the same order: fp32 rounding of a shorter sequence's batched matmuls
            torch.testing.assert_close(got, want, rtol=0, atol=2e-5, msg=f"window {w}")
    assert shortened == 11  # windows 13 .. 23 start after block 8 and drop blocks
    if not exact:  # the dropped keys are really read from the third layer on: 5x the exact case's tolerance
        assert worst > 1e-4


def _clips(n: int, blocks: int) -> LatentClips:
    g = torch.Generator().manual_seed(3)
    return LatentClips(torch.randn(n, blocks * FPB, 16, 8, 8, generator=g), [f"p{i}" for i in range(n)])


def test_make_batch_reads_the_stream_blocks_of_a_late_window() -> None:
    clips = _clips(3, 40)
    cfg = DitTrainConfig(cut_fraction=0.0, context_jitter=0.0)
    lay = long_layout(PipelineConfig(), 40, 30)  # full window: blocks 26..30, clean 0 and 19..25
    assert lay.stream_blocks == (0, *range(19, 31))
    x, t, target, prompts = make_batch(clips, lay, PipelineConfig(), cfg, torch.Generator().manual_seed(0), 4)
    assert x.shape == (4, 13 * FPB, 16, 8, 8) and target.shape == (4, 5 * FPB, 16, 8, 8)
    sig = dict(zip(PIPE.timesteps, PIPE.sigmas))
    for b in range(4):
        j = int(prompts[b][1:])
        for i, sb in enumerate(lay.stream_blocks):
            blk = slice(i * FPB, (i + 1) * FPB)
            want = clips.latents[j, sb * FPB : (sb + 1) * FPB]
            if i < lay.start:
                assert t[b, blk].eq(0).all()
                torch.testing.assert_close(x[b, blk], want, rtol=0, atol=0)
            else:
                k = i - lay.start
                ts = float(t[b, blk][0])
                x0 = x[b, blk] - sig[ts] * target[b, k * FPB : (k + 1) * FPB]
                torch.testing.assert_close(x0, want, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="clips hold 90 latent frames; this window needs 93"):
        make_batch(_clips(2, 30), lay, PipelineConfig(), cfg, torch.Generator().manual_seed(0), 2)


def test_sample_layout_draws_late_windows_at_the_set_rate() -> None:
    cfg = DitTrainConfig(long_blocks=40, long_fraction=0.5)
    g = torch.Generator().manual_seed(0)
    lays = [sample_layout(PIPE, cfg, g) for _ in range(400)]
    late = [lay for lay in lays if lay.num_blocks == 40]  # short streams have at most 13 blocks
    assert 160 <= len(late) <= 240  # Binomial(400, 0.5): +-4 sigma
    for lay in late:
        assert lay.blocks and lay.stream_blocks[-1] <= 39  # laid out short, inside the long stream
    starts = {lay.stream_blocks[lay.start] for lay in late}
    assert min(starts) == 9 and max(starts) == 39  # the first late window and the last tail window
    assert {lay.kind for lay in late} == {"full", "tail"}


def test_without_late_windows_the_draws_replay() -> None:
    """long_fraction = 0 spends no draw: the sampled windows and the generator state are a function of the
    other settings only (runs made before the option replay bit for bit)."""
    a, b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for _ in range(50):
        la = sample_layout(PIPE, DitTrainConfig(long_fraction=0.0), a)
        lb = sample_layout(PIPE, DitTrainConfig(long_blocks=40, long_fraction=0.0), b)
        assert la == lb and not la.blocks
    assert torch.equal(a.get_state(), b.get_state())


def test_config_refuses_bad_late_settings() -> None:
    with pytest.raises(ValueError, match="long_fraction must be in"):
        DitTrainConfig(long_fraction=1.5, long_blocks=40)
    with pytest.raises(ValueError, match="long_blocks must exceed max_clean_blocks"):
        DitTrainConfig(long_fraction=0.5, long_blocks=9)
    assert DitTrainConfig(long_blocks=40, long_fraction=0.5).clip_blocks(5) == 40
    assert DitTrainConfig(long_blocks=40, long_fraction=0.0).clip_blocks(5) == 13


@pytest.mark.parametrize("restart", [False, True])
def test_a_cut_takes_the_context_elsewhere_and_the_window_from_its_clip(restart: bool) -> None:
    """Every sample a cut (cut_fraction 1): the clean blocks are another clip's (same stream blocks); the
    window is the prompt's clip at its stream blocks, or with ``cut_restart`` at the clip's first blocks."""
    clips = _clips(3, 40)
    cfg = DitTrainConfig(cut_fraction=1.0, context_jitter=0.0, cut_restart=restart, cut_inflight=False)
    lay = long_layout(PipelineConfig(), 40, 30)
    x, t, target, prompts = make_batch(clips, lay, PipelineConfig(), cfg, torch.Generator().manual_seed(1), 6)
    sig = dict(zip(PIPE.timesteps, PIPE.sigmas))
    sb = lay.stream_blocks
    for b in range(6):
        j = int(prompts[b][1:])
        ctx = x[b, : lay.start * FPB]
        own = clips.latents[j, [f for blk in sb[: lay.start] for f in range(blk * FPB, (blk + 1) * FPB)]]
        assert not torch.equal(ctx, own)  # another clip's context
        for k in range(lay.end - lay.start + 1):
            i = lay.start + k
            blk = slice(i * FPB, (i + 1) * FPB)
            src = k if restart else sb[i]
            x0 = x[b, blk] - sig[float(t[b, blk][0])] * target[b, k * FPB : (k + 1) * FPB]
            torch.testing.assert_close(x0, clips.latents[j, src * FPB : (src + 1) * FPB], rtol=0, atol=1e-5)


def test_a_cut_inside_the_window_keeps_the_in_flight_blocks() -> None:
    """cut_inflight + cut_restart: the window's oldest k blocks are the context clip's at their stream blocks
    (they entered before the switch), the rest the prompt's clip from its first block; k varies."""
    clips = _clips(4, 40)
    cfg = DitTrainConfig(cut_fraction=1.0, context_jitter=0.0, cut_restart=True, cut_inflight=True)
    lay = long_layout(PipelineConfig(), 40, 30)
    x, t, target, prompts = make_batch(
        clips, lay, PipelineConfig(), cfg, torch.Generator().manual_seed(2), 16
    )
    sig = dict(zip(PIPE.timesteps, PIPE.sigmas))
    sb = lay.stream_blocks
    ctx_frames = [f for blk in sb[: lay.start] for f in range(blk * FPB, (blk + 1) * FPB)]
    ks = set()
    for b in range(16):
        j = int(prompts[b][1:])
        src = [c for c in range(4) if torch.equal(x[b, : lay.start * FPB], clips.latents[c, ctx_frames])]
        assert len(src) == 1 and src[0] != j
        k = 0
        for i in range(lay.end - lay.start + 1):
            blk = slice((lay.start + i) * FPB, (lay.start + i + 1) * FPB)
            x0 = x[b, blk] - sig[float(t[b, blk][0])] * target[b, i * FPB : (i + 1) * FPB]
            old = clips.latents[src[0], sb[lay.start + i] * FPB : (sb[lay.start + i] + 1) * FPB]
            if i == k and torch.allclose(x0, old, rtol=0, atol=1e-5):
                k += 1
                continue
            new = clips.latents[j, (i - k) * FPB : (i - k + 1) * FPB]
            torch.testing.assert_close(x0, new, rtol=0, atol=1e-5)
        ks.add(k)
    assert len(ks) >= 3 and 0 in ks
