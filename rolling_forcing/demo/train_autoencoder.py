"""Train the demo autoencoder on procedural clips (deterministic; CPU).

Objective, per step: a fresh batch of clips (:func:`rolling_forcing.demo.data.make_clips`, seed = the run
seed, clip indices ``step * batch_size ..``), raw latents ``z = encode_raw(video)``, then

* **latent noise** ``z + noise_ratio * rms_c(z) * eps`` (``rms_c``: the batch's per-channel RMS, detached,
  ``eps ~ N(0, 1)``): the decoder learns to give nearly the same video for latents perturbed by 10 % of
  each channel's scale, i.e. by about 0.1 in the normalised units the DiT works in, so the DiT's small
  errors decode to small pixel errors; scaling the noise with the latent itself means the encoder cannot
  escape it by growing the latents, and no channel gains by collapsing;
* **loss** = pixel MSE of ``decode_train`` (the first latent frame's real frame and every later frame) +
  ``l2_weight * mean(z^2)`` (pins the otherwise free overall scale of the latents; tiny).

Adam, linear warm-up then cosine decay to 5 %, gradient clipping. After training the per-channel mean/std of
the raw latents over ``stats_clips`` training clips become the model's normalisation buffers.
Deterministic: same seed, torch version and thread count (``config.threads``) -> bitwise the same weights.

Run: ``python -m rolling_forcing.demo.train_autoencoder [--steps 2500] [--decoder-steps 500] [--out PATH]``
(writes the weights, a JSON record of the run and the loss history next to them).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from rolling_forcing.demo.autoencoder import (
    WEIGHTS_PATH,
    AutoencoderConfig,
    DemoAutoencoder,
    save_autoencoder,
)
from rolling_forcing.demo.data import clip_frames, make_clips

__all__ = [
    "DEFAULT_STEPS",
    "HELDOUT_SEED",
    "AETrainConfig",
    "decoder_parameters",
    "finetune_decoder",
    "recon_psnr",
    "train_autoencoder",
]

DEFAULT_STEPS = 2500
"""Phase-1 steps of the shipped run (``train_autoencoder(AETrainConfig(), steps=DEFAULT_STEPS, seed=0)``
reproduces the shipped weights on the same torch version and thread count)."""

HELDOUT_SEED = 7_777_777
"""Seed of the held-out clips (training uses the run seed; clip streams of different seeds are disjoint)."""


@dataclass(frozen=True)
class AETrainConfig:
    """Training hyper-parameters (see the module docstring)."""

    model: AutoencoderConfig = field(default_factory=AutoencoderConfig)
    batch_size: int = 8
    latent_frames: int = 3
    lr: float = 2e-3
    warmup: int = 20
    noise_ratio: float = 0.1
    l2_weight: float = 1e-4
    grad_clip: float = 1.0
    stats_clips: int = 256
    threads: int = 2
    decoder_steps: int = 500
    decoder_lr: float = 1e-3

    def __post_init__(self) -> None:
        for name in ("batch_size", "latent_frames", "stats_clips", "threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"AETrainConfig.{name} must be an int >= 1, got {v!r}")
        for name in ("lr", "grad_clip", "decoder_lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"AETrainConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("noise_ratio", "l2_weight", "warmup", "decoder_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"AETrainConfig.{name} must be >= 0, got {getattr(self, name)}")


def _lr_factor(step: int, steps: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return 0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * frac))


def _loss(model: DemoAutoencoder, video: torch.Tensor, config: AETrainConfig, gen: torch.Generator):
    z = model.encode_raw(video)
    scale = z.detach().pow(2).mean(dim=(0, 1, 3, 4), keepdim=True).sqrt()
    noisy = z + config.noise_ratio * scale * torch.randn(z.shape, generator=gen)
    out = model.decode_train(noisy)[:, model.config.temporal_stride - 1 :]  # drop the first group's 3 extras
    mse = (out - video).pow(2).mean()
    return mse + config.l2_weight * z.pow(2).mean(), mse


@torch.no_grad()
def _set_latent_stats(model: DemoAutoencoder, config: AETrainConfig, seed: int) -> None:
    zs = []
    frames = clip_frames(config.latent_frames)
    for lo in range(0, config.stats_clips, 32):
        video, _, _ = make_clips(min(32, config.stats_clips - lo), frames, seed=seed, first=lo)
        zs.append(model.encode_raw(video))
    z = torch.cat(zs).transpose(0, 2).reshape(model.config.latent_channels, -1)  # [C, everything]
    model.latents_mean.copy_(z.mean(dim=1))
    model.latents_std.copy_(z.std(dim=1).clamp_min(1e-4))


def _run_phase(
    model: DemoAutoencoder,
    config: AETrainConfig,
    *,
    params: list[torch.nn.Parameter],
    steps: int,
    lr: float,
    seed: int,
    first_clip: int,
    gen: torch.Generator,
    desc: str,
    progress: bool,
) -> list[float]:
    """``steps`` Adam steps on ``params`` (the others frozen), clips ``first_clip ..`` of ``seed``."""
    trainable = {id(p) for p in params}
    for p in model.parameters():
        p.requires_grad_(id(p) in trainable)
    opt = torch.optim.Adam(params, lr=lr, betas=(0.9, 0.99))
    frames = clip_frames(config.latent_frames)
    history: list[float] = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=steps, desc=desc, unit="step")
    model.train()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * _lr_factor(step, steps, config.warmup)
        first = first_clip + step * config.batch_size
        video, _, _ = make_clips(config.batch_size, frames, seed=seed, first=first)
        loss, mse = _loss(model, video, config, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
        opt.step()
        history.append(float(loss.detach()))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{history[-1]:.5f}", psnr=f"{10 * math.log10(4 / float(mse)):.1f}")
    if bar is not None:
        bar.close()
    for p in model.parameters():
        p.requires_grad_(True)
    model.eval()
    return history


def decoder_parameters(model: DemoAutoencoder) -> list[torch.nn.Parameter]:
    """The decoder's parameters (temporal convs, upsampler, output conv): what :func:`finetune_decoder`
    trains; the encoder (and so the latent space) stays fixed."""
    mods = [model.conv_in, model.res1, model.res2, model.up, model.dec_out]
    return [p for m in mods for p in m.parameters()]


def finetune_decoder(
    model: DemoAutoencoder,
    config: AETrainConfig = AETrainConfig(),
    *,
    steps: int,
    seed: int = 0,
    first_clip: int = 0,
    progress: bool = False,
) -> list[float]:
    """Phase 2: train only the decoder of ``model`` (in place) for ``steps`` steps at ``config.decoder_lr``
    on clips ``first_clip ..`` of ``seed`` (a fresh optimizer and noise generator ``seed + 2``), the
    encoder and the latent statistics unchanged, so latents already handed to the DiT stay valid.
    Returns the per-step loss; uses ``config.threads`` threads."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    old_threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        gen = torch.Generator().manual_seed(seed + 2)
        return _run_phase(
            model,
            config,
            params=decoder_parameters(model),
            steps=steps,
            lr=config.decoder_lr,
            seed=seed,
            first_clip=first_clip,
            gen=gen,
            desc="decoder",
            progress=progress,
        )
    finally:
        torch.set_num_threads(old_threads)


