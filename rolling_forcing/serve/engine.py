"""The shared model of all sessions and one session's live stream on it.

:class:`Engine` builds the model once (the tiny preset's seeded random weights, shared read-only by every
session), encodes prompts, and measures the chunk cost (an untimed start-up stream, then every chunk).
:class:`LiveStream` is one session's stream: its own :class:`RollingForcingPipeline` over the shared
model (the pipeline holds the per-stream state: KV cache, pending prompt), its RNG, its decoder and its
image encoder. A stream is endless in practice: ``relative`` positions (any length) and noise drawn per
block (constant memory), bounded by ``ServeConfig.max_session_s``.
"""

from __future__ import annotations

import io
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from rolling_forcing.config import PipelineConfig, get_preset
from rolling_forcing.decode import PreviewDecoder, to_uint8_frames
from rolling_forcing.model import CausalWanModel
from rolling_forcing.pipeline import RollingForcingPipeline
from rolling_forcing.report import percentile
from rolling_forcing.serve.config import ServeConfig
from rolling_forcing.stream import Chunk, NoiseSource
from rolling_forcing.text import SeededTextEncoder
from rolling_forcing.video import VideoSpec


def encode_image(frame: np.ndarray, fmt: str, quality: int = 85) -> bytes:
    """uint8 ``[H, W, 3]`` -> JPEG or PNG bytes (Pillow)."""
    from PIL import Image

    if frame.dtype != np.uint8 or frame.ndim != 3 or frame.shape[2] != 3:
        raise ValueError(f"frame must be uint8 [H, W, 3], got {frame.dtype} {list(frame.shape)}")
    buf = io.BytesIO()
    img = Image.fromarray(frame, "RGB")
    if fmt == "jpeg":
        img.save(buf, format="JPEG", quality=quality)
    elif fmt == "png":
        img.save(buf, format="PNG")
    else:
        raise ValueError(f"fmt must be 'jpeg' or 'png', got {fmt!r}")
    return buf.getvalue()


class CostTracker:
    """The last ``window`` measured chunk costs (seconds, thread-safe); p99 over them."""

    def __init__(self, window: int) -> None:
        self._costs: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()

    def add(self, cost_s: float) -> None:
        with self._lock:
            self._costs.append(cost_s)

    def __len__(self) -> int:
        with self._lock:
            return len(self._costs)

    def p99(self) -> float:
        """p99 of the kept costs (nan when none)."""
        with self._lock:
            return percentile(list(self._costs), 99)


@dataclass(frozen=True)
class ChunkOut:
    """One produced chunk: its block, uint8 frames ``[T, H, W, 3]``, encoded images and the measured
    wall-clock split (seconds): model (generate), decode, image encode."""

    block: int
    frames: np.ndarray
    images: tuple[bytes, ...]
    generate_s: float
    decode_s: float
    encode_s: float

    @property
    def cost_s(self) -> float:
        return self.generate_s + self.decode_s + self.encode_s


