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

Run: ``python -m rolling_forcing.demo.train_autoencoder --steps N [--out PATH]`` (writes the weights and a
JSON record of the run next to them).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rolling_forcing.demo.autoencoder import (
    WEIGHTS_PATH,
    AutoencoderConfig,
    DemoAutoencoder,
    save_autoencoder,
)
from rolling_forcing.demo.data import clip_frames, make_clips

__all__ = ["HELDOUT_SEED", "AETrainConfig", "recon_psnr", "train_autoencoder"]

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

    def __post_init__(self) -> None:
        for name in ("batch_size", "latent_frames", "stats_clips", "threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"AETrainConfig.{name} must be an int >= 1, got {v!r}")
        for name in ("lr", "grad_clip"):
            if not getattr(self, name) > 0:
                raise ValueError(f"AETrainConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("noise_ratio", "l2_weight", "warmup"):
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


def train_autoencoder(
    config: AETrainConfig = AETrainConfig(), *, steps: int, seed: int = 0, progress: bool = False
) -> tuple[DemoAutoencoder, list[float]]:
    """Train a :class:`DemoAutoencoder` from scratch for ``steps`` (>= 1) steps; returns ``(model in eval
    mode with its latent statistics set, per-step total loss)``. Uses ``config.threads`` torch threads
    (restored afterwards); ``progress`` shows a tqdm bar."""
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
        opt = torch.optim.Adam(model.parameters(), lr=config.lr, betas=(0.9, 0.99))
        frames = clip_frames(config.latent_frames)
        history: list[float] = []
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=steps, desc="autoencoder", unit="step")
        model.train()
        for step in range(steps):
            for g in opt.param_groups:
                g["lr"] = config.lr * _lr_factor(step, steps, config.warmup)
            video, _, _ = make_clips(config.batch_size, frames, seed=seed, first=step * config.batch_size)
            loss, mse = _loss(model, video, config, gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            opt.step()
            history.append(float(loss.detach()))
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{float(loss):.5f}", psnr=f"{10 * math.log10(4 / float(mse)):.1f}")
        if bar is not None:
            bar.close()
        model.eval()
        _set_latent_stats(model, config, seed)
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
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=WEIGHTS_PATH)
    args = ap.parse_args(argv)
    config = AETrainConfig()
    t0 = time.perf_counter()
    model, history = train_autoencoder(config, steps=args.steps, seed=args.seed, progress=True)
    wall = time.perf_counter() - t0
    psnr = recon_psnr(model)
    record = {
        "steps": args.steps,
        "seed": args.seed,
        "threads": config.threads,
        "torch": torch.__version__,
        "wall_seconds_measured": round(wall, 1),
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
