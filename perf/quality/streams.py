"""The model behind the quality bench (one adapter) and a stream runner that returns decoded frames.

:func:`load_model` is the only place that knows which model is measured: ``"tiny"`` (random weights,
hashed-prompt embeddings, the linear preview decoder: the pipeline's structure, no picture) or ``"demo"``
(the project's trained demo model, ``rolling_forcing.demo.load_demo``, once it is in the checkout).
:func:`run_stream` streams one prompt (optionally switching prompt mid-stream) through the public stream
APIs the ``generate`` command uses (``RollingForcingPipeline`` / ``ShardedRollingForcingPipeline``,
``NoiseSource``, a ``StreamingDecoder``, ``to_uint8_frames``) and returns uint8 frames ``[T, 64, 64, 3]``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rolling_forcing.config import ModelConfig, PipelineConfig, PositionMode, get_preset
from rolling_forcing.decode import PreviewDecoder, StreamingDecoder, to_uint8_frames
from rolling_forcing.model import CausalWanModel
from rolling_forcing.procedural import (
    COLORS,
    PROMPT_SIZES,
    PROMPT_SPEED,
    SHAPES,
    Scene,
    SceneConfig,
    Shape,
    check_sizes,
    check_speed,
    prompt_layout,
    prompt_words,
    render,
)
from rolling_forcing.prompts import SWITCH_MODES, switch_options
from rolling_forcing.stream import NoiseSource
from rolling_forcing.text import SeededTextEncoder, TextEncoder

__all__ = [
    "MODELS",
    "PromptLayout",
    "StreamModel",
    "StreamResult",
    "StreamSpec",
    "load_model",
    "run_stream",
    "scene_for_prompt",
    "switch_window",
    "trained_layout",
    "truth_stream",
]

MODELS = ("tiny", "demo")
DEFAULT_MODEL = "demo"
"""The model the bench measures unless told otherwise (becomes ``"demo"`` once the demo model lands)."""


@dataclass(frozen=True)
class PromptLayout:
    """The prompt layout a model was trained on (:func:`rolling_forcing.procedural.prompt_layout`): its
    ``speed`` (pixels per frame at 64 x 64) and ``sizes`` (per kind, pixels at 64 x 64). The video such a
    model is asked to draw for a prompt is that layout's render: :func:`truth_stream` with ``layout=``."""

    speed: float = PROMPT_SPEED
    sizes: Mapping[str, float] = field(default_factory=lambda: dict(PROMPT_SIZES))

    def __post_init__(self) -> None:
        check_speed(self.speed, "PromptLayout.speed")
        object.__setattr__(self, "sizes", check_sizes(self.sizes, "PromptLayout.sizes"))


def trained_layout(weights: str | Path | None) -> PromptLayout | None:
    """The prompt layout the demo weights in ``weights`` were trained on, from the ``train_log.json``
    ``train-demo`` writes beside them (or ``dit_train_log.json``, its name in the shipped weights'
    directory): ``prompt_speed``; ``prompt_sizes``, else the default table, which was the only one before
    it was logged. ``None`` (the shipped weights): the defaults, which are the shipped weights' by
    definition (``PROMPT_SPEED``, ``PROMPT_SIZES``). Returns ``None`` for a directory whose log is missing
    or has no ``prompt_speed`` (weights from before the speed was logged trained at another speed: their
    layout is unknown, not guessed)."""
    if weights is None:
        return PromptLayout()
    logs = [Path(weights) / name for name in ("train_log.json", "dit_train_log.json")]
    log = next((p for p in logs if p.is_file()), None)
    if log is None:
        return None
    rec = json.loads(log.read_text())
    if "prompt_speed" not in rec:
        return None
    return PromptLayout(float(rec["prompt_speed"]), rec.get("prompt_sizes") or PROMPT_SIZES)


