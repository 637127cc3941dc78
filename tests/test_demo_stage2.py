"""Stage 2 of the demo DiT's training (rolling_forcing/demo/train_stage2.py): the rollout inputs are the
stream's (a block at level L re-noised from the model's own prediction at level L - 1) and the target
maps them back to the clip's true latent; the stage is seeded, leaves its start weights alone and draws
the same batches whatever the rollout fraction."""

from __future__ import annotations

import copy

import pytest
import torch

import rolling_forcing.demo.train_stage2 as tr
from rolling_forcing.config import PipelineConfig, get_preset
from rolling_forcing.demo.text_encoder import DemoTextEncoder
from rolling_forcing.demo.train_attention import training_layout
from rolling_forcing.demo.train_dit import DitTrainConfig, DitTrainResult, LatentClips, make_batch, new_models
from rolling_forcing.demo.train_stage2 import Stage2Config, rollout_batch, train_stage2

PIPE = PipelineConfig()


def _clips(n: int, frames: int) -> LatentClips:
    g = torch.Generator().manual_seed(3)
    prompts = ["a red circle bouncing on a gray background", "a blue square bouncing on a navy background"]
    return LatentClips(torch.randn(n, frames, 16, 8, 8, generator=g), [prompts[i % 2] for i in range(n)])


def _batch(window: int):
    clips = _clips(4, 24)
    lay = training_layout(PIPE, 8, window)
    cfg = DitTrainConfig(cut_fraction=0.0, context_jitter=0.0)
    x, t, target, _ = make_batch(clips, lay, PIPE, cfg, torch.Generator().manual_seed(0), 2)
    x0 = clips.latents[:, : (lay.end + 1) * 3]  # any clip: compared below per block via x - sigma * target
    return lay, x, t, target, x0


@pytest.mark.parametrize("window", [2, 4, 6])  # warm-up (3 blocks), full, full with clean context
def test_rollout_inputs_with_an_oracle_are_stage_one_inputs(window: int, monkeypatch) -> None:
    """With a model that predicts every x0 exactly, a rollout input is the true latent re-noised at its
    level: ``x_new = (1 - sigma) x0 + sigma eps'`` with fresh ``eps'``; the target maps it back to ``x0``.
    With a model that predicts x0 = its input, the input carries that (noisier) prediction instead."""
    lay, x, t, target, _ = _batch(window)
    fpb, s = PIPE.frames_per_block, lay.start
    sig = PIPE.sigmas
    x0 = torch.cat(
        [x[:, (s + i) * fpb : (s + i + 1) * fpb] - sig[lv] * target[:, i * fpb : (i + 1) * fpb]
         for i, lv in enumerate(lay.levels)], dim=1,
    )  # fmt: skip
    seen = {}

    def oracle(model, layout, pipe_cfg, x_prev, t_prev, kv):
        seen["t"] = t_prev.clone()
        out = torch.zeros_like(target)
        for i, lv in enumerate(layout.levels):
            lo, hi, w = (s + i) * fpb, (s + i + 1) * fpb, slice(i * fpb, (i + 1) * fpb)
            sg = float(t_prev[0, lo]) / 1000.0
            if lv > 0:
                out[:, w] = (x_prev[:, lo:hi] - x0[:, w]) / sg  # flow whose x0 is the truth
        return out

    monkeypatch.setattr(tr, "training_forward", oracle)
    xn, tn = rollout_batch(None, lay, PIPE, x, t, target, [], torch.Generator().manual_seed(5))
    for i, lv in enumerate(lay.levels):
        lo, hi, w = (s + i) * fpb, (s + i + 1) * fpb, slice(i * fpb, (i + 1) * fpb)
        if lv == 0:
            assert torch.equal(xn[:, lo:hi], x[:, lo:hi]) and torch.equal(tn[:, w], target[:, w])
            continue
        assert float(seen["t"][0, lo]) == pytest.approx(PIPE.timesteps[lv - 1])  # one level back
        torch.testing.assert_close(xn[:, lo:hi] - sig[lv] * tn[:, w], x0[:, w], rtol=0, atol=1e-5)
        eps = (xn[:, lo:hi] - (1 - sig[lv]) * x0[:, w]) / sig[lv]
        assert not torch.allclose(xn[:, lo:hi], x[:, lo:hi])  # fresh noise
        assert abs(float(eps.mean())) < 0.1 and abs(float(eps.std()) - 1) < 0.1
    torch.testing.assert_close(xn[:, : s * fpb], x[:, : s * fpb], rtol=0, atol=0)  # clean context kept
    if any(lv > 0 for lv in lay.levels):
        monkeypatch.setattr(tr, "training_forward", lambda m, la, p, xp, tp, kv: torch.zeros_like(target))
        xs, ts = rollout_batch(None, lay, PIPE, x, t, target, [], torch.Generator().manual_seed(5))
        assert not torch.allclose(xs, xn)  # the input depends on the model's prediction
        for i, lv in enumerate(lay.levels):  # ... and the target still leads to the clip's true latent
            lo, hi, w = (s + i) * fpb, (s + i + 1) * fpb, slice(i * fpb, (i + 1) * fpb)
            torch.testing.assert_close(xs[:, lo:hi] - sig[lv] * ts[:, w], x0[:, w], rtol=0, atol=1e-5)