class LiveStream:
    """One session's stream on the shared model (built by :meth:`Engine.open_stream`).

    Not thread-safe: one thread (the scheduler) calls :meth:`next_chunk`, :meth:`set_prompt`, :meth:`close`.
    """

    def __init__(self, engine: Engine, text_embeds: torch.Tensor, seed: int) -> None:
        self.engine = engine
        e = engine
        self.pipe = RollingForcingPipeline(e.model, e.model_cfg, e.pipe_cfg)
        gen = torch.Generator().manual_seed(seed)
        fpb = e.pipe_cfg.frames_per_block
        noise = NoiseSource(
            1, e.model_cfg.latent_frame_shape(), fpb, e.max_blocks, e.pipe_cfg.torch_dtype,
            generator=gen, upfront=False,
        )  # fmt: skip
        self.decoder = PreviewDecoder(
            e.model_cfg.out_channels,
            spatial_stride=e.spec.spatial_stride,
            temporal_stride=e.spec.temporal_stride,
            seed=e.cfg.weights_seed,
        )
        self._it: Iterator[Chunk] | None = self.pipe.stream(text_embeds, e.max_blocks, noise=noise)
        self.blocks_done = 0

    @property
    def finished(self) -> bool:
        return self._it is None

    def set_prompt(self, text_embeds: torch.Tensor, recache: bool) -> int:
        """Switch the prompt; returns the first block produced under it (the next chunk's)."""
        self.pipe.set_prompt(text_embeds, recache=recache)
        return self.blocks_done

    def next_chunk(self) -> ChunkOut | None:
        """Generate, decode and encode the next chunk (None once the stream has ended)."""
        if self._it is None:
            return None
        cfg = self.engine.cfg
        t0 = time.perf_counter()
        with torch.inference_mode():
            chunk = next(self._it, None)
            if chunk is None:
                self.close()
                return None
            t1 = time.perf_counter()
            frames = to_uint8_frames(self.decoder.decode(chunk.latents.float()))
        t2 = time.perf_counter()
        images = tuple(encode_image(f, cfg.image_format, cfg.jpeg_quality) for f in frames)
        t3 = time.perf_counter()
        self.blocks_done += 1
        if chunk.last:
            self.close()
        return ChunkOut(int(chunk.block), frames, images, t1 - t0, t2 - t1, t3 - t2)

    def close(self) -> None:
        """End the stream and drop its state (KV cache, noise, decoder history)."""
        if self._it is not None:
            self._it.close()  # type: ignore[attr-defined]
            self._it = None
        self.pipe.state = None


class Engine:
    """The model shared by every session, the prompt encoder and the measured chunk cost.

    Building it builds the model (seconds for the tiny preset): do it at server start-up, not at import.
    """

    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.model_cfg = get_preset(cfg.preset)
        self.pipe_cfg = PipelineConfig(positions="relative")
        self.spec = VideoSpec(fps=cfg.fps)
        self.max_blocks = max(
            self.pipe_cfg.window_blocks,
            self.spec.blocks_for_seconds(cfg.max_session_s, self.pipe_cfg.frames_per_block),
        )
        self.model = CausalWanModel(self.model_cfg).init_random(cfg.weights_seed).eval()
        self.text = SeededTextEncoder(self.model_cfg.text_len, self.model_cfg.text_dim)
        self.costs = CostTracker(cfg.cost_window)
        self.calibration_s: list[float] = []

    @property
    def frame_shape(self) -> tuple[int, int]:
        """Decoded frame height and width (pixels)."""
        s = self.spec.spatial_stride
        return self.model_cfg.latent_height * s, self.model_cfg.latent_width * s

    def encode(self, prompt: str) -> torch.Tensor:
        """Prompt -> ``[1, text_len, text_dim]`` embeddings in the pipeline dtype."""
        return self.text.encode([prompt]).to(self.pipe_cfg.torch_dtype)

    def open_stream(self, prompt: str, seed: int) -> LiveStream:
        """A new live stream of ``prompt`` whose noise is drawn from ``seed``."""
        return LiveStream(self, self.encode(prompt), seed)

    def calibrate(self) -> list[float]:
        """Run an untimed warm-up stream; the costs of its steady chunks (after the first) seed the cost
        estimate. Returns them (seconds, measured)."""
        stream = self.open_stream("calibration", seed=self.cfg.weights_seed + 1)
        out: list[float] = []
        try:
            for i in range(self.cfg.calibration_chunks + 1):
                c = stream.next_chunk()
                if c is None:
                    break
                if i > 0:
                    out.append(c.cost_s)
                    self.costs.add(c.cost_s)
        finally:
            stream.close()
        self.calibration_s = out
        return out

    def chunk_cost_s(self) -> float:
        """Measured p99 chunk cost over the recent chunks of every session (and the calibration)."""
        p = self.costs.p99()
        if p != p:  # nan: nothing measured yet
            raise RuntimeError("chunk cost not measured yet: call calibrate() first")
        return p


__all__ = ["ChunkOut", "CostTracker", "Engine", "LiveStream", "encode_image"]
