"""A small causal video autoencoder with Wan's geometry, for the demo model (64 x 64 RGB, 16 latent channels).

Geometry (as Wan2.1's VAE): causal in time, the first latent frame <- pixel frame 0 alone, latent frame
``j >= 1`` <- pixel frames ``4j - 3 .. 4j``; 8x spatial; 16 latent channels. A clip of ``T = 1 + 4 (F - 1)``
frames ``[B, T, 3, 64, 64]`` (float, [-1, 1]) encodes to latents ``[B, F, 16, 8, 8]`` and back.

* **Encoder** (per latent frame, so causal by construction): its 4 pixel frames stacked on channels
  (``[12, 64, 64]``, frame-major; the first latent frame repeats frame 0 four times) -> 2x pixel unshuffle
  (``[48, 32, 32]``) -> two stride-2 4x4 convs (8x down in all) -> a 3x3 conv -> a 3x3 conv to 16
  channels (SiLU between).
* **Decoder**: causal temporal convs at latent resolution (``conv_in`` kernel (3, 3, 3), a residual block
  of a (3, 3, 3) and a (1, 3, 3) conv), run by the project's op :func:`nki_kernels.ops.conv3d_causal`
  (streaming cache of the previous ``kt - 1 = 2`` latent frames, zeros before the stream, as Wan's
  ``WanCausalConv3d`` feature cache), then per latent frame a 2-D upsampler (two stages of a 3x3 conv +
  2x pixel shuffle, then a 3x3 conv to ``4 x 4 x 3`` channels + 2x pixel shuffle) -> ``4 x 3`` channels
  at full size -> 4 pixel frames. The first latent frame of a stream gives
  only its last frame (1 frame), as Wan's decoder.
* **Latent normalisation**: the per-channel mean/std of the encoder's raw output, measured on training
  clips after training, are stored with the weights (buffers ``latents_mean`` / ``latents_std``).
  :meth:`DemoAutoencoder.encode` returns normalised latents ``(z - mean) / std``; the decoders
  de-normalise ``z * std + mean`` first (Wan's ``WanVAEWrapper`` convention).

:class:`DemoStreamingDecoder` decodes chunk by chunk with a persistent cache and implements
:class:`rolling_forcing.decode.StreamingDecoder`; its output is bitwise equal to
:meth:`DemoAutoencoder.decode` of the whole clip (both run the temporal convs over the chunk and the 2-D
stage one latent frame at a time, so the arithmetic is the same). Training uses
:meth:`DemoAutoencoder.decode_train`, the differentiable batched form of the same network (plain torch).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from nki_kernels.ops import conv3d_causal, conv_weight_taps
from rolling_forcing.decode import _check_latents, video_frames_for

__all__ = [
    "AutoencoderConfig",
    "DemoAutoencoder",
    "DemoStreamingDecoder",
    "WEIGHTS_PATH",
    "check_video",
    "load_autoencoder",
]

WEIGHTS_PATH = Path(__file__).resolve().parent / "weights" / "autoencoder.safetensors"
"""The shipped trained weights (safetensors; the config is in the file's metadata)."""

# temporal convs of the decoder, in order: name -> (kt, kh, kw)
_TEMPORAL = (("conv_in", (3, 3, 3)), ("res1", (3, 3, 3)), ("res2", (1, 3, 3)))


@dataclass(frozen=True)
class AutoencoderConfig:
    """Sizes. ``height``/``width`` multiples of ``spatial_stride`` (8); ``enc_dims``: the two stride-2
    stages' widths; ``dec_dim``: the temporal stage's width; ``up_dims``: the first two upsampling
    stages' output widths. ``temporal_stride`` 4 and ``spatial_stride`` 8 are fixed (Wan's geometry)."""

    latent_channels: int = 16
    height: int = 64
    width: int = 64
    enc_dims: tuple[int, int] = (64, 128)
    dec_dim: int = 96
    up_dims: tuple[int, int] = (64, 32)
    temporal_stride: int = 4
    spatial_stride: int = 8

    def __post_init__(self) -> None:
        if self.temporal_stride != 4 or self.spatial_stride != 8:
            raise ValueError(
                f"AutoencoderConfig: temporal_stride must be 4 and spatial_stride 8 (Wan's geometry), got "
                f"{self.temporal_stride}, {self.spatial_stride}"
            )
        if self.height < 8 or self.width < 8 or self.height % 8 or self.width % 8:
            raise ValueError(
                f"AutoencoderConfig: height and width must be positive multiples of 8, got "
                f"{self.height}x{self.width}"
            )
        for name in ("enc_dims", "up_dims"):
            dims = getattr(self, name)
            if len(dims) != 2 or any(int(d) < 1 for d in dims):
                raise ValueError(f"AutoencoderConfig.{name} must be 2 positive widths, got {dims!r}")
        if self.latent_channels < 1 or self.dec_dim < 1:
            raise ValueError(
                f"AutoencoderConfig: latent_channels and dec_dim must be >= 1, got "
                f"{self.latent_channels}, {self.dec_dim}"
            )

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> AutoencoderConfig:
        d = json.loads(text)
        for k in ("enc_dims", "up_dims"):
            d[k] = tuple(d[k])
        return cls(**d)


def check_video(video: torch.Tensor, config: AutoencoderConfig, name: str = "video") -> int:
    """Raise ``ValueError`` naming ``name`` unless it is float ``[B, T, 3, H, W]`` with the config's frame
    size and ``T = 1 + 4k``; returns the latent frame count ``F = 1 + (T - 1) / 4``."""
    if not isinstance(video, torch.Tensor) or video.ndim != 5:
        got = list(video.shape) if isinstance(video, torch.Tensor) else type(video).__name__
        raise ValueError(f"{name} must be a 5-D tensor [B, T, 3, H, W], got {got}")
    b, t, c, h, w = video.shape
    if c != 3 or (h, w) != (config.height, config.width):
        raise ValueError(
            f"{name} must be [B, T, 3, {config.height}, {config.width}], got shape {list(video.shape)}"
        )
    if not video.is_floating_point():
        raise TypeError(f"{name} must be a float tensor in [-1, 1], got dtype {video.dtype}")
    if b < 1 or t < 1 or (t - 1) % config.temporal_stride:
        raise ValueError(
            f"{name} must hold B >= 1 clips of T = 1 + 4k frames (Wan's causal count), got B={b}, T={t}"
        )
    return 1 + (t - 1) // config.temporal_stride


class DemoAutoencoder(nn.Module):
    """The demo's causal video autoencoder (see the module docstring). Float32 weights; CPU."""

    latents_mean: torch.Tensor
    latents_std: torch.Tensor

    def __init__(self, config: AutoencoderConfig = AutoencoderConfig()) -> None:
        super().__init__()
        self.config = config
        e0, e1 = config.enc_dims
        zc, d = config.latent_channels, config.dec_dim
        u0, u1 = config.up_dims
        ts = config.temporal_stride
        self.enc = nn.ModuleList(
            [
                nn.Conv2d(4 * 3 * ts, e0, 4, stride=2, padding=1),  # after a 2x pixel unshuffle
                nn.Conv2d(e0, e1, 4, stride=2, padding=1),
                nn.Conv2d(e1, e1, 3, padding=1),
            ]
        )
        self.enc_out = nn.Conv2d(e1, zc, 3, padding=1)
        self.conv_in = nn.Conv3d(zc, d, (3, 3, 3), padding=0)
        self.res1 = nn.Conv3d(d, d, (3, 3, 3), padding=0)
        self.res2 = nn.Conv3d(d, d, (1, 3, 3), padding=0)
        self.up = nn.ModuleList([nn.Conv2d(d, 4 * u0, 3, padding=1), nn.Conv2d(u0, 4 * u1, 3, padding=1)])
        self.dec_out = nn.Conv2d(u1, 4 * 3 * ts, 3, padding=1)  # then a 2x pixel shuffle
        self.register_buffer("latents_mean", torch.zeros(zc))
        self.register_buffer("latents_std", torch.ones(zc))

    # ---------------------------------------------------------------- encoder
    def encode_raw(self, video: torch.Tensor) -> torch.Tensor:
        """Un-normalised latents ``[B, F, 16, h, w]`` of ``video`` ``[B, T, 3, H, W]`` (T = 1 + 4k);
        differentiable (training)."""
        nf = check_video(video, self.config)
        b, _, _, hh, ww = video.shape
        ts = self.config.temporal_stride
        x = video.float()
        groups = torch.cat([x[:, :1].expand(b, ts, 3, hh, ww), x[:, 1:]], dim=1)  # [B, 4F, 3, H, W]
        h = F.pixel_unshuffle(groups.reshape(b * nf, 3 * ts, hh, ww), 2)
        for conv in self.enc:
            h = F.silu(conv(h))
        z = self.enc_out(h)
        return z.reshape(b, nf, *z.shape[1:])

    @torch.no_grad()
    def encode(self, video: torch.Tensor) -> torch.Tensor:
        """Normalised latents: float32 ``[B, F, 16, H/8, W/8]`` for float ``video`` ``[B, T, 3, H, W]`` in
        [-1, 1], ``T = 1 + 4 (F - 1)``. Latent frame ``j`` depends only on pixel frames ``<= 4j``."""
        return self.normalise(self.encode_raw(video))

    def normalise(self, z: torch.Tensor) -> torch.Tensor:
        """Raw latents ``[B, F, C, h, w]`` -> ``(z - mean) / std`` per channel."""
        return (z - self.latents_mean.view(1, 1, -1, 1, 1)) / self.latents_std.view(1, 1, -1, 1, 1)

    def denormalise(self, z: torch.Tensor) -> torch.Tensor:
        """Normalised latents ``[B, F, C, h, w]`` -> raw ``z * std + mean`` per channel."""
        return z * self.latents_std.view(1, 1, -1, 1, 1) + self.latents_mean.view(1, 1, -1, 1, 1)

    # ---------------------------------------------------------------- decoder
    def _upsample(self, h: torch.Tensor) -> torch.Tensor:
        """2-D stage: ``[N, dec_dim, h, w]`` -> ``[N, 12, 8h, 8w]`` (4 frames x RGB, frame-major)."""
        for conv in self.up:
            h = F.silu(F.pixel_shuffle(conv(h), 2))
        return F.pixel_shuffle(self.dec_out(h), 2)

    def decode_train(self, z_raw: torch.Tensor) -> torch.Tensor:
        """Differentiable full-clip decode of RAW latents ``[B, F, C, h, w]`` -> ``[B, 4F, 3, H, W]``
        unclamped: all 4 frames of every latent frame (for the first latent frame only the last one is a
        real frame). Plain torch, batched: equal to :meth:`decode` up to fp32 rounding."""

        def causal(name: str, kt: int, x: torch.Tensor) -> torch.Tensor:
            return getattr(self, name)(F.pad(x, (1, 1, 1, 1, kt - 1, 0)))  # zeros before frame 0

        z = z_raw.permute(0, 2, 1, 3, 4)  # [B, C, F, h, w]
        skip = causal("conv_in", 3, z)
        y = causal("res1", 3, F.silu(skip))
        x = F.silu(skip + causal("res2", 1, F.silu(y)))
        b, d, nf, hh, ww = x.shape
        h = x.permute(0, 2, 1, 3, 4).reshape(b * nf, d, hh, ww)
        out = self._upsample(h)
        ts = self.config.temporal_stride
        return out.reshape(b, nf * ts, 3, *out.shape[2:])

    def temporal_taps(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]]]:
        """The temporal convs as the op takes them: name -> (weight_taps, bias, ksize)."""
        return {
            name: (
                conv_weight_taps(getattr(self, name).weight.detach()),
                getattr(self, name).bias.detach(),
                ks,
            )
            for name, ks in _TEMPORAL
        }

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
        """Full-clip decode: normalised latents ``[B, F, 16, h, w]`` -> float32
        ``[B, 1 + 4 (F - 1), 3, H, W]`` in [-1, 1] (clamped). The temporal convs run on
        :func:`nki_kernels.ops.conv3d_causal` (``backend`` as there); equal bitwise to
        :class:`DemoStreamingDecoder` over any chunking."""
        dec = DemoStreamingDecoder(self, backend=backend)
        return dec.decode(latents)