@dataclass(frozen=True)
class StreamModel:
    """A model to stream: its config, the DiT (float32, eval), a text encoder, a decoder factory (a
    fresh or reset :class:`~rolling_forcing.decode.StreamingDecoder` per stream) and, if the model has an
    encoder, the autoencoder round trip."""

    name: str
    model_cfg: ModelConfig
    model: CausalWanModel
    text_encoder: TextEncoder
    make_decoder: Callable[[], StreamingDecoder]
    description: str
    roundtrip: Callable[[np.ndarray], np.ndarray] | None = None
    """The model's autoencoder, encode then decode, on uint8 frames ``[T, H, W, 3]`` (``T = 1 + 4k``): what
    the decoder can show at best (None: the model has no encoder, e.g. the preview decoder)."""
    layout: PromptLayout | None = None
    """The prompt layout the model was trained to draw (None: none, e.g. random weights, or unknown)."""


def load_model(name: str = DEFAULT_MODEL, *, seed: int = 0, weights: str | None = None) -> StreamModel:
    """The model ``name`` (one of :data:`MODELS`). ``"tiny"``: ``CausalWanModel.init_random(seed)``,
    :class:`~rolling_forcing.text.SeededTextEncoder`, :class:`~rolling_forcing.decode.PreviewDecoder`.
    ``"demo"``: the shipped demo weights, or those in the directory ``weights`` (a ``train-demo --out``
    directory); raises ``ValueError`` if this checkout has no demo model, or for ``weights`` with
    ``"tiny"``."""
    if weights is not None and name != "demo":
        raise ValueError(f"weights={weights!r} applies to model 'demo' only, got model {name!r}")
    if name == "tiny":
        cfg = get_preset("tiny")
        model = CausalWanModel(cfg).init_random(seed).eval()
        enc = SeededTextEncoder(cfg.text_len, cfg.text_dim)

        def preview() -> StreamingDecoder:
            return PreviewDecoder(cfg.out_channels, spatial_stride=8, temporal_stride=4, seed=seed)

        return StreamModel(name, cfg, model, enc, preview, "tiny preset: random weights, preview decoder")
    if name == "demo":
        import importlib

        try:  # imported by name: the package may not be in this checkout yet
            demo: Any = importlib.import_module("rolling_forcing.demo")
        except ImportError as exc:
            raise ValueError(f"model 'demo': rolling_forcing.demo is not in this checkout ({exc})") from None
        loaded: Any = demo.load_demo(weights)  # (model_cfg, model, text_encoder, decoder)
        cfg, model, enc, dec = loaded[0], loaded[1], loaded[2], loaded[3]

        def reset() -> StreamingDecoder:
            dec.reset()
            return dec

        ae: Any = getattr(dec, "model", None)  # DemoStreamingDecoder keeps its DemoAutoencoder

        def roundtrip(frames: np.ndarray) -> np.ndarray:
            x = torch.from_numpy(frames).float().permute(0, 3, 1, 2)[None] / 127.5 - 1.0
            with torch.no_grad():
                return to_uint8_frames(ae.decode(ae.encode(x)))

        desc = "demo model (trained, shipped)"
        return StreamModel(
            name, cfg, model.float().eval(), enc, reset, desc, roundtrip if ae is not None else None,
            trained_layout(weights),
        )  # fmt: skip
    raise ValueError(f"model must be one of {MODELS}, got {name!r}")


