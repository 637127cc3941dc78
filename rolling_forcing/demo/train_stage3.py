"""Stage 3 of the demo DiT: regression on the stream's own denoising chain (an experiment, not run by
``train-demo``; docs/demo_model.md, "Where the stream loses its objects").

Why: stages 1-2 noise every window block from the *true* latent at its level (teacher forcing). The
stream never sees such inputs: a block enters its window as pure noise, and at each later level its input
is the model's own x0 prediction of the previous level re-noised with fresh noise. ``python -m
perf.demo_chain`` on the shipped weights (three prompts, 14 blocks, true clean context both times): with
true-latent inputs the final level's x0 decodes to the prompt's objects in 38 / 100 / 94 % of frames; with
the chain's own inputs in 19 / 64 / 4 %, and the x0 error does not fall down the chain (0.39 -> 0.51 mean
squared, normalised latents, first prompt). The stream's misses come from the chain, not the context.

So a stage-3 sample is a window of a *chain rollout* (:func:`chain_rollout`): for a batch of clips, every
window of a ``max_clean_blocks + window_blocks``-block stream runs in order, without gradient, each block
entering as pure noise and re-noised from the model's own x0 at each next level, exactly as
:class:`rolling_forcing.pipeline.RollingForcingPipeline` does in ``positions="relative"`` mode
(``tests/test_demo_stage3.py`` reproduces the pipeline's every window from its own noise). The clean
context is the clip's true latents with stage 1's Gaussian jitter (or, with probability
``own_context_fraction``, the rollout's own outputs). Because a procedural prompt names one video
(``rolling_forcing.procedural.prompt_layout``) the true latent is a valid target for whatever input the
chain produced: the loss is the flow MSE against ``(x_t - x0_true) / sigma`` (the flow whose
``flow_to_x0`` is the true x0). This is Self-Forcing's idea (train on the model's own rollout,
https://arxiv.org/abs/2506.08009) with a regression target in place of a distilled teacher.

Measured: it does not help. A regression target on inputs that carry no object makes every level predict
the context-only mean (600 steps: presence 12 / 15 / 4 %, objects fade); the docs list the variants tried.
Each rollout feeds ``windows_per_rollout`` gradient steps on distinct windows of it (the rollout costs
about as much as three gradient steps). A warm restart from ``start``'s weights (fresh AdamW, EMA starting
from those weights). Seeded from ``seed + 2``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rolling_forcing import schedule
from rolling_forcing.config import ModelConfig, PipelineConfig
from rolling_forcing.demo.train_attention import TrainLayout, training_forward, training_layout
from rolling_forcing.demo.train_dit import (
    DitTrainConfig,
    DitTrainResult,
    LatentClips,
    optimizer_step,
    warm_restart,
    warmup_cosine_lr,
)
from rolling_forcing.model import CausalWanModel, TextKV, add_noise

__all__ = [
    "ChainWindow",
    "NoiseFn",
    "Stage3Config",
    "chain_rollout",
    "chain_target",
    "train_stage3",
    "window_x0",
]

NoiseFn = Callable[[int, int, tuple[int, ...]], torch.Tensor]
"""``noise(block, level, shape) -> eps``: the noise a block's input is drawn with at a level."""


