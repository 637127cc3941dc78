"""The bf16 VAE workspace's decoded-video gate (``perf.vae_bf16``): a bf16 copy of each streaming decoder
(weights, causal cache, activations) against the fp32 decoder on the same latents.

Threshold: :data:`perf.fp8_psnr.PSNR_THRESHOLD_DB` (35 dB), the project's decoded-video gate for reduced
precision. Measured on the recording machine: demo (trained) 62.3 dB, Wan2.1 VAE layers with random
weights 50.6 dB (latents 4 x 6, `make test-all`) and 50.4 dB (latents 2 x 2, in CI: bf16 3D convolutions run
on a slow path on CPU, 35 s here against ~350 s at 4 x 6); all above the gate and below infinity (bf16 does
change the video), the demo above the 8-bit rounding of the written video (58.9 dB)."""

from __future__ import annotations

import math

import pytest
import torch

from perf.fp8_psnr import PSNR_THRESHOLD_DB
from perf.vae_bf16 import UINT8_PSNR_DB, decode_chunks, demo_gate, wan_random_gate
from rolling_forcing.decode import PreviewDecoder
from tests.pipeline_helpers import one_thread as one_thread  # autouse: one intra-op thread


def test_bf16_demo_decoder_passes_the_gate() -> None:
    g = demo_gate()
    print(
        f"\ndemo: bf16 vs fp32 {g.psnr_db:.1f} dB (max |d| {g.max_abs:.4f}), vs source {g.recon_psnr_db} dB"
    )
    assert math.isfinite(g.psnr_db) and g.max_abs > 0  # the bf16 workspace is not the fp32 one
    assert g.passed and g.psnr_db >= PSNR_THRESHOLD_DB
    assert g.recon_psnr_db is not None and g.psnr_db > g.recon_psnr_db + 20  # far below the codec's own error
    assert abs(UINT8_PSNR_DB - 58.92) < 0.01  # 10 log10(12 * 255^2)


@pytest.mark.parametrize(
    "latent_hw", [(2, 2), pytest.param((4, 6), marks=pytest.mark.slow, id="perf-default")], ids=str
)
def test_bf16_wan_vae_layers_pass_the_gate(latent_hw: tuple[int, int]) -> None:
    g = wan_random_gate(latent_hw=latent_hw)
    print(f"\nWan VAE layers, random weights: bf16 vs fp32 {g.psnr_db:.1f} dB (max |d| {g.max_abs:.4f})")
    assert g.frames == 1 + 4 * 3  # 4 latent frames (two chunks: 3 + 1): Wan's causal count
    assert math.isfinite(g.psnr_db) and g.passed


def test_decode_chunks_checks_the_cover() -> None:
    dec = PreviewDecoder(16)
    z = torch.randn(1, 4, 16, 2, 2)
    assert torch.equal(decode_chunks(dec, z, [(0, 3), (3, 4)]), decode_chunks(dec, z, [(0, 4)]))
    with pytest.raises(ValueError, match="chunks must cover"):
        decode_chunks(dec, z, [(0, 3)])
