"""Streaming decode, text embeddings, video writing and the latency report."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from rolling_forcing.decode import (
    PreviewDecoder,
    WanVAEStreamingDecoder,
    to_uint8_frames,
    video_frames_for,
)
from rolling_forcing.report import ChunkTiming, LatencyReport, deadline_s, percentile
from rolling_forcing.text import (
    SeededTextEncoder,
    load_prompt_embeds,
    validate_prompt_embeds,
)
from rolling_forcing.video import VideoWriter, read_video
from tests.numerics import FP32_ISSUE_BOUND  # fp32 stream equivalence (1e-5)

try:  # the `test` extra installs diffusers and transformers: without them these tests fail, never skip
    import diffusers
    import tokenizers
    import transformers
except ImportError as exc:
    raise ImportError(
        "tests/test_decode_text.py needs diffusers (AutoencoderKLWan) and transformers/tokenizers "
        "(UMT5EncoderModel): pip install -e '.[test]'"
    ) from exc


def _tiny_vae() -> torch.nn.Module:
    torch.manual_seed(0)
    # Same topology as Wan2.1's VAE (z_dim 16, 3 spatial up-samplings, 2 temporal) but 8 base channels.
    return diffusers.AutoencoderKLWan(
        base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True]
    ).eval()


def test_streamed_decode_equals_full_decode_tiny_wan_vae() -> None:
    vae = _tiny_vae()
    z = torch.randn(1, 16, 7, 4, 6)  # [B, C, F, H, W] normalised latents
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        full = vae.decode(z * std + mean).sample  # diffusers' own full-clip decode, de-normalised as RF does
    dec = WanVAEStreamingDecoder(vae)
    latents = z.permute(0, 2, 1, 3, 4)  # [B, F, C, H, W] as the pipeline yields chunks
    parts = [dec.decode(latents[:, a:b]) for a, b in [(0, 3), (3, 6), (6, 7)]]
    assert [p.shape[1] for p in parts] == [9, 12, 4]  # Wan's causal count: 1 + 4 (T-1), then 4 per frame
    streamed = torch.cat(parts, dim=1).permute(0, 2, 1, 3, 4)
    assert streamed.shape == full.shape == (1, 3, 25, 32, 48)
    # Non-trivial output: a good share of pixels is not clamped.
    assert (full.abs() < 0.99).float().mean() > 0.1
    # Same per-frame computation in the same order, but on chunks of other lengths: the conv kernels torch
    # picks by shape and CPU may sum in another order (measured max |streamed - full|: 0 on the recording
    # machine, 2.3e-06 under MKL_CBWR=COMPATIBLE; output in [-1, 1]), so the fp32 stream-equivalence bound.
    # A wrong or missing cache errs by > 1e-2 (test_streamed_decode_without_cache_differs).
    assert float((streamed - full).abs().max()) <= FP32_ISSUE_BOUND
    # A reset starts a new stream: the first chunk again decodes to 9 frames and equals the first part.
    dec.reset()
    assert torch.equal(dec.decode(latents[:, :3]), parts[0])


def test_streamed_decode_without_cache_differs() -> None:
    """Guard that the equality above depends on the persistent cache (resetting between chunks breaks it)."""
    vae = _tiny_vae()
    latents = torch.randn(1, 6, 16, 4, 6)
    dec = WanVAEStreamingDecoder(vae)
    _, second = dec.decode(latents[:, :3]), dec.decode(latents[:, 3:])
    dec.reset()
    dec.decode(latents[:, :1])  # different history
    other = dec.decode(latents[:, 3:])
    assert second.shape == other.shape
    assert float((second - other).abs().max()) > 1e-2  # far above the equality test's FP32_ISSUE_BOUND


def test_decoders_reject_wrong_latent_shape() -> None:
    dec = PreviewDecoder(16)
    with pytest.raises(ValueError, match=r"\[B, F, C, H, W\]"):
        dec.decode(torch.zeros(1, 16, 4, 4))
    with pytest.raises(ValueError, match="C=16"):
        dec.decode(torch.zeros(1, 3, 8, 4, 4))


def test_preview_decoder_frame_counts_and_values() -> None:
    dec = PreviewDecoder(16, spatial_stride=2, temporal_stride=4, seed=3)
    lat = torch.randn(1, 6, 16, 3, 5)
    a, b = dec.decode(lat[:, :3]), dec.decode(lat[:, 3:])
    assert a.shape == (1, video_frames_for(3, first_in_stream=True), 3, 6, 10) == (1, 9, 3, 6, 10)
    assert b.shape == (1, 12, 3, 6, 10)
    # Independent recomputation of one pixel: tanh(W @ z / sqrt(C)) with the same seeded W.
    w = torch.randn(3, 16, generator=torch.Generator().manual_seed(3)) / 4.0
    want = torch.tanh(w @ lat[0, 4, :, 1, 2])
    # latent frame 4 -> chunk 2 frames 4..7; pixel (1, 2) -> upsampled rows 2..3, cols 4..5
    for t in range(4, 8):
        torch.testing.assert_close(b[0, t, :, 3, 5], want)
    frames = to_uint8_frames(a)
    assert frames.shape == (9, 6, 10, 3) and frames.dtype == np.uint8


def test_seeded_text_is_deterministic_and_prompt_dependent() -> None:
    enc = SeededTextEncoder(text_len=16, text_dim=8)
    a1 = enc.encode(["a red  fox"])
    a2 = SeededTextEncoder(16, 8).encode(["a red fox"])  # whitespace-normalised like Wan's clean
    b = enc.encode(["a blue fox"])
    assert a1.shape == (1, 16, 8)
    assert torch.equal(a1, a2)
    assert not torch.allclose(a1, b)
    assert torch.count_nonzero(a1[0, 4:]) == 0 and torch.count_nonzero(a1[0, :4]) == 32  # 3 words + 1


def test_prompt_embeds_file_shape_validation(tmp_path) -> None:
    good = tmp_path / "good.safetensors"
    save_file({"prompt_embeds": torch.randn(1, 16, 8)}, str(good))
    out = load_prompt_embeds(good, 16, 8, batch=2)
    assert out.shape == (2, 16, 8)
    bad = tmp_path / "bad.safetensors"
    save_file({"prompt_embeds": torch.randn(1, 12, 8)}, str(bad))
    with pytest.raises(ValueError, match=r"text_len=16, text_dim=8\], got \[1, 12, 8\]"):
        load_prompt_embeds(bad, 16, 8)
    with pytest.raises(ValueError, match="shape"):
        validate_prompt_embeds(torch.randn(3, 16, 8), 16, 8, batch=2)
    with pytest.raises(ValueError, match="shape"):
        validate_prompt_embeds(torch.randn(16, 8), 16, 8)
    with pytest.raises(TypeError, match="floating"):
        validate_prompt_embeds(torch.zeros(1, 16, 8, dtype=torch.long), 16, 8)


def test_video_writer_round_trip(tmp_path) -> None:
    path = tmp_path / "v.mp4"
    rng = np.random.default_rng(0)
    with VideoWriter(path, fps=16) as w:
        for n in (9, 12, 12):
            w.write(rng.integers(0, 256, size=(n, 32, 48, 3), dtype=np.uint8))
    video = read_video(path)
    assert video.shape == (33, 32, 48, 3)
    with pytest.raises(ValueError, match="even"):
        VideoWriter(tmp_path / "odd.mp4", fps=16).write(np.zeros((1, 31, 48, 3), np.uint8))


def test_latency_report_figures(tmp_path) -> None:
    dl = deadline_s(frames_per_block=3, temporal_stride=4, fps=16)
    assert dl == 0.75
    ready = [2.0, 2.5, 3.5, 3.9, 4.3]  # latencies 2.0 | 0.5, 1.0, 0.4, 0.4
    frames = [9, 12, 12, 12, 12]
    rep = LatencyReport(dl, 16.0, tuple(ChunkTiming(i, r, f) for i, (r, f) in enumerate(zip(ready, frames))))
    s = rep.summary()
    assert s["kind"] == "measured"
    assert s["time_to_first_frame_s"] == 2.0
    assert s["deadline_misses"] == 1
    assert math.isclose(s["p50_chunk_latency_s"], float(np.percentile([0.5, 1.0, 0.4, 0.4], 50)))
    assert math.isclose(s["p99_chunk_latency_s"], float(np.percentile([0.5, 1.0, 0.4, 0.4], 99)))
    assert math.isclose(s["headroom_p50"], dl / 0.45 - 1)
    # Playback from t=2.0: chunk 1 due at 2.5625 (ready 2.5 ok), chunk 2 due 3.3125 (ready 3.5: stall),
    # chunk 3 due 4.0625 (3.9 ok), chunk 4 due 4.8125 (ok).
    assert s["playback_stalls"] == 1
    assert math.isclose(s["throughput_fps"], 48 / 2.3)
    rep.write_json(tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["summary"]["deadline_misses"] == 1 and len(data["chunks"]) == 5
    assert "MISS" in rep.format_table()
    assert math.isnan(percentile([], 50))  # no values: nan


def test_umt5_encoder_from_local_dir_pads_and_zeroes(tmp_path) -> None:
    """A tiny random umT5 + word-level tokenizer saved locally: RF's padding rule, checked against the
    encoder run directly on the unpadded ids (independent of our tokenisation and masking code)."""
    from rolling_forcing.text import UMT5TextEncoder

    words = ["<pad>", "</s>", "<unk>", "a", "red", "fox", "runs", "in", "snow"]
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(str(tmp_path / "tokenizer"))
    torch.manual_seed(0)
    cfg = transformers.UMT5Config(
        vocab_size=len(words), d_model=32, num_layers=1, num_heads=2, d_kv=8, d_ff=64, pad_token_id=0
    )
    model = transformers.UMT5EncoderModel(cfg).eval()
    model.save_pretrained(str(tmp_path / "text_encoder"))

    enc = UMT5TextEncoder(tmp_path, text_len=12)
    assert enc.text_dim == 32
    emb = enc.encode(["a red  fox runs", "snow"])
    assert emb.shape == (2, 12, 32)
    with torch.no_grad():
        ref0 = model(input_ids=torch.tensor([[3, 4, 5, 6]])).last_hidden_state[0]
        ref1 = model(input_ids=torch.tensor([[8]])).last_hidden_state[0]
    torch.testing.assert_close(emb[0, :4], ref0, rtol=1e-5, atol=1e-5)  # fp32 round-off of masked softmax
    torch.testing.assert_close(emb[1, :1], ref1, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(emb[0, 4:]) == 0 and torch.count_nonzero(emb[1, 1:]) == 0
    with pytest.raises(ValueError, match="not a local directory"):
        UMT5TextEncoder(tmp_path / "missing", text_len=12)
