"""Configuration of the Wan2.1 causal DiT and of the Rolling Forcing stream (frozen dataclasses).

Every derived size (head dim, tokens per frame, tokens per block, key budget, buffer slots, warped
timesteps) is a computed property of the fields below, never a literal. Values of the original follow
Wan2.1-T2V-1.3B (github.com/Wan-Video/Wan2.1 @ 9737cba, ``wan/configs/wan_t2v_1_3B.py``) and Rolling
Forcing's ``rolling_forcing_dmd.yaml`` (github.com/TencentARC/RollingForcing @ a1477d0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

PositionMode = Literal["absolute", "relative"]
"""RoPE position modes of a stream (see :mod:`rolling_forcing.schedule`)."""

POSITION_MODES: tuple[PositionMode, ...] = ("absolute", "relative")

ORIGINAL_ATTENTION_FRAMES = 21
"""Latent frames of keys per denoising pass in the original Rolling Forcing code, for every step list:
``max_attention_size = 21 * frame_length`` is a constant of ``CausalWanSelfAttention`` (the teacher's
81-frame context; github.com/TencentARC/RollingForcing @ a1477d0, ``wan/modules/causal_model.py``). The
working cache gets what the sink and the window leave of it."""


def check_guidance(scale: object, name: str = "guidance_scale") -> float:
    """``scale`` as a float if it is a finite number >= 1 (1: no guidance), else ``ValueError`` naming it as
    ``name`` (``TypeError`` for a bool or a non-number). The one rule of every guidance scale."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{name} must be a number >= 1 (1: no guidance), got {scale!r}")
    if not (math.isfinite(scale) and scale >= 1.0):
        raise ValueError(f"{name} must be a finite number >= 1 (1: no guidance), got {scale!r}")
    return float(scale)


