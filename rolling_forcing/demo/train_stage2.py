"""Stage 2 of the demo DiT's training: a warm restart, optionally on *rollout inputs* (docs/demo_model.md).

Stage 2 continues from stage 1's EMA weights (:mod:`rolling_forcing.demo.train_dit`) with a fresh
optimiser, a short warm-up to a lower peak learning rate and a cosine decay, on the same windows, cuts
and context jitter. With the shipped settings (:class:`Stage2Config`, ``rollout_fraction = 0``) that is
all it is: 1,500 more steps that took the flow loss from 0.457 to 0.42 and the quality bench's chunk
continuity from 1 of 3 prompts to 3 of 3 (measured, docs/demo_model.md).

**Rollout inputs** (``rollout_fraction > 0``; an option, measured worse, off). Stage 1 noises every window
block from the clip's true latent; the stream does not: a block enters level ``L`` re-noised (fresh
noise) from the model's own x0 prediction at level ``L - 1`` in the previous window. A rollout step
trains on that:

1. draw a stage-1 batch (same windows, cuts, context jitter);
2. for every window block at a level ``L > 0``, noise its true latent at level ``L - 1`` instead and let
   the current model predict x0 for the whole window in one no-grad forward (same attention layout);
3. re-noise each of those predictions at level ``L`` with fresh noise, as the pipeline does between
   windows, and train the flow that maps this input back to the *true* latent:
   ``target = (x_in - x0) / sigma_L`` (for ``x0_pred = x0`` this is stage 1's ``eps - x0``).

It is a first-order rollout (one level back, the window's clean context as in stage 1), the cheapest form
of the self-rollout the Self-Forcing / Rolling Forcing papers train with: one extra forward without
gradient per rollout step. Measured on the demo model (1,500 steps): it improves continuity but the
objects drop out more often (presence roughly halves), so the shipped run does not use it.

Everything is seeded from ``seed + 1`` (a separate generator from stage 1's).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rolling_forcing.config import ModelConfig, PipelineConfig
from rolling_forcing.demo.train_attention import TrainLayout, training_forward
from rolling_forcing.demo.train_dit import (
    DitTrainConfig,
    DitTrainResult,
    LatentClips,
    make_batch,
    optimizer_step,
    sample_layout,
    warm_restart,
    warmup_cosine_lr,
)
from rolling_forcing.model import CausalWanModel, TextKV, add_noise

__all__ = ["Stage2Config", "rollout_batch", "train_stage2"]


@dataclass(frozen=True)
class Stage2Config:
    """Hyper-parameters of :func:`train_stage2` (defaults: the shipped run; ``steps=0`` skips the stage).
    Batch, window sampling, cuts, jitter, grad clip and EMA decay are stage 1's (:class:`DitTrainConfig`)."""

    steps: int = 3000
    lr: float = 3e-4
    warmup_steps: int = 50
    rollout_fraction: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 0:
            raise ValueError(f"Stage2Config.steps must be an int >= 0, got {self.steps!r}")
        if not self.lr > 0 or self.warmup_steps < 0:
            raise ValueError(
                f"Stage2Config: need lr > 0 and warmup_steps >= 0, got {self.lr}, {self.warmup_steps}"
            )
        if not 0.0 <= self.rollout_fraction <= 1.0:
            raise ValueError(f"Stage2Config.rollout_fraction must be in [0, 1], got {self.rollout_fraction}")


