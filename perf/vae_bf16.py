"""The bf16 VAE workspace's decoded-video gate: a streaming decoder whose weights, causal feature cache and
activations are bf16, against the same decoder in fp32, on the same latents, as PSNR of the decoded video.

The HBM model prices the VAE's causal cache and largest-conv buffers at 2 bytes per element
(``perf.footprint``'s ``vae_workspace``); the CLI's Wan decoder runs fp32 by default
(``WanVAEStreamingDecoder.from_pretrained`` loads float32), so the 2-byte figure holds only for the bf16
option (``from_pretrained(dtype=torch.bfloat16)``). This command measures what that option costs:

* **demo**: the project's trained demo autoencoder (``rolling_forcing.demo``, 64x64, shipped weights) on
  latents of held-out procedural clips (``encode_clips``), with the fp32 decoder's own reconstruction PSNR
  against the source clips for scale;
* **wan-random**: diffusers' ``AutoencoderKLWan`` at its default configuration (the Wan2.1 VAE's layers
  and widths, 73.3 M decoder parameters) with seeded random weights, on standard-normal latents at a
  small shape (4 x 6 latents, 32 x 48 pixels): the real layer stack, not trained weights (none are
  fetched).

Gate: PSNR >= :data:`perf.fp8_psnr.PSNR_THRESHOLD_DB` (35 dB), the project's decoded-video gate for
reduced-precision options; the 8-bit rounding of the written video (:data:`UINT8_PSNR_DB`, 58.9 dB) is
printed next to it for scale. All figures *measured* on this CPU. Run ``python -m perf.vae_bf16`` (about a
minute on 2 cores).
"""

from __future__ import annotations

import argparse
import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from perf.fp8_psnr import PSNR_THRESHOLD_DB, psnr

__all__ = ["UINT8_PSNR_DB", "VaeGate", "decode_chunks", "demo_gate", "wan_random_gate", "main"]

UINT8_PSNR_DB = 10 * math.log10(4 / ((2 / 255) ** 2 / 12))
"""PSNR of rounding a [-1, 1] video to 8 bits (uniform error of one step 2/255: 58.9 dB)."""


@dataclass(frozen=True)
class VaeGate:
    """bf16 against fp32 decode of the same latents (**measured**)."""

    model: str
    psnr_db: float
    max_abs: float
    frames: int
    recon_psnr_db: float | None = None  # the fp32 decoder against the source clips (demo only)

    @property
    def passed(self) -> bool:
        return self.psnr_db >= PSNR_THRESHOLD_DB


def decode_chunks(decoder: Any, latents: torch.Tensor, chunks: Sequence[tuple[int, int]]) -> torch.Tensor:
    """``decoder.decode`` of ``latents [B, F, C, h, w]`` chunk by chunk (``[a, b)`` frame ranges covering
    ``[0, F)`` in order) from a reset decoder; float32 video ``[B, T, 3, H, W]``."""
    if [a for a, _ in chunks] != [0, *[b for _, b in chunks[:-1]]] or chunks[-1][1] != latents.shape[1]:
        raise ValueError(f"chunks must cover [0, {latents.shape[1]}) in order, got {list(chunks)}")
    decoder.reset()
    return torch.cat([decoder.decode(latents[:, a:b]) for a, b in chunks], dim=1)


def _gate(
    name: str, make: Any, model: Any, latents: torch.Tensor, chunks: Sequence[tuple[int, int]]
) -> tuple:
    ref = decode_chunks(make(model), latents, chunks)
    low = decode_chunks(make(copy.deepcopy(model).to(torch.bfloat16)), latents, chunks)
    return ref, VaeGate(name, psnr(low, ref), float((low - ref).abs().max()), ref.shape[1])


@torch.no_grad()
def demo_gate(clips: int = 2, latent_frames: int = 7) -> VaeGate:
    """The trained demo autoencoder on ``clips`` held-out clips of ``latent_frames`` latent frames,
    decoded in chunks of 3 latent frames (the stream's)."""
    from rolling_forcing.demo.autoencoder import DemoStreamingDecoder, load_autoencoder
    from rolling_forcing.demo.data import clip_frames, encode_clips, make_clips
    from rolling_forcing.demo.train_autoencoder import HELDOUT_SEED

    ae = load_autoencoder()
    latents, _ = encode_clips(ae, clips, latent_frames, seed=HELDOUT_SEED)
    chunks = [(a, min(a + 3, latent_frames)) for a in range(0, latent_frames, 3)]
    ref, gate = _gate("demo (trained)", DemoStreamingDecoder, ae, latents, chunks)
    source = make_clips(clips, clip_frames(latent_frames), seed=HELDOUT_SEED)[0]
    return VaeGate(gate.model, gate.psnr_db, gate.max_abs, gate.frames, psnr(ref, source.float()))


@torch.no_grad()
def wan_random_gate(seed: int = 0, latent_hw: tuple[int, int] = (4, 6), latent_frames: int = 4) -> VaeGate:
    """diffusers' default ``AutoencoderKLWan`` (the Wan2.1 VAE's layers) with random weights of ``seed`` on
    standard-normal latents ``[1, latent_frames, 16, *latent_hw]``, decoded as chunks of 3 + the rest."""
    import diffusers

    from rolling_forcing.decode import WanVAEStreamingDecoder

    torch.manual_seed(seed)
    vae: Any = diffusers.AutoencoderKLWan()
    vae.eval()
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(1, latent_frames, 16, *latent_hw, generator=g)
    chunks = [(a, min(a + 3, latent_frames)) for a in range(0, latent_frames, 3)]
    return _gate("Wan2.1 VAE layers, random weights", WanVAEStreamingDecoder, vae, latents, chunks)[1]


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    torch.set_num_threads(1)
    gate = f"gate >= {PSNR_THRESHOLD_DB:g} dB"
    print(f"| decoder | frames | bf16 vs fp32 PSNR dB | max abs | fp32 vs source PSNR dB | {gate} |")
    print("|---|---|---|---|---|---|")
    for g in (demo_gate(), wan_random_gate()):
        rec = "-" if g.recon_psnr_db is None else f"{g.recon_psnr_db:.1f}"
        ok = "passes" if g.passed else "fails"
        print(f"| {g.model} | {g.frames} | {g.psnr_db:.1f} | {g.max_abs:.4f} | {rec} | {ok} |")
    print(f"(8-bit rounding of the written video: {UINT8_PSNR_DB:.1f} dB; all figures measured on this CPU)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
