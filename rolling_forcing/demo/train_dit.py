"""Training of the demo DiT and its text encoder for Rolling Forcing inference (docs/demo_model.md).

Objective: teacher-forced flow matching on the stream's own attention. A sample is one window of a
``max_clean_blocks + window_blocks``-block stream (warm-up, full or tail window, as
:func:`rolling_forcing.schedule.window_plan` defines them) laid out by
:func:`rolling_forcing.demo.train_attention.training_layout`: the clip's clean latent blocks 0..s-1 (with a
small Gaussian jitter, the model's own outputs are never exact) then the window's blocks, each noised as
:func:`rolling_forcing.model.add_noise` does at the timestep of its level (the pipeline's warped
timesteps). The loss is the mean squared error of the predicted flow against ``eps - x0`` on the window
blocks. A fraction of samples is a *cut*: the clean context comes from another clip, the window and the
prompt from this one, so the prompt (not the context) decides the objects after a prompt switch. By default
the window shows this clip at the window's own stream blocks (the new prompt's video as if it had played
from stream start); with ``cut_restart`` it shows the clip's *first* blocks (a switch restarts the new
prompt's video), which does not ask the model for a stream time it cannot see in late windows. With
``cut_inflight`` a cut happens inside the window as in the stream: the window's oldest ``k`` blocks (``k``
uniform in ``0 .. n - 1``; they entered the window before the switch) are the old clip's at their stream
blocks, the rest the new prompt's (from its first block with ``cut_restart``).

Everything is seeded: one ``torch.Generator`` draws the batches and noise, ``torch.manual_seed`` the
initial weights; with a fixed thread count and torch version the run is bitwise reproducible.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from rolling_forcing.config import ModelConfig, PipelineConfig
from rolling_forcing.demo import DIT_FILE, TEXT_FILE, WIDTH_KEYS
from rolling_forcing.demo.text_encoder import DemoTextEncoder
from rolling_forcing.demo.train_attention import TrainLayout, long_layout, training_forward, training_layout
from rolling_forcing.model import CausalWanModel, add_noise

__all__ = [
    "DitTrainConfig",
    "DitTrainResult",
    "LatentClips",
    "make_batch",
    "new_models",
    "optimizer_step",
    "sample_layout",
    "save_dit",
    "train_dit",
    "warm_restart",
    "warmup_cosine_lr",
]


@dataclass(frozen=True)
class DitTrainConfig:
    """Hyper-parameters of :func:`train_dit` (defaults: the shipped run, docs/demo_model.md)."""

    steps: int = 4500
    batch: int = 8
    lr: float = 1e-3
    warmup_steps: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    ema: float = 0.998
    max_clean_blocks: int = 8
    tail_fraction: float = 0.1
    cut_fraction: float = 0.15
    context_jitter: float = 0.1
    noise_scale: float = 1.0
    long_blocks: int = 48
    long_fraction: float = 0.0
    cut_restart: bool = False
    cut_inflight: bool = False
    text_layers: int = 2
    text_heads: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "max_clean_blocks"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"DitTrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("tail_fraction", "cut_fraction", "ema"):
            if not 0.0 <= float(getattr(self, name)) <= 1.0:
                raise ValueError(f"DitTrainConfig.{name} must be in [0, 1], got {getattr(self, name)}")
        if not self.lr > 0 or self.context_jitter < 0 or self.warmup_steps < 0:
            raise ValueError("DitTrainConfig: need lr > 0, context_jitter >= 0, warmup_steps >= 0")
        if not 0.0 < self.noise_scale <= 1.0:
            raise ValueError(f"DitTrainConfig.noise_scale must be in (0, 1], got {self.noise_scale}")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError(f"DitTrainConfig.long_fraction must be in [0, 1], got {self.long_fraction}")
        if self.long_fraction > 0 and self.long_blocks <= self.max_clean_blocks + 1:
            raise ValueError(
                f"DitTrainConfig.long_blocks must exceed max_clean_blocks + 1 = {self.max_clean_blocks + 1} "
                f"when long_fraction > 0 (late windows start after the short stream), got {self.long_blocks}"
            )

    def clip_blocks(self, window_blocks: int) -> int:
        """Blocks a training clip must hold: the short stream's ``max_clean_blocks + window_blocks``, or
        ``long_blocks`` when late windows are drawn (``long_fraction > 0``)."""
        short = self.max_clean_blocks + window_blocks
        return max(short, self.long_blocks) if self.long_fraction > 0 else short


@dataclass
class LatentClips:
    """Normalised latent clips ``[N, F, C, H, W]`` float32 (every clip starts at stream start) and their
    prompts (``N`` strings)."""

    latents: torch.Tensor
    prompts: list[str]

    def __post_init__(self) -> None:
        if self.latents.dim() != 5 or len(self.prompts) != self.latents.shape[0]:
            raise ValueError(
                f"LatentClips: latents must be [N, F, C, H, W] with N = len(prompts) = {len(self.prompts)}, "
                f"got {tuple(self.latents.shape)}"
            )


@dataclass
class DitTrainResult:
    model: CausalWanModel  # EMA weights, eval mode
    text_encoder: DemoTextEncoder  # EMA weights, eval mode
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0


def new_models(model_cfg: ModelConfig, tcfg: DitTrainConfig) -> tuple[CausalWanModel, DemoTextEncoder]:
    """Freshly initialised DiT and text encoder (``torch.manual_seed(tcfg.seed)``; the DiT's output layer
    starts at zero, so the first prediction is a zero flow)."""
    torch.manual_seed(tcfg.seed)
    model = CausalWanModel(model_cfg)
    with torch.no_grad():
        model.head.head.weight.zero_()
        model.head.head.bias.zero_()
    text = DemoTextEncoder(model_cfg.text_len, model_cfg.text_dim, tcfg.text_layers, tcfg.text_heads)
    return model, text


def sample_layout(pipe_cfg: PipelineConfig, tcfg: DitTrainConfig, gen: torch.Generator) -> TrainLayout:
    """A random window: with probability ``long_fraction`` a *late* window of a ``long_blocks``-block
    stream (start block after ``max_clean_blocks``, tail windows included, as :func:`long_layout`: the
    sink, the working cache and the blocks its update passes read, the window); else with probability
    ``tail_fraction`` a tail window of a stream of random length, else any window of a
    ``max_clean_blocks + window_blocks``-block stream up to its last full window (warm-up windows
    included; s uniform over ``0 .. max_clean_blocks`` for the full ones). No draw is spent on the late
    choice when ``long_fraction == 0`` (runs without it replay bit for bit)."""
    wb = pipe_cfg.window_blocks
    n_max = tcfg.max_clean_blocks + wb
    if tcfg.long_fraction > 0 and float(torch.rand((), generator=gen)) < tcfg.long_fraction:
        first = n_max  # window n_max starts at block max_clean_blocks + 1
        w = int(torch.randint(first, tcfg.long_blocks + wb - 1, (), generator=gen))
        return long_layout(pipe_cfg, tcfg.long_blocks, w)
    if float(torch.rand((), generator=gen)) < tcfg.tail_fraction:
        n = int(torch.randint(wb, n_max + 1, (), generator=gen))
        w = int(torch.randint(n, n + wb - 1, (), generator=gen))
        return training_layout(pipe_cfg, n, w)
    w = int(torch.randint(0, n_max, (), generator=gen))
    return training_layout(pipe_cfg, n_max, w)


def make_batch(
    clips: LatentClips,
    layout: TrainLayout,
    pipe_cfg: PipelineConfig,
    tcfg: DitTrainConfig,
    gen: torch.Generator,
    batch: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[str]]:
    """``(x, t, target, prompts)``: the sequence ``[B, (e+1)*fpb, C, H, W]``, its timesteps
    ``[B, (e+1)*fpb]``, the flow target ``eps - x0`` of the window ``[B, n*fpb, C, H, W]`` and the prompts
    (module docstring)."""
    fpb = pipe_cfg.frames_per_block
    s, e = layout.start, layout.end
    nf = (e + 1) * fpb
    blocks = layout.stream_blocks
    need = (max(blocks) + 1) * fpb
    if clips.latents.shape[1] < need:
        raise ValueError(f"clips hold {clips.latents.shape[1]} latent frames; this window needs {need}")
    frames = torch.tensor([b * fpb + f for b in blocks for f in range(fpb)])
    n_clips = clips.latents.shape[0]
    idx = torch.randint(0, n_clips, (batch,), generator=gen)
    x0 = clips.latents[idx[:, None], frames[None, :]]
    if s:
        cut = torch.rand(batch, generator=gen) < tcfg.cut_fraction
        other = (idx + torch.randint(1, max(2, n_clips), (batch,), generator=gen)) % n_clips
        src = torch.where(cut, other, idx)
        ctx = clips.latents[src[:, None], frames[None, : s * fpb]]
        nw = e - s + 1
        inflight = torch.randint(0, nw, (batch,), generator=gen) if tcfg.cut_inflight else None
        if tcfg.cut_restart or inflight is not None:  # else a cut's window is already this clip's
            for r in torch.nonzero(cut).flatten().tolist():
                k = int(inflight[r]) if inflight is not None else 0
                for i in range(nw):  # window block i: in flight from the old clip, or the new prompt's
                    lo = (s + i) * fpb
                    if i < k:
                        x0[r, lo : lo + fpb] = clips.latents[src[r], frames[lo : lo + fpb]]
                    elif tcfg.cut_restart:
                        x0[r, lo : lo + fpb] = clips.latents[idx[r], (i - k) * fpb : (i - k + 1) * fpb]
        jitter = torch.rand(batch, 1, 1, 1, 1, generator=gen) * tcfg.context_jitter
        x0[:, : s * fpb] = ctx + jitter * torch.randn(ctx.shape, generator=gen)
    table = pipe_cfg.scheduler_table()
    t = torch.zeros(batch, nf)
    x = x0.clone()
    target = torch.empty_like(x0[:, s * fpb :])
    for i, level in enumerate(layout.levels):
        lo, hi = (s + i) * fpb, (s + i + 1) * fpb
        ts = pipe_cfg.timesteps[level]
        eps = torch.randn(x0[:, lo:hi].shape, generator=gen)
        if tcfg.noise_scale == 1.0:
            x[:, lo:hi] = add_noise(x0[:, lo:hi], eps, ts, table)
            target[:, lo - s * fpb : hi - s * fpb] = eps - x0[:, lo:hi]
        else:  # noised at noise_scale * sigma, labelled sigma: flow_to_x0 still recovers x0
            sig = tcfg.noise_scale * pipe_cfg.sigmas[level]
            x[:, lo:hi] = (1 - sig) * x0[:, lo:hi] + sig * eps
            target[:, lo - s * fpb : hi - s * fpb] = (sig / pipe_cfg.sigmas[level]) * (eps - x0[:, lo:hi])
        t[:, lo:hi] = ts
    return x, t, target, [clips.prompts[int(i)] for i in idx]


class StageState(NamedTuple):
    """What a warm-restarted DiT stage trains: the models (train mode), their EMA copies (eval mode), both
    parameter lists in the order :func:`optimizer_step` pairs them, and a fresh AdamW."""

    model: CausalWanModel
    text: DemoTextEncoder
    ema_model: CausalWanModel
    ema_text: DemoTextEncoder
    params: list[torch.nn.Parameter]
    ema_params: list[torch.nn.Parameter]
    opt: torch.optim.Optimizer


def warm_restart(start: DitTrainResult, lr: float, weight_decay: float) -> StageState:
    """Stages 2 and 3: copies of ``start``'s weights (``start`` is not modified) to train and to hold the
    EMA, and a fresh AdamW (betas 0.9, 0.99) at ``lr``."""
    model, text = copy.deepcopy(start.model).train(), copy.deepcopy(start.text_encoder).train()
    ema_m, ema_t = copy.deepcopy(start.model).eval(), copy.deepcopy(start.text_encoder).eval()
    params = [*model.parameters(), *text.parameters()]
    ema_params = [*ema_m.parameters(), *ema_t.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.99))
    return StageState(model, text, ema_m, ema_t, params, ema_params, opt)


def warmup_cosine_lr(step: int, lr: float, warmup_steps: int, steps: int) -> float:
    """Learning rate at ``step``: linear warm-up over ``warmup_steps``, then cosine from ``lr`` to 10 % of
    it at ``steps`` (both DiT stages)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    frac = (step - warmup_steps) / max(1, steps - warmup_steps)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def optimizer_step(
    loss: torch.Tensor,
    opt: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    ema_params: list[torch.nn.Parameter],
    grad_clip: float,
    ema_decay: float,
) -> float:
    """One training step after the forward (both DiT stages): backward, clip, optimiser step, EMA update
    ``ema <- lerp(ema, param, 1 - ema_decay)``; returns the loss value."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, grad_clip)
    opt.step()
    with torch.no_grad():
        for pe, p in zip(ema_params, params):
            pe.lerp_(p, 1 - ema_decay)
    return float(loss.detach())


def train_dit(
    clips: LatentClips,
    model_cfg: ModelConfig,
    pipe_cfg: PipelineConfig,
    tcfg: DitTrainConfig = DitTrainConfig(),
    *,
    progress: bool = True,
    on_step: Callable[[int, float], None] | None = None,
    fixed_batch: bool = False,
) -> DitTrainResult:
    """Train a fresh DiT + text encoder on ``clips`` (module docstring); returns the EMA weights.

    ``fixed_batch=True`` draws one batch and reuses it every step (the smoke test: the loss must fall).
    Runs on the current torch thread setting (the caller fixes it for reproducibility).
    """
    import time

    from tqdm import tqdm

    model, text = new_models(model_cfg, tcfg)
    ema_m, ema_t = new_models(model_cfg, tcfg)
    ema_m.load_state_dict(model.state_dict())
    ema_t.load_state_dict(text.state_dict())
    params = [*model.parameters(), *text.parameters()]
    ema_params = [*ema_m.parameters(), *ema_t.parameters()]
    opt = torch.optim.AdamW(params, lr=tcfg.lr, weight_decay=tcfg.weight_decay, betas=(0.9, 0.99))
    gen = torch.Generator().manual_seed(tcfg.seed)
    model.train()
    text.train()
    losses: list[float] = []
    fixed = None
    if fixed_batch:
        lay0 = sample_layout(pipe_cfg, tcfg, gen)
        fixed = (lay0, make_batch(clips, lay0, pipe_cfg, tcfg, gen, tcfg.batch))
    t0 = time.perf_counter()
    bar = tqdm(range(tcfg.steps), desc="dit", disable=not progress, dynamic_ncols=True)
    for step in bar:
        if fixed is not None:
            layout, (x, t, target, prompts) = fixed
        else:
            layout = sample_layout(pipe_cfg, tcfg, gen)
            x, t, target, prompts = make_batch(clips, layout, pipe_cfg, tcfg, gen, tcfg.batch)
        for g in opt.param_groups:
            g["lr"] = warmup_cosine_lr(step, tcfg.lr, tcfg.warmup_steps, tcfg.steps)
        emb = text(text.tokenize(prompts))
        flow = training_forward(model, layout, pipe_cfg, x, t, model.text_kv(emb))
        decay = min(tcfg.ema, (1 + step) / (10 + step))
        val = optimizer_step(F.mse_loss(flow, target), opt, params, ema_params, tcfg.grad_clip, decay)
        losses.append(val)
        if on_step is not None:
            on_step(step, val)
        if progress and step % 10 == 0:
            bar.set_postfix(loss=f"{sum(losses[-50:]) / len(losses[-50:]):.4f}")
    ema_m.eval()
    ema_t.eval()
    return DitTrainResult(ema_m, ema_t, losses, time.perf_counter() - t0)


def save_dit(result: DitTrainResult, out_dir: str | Path) -> list[Path]:
    """Write ``dit.safetensors`` (the ``CausalWanModel`` state dict, Wan key names; metadata: the preset's
    name and the DiT's sizes, :data:`~rolling_forcing.demo.WIDTH_KEYS`) and ``text_encoder.safetensors``
    (metadata: its layers and heads) into ``out_dir``; returns the paths."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / DIT_FILE, out / TEXT_FILE]
    text = result.text_encoder
    metas = [
        {"preset": result.model.cfg.name, **{k: str(getattr(result.model.cfg, k)) for k in WIDTH_KEYS}},
        {"num_layers": str(text.num_layers), "num_heads": str(text.num_heads)},
    ]
    for path, mod, meta in zip(paths, (result.model, text), metas):
        save_file({k: v.detach().contiguous() for k, v in mod.state_dict().items()}, str(path), metadata=meta)
    return paths
