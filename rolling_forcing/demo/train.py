"""``train_demo``: retrain the whole demo model from scratch (autoencoder, then DiT + text encoder).

Steps (all seeded from ``seed``; a fixed torch thread count, restored afterwards):

1. the autoencoder (:func:`rolling_forcing.demo.train_autoencoder.train_autoencoder`), or the one at
   ``autoencoder=PATH`` (skips step 1: the shipped DiT was trained on the shipped autoencoder);
2. latent clips of ``max_clean_blocks + window_blocks`` blocks, or ``long_blocks`` when late windows are
   drawn (:meth:`DitTrainConfig.clip_blocks`, :func:`rolling_forcing.demo.data.encode_clips`);
3. the DiT and its text encoder (:func:`rolling_forcing.demo.train_dit.train_dit`), then stage 2 from
   its EMA weights (:func:`rolling_forcing.demo.train_stage2.train_stage2`: a warm restart), then the
   *late* stage (:data:`LATE_STAGE`, a second warm restart on which half the windows are late windows of
   a ``long_blocks``-block stream, :func:`rolling_forcing.demo.train_attention.long_layout`);
4. ``autoencoder.safetensors``, ``dit.safetensors``, ``text_encoder.safetensors``, ``losses.png`` (loss
   curves, matplotlib) and ``train_log.json`` (settings, measured wall clock per stage) in ``out_dir``.

``smoke=True`` runs a few steps of each stage on a few clips (seconds; CI): the files are written, the
weights mean nothing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from rolling_forcing.config import ModelConfig, PipelineConfig, get_preset
from rolling_forcing.demo import AE_FILE, WIDTH_KEYS
from rolling_forcing.demo.train_dit import DitTrainConfig, DitTrainResult, LatentClips, save_dit, train_dit
from rolling_forcing.demo.train_stage2 import Stage2Config, train_stage2
from rolling_forcing.procedural import PROMPT_SIZES, PROMPT_SPEED, check_sizes, check_speed

__all__ = ["DEFAULT_CLIPS", "LATE_STAGE", "DemoTrainReport", "default_late", "plot_losses", "train_demo"]

DEFAULT_CLIPS = 1024
"""Latent clips the DiT trains on."""

SMOKE_AE_STEPS, SMOKE_AE_DECODER_STEPS, SMOKE_CLIPS = 3, 2, 4
SMOKE_DIT = DitTrainConfig(steps=3, batch=2, warmup_steps=1, max_clean_blocks=2, long_blocks=10)
SMOKE_STAGE2 = SMOKE_LATE = Stage2Config(steps=2, warmup_steps=1)
"""``smoke=True``: a few steps of each stage on a few clips."""

LATE_STAGE = Stage2Config(steps=1500, lr=3e-4, warmup_steps=50)
"""The late stage of the shipped recipe (``train_demo(late=Stage2Config(steps=0))`` turns it off)."""

LATE_FRACTION = 0.5
"""Share of late windows (:func:`rolling_forcing.demo.train_attention.long_layout`) in the late stage."""


def default_late(smoke: bool) -> Stage2Config:
    """The late stage :func:`train_demo` runs when given none: :data:`SMOKE_LATE` with ``smoke``, else
    :data:`LATE_STAGE`."""
    return SMOKE_LATE if smoke else LATE_STAGE


@dataclass
class DemoTrainReport:
    """What :func:`train_demo` wrote and measured (wall-clock seconds, *measured*)."""

    out_dir: Path
    files: list[Path]
    ae_seconds: float
    clips_seconds: float
    dit_seconds: float
    ae_losses: list[float]
    dit_losses: list[float]
    stage2_seconds: float = 0.0
    stage2_losses: list[float] = field(default_factory=list)
    late_seconds: float = 0.0
    late_losses: list[float] = field(default_factory=list)


def plot_losses(
    ae_losses: list[float],
    dit_losses: list[float],
    path: str | Path,
    stage2_losses: list[float] | None = None,
    late_losses: list[float] | None = None,
) -> Path:
    """Two panels (autoencoder loss, DiT flow-matching loss per step, with a running mean; stage 2's and
    the late stage's steps follow stage 1's on the same axis, dotted lines mark the restarts) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    dit_all = [*dit_losses, *(stage2_losses or []), *(late_losses or [])]
    if stage2_losses:
        axes[1].axvline(len(dit_losses), ls=":", color="gray", label="stage 2")
    if late_losses:
        axes[1].axvline(len(dit_losses) + len(stage2_losses or []), ls=":", color="black", label="late")
    for ax, losses, title in ((axes[0], ae_losses, "autoencoder"), (axes[1], dit_all, "DiT (flow MSE)")):
        ax.set_title(title)
        ax.set_xlabel("step")
        if losses:
            ax.plot(losses, lw=0.6, alpha=0.5, label="per step")
            k = max(1, len(losses) // 50)
            run = [
                sum(losses[max(0, i - k + 1) : i + 1]) / len(losses[max(0, i - k + 1) : i + 1])
                for i in range(len(losses))
            ]
            ax.plot(run, lw=1.5, label=f"mean of {k}")
            ax.set_yscale("log")
            ax.legend()
        else:
            ax.text(0.5, 0.5, "not retrained", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def train_demo(
    out_dir: str | Path,
    seed: int = 0,
    *,
    smoke: bool = False,
    threads: int = 2,
    progress: bool = True,
    autoencoder: str | Path | None = None,
    ae_steps: int | None = None,
    clips: int | None = None,
    dit: DitTrainConfig | None = None,
    stage2: Stage2Config | None = None,
    prompt_speed: float | None = None,
    late: Stage2Config | None = None,
    prompt_sizes: Mapping[str, float] | None = None,
    model_cfg: ModelConfig | None = None,
) -> DemoTrainReport:
    """Retrain the demo model into ``out_dir`` (module docstring); returns what it wrote and measured.

    Args:
        seed: int >= 0, seeds every stage.
        smoke: a few steps of each stage (CI).
        threads: torch CPU threads during training (bitwise reproducibility holds for one torch version
            and one thread count).
        autoencoder: an ``autoencoder.safetensors`` to use instead of retraining one (it is copied into
            ``out_dir``).
        ae_steps, clips, dit, stage2: override the autoencoder steps, the clip count, the DiT's stage-1
            and stage-2 settings.
        prompt_speed: the training clips' prompt-layout speed, pixels per frame at 64 x 64 (``None``:
            :data:`rolling_forcing.procedural.PROMPT_SPEED`, what the shipped weights were trained on).
        prompt_sizes: the training clips' prompt-layout size per kind, pixels at 64 x 64 (``None``:
            :data:`rolling_forcing.procedural.PROMPT_SIZES`; checked by
            :func:`~rolling_forcing.procedural.check_sizes`).
        late: the third, *late* stage after stage 2 (``None``: :data:`LATE_STAGE`, or a few steps with
            ``smoke``; ``Stage2Config(steps=0)``: off): a warm restart (:func:`train_stage2`) whose
            windows are late windows of a ``long_blocks``-block stream with probability
            :data:`LATE_FRACTION` (the clips are then encoded ``long_blocks`` long; stages 1-2 read their
            first blocks, so they are the same with or without it), seeded from ``seed + 2``.
        model_cfg: the DiT's sizes (``None``: the ``demo`` preset). Only its layers, width, heads and FFN
            may differ from the preset (the latent, text and guidance settings are the demo data's):
            ``ValueError`` otherwise. :func:`rolling_forcing.demo.load_demo` reads the width back from the
            weights.
    """
    from rolling_forcing.demo.autoencoder import load_autoencoder, save_autoencoder
    from rolling_forcing.demo.data import encode_clips
    from rolling_forcing.demo.train_autoencoder import DEFAULT_STEPS, AETrainConfig, train_autoencoder

    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    if prompt_speed is not None:
        check_speed(prompt_speed, "prompt_speed")
    sizes = dict(PROMPT_SIZES) if prompt_sizes is None else check_sizes(prompt_sizes, "prompt_sizes")
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an int >= 1, got {threads!r}")
    preset = get_preset("demo")
    if model_cfg is None:
        model_cfg = preset
    elif replace(model_cfg, **{k: getattr(preset, k) for k in WIDTH_KEYS}) != preset:
        raise ValueError(
            f"model_cfg may differ from the demo preset only in {', '.join(WIDTH_KEYS)} (the demo data fixes "
            f"the rest), got {model_cfg}"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n_ae = ae_steps if ae_steps is not None else (SMOKE_AE_STEPS if smoke else DEFAULT_STEPS)
    ae_cfg = replace(AETrainConfig(), threads=threads)
    if smoke:
        ae_cfg = replace(ae_cfg, decoder_steps=SMOKE_AE_DECODER_STEPS)
    n_clips = clips if clips is not None else (SMOKE_CLIPS if smoke else DEFAULT_CLIPS)
    dcfg: DitTrainConfig = dit if dit is not None else (SMOKE_DIT if smoke else DitTrainConfig())
    dcfg = replace(dcfg, seed=seed)
    s2cfg: Stage2Config = stage2 if stage2 is not None else (SMOKE_STAGE2 if smoke else Stage2Config())
    late_cfg: Stage2Config = late if late is not None else default_late(smoke)
    late_dit = replace(dcfg, long_fraction=LATE_FRACTION, seed=seed + 2)
    pipe_cfg = PipelineConfig()
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t0 = time.perf_counter()
        ae_losses: list[float] = []
        if autoencoder is not None:
            ae: Any = load_autoencoder(autoencoder)
        else:
            ae, ae_losses = train_autoencoder(ae_cfg, steps=n_ae, seed=seed, progress=progress)
        save_autoencoder(ae, out / AE_FILE, {"seed": str(seed)})
        t1 = time.perf_counter()
        clip_cfg = late_dit if late_cfg.steps else dcfg
        latent_frames = clip_cfg.clip_blocks(pipe_cfg.window_blocks) * pipe_cfg.frames_per_block
        lat, prompts = encode_clips(
            ae,
            n_clips,
            latent_frames,
            seed=seed + 1,
            layout="prompt",
            prompt_speed=prompt_speed,
            prompt_sizes=sizes,
        )
        t2 = time.perf_counter()
        latent_clips = LatentClips(lat, prompts)
        res1: DitTrainResult = train_dit(latent_clips, model_cfg, pipe_cfg, dcfg, progress=progress)
        t3 = time.perf_counter()
        res2 = train_stage2(res1, latent_clips, model_cfg, pipe_cfg, dcfg, s2cfg, progress=progress)
        t4 = time.perf_counter()
        res = train_stage2(res2, latent_clips, model_cfg, pipe_cfg, late_dit, late_cfg, progress=progress)
        t5 = time.perf_counter()
    finally:
        torch.set_num_threads(saved)
    files = [out / AE_FILE, *save_dit(res, out)]
    s2_losses = res2.losses if res2 is not res1 else []
    late_losses = res.losses if res is not res2 else []
    files.append(plot_losses(ae_losses, res1.losses, out / "losses.png", s2_losses, late_losses))
    log = {
        "seed": seed,
        "smoke": smoke,
        "threads": threads,
        "torch": torch.__version__,
        "autoencoder": str(autoencoder)
        if autoencoder is not None
        else f"retrained: {n_ae} steps + {ae_cfg.decoder_steps} decoder-only steps",
        "clips": n_clips,
        "model": {k: getattr(model_cfg, k) for k in WIDTH_KEYS},
        "dit": asdict(dcfg),
        "stage2": asdict(s2cfg),
        "late": {
            **asdict(late_cfg),
            "long_fraction": late_dit.long_fraction,
            "long_blocks": late_dit.long_blocks,
        },
        "prompt_speed": prompt_speed if prompt_speed is not None else PROMPT_SPEED,
        "prompt_sizes": sizes,
        "seconds_measured": {
            "autoencoder": t1 - t0,
            "clips": t2 - t1,
            "dit": t3 - t2,
            "stage2": t4 - t3,
            "late": t5 - t4,
        },
        "final_dit_loss_mean_last_100": sum(res1.losses[-100:]) / max(1, len(res1.losses[-100:])),
        "final_stage2_loss_mean_last_100": sum(s2_losses[-100:]) / max(1, len(s2_losses[-100:])),
        "final_late_loss_mean_last_100": sum(late_losses[-100:]) / max(1, len(late_losses[-100:])),
    }
    (out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    files.append(out / "train_log.json")
    return DemoTrainReport(
        out,
        files,
        t1 - t0,
        t2 - t1,
        t3 - t2,
        ae_losses,
        res1.losses,
        t4 - t3,
        s2_losses,
        t5 - t4,
        late_losses,
    )
