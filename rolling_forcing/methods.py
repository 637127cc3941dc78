"""Streaming loops as data: a frozen description of each autoregressive video-diffusion method.

One :class:`StreamMethod` says everything the single driver (:class:`rolling_forcing.pipeline.
RollingForcingPipeline`) needs to run a method's loop with the same cache, schedule functions and
forward: frames per block, the step list and its shift/warp, the staggered window, the sink and whether
its RoPE positions are fixed or re-assigned, the per-pass attention budget, the cache-update pass, the
context noise, the re-cache on a prompt switch and the RNG order. The methods (public sources):

* ``rolling-forcing`` -- TencentARC/RollingForcing @ a1477d0 (``configs/rolling_forcing_dmd.yaml``,
  ``pipeline/rolling_forcing_inference.py``): 5-block staggered window, 5 warped steps, shift 5, a
  one-block sink re-roped just before the working cache, <= 21 attended frames.
* ``self-forcing`` -- guandeh17/Self-Forcing @ 33593df (``configs/self_forcing_dmd.yaml``,
  ``pipeline/causal_inference.py``): each 3-frame block denoised by 4 sequential calls at warped
  [1000, 750, 500, 250] (shift 5), then one t = 0 call that writes its clean k/v; global causal cache of
  21 frames (keys roped at absolute positions), no sink.
* ``causvid`` -- tianweiy/CausVid @ ca21150 (``configs/wan_causal_dmd.yaml``,
  ``causvid/models/wan/causal_inference.py``): as Self-Forcing with 3 un-warped steps [1000, 757, 522]
  at shift 8.
* ``longlive`` -- NVlabs/LongLive branch v1.0 @ e52d9ef (``configs/longlive_interactive_inference.yaml``,
  ``wan/modules/causal_model.py``, ``pipeline/interactive_causal_inference.py``): as Self-Forcing with a
  3-frame sink (the first block, fixed at positions 0..2) plus a 9-frame local window (12 attended
  frames), and on a prompt switch one clean re-cache pass of the last 12 frames under the new prompt that
  does not overwrite the sink.

RoPE position modes: ``"absolute"`` is each original's (keys stored roped at their absolute frame;
Self-Forcing and CausVid stop where their 21-frame cache ends, LongLive and Rolling Forcing at the
1024-position table); ``"relative"`` re-bases every pass's positions to start at 0 (LongLive's
"infinity" variant does this), so a stream has no length limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from rolling_forcing.config import ModelConfig, PipelineConfig, PositionMode, flow_match_table

SinkPositions = Literal["none", "fixed", "reassigned"]
RecacheMode = Literal["none", "ring", "window"]
RngOrder = Literal["window-slices", "per-block"]
AbsoluteLimit = Literal["cache", "rope-table"]
SINK_POSITIONS: tuple[SinkPositions, ...] = ("none", "fixed", "reassigned")
RECACHE_MODES: tuple[RecacheMode, ...] = ("none", "ring", "window")
RNG_ORDERS: tuple[RngOrder, ...] = ("window-slices", "per-block")
ABSOLUTE_LIMITS: tuple[AbsoluteLimit, ...] = ("cache", "rope-table")


@dataclass(frozen=True)
class StreamMethod:
    """Frozen description of one streaming loop (see the module docstring).

    Attributes:
        name: CLI name.
        frames_per_block: latent frames per block (3 for all four methods).
        denoising_steps: nominal steps, noisiest first.
        timestep_shift: flow-matching shift of the scheduler table.
        warp: True: nominal step t maps to the table's ``timesteps[N - t]`` (``warp_denoising_step``);
            False: the DiT sees t itself.
        window_blocks: blocks denoised together at staggered levels (Rolling Forcing: one per step);
            1 = sequential: each block is fully denoised (one call per step) before the next starts.
        sink_blocks: leading blocks kept in the cache for the whole stream (0: no sink).
        sink_positions: ``"none"``, ``"fixed"`` (stored roped at its own frames 0..; LongLive) or
            ``"reassigned"`` (stored un-roped, re-roped just before the working cache every pass; RF).
        attention_blocks: key budget of one pass in blocks, the sink and the pass's own block included
            (21 frames: Self-Forcing, CausVid, RF; 12 frames: LongLive).
        cache_update: True: one extra call per block at t = ``context_noise`` writes its clean k/v.
        context_noise: timestep of the cache-update call (0 in every original).
        recache: what ``set_prompt(recache=True)`` re-encodes: ``"ring"`` (this project's RF switch: every
            cached block, oldest first), ``"window"`` (LongLive: one pass over the last
            ``attention_blocks`` blocks with the sink protected), ``"none"``.
        rng_order: ``"window-slices"`` (RF: one whole-window draw per re-noised block) or ``"per-block"``
            (one block-shaped draw after each step but the last; the cache pass draws nothing). Both draw the
            initial noise of every frame up front.
        absolute_limit: where an ``"absolute"`` stream stops: ``"cache"`` (the original's cache holds
            ``attention_blocks`` blocks and does not roll: Self-Forcing, CausVid) or ``"rope-table"``.
        num_train_timesteps, rope_table_size: 1000 and 1024 in every original.
    """

    name: str
    frames_per_block: int
    denoising_steps: tuple[int, ...]
    timestep_shift: float
    warp: bool
    window_blocks: int
    sink_blocks: int
    sink_positions: SinkPositions
    attention_blocks: int
    cache_update: bool = True
    context_noise: int = 0
    recache: RecacheMode = "none"
    rng_order: RngOrder = "per-block"
    absolute_limit: AbsoluteLimit = "rope-table"
    num_train_timesteps: int = 1000
    rope_table_size: int = 1024

    def __post_init__(self) -> None:
        for name in ("frames_per_block", "window_blocks", "attention_blocks", "num_train_timesteps"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"StreamMethod.{name} must be >= 1, got {getattr(self, name)}")
        if (
            not self.denoising_steps
            or any(not 0 < t <= self.num_train_timesteps for t in self.denoising_steps)
            or list(self.denoising_steps) != sorted(set(self.denoising_steps), reverse=True)
        ):
            raise ValueError(
                f"denoising_steps must be strictly decreasing in (0, {self.num_train_timesteps}], "
                f"got {self.denoising_steps}"
            )
        if self.sink_positions not in SINK_POSITIONS:
            raise ValueError(f"sink_positions must be one of {SINK_POSITIONS}, got {self.sink_positions!r}")
        if (self.sink_blocks == 0) != (self.sink_positions == "none"):
            raise ValueError(
                f"sink_positions={self.sink_positions!r} does not fit sink_blocks={self.sink_blocks} "
                "('none' exactly when there is no sink)"
            )
        if self.recache not in RECACHE_MODES:
            raise ValueError(f"recache must be one of {RECACHE_MODES}, got {self.recache!r}")
        if self.rng_order not in RNG_ORDERS:
            raise ValueError(f"rng_order must be one of {RNG_ORDERS}, got {self.rng_order!r}")
        if self.absolute_limit not in ABSOLUTE_LIMITS:
            raise ValueError(f"absolute_limit must be one of {ABSOLUTE_LIMITS}, got {self.absolute_limit!r}")
        if self.context_noise != 0:
            raise ValueError(f"context_noise must be 0 (every original's value), got {self.context_noise}")
        if self.sequential and self.attention_blocks < self.sink_blocks + 1:
            raise ValueError(
                f"attention_blocks={self.attention_blocks} must hold the sink ({self.sink_blocks}) and the "
                "pass's own block"
            )

    # ---- derived -------------------------------------------------------------------------------
    @property
    def sequential(self) -> bool:
        """True when blocks are denoised one after another (window_blocks == 1)."""
        return self.window_blocks == 1

    @property
    def steps(self) -> int:
        return len(self.denoising_steps)

    @property
    def attention_frames(self) -> int:
        return self.attention_blocks * self.frames_per_block

    @property
    def ring_slots(self) -> int:
        """Non-sink slots of the sequential cache: the previous blocks read by a pass plus its own."""
        return self.attention_blocks - self.sink_blocks

    @property
    def buffer_slots(self) -> int:
        return self.sink_blocks + self.ring_slots

    def tokens_per_block(self, model: ModelConfig) -> int:
        return self.frames_per_block * model.tokens_per_frame

    def buffer_tokens(self, model: ModelConfig) -> int:
        """Tokens of the per-layer KV buffer of a sequential method (``attention_blocks`` blocks)."""
        return self.buffer_slots * self.tokens_per_block(model)

    def scheduler_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sigmas, timesteps)`` float32 ``[num_train_timesteps]`` at this method's shift."""
        return flow_match_table(self.timestep_shift, self.num_train_timesteps)

    @property
    def timesteps(self) -> tuple[float, ...]:
        """Timesteps the DiT sees, noisiest first (warped table values, or the nominal steps)."""
        if not self.warp:
            return tuple(float(t) for t in self.denoising_steps)
        _, ts = self.scheduler_table()
        full = torch.cat([ts, torch.zeros(1, dtype=torch.float32)])
        return tuple(float(full[self.num_train_timesteps - t]) for t in self.denoising_steps)

    def max_blocks(self, positions: str) -> int | None:
        """Longest stream (blocks) in ``positions`` mode; None: unbounded."""
        if positions == "relative":
            return None
        if self.absolute_limit == "cache":
            return self.attention_blocks
        return self.rope_table_size // self.frames_per_block

    def pipeline_config(self, dtype: str = "float32", positions: PositionMode = "absolute") -> PipelineConfig:
        """The :class:`PipelineConfig` of a staggered method (Rolling Forcing); ValueError otherwise."""
        if self.sequential:
            raise ValueError(f"method {self.name!r} is sequential: it has no Rolling Forcing PipelineConfig")
        return PipelineConfig(
            frames_per_block=self.frames_per_block,
            window_blocks=self.window_blocks,
            sink_blocks=self.sink_blocks,
            context_blocks=self.attention_blocks - self.sink_blocks - self.window_blocks,
            denoising_steps=self.denoising_steps,
            timestep_shift=self.timestep_shift,
            num_train_timesteps=self.num_train_timesteps,
            context_noise=self.context_noise,
            dtype=dtype,
            positions=positions,
            rope_table_size=self.rope_table_size,
        )


