"""The shared model of all sessions and one session's live stream on it.

:class:`ModelParts` is what a served model is made of: the DiT (shared read-only by every session), the
prompt encoder, a factory of per-stream decoders, the prompt rule and the descriptions the page and the
reports show. :func:`default_parts` builds them for the ``demo`` preset (the shipped trained DiT, text
encoder and autoencoder) and the ``tiny`` preset (seeded random weights, seeded embeddings, the preview
decoder); ``rolling-forcing serve`` builds them for every preset with ``generate``'s builders and checks
(``nki_ardiff/cli_serve.py``: ``--checkpoint``, ``--vae``, ``--text-encoder``).

:class:`Engine` holds the parts, encodes prompts, and measures the chunk cost (an untimed start-up
stream, then every chunk). :class:`LiveStream` is one session's stream: its own
:class:`RollingForcingPipeline` over the shared model (the pipeline holds the per-stream state: KV cache,
pending prompt), its RNG, its own decoder (a streaming decoder keeps a causal cache per stream) and its
image encoder. A stream is endless in practice: ``relative`` positions (any length) and noise drawn per
block (constant memory), bounded by ``ServeConfig.max_session_s``.
"""

from __future__ import annotations

import copy
import io
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rolling_forcing.config import ModelConfig, PipelineConfig, get_preset
from rolling_forcing.decode import PreviewDecoder, StreamingDecoder, WanVAEStreamingDecoder, to_uint8_frames
from rolling_forcing.guidance import guidance_text
from rolling_forcing.model import CausalWanModel
from rolling_forcing.pipeline import RollingForcingPipeline
from rolling_forcing.procedural import BACKGROUNDS, COLORS, SHAPES
from rolling_forcing.prompts import DEMO_SWITCH, MAX_OBJECTS, SWITCH_MODES, check_scene_prompt
from rolling_forcing.report import percentile
from rolling_forcing.serve.config import ServeConfig
from rolling_forcing.stream import Chunk, NoiseSource
from rolling_forcing.text import SeededTextEncoder
from rolling_forcing.video import VideoSpec

DEMO_PROMPT = "a red circle and a blue square bouncing on a gray background"
"""The page's first prompt for the demo preset (``generate``'s default prompt)."""

DEMO_PROMPT_HELP = (
    f"1 to {MAX_OBJECTS} '<colour> <shape>' objects on one '<background> background'; shape colours "
    f"{', '.join(COLORS)}; shapes {', '.join(SHAPES)}; backgrounds {', '.join(BACKGROUNDS)}"
)
"""The demo preset's prompt rule as the page shows it (:func:`rolling_forcing.prompts.check_scene_prompt`)."""


@dataclass(frozen=True)
class ModelParts:
    """A served model.

    Attributes:
        preset: the model preset (``rolling_forcing.config.PRESETS``).
        model_cfg: its :class:`ModelConfig`.
        model: the DiT, float32, eval mode; shared read-only by every session.
        encode: prompt -> float32 embeddings ``[1, text_len, text_dim]``.
        new_decoder: a fresh :class:`StreamingDecoder` for one stream (latents ``[1, F, C, h, w]`` ->
            video ``[1, T, 3, H, W]`` in [-1, 1]); it may share weights with the others, never state.
        weights, text, decoder: what each part is, for the page and the session reports.
        prompt_rule: raises ``ValueError`` naming the rule for a prompt this model cannot draw (None: any
            non-empty text).
        prompt_help: the prompt rule in words (empty when there is none).
        default_prompt: the page's first prompt (it passes ``prompt_rule``).
        switch: how the page switches a prompt by default (:data:`SWITCH_MODES`): ``"continue"`` (the
            stream continues under the new prompt), ``"recache"`` (and re-encodes its KV cache) or
            ``"restart"`` (the stream restarts under it: the demo model's, which cannot draw objects its
            context does not show, docs/demo_model.md).
    """

    preset: str
    model_cfg: ModelConfig
    model: CausalWanModel
    encode: Callable[[str], torch.Tensor]
    new_decoder: Callable[[], StreamingDecoder]
    weights: str
    text: str
    decoder: str
    prompt_rule: Callable[[str], object] | None = None
    prompt_help: str = ""
    default_prompt: str = "a red fox running through fresh snow"
    switch: str = "continue"

    def __post_init__(self) -> None:
        if self.switch not in SWITCH_MODES:
            raise ValueError(f"switch must be one of {SWITCH_MODES}, got {self.switch!r}")

    def describe(self) -> dict[str, str]:
        """Which model is served: preset, weights, text conditioning, decoder, prompt rule."""
        return {
            "preset": self.preset,
            "weights": self.weights,
            "text": self.text,
            "decoder": self.decoder,
            "guidance": guidance_text(self.model_cfg.guidance_scale, self.model_cfg.guidance_sigma_min),
            "prompt_rule": self.prompt_help,
            "switch": self.switch,
        }


def session_decoder(proto: Any) -> StreamingDecoder:
    """A decoder for one more stream, sharing ``proto``'s weights but not its causal cache (the demo
    autoencoder's, the Wan VAE's) or a new preview decoder with ``proto``'s projection."""
    from rolling_forcing.demo.autoencoder import DemoStreamingDecoder

    if isinstance(proto, DemoStreamingDecoder):
        return DemoStreamingDecoder(proto.model, backend=proto.backend)
    if isinstance(proto, WanVAEStreamingDecoder):
        return WanVAEStreamingDecoder(proto.vae, normalized=proto.normalized)
    if isinstance(proto, PreviewDecoder):  # stateless but for its frame count, which reset() renews
        dec = copy.copy(proto)
        dec.reset()
        return dec
    raise TypeError(f"no per-stream copy of a {type(proto).__name__} decoder")