def test_train_stage2_is_seeded_and_keeps_its_start() -> None:
    mc = get_preset("demo")
    cfg = DitTrainConfig(batch=2, max_clean_blocks=2)
    model, text = new_models(mc, cfg)
    with torch.no_grad():
        model.head.head.weight.normal_(0, 0.02)  # a non-zero start, so the rollout forward matters
    start = DitTrainResult(model, text)
    before = copy.deepcopy(model.state_dict())
    clips = _clips(4, 21)
    rcfg = Stage2Config(steps=3, warmup_steps=1, rollout_fraction=1.0)
    a = train_stage2(start, clips, mc, PIPE, cfg, rcfg, progress=False)
    b = train_stage2(start, clips, mc, PIPE, cfg, rcfg, progress=False)
    assert len(a.losses) == 3 and all(torch.isfinite(torch.tensor(a.losses)))
    assert a.losses == b.losses
    for k, v in a.model.state_dict().items():
        assert torch.equal(v, b.model.state_dict()[k])
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert any(not torch.equal(v, before[k]) for k, v in a.model.state_dict().items())
    assert isinstance(a.text_encoder, DemoTextEncoder)
    plain = train_stage2(start, clips, mc, PIPE, cfg, Stage2Config(steps=3, warmup_steps=1), progress=False)
    assert plain.losses[0] != a.losses[0]  # same first batch, exact vs rollout inputs
    assert train_stage2(start, clips, mc, PIPE, cfg, Stage2Config(steps=0)) is start


@pytest.mark.parametrize("bad", [dict(steps=-1), dict(lr=0.0), dict(rollout_fraction=1.5)])
def test_rollout_config_rejects_bad_values(bad: dict) -> None:
    with pytest.raises(ValueError, match="Stage2Config"):
        Stage2Config(**bad)


def test_stage2_from_saved_weights_equals_stage2_in_memory(tmp_path) -> None:
    """``train_demo`` runs stage 2 on stage 1's in-memory EMA weights; the shipped stage 2 ran on the
    shipped stage-1 files. Both give the same bits (so a retrain reproduces the shipped weights when
    stage 1 does): stage 1 at smoke scale, saved and reloaded with ``load_demo``, then stage 2 from each."""
    from rolling_forcing.demo import load_demo
    from rolling_forcing.demo.train_dit import save_dit, train_dit

    mc = get_preset("demo")
    cfg = DitTrainConfig(steps=2, batch=2, warmup_steps=1, max_clean_blocks=2)
    clips = _clips(4, 21)
    res1 = train_dit(clips, mc, PIPE, cfg, progress=False)
    save_dit(res1, tmp_path)
    loaded = load_demo(tmp_path, with_decoder=False)
    s2 = Stage2Config(steps=2, warmup_steps=1)
    a = train_stage2(res1, clips, mc, PIPE, cfg, s2, progress=False)
    b = train_stage2(
        DitTrainResult(loaded.model, loaded.text_encoder), clips, mc, PIPE, cfg, s2, progress=False
    )
    assert a.losses == b.losses
    for mine, theirs in ((a.model, b.model), (a.text_encoder, b.text_encoder)):
        sd = theirs.state_dict()
        assert all(torch.equal(v, sd[k]) for k, v in mine.state_dict().items())
