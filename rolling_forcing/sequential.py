"""Pure index maths of the sequential loops (Self-Forcing, CausVid, LongLive): steps, slots, positions.

A sequential method (``StreamMethod.window_blocks == 1``) denoises block b by ``steps`` calls, one per
step, each a one-block "window" at that step's level, then (``cache_update``) one call on the block's x0
at t = ``context_noise`` that writes its clean k/v. Step ``i`` of the stream is block ``i // steps``
at level ``i % steps``. The plans use the same records as Rolling Forcing's (:class:`~rolling_forcing.
schedule.KeyBlock`, :class:`~rolling_forcing.schedule.PassPlan`) so one driver runs both.

* **Slots.** ``sink_blocks`` sink slots, then a ring of ``ring_slots = attention_blocks - sink_blocks``
  slots: block ``b >= sink_blocks`` lives in ``sink_blocks + (b - sink_blocks) % ring_slots``. The
  originals keep a contiguous buffer and shift it left on eviction; the ring holds the same blocks.
* **Keys of block b** (every call of the block): the sink blocks (once b is past them), the previous
  non-sink blocks ``max(sink_blocks, b - ring_slots + 1) .. b - 1``, then the block itself (its own
  fresh keys in a denoise call; read back after the write in the cache-update call). The originals write
  the block's k/v before every call; only the last (clean) write persists, so the denoise calls' writes
  are skipped.
* **Positions.** ``"absolute"``: keys are stored roped at their absolute frame ``fpb * b`` (the sink
  too: LongLive's sink stays at 0..2); the query is at ``fpb * b``. ``"relative"``: keys are stored
  un-roped and every pass ropes them at ``fpb * i`` for the i-th key block; the query is the last.
* **Re-cache** (LongLive, at the first block ``b`` after a prompt switch): one clean pass over the last
  ``attention_blocks`` blocks ``R = max(0, b - A) .. b - 1`` under the new prompt. When R starts after
  block 0 the original protects the sink: it keeps the old sink, and only the last ``ring_slots``
  blocks of R are written and attended (the first block of R is computed but neither stored nor read,
  so it changes nothing and is not run here). When R starts at block 0 every block of R is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rolling_forcing.methods import StreamMethod
from rolling_forcing.schedule import KeyBlock, PassPlan


@dataclass(frozen=True)
class StepPlan:
    """One call of a sequential stream (the fields the driver reads, like a Rolling Forcing window)."""

    index: int
    start_block: int
    levels: tuple[int, ...]  # (level of the block,)
    fresh_block: int | None  # the block, at its first step
    finished_block: int | None  # the block, at its last step
    renoise: tuple[tuple[int, int], ...]  # ((block, next level),) except at the last step
    write_slot: int
    store_roped: bool
    denoise: PassPlan
    update: PassPlan | None  # the cache-update call after the last step (None otherwise)
    prompt_boundary: bool  # a prompt switch may take effect before this call (first step of a block)

    @property
    def blocks(self) -> tuple[int, ...]:
        return (self.start_block,)


@dataclass(frozen=True)
class RecachePlan:
    """The re-cache pass at block ``block``: queries ``blocks`` (clean, t = context_noise), written to
    ``slots``, attending to ``pass_.cache_keys`` (the protected sink, if any) + their own keys."""

    block: int
    blocks: tuple[int, ...]
    slots: tuple[int, ...]
    store_roped: bool
    pass_: PassPlan


def _check(method: StreamMethod, num_blocks: int) -> None:
    if not method.sequential:
        raise ValueError(f"method {method.name!r} is not sequential (window_blocks={method.window_blocks})")
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int):
        raise TypeError(f"num_blocks must be an int, got {type(num_blocks).__name__}")
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")


def check_length(method: StreamMethod, num_blocks: int, positions: str) -> None:
    """Raise ``ValueError`` if ``num_blocks`` is not a valid stream length of ``method`` in ``positions``."""
    _check(method, num_blocks)
    top = method.max_blocks(positions)
    if top is not None and num_blocks > top:
        what = (
            f"its {method.attention_frames}-frame KV cache (the original does not roll it)"
            if method.absolute_limit == "cache"
            else f"the {method.rope_table_size}-position RoPE table"
        )
        raise ValueError(
            f"num_blocks={num_blocks} is too long for method {method.name!r} with positions='absolute': "
            f"at most {top} blocks fit {what}; use positions='relative' for unbounded streams"
        )


def num_steps(method: StreamMethod, num_blocks: int) -> int:
    """Calls of the stream that carry a denoise pass: ``num_blocks * steps``."""
    _check(method, num_blocks)
    return num_blocks * method.steps


def slot_of(method: StreamMethod, block: int) -> int:
    """Buffer slot of ``block`` (sink slots first, then the ring)."""
    if block < 0:
        raise ValueError(f"block must be >= 0, got {block}")
    s = method.sink_blocks
    return block if block < s else s + (block - s) % method.ring_slots


def key_blocks(method: StreamMethod, block: int) -> tuple[int, ...]:
    """Blocks attended by every call of ``block``, in key order, the block itself last."""
    s = method.sink_blocks
    sink = tuple(range(min(s, block)))
    prev = tuple(range(max(s, block - method.ring_slots + 1), block))
    return (*sink, *prev, block)


def _keys(
    method: StreamMethod, blocks: tuple[int, ...], own: tuple[int, ...], positions: str
) -> tuple[tuple[KeyBlock, ...], int]:
    """KeyBlocks of the cached ``blocks`` (all but ``own``) and the query position of ``own``."""
    fpb = method.frames_per_block
    absolute = positions == "absolute"
    keys = []
    for i, b in enumerate(blocks):
        if b in own:
            continue
        pos = b * fpb if absolute else i * fpb
        keys.append(KeyBlock(b, slot_of(method, b), pos, absolute))
    qpos = own[0] * fpb if absolute else blocks.index(own[0]) * fpb
    return tuple(keys), qpos


def step_plan(method: StreamMethod, num_blocks: int, step: int, positions: str) -> StepPlan:
    """The plan of call ``step`` (block ``step // steps`` at level ``step % steps``)."""
    n = num_steps(method, num_blocks)
    if not 0 <= step < n:
        raise ValueError(f"step={step} is outside [0, {n}) for {num_blocks} blocks")
    b, lv = divmod(step, method.steps)
    last = lv == method.steps - 1
    blocks = key_blocks(method, b)
    prev, qpos = _keys(method, blocks, (b,), positions)
    denoise = PassPlan((b,), qpos, prev, True)
    update = None
    if last and method.cache_update:
        absolute = positions == "absolute"
        own = KeyBlock(b, slot_of(method, b), qpos, absolute)
        update = PassPlan((b,), qpos, (*prev, own), False)
    return StepPlan(
        index=step,
        start_block=b,
        levels=(lv,),
        fresh_block=b if lv == 0 else None,
        finished_block=b if last else None,
        renoise=() if last else ((b, lv + 1),),
        write_slot=slot_of(method, b),
        store_roped=positions == "absolute",
        denoise=denoise,
        update=update,
        prompt_boundary=lv == 0,
    )


def recache_plan(method: StreamMethod, block: int, positions: str) -> RecachePlan | None:
    """The re-cache pass before ``block`` (see the module docstring); None when nothing is cached."""
    if block < 1:
        return None
    first = max(0, block - method.attention_blocks)
    r = tuple(range(first, block))
    written = r if first == 0 else r[-method.ring_slots :]
    sink = tuple(b for b in range(method.sink_blocks) if b not in written)
    keys, qpos = _keys(method, (*sink, *written), written, positions)
    return RecachePlan(
        block=block,
        blocks=written,
        slots=tuple(slot_of(method, b) for b in written),
        store_roped=positions == "absolute",
        pass_=PassPlan(written, qpos, keys, True),
    )


def static_layout(method: StreamMethod, tokens_per_block: int, positions: str) -> Any:
    """The :class:`~rolling_forcing.merged.MergedLayout` of a sequential method's static forward.

    Every call is one forward of ``2 * frames_per_block`` frames: the previous block's held-back cache
    update (masked when there is none) and one block to denoise; table rows of ``attention_blocks``
    entries; roped copies: none needed in ``"absolute"`` (one unused block keeps the shapes non-empty),
    ``2 * attention_blocks - 1`` in ``"relative"`` (the update group's keys and the denoise group's
    cached keys).
    """
    from rolling_forcing.merged import MergedLayout

    copies = 1 if positions == "absolute" else 2 * method.attention_blocks - 1
    return MergedLayout(method.frames_per_block, 1, tokens_per_block, method.attention_blocks, copies)


def static_step(
    method: StreamMethod,
    layout: Any,
    num_blocks: int,
    step: int,
    positions: str,
    update_step: int | None,
) -> Any:
    """The :class:`~rolling_forcing.merged.MergedStep` of call ``step`` carrying the cache update of
    ``update_step`` (the previous block's last step, or None: masked), from the same plans as the
    two-pass stream (:func:`step_plan`): ring entries read in place, other keys as roped copies."""
    from rolling_forcing.merged import EMPTY, SRC_COPY, SRC_FRESH, SRC_RING, MergedStep

    fpb = method.frames_per_block
    copies: list[tuple[int, int]] = []

    def entry(kb: KeyBlock) -> tuple[int, int]:
        if kb.roped_in_cache:
            return SRC_RING, kb.slot
        copies.append((kb.slot, kb.position))
        return SRC_COPY, len(copies) - 1

    upd_entries: list[tuple[int, int]] = []
    upd_positions = [0] * fpb
    write_slot, store_roped, update_block = 0, False, None
    if update_step is not None:
        up = step_plan(method, num_blocks, update_step, positions)
        if (
            up.update is None
            or update_step // method.steps + 1 != step // method.steps
            or step % method.steps
        ):
            raise ValueError(
                f"update_step={update_step} must be the last step of the block before step {step}'s block, "
                f"and step {step} the first of its block"
            )
        upd_entries = [entry(kb) for kb in up.update.cache_keys]
        upd_positions = [up.update.query_position + i for i in range(fpb)]
        write_slot, store_roped, update_block = up.write_slot, up.store_roped, up.start_block
    dp = step_plan(method, num_blocks, step, positions)
    den_entries = [entry(kb) for kb in dp.denoise.cache_keys] + [(SRC_FRESH, 1)]
    pad = [(EMPTY, 0)] * layout.table_blocks
    if max(len(upd_entries), len(den_entries)) > layout.table_blocks or len(copies) > layout.copy_blocks:
        raise RuntimeError(f"step {step}: the key sets do not fit the static layout {layout}")
    return MergedStep(
        window=step,
        update_window=update_step,
        update_block=update_block,
        window_frames=fpb,
        frame_positions=tuple(upd_positions + [dp.denoise.query_position + i for i in range(fpb)]),
        write_slot=write_slot,
        store_roped=store_roped,
        write_valid=update_step is not None,
        copies=tuple(copies + [(0, 0)] * (layout.copy_blocks - len(copies))),
        table=(tuple(upd_entries + pad[len(upd_entries) :]), tuple(den_entries + pad[len(den_entries) :])),
    )


__all__ = [
    "RecachePlan",
    "StepPlan",
    "check_length",
    "key_blocks",
    "num_steps",
    "recache_plan",
    "slot_of",
    "static_layout",
    "static_step",
    "step_plan",
]
