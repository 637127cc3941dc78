"""Streaming latent -> pixel decoders, one finished chunk at a time.

Layouts: a chunk of latents is ``[B, F, C, H, W]`` (Rolling Forcing's frame-major layout, as the pipeline
yields it); decoded video is float32 ``[B, T, 3, H * s, W * s]`` in ``[-1, 1]`` where ``s`` is the
spatial stride. Both decoders follow Wan's causal frame count: the very first latent frame of a stream
gives 1 video frame and every later latent frame gives ``temporal_stride`` (4) frames, so a first
3-frame chunk gives 9 frames and every later chunk 12.

* :class:`WanVAEStreamingDecoder` wraps diffusers' ``AutoencoderKLWan``. The Wan decoder already runs one
  latent frame at a time with a causal feature cache (one slot per ``WanCausalConv3d``; see diffusers'
  ``AutoencoderKLWan._decode``). Here the cache lives in this object and persists across chunks, so
  decoding chunk by chunk performs exactly the same per-frame computation as decoding the whole clip
  (tested on a tiny random VAE). Latents are de-normalised first with the per-channel mean/std of the
  VAE config, as RF's ``WanVAEWrapper`` does: ``z * std + mean``.
* :class:`PreviewDecoder` is the light decoder of the ``tiny`` preset: a fixed, seeded linear map of the
  latent channels to RGB, ``tanh``, nearest-neighbour spatial upsampling and temporal repetition. It is a
  cheap preview so the CLI can write a video without any weights; it is **not** a trained VAE and its
  pictures mean nothing beyond showing the stream's structure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch


class StreamingDecoder(Protocol):
    """Decodes consecutive chunks of one stream; ``reset()`` starts a new stream."""

    temporal_stride: int
    spatial_stride: int

    def reset(self) -> None:
        """Forget the previous chunks: the next :meth:`decode` starts a new stream."""
        ...

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Next chunk ``[B, F, C, H, W]`` latents -> float32 video ``[B, T, 3, sH, sW]`` in [-1, 1]."""
        ...


def video_frames_for(num_latent_frames: int, *, first_in_stream: bool, temporal_stride: int = 4) -> int:
    """Video frames a causal decoder emits for ``num_latent_frames`` (Wan: 1 + 4 (T - 1) for the first)."""
    if num_latent_frames < 0:
        raise ValueError(f"num_latent_frames must be >= 0, got {num_latent_frames}")
    if num_latent_frames == 0:
        return 0
    return temporal_stride * num_latent_frames - (temporal_stride - 1 if first_in_stream else 0)


def _check_latents(latents: torch.Tensor, channels: int) -> None:
    if not isinstance(latents, torch.Tensor) or latents.ndim != 5:
        got = list(latents.shape) if isinstance(latents, torch.Tensor) else type(latents).__name__
        raise ValueError(f"latents must be a 5-D tensor [B, F, C, H, W], got {got}")
    if latents.shape[2] != channels:
        raise ValueError(
            f"latents must have C={channels} channels at dim 2 of [B, F, C, H, W], "
            f"got shape {list(latents.shape)}"
        )
    if latents.shape[1] == 0:
        raise ValueError("latents must hold at least one frame (F >= 1)")