def default_parts(cfg: ServeConfig) -> ModelParts:
    """The parts of ``cfg.preset`` without any file: ``demo`` (the shipped trained model,
    ``rolling_forcing.demo.load_demo``) or ``tiny`` (``init_random(cfg.weights_seed)``, seeded prompt
    embeddings, the preview decoder seeded with ``cfg.weights_seed``). Other presets need weights and a
    text encoder: ``ValueError`` (``rolling-forcing serve --checkpoint ... --text-encoder ...`` builds
    them)."""
    mcfg = get_preset(cfg.preset)
    if cfg.preset == "demo":
        from rolling_forcing.demo import load_demo

        demo = load_demo()
        mcfg, text_len = demo.model_cfg, demo.model_cfg.text_len

        def demo_encode(prompt: str) -> torch.Tensor:
            with torch.no_grad():
                return demo.text_encoder.encode([prompt])

        return ModelParts(
            "demo", mcfg, demo.model.float().eval(), demo_encode,
            lambda: session_decoder(demo.decoder), "shipped demo weights",
            "demo text encoder (trained with the DiT)", "demo autoencoder (streaming decoder, trained)",
            lambda p: check_scene_prompt(p, text_len), DEMO_PROMPT_HELP, DEMO_PROMPT, DEMO_SWITCH,
        )  # fmt: skip
    if cfg.preset == "tiny":
        text = SeededTextEncoder(mcfg.text_len, mcfg.text_dim)
        proto = PreviewDecoder(mcfg.out_channels, seed=cfg.weights_seed)
        return ModelParts(
            "tiny", mcfg, CausalWanModel(mcfg).init_random(cfg.weights_seed).eval(),
            lambda p: text.encode([p]), lambda: session_decoder(proto),
            f"random (init_random({cfg.weights_seed}))",
            "seeded embeddings (tiny preset; SHA-256 of the prompt)",
            "preview decoder (fixed linear latent->RGB, not a trained VAE)",
        )  # fmt: skip
    raise ValueError(
        f"preset: {cfg.preset!r} needs weights and a text encoder; build it with `rolling-forcing serve "
        f"--preset {cfg.preset} --checkpoint ... --text-encoder ...` (only demo and tiny need no files)"
    )


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
        self.decoder = e.parts.new_decoder()
        self._it: Iterator[Chunk] | None = self.pipe.stream(text_embeds, e.max_blocks, noise=noise)
        self.blocks_done = 0

    @property
    def finished(self) -> bool:
        return self._it is None

    def set_prompt(self, text_embeds: torch.Tensor, recache: bool, restart: bool = False) -> int:
        """Switch the prompt (``restart``: the stream restarts under it); returns the first block produced
        under it (the next chunk's)."""
        self.pipe.set_prompt(text_embeds, recache=recache, restart=restart)
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

    ``parts``: the served model (default :func:`default_parts` of ``cfg``; its preset must be
    ``cfg.preset``). Building it builds the model (seconds): do it at server start-up, not at import.
    """

    def __init__(self, cfg: ServeConfig, parts: ModelParts | None = None) -> None:
        self.cfg = cfg
        self.parts = default_parts(cfg) if parts is None else parts
        if self.parts.preset != cfg.preset:
            raise ValueError(f"parts are of preset {self.parts.preset!r}, cfg.preset is {cfg.preset!r}")
        self.model_cfg = self.parts.model_cfg
        self.pipe_cfg = PipelineConfig(positions="relative")
        self.spec = VideoSpec(fps=cfg.fps)
        self.max_blocks = max(
            self.pipe_cfg.window_blocks,
            self.spec.blocks_for_seconds(cfg.max_session_s, self.pipe_cfg.frames_per_block),
        )
        self.model = self.parts.model
        self.costs = CostTracker(cfg.cost_window)
        self.calibration_s: list[float] = []

    @property
    def frame_shape(self) -> tuple[int, int]:
        """Decoded frame height and width (pixels)."""
        s = self.spec.spatial_stride
        return self.model_cfg.latent_height * s, self.model_cfg.latent_width * s

    def check_prompt(self, prompt: str) -> None:
        """``ValueError`` naming the rule for a prompt this model cannot draw (``ModelParts.prompt_rule``)."""
        if self.parts.prompt_rule is not None:
            self.parts.prompt_rule(prompt)

    def encode(self, prompt: str) -> torch.Tensor:
        """Prompt -> ``[1, text_len, text_dim]`` embeddings in the pipeline dtype."""
        return self.parts.encode(prompt).to(self.pipe_cfg.torch_dtype)

    def open_stream(self, prompt: str, seed: int) -> LiveStream:
        """A new live stream of ``prompt`` whose noise is drawn from ``seed``."""
        return LiveStream(self, self.encode(prompt), seed)

    def calibrate(self) -> list[float]:
        """Run an untimed warm-up stream; the costs of its steady chunks (after the first) seed the cost
        estimate. Returns them (seconds, measured)."""
        stream = self.open_stream(self.parts.default_prompt, seed=self.cfg.weights_seed + 1)
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


__all__ = [
    "DEMO_PROMPT",
    "ChunkOut",
    "CostTracker",
    "Engine",
    "LiveStream",
    "ModelParts",
    "default_parts",
    "encode_image",
    "session_decoder",
]
