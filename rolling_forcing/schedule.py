"""Pure index maths of the Rolling Forcing stream: windows, noise levels, ring slots, RoPE positions.

Everything here is a pure function of ``(PipelineConfig, num_blocks, window index, positions mode)``
and reproduces the original's bookkeeping (github.com/TencentARC/RollingForcing @ a1477d0,
``pipeline/rolling_forcing_inference.py``; the per-window trace is in ``tests/test_cache_trace.py``):

* **Windows.** ``num_blocks + window_blocks - 1`` windows; window w holds blocks
  ``max(0, w - W + 1) .. min(num_blocks - 1, w)`` (W = ``window_blocks``).
* **Noise levels.** Level index ``i`` means timestep ``cfg.timesteps[i]`` (0 = noisiest, W-1 = the last
  step). A full window holds levels ``W-1, ..., 0`` oldest to newest; warm-up windows (start block 0)
  use the *last* n entries of that vector, tail windows (end block = last block) the *first* n.
  The oldest block of window ``w >= W-1`` is at the last level and is finished after the window.
* **Slots.** The per-layer KV buffer holds ``cfg.buffer_slots`` block slots: slot 0 is the sink (block
  0, stored *un-roped*); block ``b >= 1`` lives in ring slot ``1 + (b - 1) % ring_slots``. The original
  keeps a contiguous buffer and evicts by shifting slots 2..7 to 1..6; the ring stores the same blocks
  without copies, so the time order of the working cache is reconstructed from the ring (a range of
  blocks may wrap around the ring and then becomes two segments).
* **Denoise pass keys** (window w, start block s, n query blocks): during warm-up (s = 0) only the
  window's own keys. Otherwise: the sink re-roped at ``3s - working_frames - 3`` (just before the
  working cache), the working cache = blocks ``max(1, s - m) .. s-1`` with
  ``m = key_budget_blocks - n - sink_blocks`` (1 block in steady state, up to 5 in the tail), then the
  window's own keys. The placeholder the original writes for block s in this pass is never read (the
  update pass overwrites it before any read); :attr:`WindowPlan.write_slot` names that slot.
* **Update pass keys** (the finished-or-oldest block s at t=0): the last ``key_budget_blocks`` blocks
  ending at s, i.e. ``max(0, s + 1 - 7) .. s``; the sink is among them (re-roped at 0, its true position)
  only while ``s < key_budget_blocks``: the original drops it once the cache holds more than 7 blocks.
* **Positions.** ``"absolute"`` (the original): queries at their absolute frame index ``3s``; cached
  non-sink keys keep the position baked in when written (``3b``), the sink is re-roped every pass.
  ``"relative"``: every pass re-bases all positions so that its first key frame is at 0 (keys are then
  stored un-roped and roped when read). RoPE depends only on offsets, so both give the same attention
  up to rounding; relative positions never exceed ``key_budget_frames - 1`` and streams can be any length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from rolling_forcing.config import POSITION_MODES, PipelineConfig

if TYPE_CHECKING:
    from rolling_forcing.methods import StreamMethod
    from rolling_forcing.sequential import StepPlan


@dataclass(frozen=True)
class KeyBlock:
    """One block of keys read from the KV buffer in a pass.

    Attributes:
        block: stream block index.
        slot: buffer slot holding it (tokens ``[slot*T, (slot+1)*T)``, T = tokens per block).
        position: RoPE time position of its first frame in this pass.
        roped_in_cache: True when the buffer already holds the keys roped at ``position`` (read in
            place); False when the pass must rope a copy at ``position`` (the sink; every key in
            ``"relative"`` mode).
    """

    block: int
    slot: int
    position: int
    roped_in_cache: bool


@dataclass(frozen=True)
class PassPlan:
    """Keys and positions of one forward pass (denoise or cache update).

    ``cache_keys`` are in key order. For the denoise pass the window's own fresh keys follow them
    (``self_keys=True``); the update pass reads its own block back from the buffer (it is the last
    entry of ``cache_keys``) after writing it.
    """

    query_blocks: tuple[int, ...]
    query_position: int
    cache_keys: tuple[KeyBlock, ...]
    self_keys: bool

    def key_frames(self, frames_per_block: int) -> int:
        """Key frames of the pass (cache keys + own keys)."""
        own = len(self.query_blocks) if self.self_keys else 0
        return (len(self.cache_keys) + own) * frames_per_block


WindowKind = Literal["warmup", "full", "tail"]
"""What a window is (:func:`window_kind`): ``"full"`` (window_blocks blocks), ``"warmup"`` (it starts at
block 0 with fewer) or ``"tail"`` (it ends at the last block with fewer)."""


@dataclass(frozen=True)
class WindowPlan:
    """Everything the stream does in window ``index`` (see the module docstring)."""

    index: int
    kind: WindowKind
    start_block: int
    end_block: int  # inclusive
    levels: tuple[int, ...]  # level index per block, oldest first
    fresh_block: int | None  # block whose input is fresh initial noise (the newest, when it enters)
    finished_block: int | None  # block at the last level: its x0 is final after this window
    renoise: tuple[tuple[int, int], ...]  # (block, next level) re-noised after the denoise pass, in order
    write_slot: int  # slot of the start block (placeholder in the denoise pass, clean k/v in the update)
    store_roped: bool  # the update pass stores roped keys (absolute mode, non-sink block)
    denoise: PassPlan
    update: PassPlan

    @property
    def blocks(self) -> tuple[int, ...]:
        return tuple(range(self.start_block, self.end_block + 1))

    @property
    def num_blocks(self) -> int:
        return self.end_block - self.start_block + 1

    @property
    def prompt_boundary(self) -> bool:
        """A prompt switch may take effect before any window."""
        return True


def _check(cfg: PipelineConfig, num_blocks: int, window: int | None = None) -> None:
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int):
        raise TypeError(f"num_blocks must be an int, got {type(num_blocks).__name__}")
    if num_blocks < cfg.window_blocks:
        raise ValueError(
            f"num_blocks={num_blocks} is too short: Rolling Forcing needs at least window_blocks="
            f"{cfg.window_blocks} blocks ({cfg.window_blocks * cfg.frames_per_block} latent frames); with "
            "fewer, the warm-up re-injects fresh noise into unfinished blocks"
        )
    if window is not None and not 0 <= window < num_windows(cfg, num_blocks):
        raise ValueError(
            f"window={window} is outside [0, {num_windows(cfg, num_blocks)}) for {num_blocks} blocks"
        )


def num_windows(cfg: PipelineConfig, num_blocks: int) -> int:
    """Windows of a stream of ``num_blocks`` blocks: ``num_blocks + window_blocks - 1``."""
    return num_blocks + cfg.window_blocks - 1


def window_range(cfg: PipelineConfig, num_blocks: int, window: int) -> tuple[int, int]:
    """``(start_block, end_block)`` (inclusive) of ``window``."""
    _check(cfg, num_blocks, window)
    return max(0, window - cfg.window_blocks + 1), min(num_blocks - 1, window)


def window_kind(cfg: PipelineConfig, num_blocks: int, window: int) -> WindowKind:
    """``"full"`` (window_blocks blocks), ``"warmup"`` (start block 0) or ``"tail"`` (end = last block)."""
    s, e = window_range(cfg, num_blocks, window)
    n = e - s + 1
    if n == cfg.window_blocks:
        return "full"
    return "warmup" if s == 0 else "tail"


def block_levels(cfg: PipelineConfig, num_blocks: int, window: int) -> tuple[int, ...]:
    """Level index of each block of ``window``, oldest first (0 = noisiest step, W-1 = last step)."""
    s, e = window_range(cfg, num_blocks, window)
    n = e - s + 1
    full = tuple(range(cfg.window_blocks - 1, -1, -1))  # oldest (last step) ... newest (first step)
    kind = window_kind(cfg, num_blocks, window)
    if kind == "full":
        return full
    return full[-n:] if kind == "warmup" else full[:n]


def frame_timesteps(cfg: PipelineConfig | StreamMethod, levels: Sequence[int]) -> tuple[float, ...]:
    """Per-frame timesteps (float32 values) of blocks at ``levels``: each repeated ``frames_per_block``."""
    ts = cfg.timesteps
    return tuple(ts[lv] for lv in levels for _ in range(cfg.frames_per_block))


def slot_of(cfg: PipelineConfig, block: int) -> int:
    """Buffer slot of ``block``: 0 for the sink, else ring slot ``1 + (block - 1) % ring_slots``."""
    if block < 0:
        raise ValueError(f"block must be >= 0, got {block}")
    if block < cfg.sink_blocks:
        return block
    return cfg.sink_blocks + (block - cfg.sink_blocks) % cfg.ring_slots


def resolve_positions(cfg: PipelineConfig, positions: str | None) -> str:
    """The RoPE position mode of a stream: ``positions``, or ``cfg.positions`` when None.

    Raises ``ValueError`` naming ``positions`` if it is not one of ``POSITION_MODES``.
    """
    mode = cfg.positions if positions is None else positions
    if mode not in POSITION_MODES:
        raise ValueError(f"positions must be one of {POSITION_MODES}, got {mode!r}")
    return mode


def denoise_pass(cfg: PipelineConfig, num_blocks: int, window: int, positions: str | None = None) -> PassPlan:
    """Keys and positions of the denoise pass of ``window`` (see the module docstring)."""
    mode = resolve_positions(cfg, positions)
    s, e = window_range(cfg, num_blocks, window)
    fpb = cfg.frames_per_block
    n = e - s + 1
    query = tuple(range(s, e + 1))
    if s < cfg.sink_blocks:  # warm-up: the write lands in the sink slot; no cache read
        return PassPlan(query, s * fpb, (), True)
    m = cfg.key_budget_blocks - n - cfg.sink_blocks  # working-cache budget in blocks
    working = tuple(range(max(cfg.sink_blocks, s - m), s))
    if mode == "absolute":
        sink_pos = (s - len(working) - cfg.sink_blocks) * fpb
        keys = [KeyBlock(0, slot_of(cfg, 0), sink_pos, False)]
        keys += [KeyBlock(b, slot_of(cfg, b), b * fpb, True) for b in working]
        return PassPlan(query, s * fpb, tuple(keys), True)
    keys = [KeyBlock(0, slot_of(cfg, 0), 0, False)]
    keys += [KeyBlock(b, slot_of(cfg, b), (cfg.sink_blocks + i) * fpb, False) for i, b in enumerate(working)]
    return PassPlan(query, (cfg.sink_blocks + len(working)) * fpb, tuple(keys), True)


def update_pass(cfg: PipelineConfig, num_blocks: int, window: int, positions: str | None = None) -> PassPlan:
    """Keys and positions of the cache-update pass (start block at t=0) of ``window``."""
    mode = resolve_positions(cfg, positions)
    s, _ = window_range(cfg, num_blocks, window)
    fpb = cfg.frames_per_block
    first = max(0, s + 1 - cfg.key_budget_blocks)
    blocks = range(first, s + 1)
    if mode == "absolute":
        keys = tuple(KeyBlock(b, slot_of(cfg, b), b * fpb, b >= cfg.sink_blocks) for b in blocks)
        return PassPlan((s,), s * fpb, keys, False)
    keys = tuple(KeyBlock(b, slot_of(cfg, b), (b - first) * fpb, False) for b in blocks)
    return PassPlan((s,), (s - first) * fpb, keys, False)


def window_plan(
    cfg: PipelineConfig, num_blocks: int, window: int, positions: str | None = None
) -> WindowPlan:
    """The full plan of ``window``: blocks, levels, noise actions, slots, both passes."""
    mode = resolve_positions(cfg, positions)
    s, e = window_range(cfg, num_blocks, window)
    kind = window_kind(cfg, num_blocks, window)
    levels = block_levels(cfg, num_blocks, window)
    last = cfg.window_blocks - 1
    fresh = e if kind in ("full", "warmup") else None
    finished = s if levels[0] == last else None
    renoise = tuple((b, lv + 1) for b, lv in zip(range(s, e + 1), levels) if lv != last)
    return WindowPlan(
        index=window,
        kind=kind,
        start_block=s,
        end_block=e,
        levels=levels,
        fresh_block=fresh,
        finished_block=finished,
        renoise=renoise,
        write_slot=slot_of(cfg, s),
        store_roped=mode == "absolute" and s >= cfg.sink_blocks,
        denoise=denoise_pass(cfg, num_blocks, window, mode),
        update=update_pass(cfg, num_blocks, window, mode),
    )


@dataclass(frozen=True)
class WritePass:
    """One cache-writing forward of one block (a cache update, or a Rolling Forcing re-cache pass).

    Attributes:
        block: the block whose clean x0 is encoded.
        pass_: its keys and positions (the block itself is the last cache key: it is read back after the
            write).
        slot: buffer slot written.
        store_roped: the keys are stored roped at ``pass_.query_position`` (absolute mode, non-sink).
    """

    block: int
    pass_: PassPlan
    slot: int
    store_roped: bool


def update_write(plan: WindowPlan | StepPlan) -> WritePass:
    """The cache-update forward of ``plan``'s start block (a window, or a sequential method's step whose
    ``update`` is set; raises ``ValueError`` for a step without one)."""
    if plan.update is None:
        raise ValueError(f"call {plan.index} has no cache update")
    return WritePass(plan.start_block, plan.update, plan.write_slot, plan.store_roped)


def kept_clean_blocks(cfg: PipelineConfig, block: int) -> set[int]:
    """Blocks whose clean x0 a stream keeps once ``block`` is cached (for a re-cache at a prompt switch):
    the sink blocks and the ``ring_slots`` newest blocks ending at ``block`` (the blocks still cached)."""
    sink = set(range(cfg.sink_blocks))
    return sink | set(range(max(cfg.sink_blocks, block - cfg.ring_slots + 1), block + 1))


def recache_passes(
    cfg: PipelineConfig, num_blocks: int, present: Sequence[int], positions: str | None = None
) -> tuple[WritePass, ...]:
    """Rolling Forcing's re-cache at a prompt switch (this project's adaptation of LongLive's KV
    re-cache): one update-only forward per clean block still cached (``present``), oldest first, each at
    the slot and position of its original cache update (the update pass of window
    ``b + window_blocks - 1``), attending to the cached blocks before it with the keys of blocks evicted
    since then (older than the oldest ring block present) left out; the sink is kept.
    """
    mode = resolve_positions(cfg, positions)
    blocks = sorted(present)
    oldest_ring = min((b for b in blocks if b >= cfg.sink_blocks), default=0)
    out = []
    for b in blocks:
        plan = window_plan(cfg, num_blocks, b + cfg.window_blocks - 1, mode)
        keys = tuple(k for k in plan.update.cache_keys if k.block < cfg.sink_blocks or k.block >= oldest_ring)
        upd = PassPlan(plan.update.query_blocks, plan.update.query_position, keys, False)
        out.append(WritePass(b, upd, plan.write_slot, plan.store_roped))
    return tuple(out)


def max_position(cfg: PipelineConfig, num_blocks: int, positions: str | None = None) -> int:
    """Largest RoPE time position any pass of the stream uses."""
    mode = resolve_positions(cfg, positions)
    _check(cfg, num_blocks)
    if mode == "absolute":
        return num_blocks * cfg.frames_per_block - 1
    return min(num_blocks * cfg.frames_per_block, cfg.key_budget_frames) - 1


def check_positions(cfg: PipelineConfig, num_blocks: int, positions: str | None = None) -> None:
    """Raise ``ValueError`` if the stream needs RoPE positions beyond ``cfg.rope_table_size``."""
    mode = resolve_positions(cfg, positions)
    top = max_position(cfg, num_blocks, mode)
    if top >= cfg.rope_table_size:
        raise ValueError(
            f"num_blocks={num_blocks} ({num_blocks * cfg.frames_per_block} latent frames) needs RoPE time "
            f"position {top}, beyond the {cfg.rope_table_size}-position table of positions='absolute' (the "
            f"original's limit: at most {cfg.rope_table_size // cfg.frames_per_block} blocks); use "
            "positions='relative' for longer streams"
        )


def segments(keys: Sequence[KeyBlock], tokens_per_block: int) -> list[tuple[int, int]]:
    """Token ranges ``(start, length)`` of ``keys`` in key order; consecutive slots are merged.

    A working cache that wraps around the ring yields two segments (time order is kept).
    """
    out: list[tuple[int, int]] = []
    prev_slot = None
    for kb in keys:
        start = kb.slot * tokens_per_block
        if out and prev_slot is not None and kb.slot == prev_slot + 1:
            s0, n0 = out[-1]
            out[-1] = (s0, n0 + tokens_per_block)
        else:
            out.append((start, tokens_per_block))
        prev_slot = kb.slot
    return out


__all__ = [
    "KeyBlock",
    "PassPlan",
    "WindowPlan",
    "WritePass",
    "block_levels",
    "check_positions",
    "denoise_pass",
    "frame_timesteps",
    "kept_clean_blocks",
    "max_position",
    "num_windows",
    "recache_passes",
    "segments",
    "slot_of",
    "update_pass",
    "update_write",
    "window_kind",
    "window_plan",
    "window_range",
]
