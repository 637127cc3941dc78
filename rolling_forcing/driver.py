"""The one stream driver of every method, unsharded and sharded alike.

:class:`StreamDriver` runs a stream's calls in order (Rolling Forcing windows or a sequential method's
steps, :func:`stream_plans`): the prompt switches (text k/v, the re-cache passes), the window input, the
flow -> x0 -> re-noise step, the cache update (run at once, or held back and carried by the next call's
merged forward) and the clean-block bookkeeping. What one forward does is the business of a
:class:`StreamPasses` object: the unsharded pipeline supplies :class:`rolling_forcing.passes.LocalPasses`
(``CausalWanModel.forward_with`` with closures over the cache), the sharded stream supplies
:class:`sharding.rank_stream.RankStream` (token-sharded forwards on one rank's heads). Both get the
:class:`~rolling_forcing.stream.StreamState` of the stream with every call.

How cache updates are run is the :class:`UpdateMode`:

* ``TWO_PASS``: the denoise forward, then (when the call has one) the cache-update forward at once.
* ``BATCHED``: the update is held back; the next call runs it with its own denoise in one merged forward
  (``StreamPasses.merged_pass``); a call with nothing held back runs a plain denoise forward.
* ``MERGED``: every call is one merged forward of static shape (a masked update when nothing is held
  back): Rolling Forcing's merged forward (:mod:`rolling_forcing.merged`) and the sequential methods'
  static forward.

In both held-back modes an update pending at a prompt switch belongs to the old prompt and runs alone
first; the last call's update (never read) is not run.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from nki_kernels import ops
from rolling_forcing import schedule, sequential
from rolling_forcing.cache import RollingKVCache
from rolling_forcing.config import ModelConfig, PipelineConfig, check_guidance, check_sigma_min
from rolling_forcing.guidance import GuidedNoise, combine_x0, frame_scales
from rolling_forcing.merged import MergedLayout, MergedStep, merged_step
from rolling_forcing.methods import StreamMethod
from rolling_forcing.model import CausalWanModel, add_noise, flow_to_x0
from rolling_forcing.schedule import WindowPlan, WritePass, resolve_positions
from rolling_forcing.sequential import RecachePlan, StepPlan
from rolling_forcing.stream import Chunk, NoiseSource, StreamState

Timing = PipelineConfig | StreamMethod
"""What the step functions read: ``frames_per_block``, ``timesteps`` (a PipelineConfig or a method)."""

Plan = WindowPlan | StepPlan
"""One call of a stream: a Rolling Forcing window or a sequential method's step."""

Switch = tuple[torch.Tensor, bool]
"""A prompt switch: (``text_embeds [B, L<=text_len, text_dim]``, recache)."""


# ---- pure helpers of the stream's calls ---------------------------------------------------------------
def check_stream_args(
    model: CausalWanModel,
    pipe_cfg: PipelineConfig,
    text_embeds: torch.Tensor,
    num_blocks: int,
    positions: str,
) -> None:
    """Validate a stream's prompt ``[B, L<=text_len, text_dim]`` and length before any work is done.

    Raises ``ValueError`` for a prompt of the wrong shape, ``num_blocks < window_blocks`` and, in
    ``"absolute"`` mode, a stream longer than the RoPE table.
    """
    model.check_context(text_embeds)
    schedule.window_range(pipe_cfg, num_blocks, 0)  # validates num_blocks
    if positions == "absolute":
        schedule.check_positions(pipe_cfg, num_blocks, "absolute")


def check_method_stream(
    model: CausalWanModel,
    method: StreamMethod,
    pipe_cfg: PipelineConfig,
    text_embeds: torch.Tensor,
    num_blocks: int,
    positions: str,
) -> None:
    """Validate a stream of any method before any work (a sequential method's length, or
    :func:`check_stream_args` for Rolling Forcing)."""
    if method.sequential:
        model.check_context(text_embeds)
        sequential.check_length(method, num_blocks, positions)
    else:
        check_stream_args(model, pipe_cfg, text_embeds, num_blocks, positions)


def stream_plans(
    method: StreamMethod, pipe_cfg: PipelineConfig, num_blocks: int, positions: str
) -> Iterator[Plan]:
    """The calls of a stream in order: Rolling Forcing windows (``pipe_cfg``), or a sequential method's
    steps; ``plan.index`` numbers them from 0."""
    if method.sequential:
        for i in range(sequential.num_steps(method, num_blocks)):
            yield sequential.step_plan(method, num_blocks, i, positions)
    else:
        for w in range(schedule.num_windows(pipe_cfg, num_blocks)):
            yield schedule.window_plan(pipe_cfg, num_blocks, w, positions)