def rollout_batch(
    model: CausalWanModel,
    layout: TrainLayout,
    pipe_cfg: PipelineConfig,
    x: torch.Tensor,
    t: torch.Tensor,
    target: torch.Tensor,
    text_kv: TextKV,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rollout inputs for a stage-1 batch ``(x, t, target)`` of :func:`make_batch` (noise scale 1): the new
    ``(x, target)`` (module docstring, steps 2-3); ``t`` is unchanged. Blocks at level 0 (pure noise)
    keep their input. ``text_kv`` is used without gradient."""
    fpb = pipe_cfg.frames_per_block
    s = layout.start
    table = pipe_cfg.scheduler_table()
    sig, ts = pipe_cfg.sigmas, pipe_cfg.timesteps
    x_prev, t_prev = x.clone(), t.clone()
    x0 = torch.empty_like(target)
    blocks = []
    for i, level in enumerate(layout.levels):
        lo, hi = (s + i) * fpb, (s + i + 1) * fpb
        w = slice(i * fpb, (i + 1) * fpb)
        x0[:, w] = x[:, lo:hi] - sig[level] * target[:, w]  # the clip's latent (make_batch's add_noise)
        if level > 0:
            eps = torch.randn(x0[:, w].shape, generator=gen)
            x_prev[:, lo:hi] = add_noise(x0[:, w], eps, ts[level - 1], table)
            t_prev[:, lo:hi] = ts[level - 1]
            blocks.append((lo, hi, w, level))
    if not blocks:
        return x, target
    with torch.no_grad():
        kv = [(k.detach(), v.detach()) for k, v in text_kv]
        flow = training_forward(model, layout, pipe_cfg, x_prev, t_prev, kv)
    x_new, tgt = x.clone(), target.clone()
    for lo, hi, w, level in blocks:
        pred = x_prev[:, lo:hi] - sig[level - 1] * flow[:, w]
        eps = torch.randn(pred.shape, generator=gen)
        x_new[:, lo:hi] = add_noise(pred, eps, ts[level], table)
        tgt[:, w] = (x_new[:, lo:hi] - x0[:, w]) / sig[level]
    return x_new, tgt


def train_stage2(
    start: DitTrainResult,
    clips: LatentClips,
    model_cfg: ModelConfig,
    pipe_cfg: PipelineConfig,
    tcfg: DitTrainConfig | None = None,
    rcfg: Stage2Config | None = None,
    *,
    progress: bool = True,
    on_step: Callable[[int, float], None] | None = None,
) -> DitTrainResult:
    """Stage 2 from ``start``'s weights (not modified); returns the new EMA weights and stage 2's losses
    (``start`` itself when ``rcfg.steps == 0``).
    ``tcfg`` / ``rcfg``: default :class:`DitTrainConfig` / :class:`Stage2Config`. Runs on the current
    torch thread setting."""
    from tqdm import tqdm

    tcfg = tcfg if tcfg is not None else DitTrainConfig()
    rcfg = rcfg if rcfg is not None else Stage2Config()
    if rcfg.steps == 0:
        return start
    if tcfg.noise_scale != 1.0:
        raise ValueError(f"train_stage2 needs DitTrainConfig.noise_scale == 1, got {tcfg.noise_scale}")
    model, text, ema_m, ema_t, params, ema_params, opt = warm_restart(start, rcfg.lr, tcfg.weight_decay)
    gen = torch.Generator().manual_seed(tcfg.seed + 1)
    losses: list[float] = []
    t0 = time.perf_counter()
    bar = tqdm(range(rcfg.steps), desc="dit stage 2", disable=not progress, dynamic_ncols=True)
    for step in bar:
        layout = sample_layout(pipe_cfg, tcfg, gen)
        x, t, target, prompts = make_batch(clips, layout, pipe_cfg, tcfg, gen, tcfg.batch)
        for g in opt.param_groups:
            g["lr"] = warmup_cosine_lr(step, rcfg.lr, rcfg.warmup_steps, rcfg.steps)
        emb = text(text.tokenize(prompts))
        text_kv = model.text_kv(emb)
        if float(torch.rand((), generator=gen)) < rcfg.rollout_fraction:
            x, target = rollout_batch(model, layout, pipe_cfg, x, t, target, text_kv, gen)
        flow = training_forward(model, layout, pipe_cfg, x, t, text_kv)
        loss = F.mse_loss(flow, target)
        losses.append(optimizer_step(loss, opt, params, ema_params, tcfg.grad_clip, tcfg.ema))
        if on_step is not None:
            on_step(step, losses[-1])
        if progress and step % 10 == 0:
            bar.set_postfix(loss=f"{sum(losses[-50:]) / len(losses[-50:]):.4f}")
    return DitTrainResult(ema_m, ema_t, losses, time.perf_counter() - t0)
