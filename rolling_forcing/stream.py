"""State records of one stream: finished chunks, the noise source in the originals' RNG order, the
runtime state and the forward counters (shared by the unsharded and the sharded driver)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from rolling_forcing.cache import RollingKVCache
from rolling_forcing.merged import tensor_signature


@dataclass(frozen=True)
class Chunk:
    """One finished block of the stream.

    Attributes:
        block: block index (0-based); latent frames ``[block*fpb, (block+1)*fpb)``.
        latents: final x0 latents ``[B, frames_per_block, C, H, W]`` in the pipeline dtype.
        final: True: these latents never change again (every yielded chunk is final).
        last: True for the stream's last block.
        window: the window after which the block was finished.
    """

    block: int
    latents: torch.Tensor
    final: bool
    last: bool
    window: int


class NoiseSource:
    """Noise of a stream in the original's RNG order.

    ``initial(block)``: the block's pure-noise input ``[B, fpb, C, H, W]``. With ``initial_noise`` given
    (``[B, F, C, H, W]``, as the original draws up front) it is sliced from it; otherwise all of it is
    drawn up front from ``generator`` when ``upfront=True`` (the original's order) or per block when it
    enters the window (``upfront=False``: constant memory for endless streams; a different RNG order).
    ``renoise(shape)``: a fresh sample over the whole window ``[B*n_frames, C, H, W]`` (the caller uses one
    block's slice), drawn from ``generator`` (the global RNG when None).
    """

    def __init__(
        self,
        batch: int,
        frame_shape: tuple[int, int, int],
        frames_per_block: int,
        num_blocks: int,
        dtype: torch.dtype,
        *,
        generator: torch.Generator | None = None,
        initial_noise: torch.Tensor | None = None,
        upfront: bool = True,
    ) -> None:
        self.batch, self.frame_shape, self.fpb, self.dtype = batch, frame_shape, frames_per_block, dtype
        self.generator = generator
        shape = (batch, num_blocks * frames_per_block, *frame_shape)
        if initial_noise is not None:
            if not isinstance(initial_noise, torch.Tensor):
                raise TypeError(
                    f"noise must be a torch.Tensor or NoiseSource, got {type(initial_noise).__name__}"
                )
            if tuple(initial_noise.shape) != shape:
                raise ValueError(
                    f"noise latents must be [B, F, C, H, W] = {shape} (F = num_blocks * frames_per_block), "
                    f"got {tuple(initial_noise.shape)}"
                )
            self._initial: torch.Tensor | None = initial_noise.to(dtype)
        elif upfront:
            self._initial = self._randn(shape)
        else:
            self._initial = None

    def _randn(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=self.generator, dtype=self.dtype)

    def initial(self, block: int) -> torch.Tensor:
        """Pure-noise input of ``block``: ``[B, fpb, C, H, W]`` in ``dtype``."""
        if self._initial is None:
            return self._randn((self.batch, self.fpb, *self.frame_shape))
        return self._initial[:, block * self.fpb : (block + 1) * self.fpb]

    def renoise(self, num_frames: int) -> torch.Tensor:
        """Fresh noise ``[B * num_frames, C, H, W]`` in ``dtype`` drawn from ``generator``."""
        return self._randn((self.batch * num_frames, *self.frame_shape))

    def upfront_blocks(self) -> int | None:
        """Blocks of initial noise held up front (None: drawn per block, any number)."""
        return None if self._initial is None else self._initial.shape[1] // self.fpb


class ShiftedNoise(NoiseSource):
    """The noise of a stream *restarted* at block ``offset`` of ``inner``'s stream (``set_prompt(...,
    restart=True)``): block ``b`` of the new stream takes ``inner``'s block ``offset + b``, so a restarted
    stream draws the noise the blocks it shows would have drawn; a block past the end of ``inner``'s
    up-front noise (a restart less than a window from the end runs blocks it never shows) is drawn fresh
    from ``inner``'s generator. Re-noise draws are ``inner``'s (its generator, in order)."""

    def __init__(self, inner: NoiseSource, offset: int) -> None:  # noqa: D107 - nothing to draw
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        self.inner, self.offset = inner, offset
        self.batch, self.frame_shape, self.fpb, self.dtype = (
            inner.batch,
            inner.frame_shape,
            inner.fpb,
            inner.dtype,
        )
        self.generator = inner.generator

    def _randn(self, shape: tuple[int, ...]) -> torch.Tensor:
        return self.inner._randn(shape)

    def initial(self, block: int) -> torch.Tensor:
        """``inner.initial(offset + block)`` ``[B, fpb, C, H, W]`` (fresh past ``inner``'s up-front noise)."""
        b = self.offset + block
        up = self.inner.upfront_blocks()
        if up is not None and b >= up:
            return self._randn((self.batch, self.fpb, *self.frame_shape))
        return self.inner.initial(b)

    def upfront_blocks(self) -> int | None:
        up = self.inner.upfront_blocks()
        return None if up is None else max(0, up - self.offset)

    def renoise(self, num_frames: int) -> torch.Tensor:
        """``inner.renoise(num_frames)``."""
        return self.inner.renoise(num_frames)


@dataclass
class StreamState:
    """Runtime state of one stream (owned by the pipeline; never global)."""

    num_blocks: int
    cache: RollingKVCache
    noise: NoiseSource
    window: int = 0
    noisy: dict[int, torch.Tensor] = field(default_factory=dict)  # block -> current noisy input
    clean: dict[int, torch.Tensor] = field(default_factory=dict)  # block -> x0 last cached (recache)


@dataclass
class ForwardStats:
    """Measured counts of one stream: model forwards by kind and their distinct input signatures."""

    forwards: Counter[str] = field(default_factory=Counter)
    signatures: Counter[tuple[object, ...]] = field(default_factory=Counter)

    def log(self, kind: str, *tensors: torch.Tensor) -> None:
        self.forwards[kind] += 1
        self.signatures[(kind, tensor_signature(*tensors))] += 1

    @property
    def total(self) -> int:
        return sum(self.forwards.values())


__all__ = ["Chunk", "ForwardStats", "NoiseSource", "StreamState"]