@dataclass(frozen=True)
class StreamSpec:
    """One stream: ``prompt``, ``num_blocks`` (>= 5), noise ``seed``; pipeline options as ``generate``:
    ``merged`` (None = the backend's default), ``cores`` (> 1: sharded over gloo ranks), ``backend``
    (None = reference), ``dtype`` (``"float32"`` / ``"bfloat16"``), ``positions``; ``upfront``: draw the
    initial noise up front (False: per block, constant memory for long streams). ``switch``: ``(prompt,
    block, mode)``: the stream's prompt becomes ``prompt`` from ``block`` on (>= 1), taken as ``mode``
    says (``SWITCH_MODES``: ``"continue"``, ``"recache"`` or ``"restart"``, ``set_prompt``'s options; the
    sharded stream has no restart)."""

    prompt: str
    num_blocks: int
    seed: int = 0
    merged: bool | None = None
    cores: int = 1
    backend: str | None = None
    dtype: str = "float32"
    positions: PositionMode = "absolute"
    upfront: bool = True
    switch: tuple[str, int, str] | None = None

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"StreamSpec.num_blocks must be >= 1, got {self.num_blocks}")
        if self.cores < 1:
            raise ValueError(f"StreamSpec.cores must be >= 1, got {self.cores}")
        if self.switch is not None and not 1 <= self.switch[1] < self.num_blocks:
            raise ValueError(
                f"StreamSpec.switch block must be in [1, num_blocks={self.num_blocks}), got {self.switch[1]}"
            )
        if self.switch is not None and self.switch[2] not in SWITCH_MODES:
            raise ValueError(f"StreamSpec.switch mode must be one of {SWITCH_MODES}, got {self.switch[2]!r}")
        if self.switch is not None and self.switch[2] == "restart" and self.cores > 1:
            raise ValueError(
                "StreamSpec.switch mode 'restart': the sharded stream (cores > 1) has no restart"
            )


@dataclass(frozen=True)
class StreamResult:
    """Decoded frames uint8 ``[T, H, W, 3]``, frames per chunk, the first frame of the switch block (None
    without a switch), measured wall clock (s) of the stream and its decode, whether the forward was
    merged."""

    frames: np.ndarray
    chunk_frames: tuple[int, ...]
    switch_frame: int | None
    wall_s: float
    merged: bool


class _Fp32Noise(NoiseSource):
    """Noise drawn in float32 and cast to the stream dtype: a bf16 stream sees the same noise as fp32."""

    def _randn(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=self.generator, dtype=torch.float32).to(self.dtype)


def switch_window(pipe_cfg: PipelineConfig, block: int) -> int:
    """The Rolling Forcing window at which a switch made after the chunk of ``block - 1`` takes effect:
    ``block - 1`` is finished by window ``block - 1 + window_blocks - 1``; the switch applies to the next."""
    return block + pipe_cfg.window_blocks - 1


def run_stream(sm: StreamModel, spec: StreamSpec) -> StreamResult:
    """Stream ``spec`` through ``sm`` and decode every chunk; see :class:`StreamSpec`. The model is cast to
    ``spec.dtype`` for the stream and back to float32 after."""
    pipe_cfg = PipelineConfig(dtype=spec.dtype, positions=spec.positions)
    dt = pipe_cfg.torch_dtype
    model = sm.model.to(dt)
    try:
        with torch.no_grad():  # a trained text encoder is an nn.Module
            emb = sm.text_encoder.encode([spec.prompt]).to(dt)
            new_emb = None if spec.switch is None else sm.text_encoder.encode([spec.switch[0]]).to(dt)
        decoder = sm.make_decoder()
        gen = torch.Generator().manual_seed(spec.seed)
        pipe: Any
        t0 = time.perf_counter()
        if spec.cores > 1:
            from sharding.pipeline import ShardedRollingForcingPipeline

            pipe = ShardedRollingForcingPipeline(
                model, sm.model_cfg, pipe_cfg, cores=spec.cores, backend=spec.backend,
                positions=spec.positions, merged=spec.merged,
            )  # fmt: skip
            if spec.switch is not None and new_emb is not None:
                pipe.set_prompt(
                    new_emb, spec.switch[2] == "recache", window=switch_window(pipe_cfg, spec.switch[1])
                )
            stream = pipe.stream(emb, spec.num_blocks, generator=gen, upfront=spec.upfront)
        else:
            from rolling_forcing.pipeline import RollingForcingPipeline

            pipe = RollingForcingPipeline(
                model, sm.model_cfg, pipe_cfg, backend=spec.backend, positions=spec.positions,
                merged=spec.merged,
            )  # fmt: skip
            noise = _Fp32Noise(
                1, sm.model_cfg.latent_frame_shape(), pipe_cfg.frames_per_block, spec.num_blocks, dt,
                generator=gen, upfront=spec.upfront,
            )  # fmt: skip
            stream = pipe.stream(emb, spec.num_blocks, generator=gen, noise=noise)
        frames: list[np.ndarray] = []
        switch_frame = None
        with torch.inference_mode():
            for chunk in stream:
                if spec.switch is not None and chunk.block == spec.switch[1]:
                    switch_frame = sum(f.shape[0] for f in frames)
                frames.append(to_uint8_frames(decoder.decode(chunk.latents.float())))
                if spec.cores == 1 and spec.switch is not None and chunk.block + 1 == spec.switch[1]:
                    pipe.set_prompt(new_emb, **switch_options(spec.switch[2]))
        wall = time.perf_counter() - t0
    finally:
        sm.model.float()
    return StreamResult(
        np.concatenate(frames), tuple(f.shape[0] for f in frames), switch_frame, wall, bool(pipe.merged)
    )