@dataclass(frozen=True)
class Stage3Config:
    """Hyper-parameters of :func:`train_stage3` (defaults: the measured 600-step run of docs/demo_model.md;
    ``steps=0`` skips the stage).
    Batch, stream length (``max_clean_blocks``), jitter, weight decay, grad clip and EMA decay are stage
    1's (:class:`DitTrainConfig`)."""

    steps: int = 600
    lr: float = 3e-4
    warmup_steps: int = 50
    windows_per_rollout: int = 6
    tail_fraction: float = 0.2
    own_context_fraction: float = 0.0

    def __post_init__(self) -> None:
        for name, lo in (("steps", 0), ("warmup_steps", 0), ("windows_per_rollout", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"Stage3Config.{name} must be an int >= {lo}, got {v!r}")
        if not self.lr > 0:
            raise ValueError(f"Stage3Config.lr must be > 0, got {self.lr}")
        for name in ("tail_fraction", "own_context_fraction"):
            if not 0.0 <= float(getattr(self, name)) <= 1.0:
                raise ValueError(f"Stage3Config.{name} must be in [0, 1], got {getattr(self, name)}")


@dataclass(frozen=True)
class ChainWindow:
    """One window of a chain rollout: its layout, the sequence ``x`` ``[B, (e+1)*fpb, C, H, W]`` (clean
    context then the window's chain inputs) and timesteps ``t`` ``[B, (e+1)*fpb]`` (0 on the context), as
    :func:`rolling_forcing.demo.train_attention.training_forward` takes them, and the model's x0 of the
    window's blocks ``[B, (e-s+1)*fpb, C, H, W]`` from that forward (:func:`window_x0`)."""

    layout: TrainLayout
    x: torch.Tensor
    t: torch.Tensor
    x0: torch.Tensor


def window_x0(
    layout: TrainLayout, x: torch.Tensor, flow: torch.Tensor, pipe_cfg: PipelineConfig
) -> torch.Tensor:
    """The x0 of a window's blocks ``[B, (e-s+1)*fpb, C, H, W]`` from its input sequence ``x`` ``[B,
    (e+1)*fpb, C, H, W]`` and the forward's flow ``[B, (e-s+1)*fpb, C, H, W]``: ``x_t - sigma * flow`` per
    block at its level's sigma."""
    fpb = pipe_cfg.frames_per_block
    return torch.cat(
        [
            x[:, (layout.start + i) * fpb : (layout.start + i + 1) * fpb]
            - pipe_cfg.sigmas[level] * flow[:, i * fpb : (i + 1) * fpb]
            for i, level in enumerate(layout.levels)
        ],
        dim=1,
    )


@torch.no_grad()
def chain_rollout(
    model: CausalWanModel,
    text_kv: TextKV,
    context: torch.Tensor,
    pipe_cfg: PipelineConfig,
    num_blocks: int,
    noise: NoiseFn,
    *,
    own_context: bool = False,
) -> tuple[list[ChainWindow], torch.Tensor]:
    """Run every window of a ``num_blocks``-block relative-position stream in order (module docstring).

    Args:
        model: the DiT (used without gradient).
        text_kv: ``model.text_kv(embeddings)`` of the batch's prompts.
        context: float32 ``[B, num_blocks * fpb, C, H, W]``: the clean latents the context blocks hold
            (ignored for blocks the rollout produced itself when ``own_context``).
        noise: the noise of each block's input at each level (level 0: the input itself).
        own_context: the clean context is the rollout's own outputs (the stream), not ``context``.

    Returns:
        ``(windows, outputs)``: the :class:`ChainWindow` of every window in stream order and the rollout's
        final x0 of every block ``[B, num_blocks * fpb, C, H, W]`` (the stream's chunks).
    """
    fpb = pipe_cfg.frames_per_block
    if context.dim() != 5 or context.shape[1] != num_blocks * fpb:
        raise ValueError(
            f"context must be [B, {num_blocks * fpb}, C, H, W] ({num_blocks} blocks of {fpb} frames), got "
            f"{tuple(context.shape)}"
        )
    table = pipe_cfg.scheduler_table()
    ts = pipe_cfg.timesteps
    last = len(ts) - 1
    clean = context.clone()
    outputs = torch.zeros_like(context)
    prev: dict[int, torch.Tensor] = {}  # block -> its x0 at its previous level
    windows: list[ChainWindow] = []
    for w in range(schedule.num_windows(pipe_cfg, num_blocks)):
        lay = training_layout(pipe_cfg, num_blocks, w)
        s, e = lay.start, lay.end
        x = clean[:, : (e + 1) * fpb].clone()
        t = torch.zeros(context.shape[0], (e + 1) * fpb)
        for i, level in enumerate(lay.levels):
            b = s + i
            blk = slice(b * fpb, (b + 1) * fpb)
            eps = noise(b, level, tuple(x[:, blk].shape))
            x[:, blk] = eps if level == 0 else add_noise(prev[b], eps, ts[level], table)
            t[:, blk] = ts[level]
        x0 = window_x0(lay, x, training_forward(model, lay, pipe_cfg, x, t, text_kv), pipe_cfg)
        windows.append(ChainWindow(lay, x, t, x0))
        for i, level in enumerate(lay.levels):
            b = s + i
            blk = slice(b * fpb, (b + 1) * fpb)
            prev[b] = x0[:, i * fpb : (i + 1) * fpb]
            if level == last:
                outputs[:, blk] = prev[b]
                if own_context:
                    clean[:, blk] = prev[b]
    return windows, outputs


def chain_target(window: ChainWindow, truth: torch.Tensor, pipe_cfg: PipelineConfig) -> torch.Tensor:
    """The flow target of a chain window's blocks ``[B, (e-s+1)*fpb, C, H, W]``: ``(x_t - x0) / sigma`` per
    block at its level, so that ``x_t - sigma * target`` (what ``flow_to_x0`` computes) is ``truth``'s
    latent of that block. ``truth``: ``[B, >= (e+1)*fpb, C, H, W]``."""
    fpb = pipe_cfg.frames_per_block
    lay = window.layout
    lo = lay.start * fpb
    sigma = torch.tensor([pipe_cfg.sigmas[lv] for lv in lay.levels]).repeat_interleave(fpb)
    x0 = truth[:, lo : (lay.end + 1) * fpb]
    return (window.x[:, lo:] - x0) / sigma[None, :, None, None, None]


def _pick_windows(
    pipe_cfg: PipelineConfig, num_blocks: int, rcfg: Stage3Config, gen: torch.Generator
) -> list[int]:
    """``windows_per_rollout`` distinct windows: warm-up and full ones uniformly; with probability
    ``tail_fraction`` the last pick is a tail window instead."""
    n_tail = pipe_cfg.window_blocks - 1
    n_main = schedule.num_windows(pipe_cfg, num_blocks) - n_tail
    k = min(rcfg.windows_per_rollout, n_main)
    picks = torch.randperm(n_main, generator=gen)[:k].tolist()
    if n_tail and float(torch.rand((), generator=gen)) < rcfg.tail_fraction:
        picks[-1] = n_main + int(torch.randint(0, n_tail, (), generator=gen))
    return picks


def train_stage3(
    start: DitTrainResult,
    clips: LatentClips,
    model_cfg: ModelConfig,
    pipe_cfg: PipelineConfig,
    tcfg: DitTrainConfig | None = None,
    rcfg: Stage3Config | None = None,
    *,
    progress: bool = True,
    on_step: Callable[[int, float], None] | None = None,
) -> DitTrainResult:
    """Stage 3 from ``start``'s weights (not modified; module docstring); returns the new EMA weights and
    stage 3's losses (``start`` itself when ``rcfg.steps == 0``). ``clips``: stage 1's latent clips
    (``[N, >= (max_clean_blocks + window_blocks) * fpb, C, H, W]``). Runs on the current torch thread
    setting."""
    from tqdm import tqdm

    tcfg = tcfg if tcfg is not None else DitTrainConfig()
    rcfg = rcfg if rcfg is not None else Stage3Config()
    if rcfg.steps == 0:
        return start
    fpb = pipe_cfg.frames_per_block
    num_blocks = tcfg.max_clean_blocks + pipe_cfg.window_blocks
    if clips.latents.shape[1] < num_blocks * fpb:
        raise ValueError(
            f"clips hold {clips.latents.shape[1]} latent frames; stage 3 needs {num_blocks * fpb}"
        )
    model, text, ema_m, ema_t, params, ema_params, opt = warm_restart(start, rcfg.lr, tcfg.weight_decay)
    gen = torch.Generator().manual_seed(tcfg.seed + 2)

    def draw(block: int, level: int, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=gen)

    losses: list[float] = []
    t0 = time.perf_counter()
    bar = tqdm(total=rcfg.steps, desc="dit stage 3", disable=not progress, dynamic_ncols=True)
    while len(losses) < rcfg.steps:
        idx = torch.randint(0, clips.latents.shape[0], (tcfg.batch,), generator=gen)
        prompts = [clips.prompts[int(i)] for i in idx]
        truth = clips.latents[idx, : num_blocks * fpb]
        jitter = torch.rand(tcfg.batch, 1, 1, 1, 1, generator=gen) * tcfg.context_jitter
        context = truth + jitter * torch.randn(truth.shape, generator=gen)
        own = float(torch.rand((), generator=gen)) < rcfg.own_context_fraction
        with torch.no_grad():
            kv = model.text_kv(text(text.tokenize(prompts)))
        windows, _ = chain_rollout(model, kv, context, pipe_cfg, num_blocks, draw, own_context=own)
        for w in _pick_windows(pipe_cfg, num_blocks, rcfg, gen):
            if len(losses) >= rcfg.steps:
                break
            step, win = len(losses), windows[w]
            for g in opt.param_groups:
                g["lr"] = warmup_cosine_lr(step, rcfg.lr, rcfg.warmup_steps, rcfg.steps)
            text_kv = model.text_kv(text(text.tokenize(prompts)))
            flow = training_forward(model, win.layout, pipe_cfg, win.x, win.t, text_kv)
            loss = F.mse_loss(flow, chain_target(win, truth, pipe_cfg))
            losses.append(optimizer_step(loss, opt, params, ema_params, tcfg.grad_clip, tcfg.ema))
            if on_step is not None:
                on_step(step, losses[-1])
            bar.update(1)
            if progress and step % 10 == 0:
                bar.set_postfix(loss=f"{sum(losses[-50:]) / len(losses[-50:]):.4f}")
    bar.close()
    return DitTrainResult(ema_m, ema_t, losses, time.perf_counter() - t0)
