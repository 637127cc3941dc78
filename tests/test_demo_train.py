"""The demo DiT's training forward reproduces the stream's attention; the training loop learns.

The central check: for every window of a stream (warm-up, full, tail; clean context up to 8 blocks, so
the update passes that drop the sink are included), the training forward's prediction of the window
equals the real pipeline's prediction (``RollingForcingPipeline``, two-pass, relative positions) for
the same window input given the same clean blocks.
"""

from __future__ import annotations

import math

import pytest
import torch

from nki_kernels import ops
from rolling_forcing import schedule
from rolling_forcing.config import PipelineConfig, get_preset
from rolling_forcing.demo.train_attention import rope_pairs, training_forward, training_layout
from rolling_forcing.demo.train_dit import DitTrainConfig, LatentClips, make_batch, train_dit
from rolling_forcing.model import CausalWanModel
from rolling_forcing.pipeline import RollingForcingPipeline

PIPE = PipelineConfig(positions="relative")


def test_layout_key_sets_follow_the_stream() -> None:
    """Rules of schedule.py's docstring, re-derived: update pass of b = blocks max(0, b-6)..b at 3*(b'-first);
    denoise pass = sink at 0, working cache, window, consecutive positions."""
    n = 12
    for w in range(schedule.num_windows(PIPE, n)):
        lay = training_layout(PIPE, n, w)
        s, e = schedule.window_range(PIPE, n, w)
        assert (lay.start, lay.end) == (s, e) and len(lay.passes) == s + 1
        for b, p in enumerate(lay.passes[:-1]):
            first = max(0, b - 6)
            assert (p.query_block, p.query_blocks, p.query_position) == (b, 1, 3 * (b - first))
            assert p.keys == tuple((k, 3 * (k - first)) for k in range(first, b + 1))
        win = lay.passes[-1]
        n_win = e - s + 1
        if s == 0:
            want = [(k, 3 * k) for k in range(n_win)]
        else:
            working = list(range(max(1, s - (7 - n_win - 1)), s))
            want = [(0, 0)] + [(k, 3 * (1 + i)) for i, k in enumerate(working)]
            want += [(s + i, 3 * (1 + len(working) + i)) for i in range(n_win)]
        assert list(win.keys) == want
        assert win.query_position == (want[-n_win][1] if n_win else 0)


def test_rope_pairs_is_the_reference_rotation() -> None:
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3 * 16, 4, 32, generator=g), torch.randn(2, 3 * 16, 4, 32, generator=g)
    cos, sin = ops.rope_tables((3, 4, 4), 32, 5, dtype=torch.float64)
    qr, kr = ops.rope3d_tables(q, k, cos, sin, backend="reference")
    torch.testing.assert_close(rope_pairs(q, cos.float(), sin.float()), qr, rtol=0, atol=2e-6)
    torch.testing.assert_close(rope_pairs(k, cos.float(), sin.float()), kr, rtol=0, atol=2e-6)