def scene_for_prompt(prompt: str, rng: np.random.Generator, config: SceneConfig | None = None) -> Scene:
    """A scene with exactly the prompt's objects (in order) and background, random sizes, start points and
    velocities from ``rng`` (the generator's ranges). Raises ``ValueError`` for a prompt without objects,
    with more than 3 or without a background colour."""
    config = SceneConfig() if config is None else config
    words = prompt_words(prompt)
    objs = [(a, b) for a, b in zip(words, words[1:]) if a in COLORS and b in SHAPES]
    bgs = [a for a, b in zip(words, words[1:]) if b == "background"]
    if not 1 <= len(objs) <= 3 or len(bgs) != 1:
        raise ValueError(
            f"prompt {prompt!r}: need 1-3 '<colour> <shape>' objects and one '<colour> background'"
        )
    shapes = []
    for color, kind in objs:
        size = float(rng.uniform(config.min_size, config.max_size))
        x0 = float(rng.uniform(size, config.width - size))
        y0 = float(rng.uniform(size, config.height - size))
        speed = float(rng.uniform(config.min_speed, config.max_speed))
        angle = float(rng.uniform(0, 2 * np.pi))
        shapes.append(Shape(kind, color, size, x0, y0, speed * np.cos(angle), speed * np.sin(angle)))
    return Scene(tuple(shapes), bgs[0], config)


def truth_stream(spec: StreamSpec, *, seed: int = 0, layout: PromptLayout | None = None) -> StreamResult:
    """The ideal stream of ``spec``: the procedural generator's own frames of a scene for the prompt
    (:func:`scene_for_prompt`, seeded), switching to a scene for the new prompt at the switch block; chunk
    sizes as a Rolling Forcing stream (9 frames, then 12). The bench's sanity baseline: the detector and
    metrics must find every target met on it.

    ``layout``: instead of random sizes, start points and velocities, the prompt layout a model was
    trained on (:class:`PromptLayout`; the scene is then a function of the prompt alone, ``seed`` does
    not matter), rendered from its frame 0, and after a switch the new prompt's layout from *its* frame 0
    (what a restarting switch asks for): the video the demo model is trained to draw for ``spec``."""
    rng = np.random.default_rng(seed)
    chunks = tuple([9] + [12] * (spec.num_blocks - 1))
    total = sum(chunks)
    t0 = time.perf_counter()

    def scene(prompt: str) -> Scene:
        s = scene_for_prompt(prompt, rng)
        return s if layout is None else prompt_layout(s, layout.speed, layout.sizes)

    frames = render(scene(spec.prompt), 0, total)
    switch_frame = None
    if spec.switch is not None:
        switch_frame = sum(chunks[: spec.switch[1]])
        start = switch_frame if layout is None else 0
        new = render(scene(spec.switch[0]), start, total - switch_frame)
        frames = np.concatenate([frames[:switch_frame], new])
    return StreamResult(frames, chunks, switch_frame, time.perf_counter() - t0, False)