class DemoStreamingDecoder:
    """Chunk-by-chunk decode with a persistent causal cache (``rolling_forcing.decode.StreamingDecoder``).

    ``decode(chunk)`` takes normalised latents ``[B, F, 16, h, w]`` (F >= 1; the batch size is fixed per
    stream) and returns float32 ``[B, T, 3, 8h, 8w]`` in [-1, 1] with ``T = 4F`` (``4F - 3`` for the
    stream's first chunk). ``reset()`` starts a new stream. The weights are read once, at construction.
    """

    temporal_stride = 4
    spatial_stride = 8

    def __init__(self, model: DemoAutoencoder, *, backend: str | None = None) -> None:
        if not isinstance(model, DemoAutoencoder):
            raise TypeError(f"model must be a DemoAutoencoder, got {type(model).__name__}")
        self.model = model
        self.backend = backend
        self.channels = model.config.latent_channels
        self._taps = model.temporal_taps()
        self.reset()

    def reset(self) -> None:
        """Forget the causal cache: the next chunk is the first of a new stream."""
        self._cache: dict[str, torch.Tensor | None] = {name: None for name, _ in _TEMPORAL}
        self._frames_seen = 0
        self._batch: int | None = None

    def _conv(self, name: str, x: torch.Tensor) -> torch.Tensor:
        taps, bias, ks = self._taps[name]
        out, self._cache[name] = conv3d_causal(
            x.contiguous(), taps, bias, ksize=ks, cache=self._cache[name], backend=self.backend
        )
        return out

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Next chunk of normalised latents ``[B, F, 16, h, w]`` -> float32 ``[B, T, 3, 8h, 8w]``, [-1, 1]."""
        _check_latents(latents, self.channels)
        cfg = self.model.config
        b, nf, _, hh, ww = latents.shape
        if (hh * 8, ww * 8) != (cfg.height, cfg.width):
            raise ValueError(
                f"latents must be [B, F, {self.channels}, {cfg.height // 8}, {cfg.width // 8}] for this "
                f"autoencoder, got shape {list(latents.shape)}"
            )
        if self._batch is not None and b != self._batch:
            raise ValueError(
                f"latents batch size {b} differs from this stream's {self._batch}; reset() first"
            )
        self._batch = b
        first = self._frames_seen == 0
        z = self.model.denormalise(latents.float()).permute(0, 2, 1, 3, 4)  # [B, C, F, h, w]
        z = z.to(self._taps["conv_in"][0].dtype)  # the workspace in the weights' dtype (bf16: an option)
        skip = self._conv("conv_in", z)
        y = self._conv("res1", F.silu(skip))
        x = skip + self._conv("res2", F.silu(y))
        x = F.silu(x)
        frames = []
        for j in range(nf):  # one latent frame at a time: the same arithmetic for every chunking
            out = self.model._upsample(x[:, :, j].contiguous())
            frames.append(out.reshape(b, self.temporal_stride, 3, *out.shape[2:]))
        video = torch.cat(frames, dim=1)
        if first:
            video = video[:, self.temporal_stride - 1 :]
        self._frames_seen += nf
        assert video.shape[1] == video_frames_for(nf, first_in_stream=first)
        return video.float().clamp(-1.0, 1.0).contiguous()


def save_autoencoder(
    model: DemoAutoencoder, path: str | Path, metadata: dict[str, str] | None = None
) -> None:
    """Write the weights (+ latent mean/std buffers) as safetensors with the config in the metadata."""
    from safetensors.torch import save_file

    meta = {"config": model.config.to_json(), **(metadata or {})}
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path), metadata=meta)


def load_autoencoder(path: str | Path | None = None) -> DemoAutoencoder:
    """Load a :class:`DemoAutoencoder` (eval mode) from safetensors written by :func:`save_autoencoder`;
    ``None`` = the shipped :data:`WEIGHTS_PATH`.

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` naming the file (and the tensor)
    for a corrupt file, no config metadata, a NaN/inf in any floating tensor, or tensors that do not fit
    the config (missing, unexpected or wrongly shaped)."""
    from rolling_forcing.tensor_io import check_finite, read_safetensors

    p = Path(path) if path is not None else WEIGHTS_PATH
    if not p.is_file():
        raise FileNotFoundError(f"autoencoder weights {str(p)!r} not found")
    state, meta = read_safetensors(p, ValueError)  # one read: metadata and tensors
    if "config" not in meta:
        raise ValueError(f"{str(p)!r} has no 'config' metadata: not written by save_autoencoder")
    for k, t in state.items():
        if t.is_floating_point():
            check_finite(t, f"autoencoder weights tensor {k!r}", ValueError)
    model = DemoAutoencoder(AutoencoderConfig.from_json(meta["config"]))
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:  # torch's message names the missing / unexpected / misshaped tensors
        why = " ".join(str(exc).split())  # one line
        raise ValueError(
            f"{str(p)!r}: weights do not fit the autoencoder config in its metadata: {why}"
        ) from None
    return model.eval()