class WanVAEStreamingDecoder:
    """Chunk-wise decode with a diffusers ``AutoencoderKLWan`` and a persistent causal feature cache.

    Args:
        vae: an ``AutoencoderKLWan`` (Wan2.1 layout; ``patch_size`` None).
        normalized: if True (the default, as the DiT produces), latents are de-normalised with the VAE
            config's ``latents_mean``/``latents_std`` before decoding.
    """

    def __init__(self, vae: Any, *, normalized: bool = True) -> None:
        from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

        if getattr(vae.config, "patch_size", None) is not None:
            raise ValueError("vae: only the Wan2.1 VAE layout (patch_size=None) is supported for streaming")
        self.vae = vae
        self.normalized = normalized
        self.channels = int(vae.config.z_dim)
        self.temporal_stride = int(2 ** sum(bool(t) for t in vae.config.temperal_downsample))
        self.spatial_stride = int(2 ** (len(vae.config.dim_mult) - 1))
        self._num_convs = sum(isinstance(m, WanCausalConv3d) for m in vae.decoder.modules())
        mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32)
        std = torch.tensor(vae.config.latents_std, dtype=torch.float32)
        if mean.numel() != self.channels or std.numel() != self.channels:
            raise ValueError(
                f"vae config: latents_mean/std need {self.channels} entries, got {mean.numel()}/{std.numel()}"
            )
        self._mean = mean.view(1, -1, 1, 1, 1)
        self._std = std.view(1, -1, 1, 1, 1)
        self.reset()

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: torch.dtype = torch.float32, normalized: bool = True
    ) -> WanVAEStreamingDecoder:
        """Load ``AutoencoderKLWan`` from a local directory (a ``vae/`` subfolder is found); no downloads."""
        from diffusers import AutoencoderKLWan

        root = Path(path)
        if not root.is_dir():
            raise ValueError(f"vae path {str(root)!r} is not a local directory")
        sub = root / "vae" if (root / "vae" / "config.json").is_file() else root
        vae = AutoencoderKLWan.from_pretrained(str(sub), torch_dtype=dtype, local_files_only=True)
        return cls(vae.eval(), normalized=normalized)

    def reset(self) -> None:
        """Forget the causal cache: the next chunk is the first of a new stream."""
        self._feat_map: list[Any] = [None] * self._num_convs
        self._frames_seen = 0

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode the next chunk ``[B, F, C, H, W]`` -> float32 ``[B, T, 3, 8H, 8W]`` in [-1, 1]."""
        _check_latents(latents, self.channels)
        param = next(self.vae.parameters())
        z = latents.permute(0, 2, 1, 3, 4).to(device=param.device, dtype=torch.float32)
        if self.normalized:
            z = z * self._std.to(z.device) + self._mean.to(z.device)
        x = self.vae.post_quant_conv(z.to(param.dtype))  # kernel 1: frame-local, safe per chunk
        outs = []
        for i in range(x.shape[2]):
            conv_idx = [0]
            outs.append(
                self.vae.decoder(
                    x[:, :, i : i + 1],
                    feat_cache=self._feat_map,
                    feat_idx=conv_idx,
                    first_chunk=self._frames_seen == 0,
                )
            )
            self._frames_seen += 1
        out = torch.clamp(torch.cat(outs, dim=2), -1.0, 1.0).float()
        return out.permute(0, 2, 1, 3, 4).contiguous()


class PreviewDecoder:
    """Cheap deterministic preview decoder for the ``tiny`` preset (not a trained VAE).

    Each latent frame ``[C, H, W]`` becomes RGB ``tanh(W_rgb @ z / sqrt(C))`` with a fixed seeded
    ``W_rgb [3, C]``, upsampled ``spatial_stride`` x by nearest neighbour, and repeated in time following
    the causal count (1 frame for the first latent frame of the stream, ``temporal_stride`` after).
    """

    def __init__(
        self, channels: int, *, spatial_stride: int = 8, temporal_stride: int = 4, seed: int = 0
    ) -> None:
        if channels <= 0 or spatial_stride <= 0 or temporal_stride <= 0:
            raise ValueError(
                f"channels, spatial_stride and temporal_stride must be positive, got "
                f"{channels}, {spatial_stride}, {temporal_stride}"
            )
        self.channels = channels
        self.spatial_stride = spatial_stride
        self.temporal_stride = temporal_stride
        gen = torch.Generator().manual_seed(seed)
        self._proj = torch.randn(3, channels, generator=gen) / channels**0.5
        self.reset()

    def reset(self) -> None:
        self._frames_seen = 0

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode the next chunk ``[B, F, C, H, W]`` -> float32 ``[B, T, 3, sH, sW]`` in [-1, 1]."""
        _check_latents(latents, self.channels)
        z = latents.float()
        rgb = torch.tanh(torch.einsum("kc,bfchw->bfkhw", self._proj, z))
        s = self.spatial_stride
        rgb = rgb.repeat_interleave(s, dim=3).repeat_interleave(s, dim=4)
        reps = torch.full((rgb.shape[1],), self.temporal_stride, dtype=torch.long)
        if self._frames_seen == 0:
            reps[0] = 1
        self._frames_seen += rgb.shape[1]
        return rgb.repeat_interleave(reps, dim=1)


def to_uint8_frames(video: torch.Tensor) -> np.ndarray:
    """``[T, 3, H, W]`` (or ``[1, T, 3, H, W]``) float in [-1, 1] -> uint8 ``[T, H, W, 3]`` for writers."""
    if video.ndim == 5:
        if video.shape[0] != 1:
            raise ValueError(f"video: expected batch size 1 to write frames, got shape {list(video.shape)}")
        video = video[0]
    if video.ndim != 4 or video.shape[1] != 3:
        raise ValueError(f"video must be [T, 3, H, W], got {list(video.shape)}")
    pix = ((video.float().clamp(-1.0, 1.0) + 1.0) * 127.5).round().to(torch.uint8)
    return pix.permute(0, 2, 3, 1).contiguous().numpy()