def num_calls(method: StreamMethod, pipe_cfg: PipelineConfig, num_blocks: int) -> int:
    """Number of plans :func:`stream_plans` yields."""
    if method.sequential:
        return sequential.num_steps(method, num_blocks)
    return schedule.num_windows(pipe_cfg, num_blocks)


def window_input(
    pipe_cfg: Timing,
    plan: Plan,
    noise: NoiseSource,
    noisy: dict[int, torch.Tensor],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The window's latents ``[B, n*fpb, C, H, W]`` and per-frame timesteps ``[B, n*fpb]`` float32.

    The fresh block's input is drawn from ``noise``; every other block's current noisy latents are
    popped from ``noisy`` (block -> ``[B, fpb, C, H, W]``).
    """
    parts = []
    for b in plan.blocks:
        parts.append(noise.initial(b).to(device) if b == plan.fresh_block else noisy.pop(b))
    x_in = torch.cat(parts, dim=1)
    t_in = torch.tensor(schedule.frame_timesteps(pipe_cfg, plan.levels), dtype=torch.float32)
    return x_in, t_in[None].expand(x_in.shape[0], -1).contiguous()


def renoise_window(
    pipe_cfg: Timing,
    table: tuple[torch.Tensor, torch.Tensor],
    plan: Plan,
    x0: torch.Tensor,
    noise: NoiseSource,
    noisy: dict[int, torch.Tensor],
) -> None:
    """Re-noise the window's x0 ``[B, n*fpb, C, H, W]`` to each block's next level, into ``noisy``.

    One fresh whole-window sample per re-noised block (the original's RNG order), of which the block's
    slice is used; ``table`` is ``pipe_cfg.scheduler_table()``.
    """
    fpb = pipe_cfg.frames_per_block
    for b, nxt in plan.renoise:
        eps = noise.renoise(x0.shape[1]).to(x0.device).unflatten(0, x0.shape[:2])
        i = b - plan.start_block
        blk = x0[:, i * fpb : (i + 1) * fpb]
        noisy[b] = add_noise(blk, eps[:, i * fpb : (i + 1) * fpb], pipe_cfg.timesteps[nxt], table)


def merged_input(
    held: torch.Tensor | None,
    x_win: torch.Tensor,
    t_win: torch.Tensor,
    frames_per_block: int,
    frames: int,
    context_noise: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The input of one merged forward: ``frames`` frames = [update block, window, zero padding].

    ``held``: the held-back update block's clean x0 ``[B, fpb, C, H, W]`` (fpb = ``frames_per_block``), or
    None (a masked update: zeros); ``x_win`` ``[B, nf, C, H, W]``, ``t_win`` ``[B, nf]``. Returns x
    ``[B, frames, C, H, W]`` (x_win's dtype) and timesteps ``[B, frames]`` float32: ``context_noise`` on
    the update block, ``t_win`` on the window, 0 on the padding (``frames = fpb + nf``: no padding).
    Raises ``ValueError`` when the update block and the window do not fit in ``frames``.
    """
    bsz, nf = x_win.shape[:2]
    fpb = frames_per_block
    if frames < fpb + nf:
        raise ValueError(f"frames={frames} must hold the update block ({fpb} frames) and the window ({nf})")
    upd = held if held is not None else x_win.new_zeros((bsz, fpb, *x_win.shape[2:]))
    pad = x_win.new_zeros((bsz, frames - fpb - nf, *x_win.shape[2:]))
    x = torch.cat([upd, x_win, pad], dim=1)
    t = torch.zeros(bsz, frames, dtype=torch.float32)
    t[:, :fpb] = float(context_noise)
    t[:, fpb : fpb + nf] = t_win
    return x, t


def merged_call_step(
    method: StreamMethod,
    pipe_cfg: PipelineConfig,
    layout: MergedLayout,
    num_blocks: int,
    index: int,
    positions: str,
    update_index: int | None,
) -> MergedStep:
    """The :class:`~rolling_forcing.merged.MergedStep` of call ``index`` carrying the held-back update
    of call ``update_index`` (None: masked): :func:`rolling_forcing.merged.merged_step` for Rolling
    Forcing, :func:`rolling_forcing.sequential.static_step` for a sequential method."""
    if method.sequential:
        step: MergedStep = sequential.static_step(method, layout, num_blocks, index, positions, update_index)
        return step
    return merged_step(pipe_cfg, layout, num_blocks, index, positions, update_index)


# ---- the driver -------------------------------------------------------------------------------------
class UpdateMode(enum.Enum):
    """How a stream runs its cache updates (see the module docstring)."""

    TWO_PASS = "two-pass"
    BATCHED = "batched"
    MERGED = "merged"


def resolve_update_mode(
    method: StreamMethod, backend: str | None, merged: bool | None, static: bool = False
) -> UpdateMode:
    """The update mode of a stream from its front's ``merged`` / ``static`` options (the rule of every
    stream, unsharded and sharded).

    Rolling Forcing: ``merged`` True -> ``MERGED`` (needs ``ops.attention_block_table`` on ``backend``,
    else ``NotImplementedError``), False -> ``TWO_PASS``, None -> ``MERGED`` where that op runs. A
    sequential method: ``static=True`` -> ``MERGED`` (the static forward), ``merged`` True -> ``BATCHED``,
    else ``TWO_PASS``. Raises ``TypeError`` for a ``merged`` that is not a bool or None or a ``static``
    that is not a bool, ``ValueError`` for ``static=True`` with Rolling Forcing or with ``merged=False``.
    """
    if merged is not None and not isinstance(merged, bool):
        raise TypeError(f"merged must be a bool or None, got {type(merged).__name__}")
    if not isinstance(static, bool):
        raise TypeError(f"static must be a bool, got {type(static).__name__}")
    if static and not method.sequential:
        raise ValueError("static=True is for sequential methods (Rolling Forcing's merged forward is static)")
    if static and merged is False:
        raise ValueError("static=True batches the cache updates: it needs merged=True or None")
    if method.sequential:
        return UpdateMode.MERGED if static else UpdateMode.BATCHED if merged else UpdateMode.TWO_PASS
    supported = ops.has_kernel("attention_block_table", backend)
    if merged and not supported:
        raise NotImplementedError(
            f"merged=True needs ops.attention_block_table, which backend={backend!r} does not implement; "
            "use merged=False (two passes) or backend='reference'"
        )
    return UpdateMode.MERGED if (supported if merged is None else merged) else UpdateMode.TWO_PASS


@dataclass(frozen=True)
class HeldUpdate:
    """A cache update held back for the next call's merged forward: the call ``plan`` whose update it is
    and the clean x0 ``[B, fpb, C, H, W]`` of its start block."""

    plan: Plan
    clean: torch.Tensor

    @property
    def write(self) -> WritePass:
        return schedule.update_write(self.plan)


class StreamPasses(Protocol):
    """The forwards of one stream (unsharded: :class:`rolling_forcing.passes.LocalPasses`; sharded:
    :class:`sharding.rank_stream.RankStream`). Each counts its forwards in its own ``ForwardStats``."""

    def denoise_pass(self, st: StreamState, plan: Plan, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Denoise forward of ``plan``'s window ``x [B, nf, C, H, W]`` at ``t [B, nf]``; returns the flow
        (same shape as x)."""
        ...

    def merged_pass(
        self, st: StreamState, plan: Plan, held: HeldUpdate | None, x: torch.Tensor, t: torch.Tensor
    ) -> torch.Tensor:
        """One forward of :func:`merged_input`'s ``x, t`` (the ``held`` update, masked when None, with
        ``plan``'s denoise): the flow of the frames after the update block (padding included)."""
        ...

    def update_pass(
        self, st: StreamState, write: WritePass, x: torch.Tensor, t: torch.Tensor, kind: str
    ) -> None:
        """Cache-writing forward of one clean block ``x [B, fpb, C, H, W]`` at ``t``: only its k/v writes
        matter. ``kind``: ``"update"`` or ``"recache"`` (the forward counter's name)."""
        ...

    def recache_pass(self, st: StreamState, rp: RecachePlan, x: torch.Tensor, t: torch.Tensor) -> None:
        """LongLive's re-cache forward: the clean blocks ``rp.blocks`` (``x``, frames in order) under the
        new prompt, written to ``rp.slots``."""
        ...


@dataclass(frozen=True)
class DriverSpec:
    """What a stream is (frozen; the same for every stream of a pipeline).

    Attributes:
        method: the method (:mod:`rolling_forcing.methods`).
        pipe_cfg: Rolling Forcing's windows; also the clean-block bookkeeping of every method
            (:func:`rolling_forcing.schedule.kept_clean_blocks`).
        positions: ``"absolute"`` or ``"relative"``.
        mode: how cache updates run.
        merged_frames: frames of one merged forward (``MergedLayout.frames``; the batched forward: 0, the
            update block + the window, no padding).
        guidance: the classifier-free guidance scale (:mod:`rolling_forcing.guidance`); above 1 the stream's
            batch is ``[prompt rows | negative rows]`` (the front doubles it) and every call's x0 is
            combined before it is used; 1: no guidance. ``guidance_sigma_min``: only frames whose sigma
            is above it are guided (the others take the prompt half's x0).
    """

    method: StreamMethod
    pipe_cfg: PipelineConfig
    positions: str
    mode: UpdateMode
    merged_frames: int = 0
    guidance: float = 1.0
    guidance_sigma_min: float = 0.0

    @property
    def guided(self) -> bool:
        """True when the stream's batch is doubled for guidance (``guidance > 1``)."""
        return self.guidance > 1.0

    def __post_init__(self) -> None:
        check_guidance(self.guidance, "DriverSpec.guidance")
        check_sigma_min(self.guidance_sigma_min, "DriverSpec.guidance_sigma_min")
        resolve_positions(self.pipe_cfg, self.positions)  # the one positions rule (raises ValueError)
        if not isinstance(self.mode, UpdateMode):
            raise TypeError(f"mode must be an UpdateMode, got {type(self.mode).__name__}")
        if (self.mode is UpdateMode.MERGED) != (self.merged_frames > 0):
            raise ValueError(
                f"merged_frames must be > 0 exactly for UpdateMode.MERGED, got {self.merged_frames} with "
                f"{self.mode}"
            )

    @property
    def timing(self) -> Timing:
        return self.method if self.method.sequential else self.pipe_cfg


class StreamDriver:
    """Runs one stream (see the module docstring) on ``passes``.

    Args:
        model: the DiT (its ``text_kv`` computes a new prompt's text k/v cache).
        spec: the stream's method, positions and update mode.
        passes: the forwards.
    """

    def __init__(self, model: CausalWanModel, spec: DriverSpec, passes: StreamPasses) -> None:
        self.model, self.spec, self.passes = model, spec, passes
        self.timing = spec.timing
        self.table = self.timing.scheduler_table()

    def start(
        self,
        model_cfg: ModelConfig,
        text_embeds: torch.Tensor,
        num_blocks: int,
        *,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | NoiseSource | None = None,
        num_heads: int | None = None,
        kv_dtype: str | None = None,
        block_tokens: tuple[int, int] | None = None,
        num_slots: int | None = None,
    ) -> StreamState:
        """The state of a new stream: its noise (``noise``: initial noise ``[B, num_blocks*fpb, C, H, W]``
        or a :class:`NoiseSource`; None: drawn from ``generator`` up front, the originals' order), a KV
        cache on the model's device in ``pipe_cfg``'s dtype (``num_heads``: a tensor-parallel rank's head
        count; None: all) holding the text k/v of ``text_embeds`` ``[B, L<=text_len, text_dim]`` (all
        heads; ``kv_dtype``, ``block_tokens`` (a sequence-parallel rank's share of every block),
        ``num_slots``: see :class:`rolling_forcing.cache.RollingKVCache`). Inputs are checked by the front
        before (``check_method_stream``). A guided stream (``spec.guided``) takes ``text_embeds`` as
        ``[prompt | negative]`` (2B rows, :func:`rolling_forcing.guidance.guided_embeds`) and its noise (a
        ``NoiseSource`` or initial noise) for the B prompt rows, repeated for the negative rows
        (:class:`~rolling_forcing.guidance.GuidedNoise`)."""
        tim, dtype = self.timing, self.spec.pipe_cfg.torch_dtype
        bsz = text_embeds.shape[0]
        if isinstance(noise, NoiseSource):
            src = noise
        else:  # a guided stream draws the noise of its prompt rows only
            src = NoiseSource(
                bsz // 2 if self.spec.guided else bsz, model_cfg.latent_frame_shape(), tim.frames_per_block,
                num_blocks, dtype, generator=generator, initial_noise=noise,
            )  # fmt: skip
        if self.spec.guided:  # ... and repeats it for the negative rows (rolling_forcing.guidance)
            src = GuidedNoise(src)
        device = self.model.patch_embedding.weight.device
        cache = RollingKVCache(
            model_cfg, tim, bsz, device=device, dtype=dtype, num_heads=num_heads, kv_dtype=kv_dtype,
            block_tokens=block_tokens, num_slots=num_slots,
        )  # fmt: skip
        cache.set_text(self.model.text_kv(text_embeds.to(dtype)))
        return StreamState(num_blocks, cache, src)

    def run(
        self, st: StreamState, take_switch: Callable[[Plan], Switch | None]
    ) -> Generator[Chunk, None, None]:
        """Run the stream of ``st`` (from :meth:`start`), yielding each chunk when final.

        ``take_switch(plan)`` is asked before every call: the prompt switch to apply before it, or None
        (it is asked after the chunk of the call before was consumed, so a switch made then lands here).
        """
        spec, tim, passes = self.spec, self.timing, self.passes
        device = self.model.patch_embedding.weight.device
        fpb = tim.frames_per_block
        held: HeldUpdate | None = None
        for plan in stream_plans(spec.method, spec.pipe_cfg, st.num_blocks, spec.positions):
            st.window = plan.index
            switch = take_switch(plan)
            if switch is not None:
                if held is not None:  # the held-back update belongs to the old prompt: run it alone
                    self._update(st, held.write, held.clean)
                    held = None
                self._switch(st, switch, plan.start_block)
            x_in, t_in = window_input(tim, plan, st.noise, st.noisy, device)
            nf = x_in.shape[1]
            if spec.mode is UpdateMode.MERGED or (spec.mode is UpdateMode.BATCHED and held is not None):
                frames = spec.merged_frames or fpb + nf
                x, t = merged_input(
                    None if held is None else held.clean, x_in, t_in, fpb, frames, tim.context_noise
                )
                flow = passes.merged_pass(st, plan, held, x, t)[:, :nf]  # the padded window's frames
                if held is not None:
                    self._record_clean(st, held.plan.start_block, held.clean)
                held = None
            else:
                flow = passes.denoise_pass(st, plan, x_in, t_in)
            x0 = flow_to_x0(flow, x_in, t_in, self.table)
            if spec.guided:  # both halves continue from the guided x0 (rolling_forcing.guidance)
                x0 = combine_x0(x0, frame_scales(t_in, self.table, spec.guidance, spec.guidance_sigma_min))
            renoise_window(tim, self.table, plan, x0, st.noise, st.noisy)
            clean = x0[:, :fpb].contiguous()
            if plan.update is not None and spec.mode is UpdateMode.TWO_PASS:
                self._update(st, schedule.update_write(plan), clean)
            elif plan.update is not None:
                held = HeldUpdate(plan, clean)
            if plan.finished_block is not None:
                last = plan.start_block == st.num_blocks - 1
                out = clean[: clean.shape[0] // 2] if spec.guided else clean
                yield Chunk(plan.start_block, out, True, last, plan.index)

    def _context_t(self, x: torch.Tensor) -> torch.Tensor:
        """Timesteps ``[B, F]`` float32 = ``context_noise`` of clean frames ``x [B, F, C, H, W]``."""
        return torch.full(x.shape[:2], float(self.timing.context_noise), dtype=torch.float32)

    def _update(self, st: StreamState, write: WritePass, clean: torch.Tensor) -> None:
        """The cache-update forward of ``write.block`` alone; its x0 is then remembered."""
        self.passes.update_pass(st, write, clean, self._context_t(clean), "update")
        self._record_clean(st, write.block, clean)

    def _record_clean(self, st: StreamState, block: int, clean: torch.Tensor) -> None:
        """Remember the x0 of ``block``, now cached; forget blocks no longer cached (sink kept)."""
        st.clean[block] = clean
        keep = schedule.kept_clean_blocks(self.spec.pipe_cfg, block)
        for b in [b for b in st.clean if b not in keep]:
            del st.clean[b]

    def _switch(self, st: StreamState, switch: Switch, block: int) -> None:
        """Install a new prompt before the call of ``block``: its text k/v, then (if asked) the re-cache:
        Rolling Forcing's :func:`~rolling_forcing.schedule.recache_passes`, or LongLive's one pass
        (:func:`~rolling_forcing.sequential.recache_plan`, sink protected)."""
        spec = self.spec
        emb, recache = switch
        st.cache.set_text(self.model.text_kv(emb.to(spec.pipe_cfg.torch_dtype)))
        if not recache:
            return
        if spec.method.sequential:
            rp = sequential.recache_plan(spec.method, block, spec.positions)
            if rp is not None:
                x = torch.cat([st.clean[b] for b in rp.blocks], dim=1)
                self.passes.recache_pass(st, rp, x, self._context_t(x))
            return
        for w in schedule.recache_passes(spec.pipe_cfg, st.num_blocks, list(st.clean), spec.positions):
            x = st.clean[w.block]
            self.passes.update_pass(st, w, x, self._context_t(x), "recache")


__all__ = [
    "DriverSpec",
    "HeldUpdate",
    "Plan",
    "StreamDriver",
    "StreamPasses",
    "Switch",
    "Timing",
    "UpdateMode",
    "check_method_stream",
    "check_stream_args",
    "merged_call_step",
    "merged_input",
    "num_calls",
    "renoise_window",
    "resolve_positions",
    "resolve_update_mode",
    "stream_plans",
    "window_input",
]