def train_autoencoder(
    config: AETrainConfig = AETrainConfig(), *, steps: int, seed: int = 0, progress: bool = False
) -> tuple[DemoAutoencoder, list[float]]:
    """Train a :class:`DemoAutoencoder` from scratch: ``steps`` (>= 1) steps of the whole model, then the
    latent statistics, then ``config.decoder_steps`` steps of the decoder alone
    (:func:`finetune_decoder`, clips after phase 1's). Returns ``(model in eval mode, per-step total loss
    of both phases)``. Uses ``config.threads`` torch threads (restored afterwards); ``progress`` shows
    tqdm bars."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    old_threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        torch.manual_seed(seed)
        model = DemoAutoencoder(config.model)
        gen = torch.Generator().manual_seed(seed + 1)
        history = _run_phase(
            model,
            config,
            params=list(model.parameters()),
            steps=steps,
            lr=config.lr,
            seed=seed,
            first_clip=0,
            gen=gen,
            desc="autoencoder",
            progress=progress,
        )
        _set_latent_stats(model, config, seed)
        if config.decoder_steps:
            history += finetune_decoder(
                model,
                config,
                steps=config.decoder_steps,
                seed=seed,
                first_clip=steps * config.batch_size,
                progress=progress,
            )
        return model, history
    finally:
        torch.set_num_threads(old_threads)


@torch.no_grad()
def recon_psnr(
    model: DemoAutoencoder, *, n: int = 64, latent_frames: int = 3, seed: int = HELDOUT_SEED
) -> float:
    """Reconstruction PSNR in dB of ``decode(encode(clips))`` over ``n`` clips of ``seed`` (held-out by
    default): ``10 log10(2^2 / MSE)`` on the [-1, 1] scale (= the uint8 PSNR with peak 255)."""
    video, _, _ = make_clips(n, clip_frames(latent_frames), seed=seed)
    rec = model.decode(model.encode(video), backend="reference")
    mse = float((rec - video).pow(2).mean())
    return 10.0 * math.log10(4.0 / mse)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Train the demo autoencoder and write its weights.")
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="phase-1 steps (the whole model)")
    ap.add_argument("--decoder-steps", type=int, default=AETrainConfig().decoder_steps)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=WEIGHTS_PATH)
    ap.add_argument(
        "--resume-phase1",
        type=Path,
        default=None,
        help="weights of a finished phase 1 of the same --steps/--seed: run only the decoder phase",
    )
    args = ap.parse_args(argv)
    config = replace(AETrainConfig(), decoder_steps=args.decoder_steps)
    t0 = time.perf_counter()
    if args.resume_phase1 is not None:
        from rolling_forcing.demo.autoencoder import load_autoencoder

        model = load_autoencoder(args.resume_phase1)
        history = finetune_decoder(
            model,
            config,
            steps=args.decoder_steps,
            seed=args.seed,
            first_clip=args.steps * config.batch_size,
            progress=True,
        )
    else:
        model, history = train_autoencoder(config, steps=args.steps, seed=args.seed, progress=True)
    wall = time.perf_counter() - t0
    psnr = recon_psnr(model)
    record = {
        "steps": args.steps,
        "decoder_steps": args.decoder_steps,
        "seed": args.seed,
        "threads": config.threads,
        "torch": torch.__version__,
        "wall_seconds_measured": round(wall, 1),
        "resumed_from_phase1": args.resume_phase1 is not None,
        "heldout_psnr_db_measured": round(psnr, 2),
        "heldout": "64 clips x 9 frames of seed HELDOUT_SEED",
        "final_loss_mean_last_20": sum(history[-20:]) / len(history[-20:]),
        "params": sum(p.numel() for p in model.parameters()),
    }
    save_autoencoder(model, args.out, {"record": json.dumps(record)})
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    hist_path = args.out.with_name(args.out.stem + "_loss.json")
    hist_path.write_text(json.dumps([round(h, 6) for h in history]) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