def test_attention_op_backward_is_the_softmax_gradient() -> None:
    """ops.attention's registered backward against autograd of an independent float64 softmax attention."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 5, 3, 8, generator=g) for _ in range(3))
    w_out, w_lse = torch.randn(2, 5, 3, 8, generator=g), torch.randn(2, 5, 3, generator=g)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = ops.attention(*leaves, return_lse=True)
    ((out * w_out).sum() + (lse * w_lse).sum()).backward()
    ref = [t.double().requires_grad_(True) for t in (q, k, v)]
    s = torch.einsum("bqhd,bkhd->bhqk", ref[0], ref[1]) / math.sqrt(8)
    o = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), ref[2])
    ((o * w_out.double()).sum() + (torch.logsumexp(s, -1).transpose(1, 2) * w_lse.double()).sum()).backward()
    for got, want in zip(leaves, ref):  # fp32 forward recomputation vs float64: fp32 rounding only
        assert got.grad is not None and want.grad is not None
        torch.testing.assert_close(got.grad, want.grad.float(), rtol=1e-5, atol=1e-5)


def test_training_forward_equals_the_pipeline() -> None:
    mc = get_preset("tiny")
    model = CausalWanModel(mc).init_random(3).eval()
    text = torch.randn(1, 6, mc.text_dim, generator=torch.Generator().manual_seed(4))
    n = 9
    denoise_calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    forward = model.forward_with

    def recording(x, t, tkv, fn, **kw):  # type: ignore[no-untyped-def]
        out = forward(x, t, tkv, fn, **kw)
        if kw.get("context_frames", 0) == 0:
            denoise_calls.append((x.clone(), t.clone(), out.clone()))
        return out

    model.forward_with = recording  # type: ignore[method-assign]
    pipe = RollingForcingPipeline(model, mc, PIPE, merged=False, backend="reference")
    chunks = [c.latents for c in pipe.stream(text, n, generator=torch.Generator().manual_seed(5))]
    del model.forward_with
    assert len(denoise_calls) == schedule.num_windows(PIPE, n) and len(chunks) == n
    text_kv = model.text_kv(text)
    kinds = set()
    for w, (x_win, t_win, want) in enumerate(denoise_calls):
        lay = training_layout(PIPE, n, w)
        kinds.add(lay.kind)
        s = lay.start
        x = torch.cat([*chunks[:s], x_win], dim=1)
        t = torch.cat([torch.zeros(1, 3 * s), t_win], dim=1)
        with torch.no_grad():
            got = training_forward(model, lay, PIPE, x, t, text_kv)
        # different summation orders (LSE-merged partials vs one softmax, fp32 vs fp64 RoPE factors):
        # fp32 rounding, observed <= 2.2e-6 on outputs of magnitude ~5
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5, msg=f"window {w} ({lay.kind}, s={s})")
    assert kinds == {"warmup", "full", "tail"}


def _clips(n: int, frames: int) -> LatentClips:
    g = torch.Generator().manual_seed(7)
    prompts = ["a red circle bouncing on a gray background", "a blue square bouncing on a navy background"]
    return LatentClips(torch.randn(n, frames, 16, 8, 8, generator=g), [prompts[i % 2] for i in range(n)])


def test_make_batch_noises_each_block_at_its_level() -> None:
    clips = _clips(3, 21)
    cfg = DitTrainConfig(cut_fraction=0.0, context_jitter=0.0)
    lay = training_layout(PipelineConfig(), 7, 6)  # full window: blocks 2..6, clean 0..1
    x, t, target, prompts = make_batch(clips, lay, PipelineConfig(), cfg, torch.Generator().manual_seed(0), 4)
    sig = dict(zip(PipelineConfig().timesteps, PipelineConfig().sigmas))
    assert x.shape == (4, 21, 16, 8, 8) and target.shape == (4, 15, 16, 8, 8) and len(prompts) == 4
    assert t[:, :6].eq(0).all()
    for i, level in enumerate(lay.levels):
        ts = PipelineConfig().timesteps[level]
        blk = slice(6 + 3 * i, 9 + 3 * i)
        assert t[:, blk].eq(ts).all()
        x0 = x[:, blk] - sig[ts] * target[:, 3 * i : 3 * i + 3]  # x_t = x0 + sigma (eps - x0)
        clean = x[:, :6]  # no jitter, no cut: the clip's own first blocks tell which clip a sample is
        match = [
            int(torch.argmin((clips.latents[:, :6] - clean[b]).abs().flatten(1).sum(1))) for b in range(4)
        ]
        assert [clips.prompts[j] for j in match] == prompts
        torch.testing.assert_close(x0, clips.latents[match][:, blk], rtol=0, atol=1e-5)


def test_smoke_training_loss_falls_on_a_fixed_batch() -> None:
    torch.manual_seed(0)
    cfg = DitTrainConfig(steps=12, batch=2, warmup_steps=1, lr=2e-3, max_clean_blocks=1, tail_fraction=0.0)
    res = train_dit(
        _clips(4, 18), get_preset("demo"), PipelineConfig(), cfg, progress=False, fixed_batch=True
    )
    assert len(res.losses) == 12 and all(math.isfinite(v) for v in res.losses)
    assert sum(res.losses[-3:]) / 3 < 0.8 * sum(res.losses[:3]) / 3, res.losses


@pytest.mark.parametrize("bad", [dict(steps=0), dict(cut_fraction=1.5), dict(lr=0.0)])
def test_train_config_rejects_bad_values(bad: dict) -> None:
    with pytest.raises(ValueError, match="DitTrainConfig"):
        DitTrainConfig(**bad)