def check_sigma_min(value: object, name: str = "guidance_sigma_min") -> float:
    """``value`` as a float if it is a number in [0, 1) (the noise levels guided are those above it), else
    ``ValueError`` naming it as ``name`` (``TypeError`` for a bool or a non-number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number in [0, 1), got {value!r}")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1) (guidance where sigma > it), got {value!r}")
    return float(value)


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Wan2.1-style causal DiT.

    Latent video is ``[B, C, F, H, W]`` (``C = in_channels``); the patch embedding (Conv3d, kernel =
    stride = ``patch_size``) turns each latent frame into ``tokens_per_frame = (H/ph) * (W/pw)`` tokens.

    ``guidance_scale``: the classifier-free guidance the preset's weights stream with by default
    (:mod:`rolling_forcing.guidance`; a pipeline's ``guidance_scale=`` overrides it): 1 (none) for the
    distilled originals, more for the regression-trained demo model. ``guidance_sigma_min``: guidance
    applies to the frames whose noise level sigma exceeds it (a guidance interval; 0: every level).
    """

    name: str
    num_layers: int
    dim: int
    num_heads: int
    ffn_dim: int
    freq_dim: int
    text_dim: int
    text_len: int
    latent_height: int
    latent_width: int
    patch_size: tuple[int, int, int] = (1, 2, 2)
    in_channels: int = 16
    out_channels: int = 16
    eps: float = 1e-6
    guidance_scale: float = 1.0
    guidance_sigma_min: float = 0.0

    def __post_init__(self) -> None:
        check_guidance(self.guidance_scale, "ModelConfig.guidance_scale")
        check_sigma_min(self.guidance_sigma_min, "ModelConfig.guidance_sigma_min")
        for name in ("num_layers", "dim", "num_heads", "ffn_dim", "freq_dim", "text_dim", "text_len"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.num_heads:
            raise ValueError(f"ModelConfig.dim={self.dim} must be divisible by num_heads={self.num_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim = dim / num_heads = {self.head_dim} must be even (RoPE pairs)")
        if self.freq_dim % 2:
            raise ValueError(f"ModelConfig.freq_dim={self.freq_dim} must be even (cos and sin halves)")
        if len(self.patch_size) != 3 or self.patch_size[0] != 1:
            raise ValueError(
                f"patch_size must be (1, ph, pw) (one latent frame per token), got {self.patch_size}"
            )
        _, ph, pw = self.patch_size
        if self.latent_height % ph or self.latent_width % pw:
            raise ValueError(
                f"latent {self.latent_height}x{self.latent_width} must be divisible by patch {ph}x{pw}"
            )

    @property
    def head_dim(self) -> int:
        """``dim // num_heads`` (128 for Wan2.1-1.3B)."""
        return self.dim // self.num_heads

    @property
    def grid_hw(self) -> tuple[int, int]:
        """Patch rows and columns per latent frame ``(Hp, Wp)`` (30 x 52 for Wan2.1 at 480x832)."""
        return self.latent_height // self.patch_size[1], self.latent_width // self.patch_size[2]

    @property
    def tokens_per_frame(self) -> int:
        """Tokens of one latent frame, ``Hp * Wp`` (1,560 for Wan2.1 at 480x832)."""
        hp, wp = self.grid_hw
        return hp * wp

    @property
    def patch_out(self) -> int:
        """Output features of the head per token: ``prod(patch_size) * out_channels`` (64)."""
        p = self.patch_size
        return p[0] * p[1] * p[2] * self.out_channels

    def latent_frame_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of one latent frame."""
        return self.in_channels, self.latent_height, self.latent_width


_WAN21_1_3B = ModelConfig(
    name="wan2.1-1.3b",
    num_layers=30,
    dim=1536,
    num_heads=12,
    ffn_dim=8960,
    freq_dim=256,
    text_dim=4096,
    text_len=512,
    latent_height=60,
    latent_width=104,
)

DEMO_GUIDANCE = 3.0
"""The demo preset's classifier-free guidance scale, applied where sigma > :data:`DEMO_GUIDANCE_SIGMA_MIN`
(docs/demo_model.md, "Guidance": measured best on the quality bench)."""

DEMO_GUIDANCE_SIGMA_MIN = 0.85
"""The demo preset's guidance interval: the stream's three noisiest levels (sigma 1, 0.952, 0.882) are
guided, the last two (0.769, 0.556), where the shapes' kinds are decided, are not."""

PRESETS: dict[str, ModelConfig] = {
    "wan2.1-1.3b": _WAN21_1_3B,
    # Wan2.1-1.3B's real matrix sizes (dim, heads, FFN, text) with 2 layers and an 8x8 latent (16 tokens
    # per frame): CPU benchmarks of real-width layers in seconds (perf/bench_pipeline.py).
    "mid": replace(_WAN21_1_3B, name="mid", num_layers=2, latent_height=8, latent_width=8),
    # 12 heads like the real model (so head sharding is exercised), everything else tiny.
    "tiny": ModelConfig(
        name="tiny",
        num_layers=2,
        dim=192,
        num_heads=12,
        ffn_dim=384,
        freq_dim=64,
        text_dim=32,
        text_len=16,
        latent_height=8,
        latent_width=8,
    ),
    # the trained demo model (rolling_forcing/demo, docs/demo_model.md): 64x64-pixel procedural scenes,
    # 8x8x16 latents of the demo autoencoder, text from the demo's word-level text encoder.
    "demo": ModelConfig(
        name="demo",
        num_layers=4,
        dim=128,
        num_heads=4,
        ffn_dim=512,
        freq_dim=64,
        text_dim=64,
        text_len=16,
        latent_height=8,
        latent_width=8,
        guidance_scale=DEMO_GUIDANCE,
        guidance_sigma_min=DEMO_GUIDANCE_SIGMA_MIN,
    ),
    # even smaller: used by the long-stream (3,000 latent frames) memory test.
    "micro": ModelConfig(
        name="micro",
        num_layers=1,
        dim=96,
        num_heads=12,
        ffn_dim=96,
        freq_dim=16,
        text_dim=8,
        text_len=4,
        latent_height=4,
        latent_width=4,
        in_channels=4,
        out_channels=4,
    ),
}


def get_preset(name: str) -> ModelConfig:
    """The model preset ``name`` (one of :data:`PRESETS`); unknown names raise ``ValueError``."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}") from None


def flow_match_table(shift: float, num_train_timesteps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sigmas, timesteps)`` of the FlowMatch scheduler as the original builds it, float32 ``[N]``.

    ``FlowMatchScheduler(shift, sigma_min=0, extra_one_step=True).set_timesteps(N)``: sigma_i =
    shift(s_i) with s = linspace(1, 0, N+1)[:-1] and shift(s) = shift*s / (1 + (shift-1)*s), all in float32;
    ``timesteps = N * sigmas``.
    """
    s = torch.linspace(1.0, 0.0, num_train_timesteps + 1, dtype=torch.float32)[:-1]
    sigmas = shift * s / (1 + (shift - 1) * s)
    return sigmas, sigmas * num_train_timesteps


@dataclass(frozen=True)
class PipelineConfig:
    """Rolling Forcing stream parameters (defaults = the original).

    A *block* is ``frames_per_block`` latent frames; the rolling window holds ``window_blocks`` blocks at
    staggered noise levels (one per denoising step); the first ``sink_blocks`` block(s) stay in the cache
    for the whole stream (the attention sink); ``context_blocks`` recent clean blocks are attended in
    steady state (the working cache). The per-pass key budget is sink + context + window.

    ``context_blocks=None`` (default) derives it as the original does for any step list: what its fixed
    :data:`ORIGINAL_ATTENTION_FRAMES` (21-frame) budget leaves after the sink and the window, i.e.
    ``21 // frames_per_block - sink_blocks - window_blocks`` blocks (1 for the released 5 steps, 2 for 4
    steps, 0 for 6). A step list whose window and sink alone exceed the budget (7 or more steps of 3
    frames) is refused: the original then attends beyond the 21-frame context its model was trained on.
    An explicit ``context_blocks`` (>= 0) is taken as given (a larger budget than the original's).
    """

    frames_per_block: int = 3
    window_blocks: int = 5
    sink_blocks: int = 1
    context_blocks: int | None = None
    denoising_steps: tuple[int, ...] = (1000, 800, 600, 400, 200)
    timestep_shift: float = 5.0
    num_train_timesteps: int = 1000
    context_noise: int = 0
    dtype: str = "float32"
    positions: PositionMode = "absolute"
    rope_table_size: int = 1024

    def __post_init__(self) -> None:
        for name in ("frames_per_block", "window_blocks", "num_train_timesteps"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"PipelineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.context_blocks is not None and (
            isinstance(self.context_blocks, bool)
            or not isinstance(self.context_blocks, int)
            or self.context_blocks < 0
        ):
            raise ValueError(
                f"PipelineConfig.context_blocks must be an int >= 0 or None (derived from the original's "
                f"{ORIGINAL_ATTENTION_FRAMES}-frame attention budget), got {self.context_blocks!r}"
            )
        if self.sink_blocks != 1:
            raise ValueError(
                f"PipelineConfig.sink_blocks must be 1 (the original keeps exactly the first block), "
                f"got {self.sink_blocks}"
            )
        if len(self.denoising_steps) != self.window_blocks:
            raise ValueError(
                f"Rolling Forcing needs one window block per denoising step: len(denoising_steps)="
                f"{len(self.denoising_steps)} != window_blocks={self.window_blocks}"
            )
        if list(self.denoising_steps) != sorted(self.denoising_steps, reverse=True) or any(
            not 0 < t <= self.num_train_timesteps for t in self.denoising_steps
        ):
            raise ValueError(
                f"denoising_steps must be strictly decreasing in (0, {self.num_train_timesteps}], "
                f"got {self.denoising_steps}"
            )
        if len(set(self.denoising_steps)) != len(self.denoising_steps):
            raise ValueError(f"denoising_steps must be distinct, got {self.denoising_steps}")
        if self.context_blocks is None:
            object.__setattr__(self, "context_blocks", self._original_context_blocks())
        if self.dtype not in _DTYPES:
            raise ValueError(f"PipelineConfig.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.positions not in POSITION_MODES:
            raise ValueError(f"positions must be one of {POSITION_MODES}, got {self.positions!r}")
        if self.context_noise != 0:
            raise ValueError(f"context_noise must be 0 (the original's value), got {self.context_noise}")
        if self.rope_table_size < self.key_budget_frames:
            raise ValueError(
                f"rope_table_size={self.rope_table_size} is smaller than the key budget "
                f"({self.key_budget_frames} frames)"
            )

    def _original_context_blocks(self) -> int:
        """The working cache the original's fixed 21-frame budget leaves (see the class docstring)."""
        budget, fpb = ORIGINAL_ATTENTION_FRAMES, self.frames_per_block
        need = (self.sink_blocks + self.window_blocks) * fpb
        if budget % fpb or need > budget:
            raise ValueError(
                f"context_blocks=None derives the working cache from the original's {budget}-frame "
                f"attention budget, which {len(self.denoising_steps)} denoising steps of {fpb} frames cannot "
                f"follow: the sink and the window alone take {need} frames"
                + (f" (> {budget})" if need > budget else f" and {budget} is not a whole number of blocks")
                + "; the original then attends beyond the context its model was trained on. Use at most "
                f"{budget // fpb - self.sink_blocks} steps, or pass context_blocks explicitly"
            )
        return budget // fpb - self.sink_blocks - self.window_blocks

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def sink_frames(self) -> int:
        return self.sink_blocks * self.frames_per_block

    @property
    def window_frames(self) -> int:
        """Latent frames of a full window (15)."""
        return self.window_blocks * self.frames_per_block

    @property
    def key_budget_blocks(self) -> int:
        """Blocks of keys per pass: sink + working cache + window (7)."""
        assert self.context_blocks is not None  # set by __post_init__
        return self.sink_blocks + self.context_blocks + self.window_blocks

    @property
    def key_budget_frames(self) -> int:
        """Latent frames of keys per pass (21 = Wan's native 81-frame context)."""
        return self.key_budget_blocks * self.frames_per_block

    @property
    def ring_slots(self) -> int:
        """Ring slots for non-sink blocks: the update pass reads the last ``key_budget_blocks`` blocks (7)."""
        return self.key_budget_blocks

    @property
    def buffer_slots(self) -> int:
        """Block slots of the per-layer KV buffer: sink slot(s) + ring (8 = 24 frames)."""
        return self.sink_blocks + self.ring_slots

    @property
    def buffer_frames(self) -> int:
        return self.buffer_slots * self.frames_per_block

    def tokens_per_block(self, model: ModelConfig) -> int:
        """Tokens of one block (4,680 for Wan2.1-1.3B)."""
        return self.frames_per_block * model.tokens_per_frame

    def buffer_tokens(self, model: ModelConfig) -> int:
        """Tokens of the per-layer KV buffer (37,440 for Wan2.1-1.3B)."""
        return self.buffer_slots * self.tokens_per_block(model)

    def key_budget_tokens(self, model: ModelConfig) -> int:
        """Max keys per pass (32,760 for Wan2.1-1.3B)."""
        return self.key_budget_frames * model.tokens_per_frame

    # ---- scheduler -----------------------------------------------------------------------------
    def scheduler_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sigmas, timesteps)`` float32 ``[num_train_timesteps]`` (see :func:`flow_match_table`)."""
        return flow_match_table(self.timestep_shift, self.num_train_timesteps)

    @property
    def timesteps(self) -> tuple[float, ...]:
        """Warped denoising timesteps, noisiest first (1000, 952.38, 882.35, 769.23, 555.56).

        ``warp_denoising_step``: nominal step t maps to ``cat(timesteps, [0])[N - t]`` (float32 values).
        """
        _, ts = self.scheduler_table()
        full = torch.cat([ts, torch.zeros(1, dtype=torch.float32)])
        return tuple(float(full[self.num_train_timesteps - t]) for t in self.denoising_steps)

    @property
    def sigmas(self) -> tuple[float, ...]:
        """Noise level sigma of each warped timestep (float32 values; same order as :attr:`timesteps`)."""
        sig, _ = self.scheduler_table()
        full = torch.cat([sig, torch.zeros(1, dtype=torch.float32)])
        return tuple(float(full[self.num_train_timesteps - t]) for t in self.denoising_steps)


__all__ = [
    "DEMO_GUIDANCE",
    "DEMO_GUIDANCE_SIGMA_MIN",
    "PositionMode",
    "ModelConfig",
    "PRESETS",
    "POSITION_MODES",
    "PipelineConfig",
    "check_guidance",
    "check_sigma_min",
    "flow_match_table",
    "get_preset",
]