METHODS: dict[str, StreamMethod] = {
    "rolling-forcing": StreamMethod(
        name="rolling-forcing",
        frames_per_block=3,
        denoising_steps=(1000, 800, 600, 400, 200),
        timestep_shift=5.0,
        warp=True,
        window_blocks=5,
        sink_blocks=1,
        sink_positions="reassigned",
        attention_blocks=7,
        recache="ring",
        rng_order="window-slices",
        absolute_limit="rope-table",
    ),
    "self-forcing": StreamMethod(
        name="self-forcing",
        frames_per_block=3,
        denoising_steps=(1000, 750, 500, 250),
        timestep_shift=5.0,
        warp=True,
        window_blocks=1,
        sink_blocks=0,
        sink_positions="none",
        attention_blocks=7,
        absolute_limit="cache",
    ),
    "causvid": StreamMethod(
        name="causvid",
        frames_per_block=3,
        denoising_steps=(1000, 757, 522),
        timestep_shift=8.0,
        warp=False,
        window_blocks=1,
        sink_blocks=0,
        sink_positions="none",
        attention_blocks=7,
        absolute_limit="cache",
    ),
    "longlive": StreamMethod(
        name="longlive",
        frames_per_block=3,
        denoising_steps=(1000, 750, 500, 250),
        timestep_shift=5.0,
        warp=True,
        window_blocks=1,
        sink_blocks=1,
        sink_positions="fixed",
        attention_blocks=4,
        recache="window",
        absolute_limit="rope-table",
    ),
}

METHOD_NAMES = tuple(METHODS)


def get_method(name: str | StreamMethod) -> StreamMethod:
    """The method ``name`` (one of :data:`METHOD_NAMES`), or ``name`` itself if already a StreamMethod.

    Raises ``ValueError`` naming the choices for an unknown name.
    """
    if isinstance(name, StreamMethod):
        return name
    try:
        return METHODS[name]
    except (KeyError, TypeError):
        raise ValueError(f"method must be one of {list(METHOD_NAMES)}, got {name!r}") from None


__all__ = ["METHODS", "METHOD_NAMES", "StreamMethod", "get_method"]
