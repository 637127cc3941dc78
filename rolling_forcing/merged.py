"""Merged forward: the cache-update pass of window w-1 and the denoise pass of window w in ONE forward.

The two-pass stream (:mod:`rolling_forcing.pipeline`, ``merged=False``) runs per window a denoise forward
over the window (up to ``window_frames`` = 15 frames) and then a cache-update forward over the start
block's clean x0 at t = 0 (``frames_per_block`` = 3 frames). Here the update of window w-1 and the denoise
of window w share one forward over ``frames_per_block + window_frames`` = 18 frames:

* linear layers, norms, per-frame adaLN modulation, cross-attention and the FFN run once over all frames
  (they act per token / per frame, so stacking the two passes changes nothing);
* self-attention is split into two **query groups** with their own key sets, given to
  :func:`nki_kernels.ops.attention_block_table` as a block table: the update queries (group 0) attend to
  the last ``key_budget_blocks`` cached blocks ending at their own block; the denoise queries (group 1)
  to the sink + working cache + the window's own keys. Ring blocks are read **in place**; only the blocks
  that need re-roping (the sink; every cached block in ``"relative"`` mode) are roped copies.
* Order inside each layer: rope all 18 frames, **write the update block's clean k/v into its ring slot**
  (``ops.kv_cache_write_at``), then attend. In the two-pass order update(w-1) runs before denoise(w), and
  denoise(w) reads block s_w - 1 (= the update block) from the working cache: because layer l's write
  happens before layer l's reads, the denoise queries see exactly the clean k/v the separate update
  forward would have left in the ring. Nothing else in the ring changes between the two passes.

**Static shapes.** Every merged forward of a stream has the same input shapes: warm-up and tail windows
are padded to ``window_blocks`` blocks (padded frames are zeros at t = 0, position 0; no valid query ever
sees their keys: they are not in any block table), the first window (no update yet) carries a masked
update (its write stores the slot's old contents back). Positions, the write slot, the copy slots and the
block table are **tensors** (:class:`MergedIndex`), so one compiled graph serves every window:
``torch.compile(fullgraph=True)`` traces :func:`merged_forward` once per stream layout.

Everything the forward needs is a pure function of the schedule: :func:`merged_step` (host side, Python
ints, testable) -> :meth:`MergedIndex.from_step` (tensors).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nki_kernels import ops
from rolling_forcing import schedule
from rolling_forcing.config import ModelConfig, PipelineConfig
from rolling_forcing.fp8 import kv_fp8_roundtrip
from rolling_forcing.model import CausalWanModel, Grid, TextKV
from rolling_forcing.schedule import KeyBlock

SRC_RING = 0
"""Block-table source: the layer's KV buffer (sink slot + ring), read in place."""
SRC_FRESH = 1
"""Block-table source: this forward's own roped k / v (block 0 = update block, 1.. = window blocks)."""
SRC_COPY = 2
"""Block-table source: roped copies of cached blocks that need a pass-specific position (the sink)."""
EMPTY = -1
"""Source value of an empty block-table entry."""


def copy_blocks(cfg: PipelineConfig, positions: str) -> int:
    """Roped-copy blocks per merged forward (static): the blocks of both groups not roped in the ring.

    ``"absolute"``: only the sink is re-roped, once per group: ``2 * sink_blocks``. ``"relative"``: every
    cached key is roped when read: the update group's ``key_budget_blocks`` plus the denoise group's
    ``key_budget_blocks - 1`` (its window holds at least one block).
    """
    if positions == "absolute":
        return 2 * cfg.sink_blocks
    return 2 * cfg.key_budget_blocks - 1


@dataclass(frozen=True)
class MergedLayout:
    """Static sizes of the merged forward (derived from the configs; identical for every window)."""

    frames_per_block: int
    window_blocks: int
    tokens_per_block: int
    table_blocks: int
    copy_blocks: int

    @classmethod
    def from_configs(cls, model_cfg: ModelConfig, pipe_cfg: PipelineConfig, positions: str) -> MergedLayout:
        return cls(
            frames_per_block=pipe_cfg.frames_per_block,
            window_blocks=pipe_cfg.window_blocks,
            tokens_per_block=pipe_cfg.tokens_per_block(model_cfg),
            table_blocks=pipe_cfg.key_budget_blocks,
            copy_blocks=copy_blocks(pipe_cfg, positions),
        )

    @property
    def update_frames(self) -> int:
        return self.frames_per_block

    @property
    def frames(self) -> int:
        """Frames of one merged forward: update block + padded window (3 + 15 = 18)."""
        return self.frames_per_block * (1 + self.window_blocks)

    @property
    def q_groups(self) -> tuple[int, int]:
        """Query tokens of the update group and of the (padded) denoise group."""
        t = self.tokens_per_block
        return t, self.window_blocks * t


@dataclass(frozen=True)
class MergedStep:
    """Host-side plan of one merged forward (pure data; see :func:`merged_step`).

    Attributes:
        window: the denoise window w.
        update_window: the window whose cache update rides along (w - 1), or None (masked update).
        update_block: the block written (start block of ``update_window``), or None.
        window_frames: valid (un-padded) window frames.
        frame_positions: RoPE time position of each of the ``layout.frames`` frames (padding: 0).
        write_slot, store_roped, write_valid: the update block's write (``write_valid=False``: the slot's
            old contents are written back).
        copies: ``(slot, position)`` of each roped-copy block (padded with ``(0, 0)``, unused).
        table: ``[2][table_blocks]`` entries ``(source, block)`` of the update and denoise groups.
    """

    window: int
    update_window: int | None
    update_block: int | None
    window_frames: int
    frame_positions: tuple[int, ...]
    write_slot: int
    store_roped: bool
    write_valid: bool
    copies: tuple[tuple[int, int], ...]
    table: tuple[tuple[tuple[int, int], ...], ...]


def merged_step(
    cfg: PipelineConfig,
    layout: MergedLayout,
    num_blocks: int,
    window: int,
    positions: str,
    update_window: int | None,
) -> MergedStep:
    """The merged forward of denoise window ``window`` carrying the update pass of ``update_window``.

    ``update_window`` is ``window - 1`` in a plain stream, None for the first window (and after a prompt
    switch, when the pending update was flushed under the old prompt). Key sets come from
    :func:`rolling_forcing.schedule.window_plan` (the same plans the two-pass stream uses): a
    :class:`~rolling_forcing.schedule.KeyBlock` roped in the cache is a ring entry read in place, any
    other becomes a roped copy at its pass position.
    """
    if update_window is not None and update_window != window - 1:
        raise ValueError(
            f"update_window must be window - 1 = {window - 1} (or None), got {update_window}: the update of "
            "window w-1 is the only one that can ride with denoise(w) (it must precede denoise(w)'s reads)"
        )
    fpb = layout.frames_per_block
    copies: list[tuple[int, int]] = []

    def entry(kb: KeyBlock) -> tuple[int, int]:
        if kb.roped_in_cache:
            return SRC_RING, kb.slot
        copies.append((kb.slot, kb.position))
        return SRC_COPY, len(copies) - 1

    upd_entries: list[tuple[int, int]] = []
    upd_positions = [0] * fpb
    write_slot, store_roped, update_block = 0, False, None
    if update_window is not None:
        up = schedule.window_plan(cfg, num_blocks, update_window, positions)
        upd_entries = [entry(kb) for kb in up.update.cache_keys]
        upd_positions = [up.update.query_position + i for i in range(fpb)]
        write_slot, store_roped, update_block = up.write_slot, up.store_roped, up.start_block
    dp = schedule.window_plan(cfg, num_blocks, window, positions)
    den_entries = [entry(kb) for kb in dp.denoise.cache_keys]
    den_entries += [(SRC_FRESH, 1 + i) for i in range(dp.num_blocks)]
    nvalid = dp.num_blocks * fpb
    win_positions = [dp.denoise.query_position + i for i in range(nvalid)]
    win_positions += [0] * (layout.window_blocks * fpb - nvalid)
    for name, ents in (("update", upd_entries), ("denoise", den_entries)):
        if len(ents) > layout.table_blocks:
            raise RuntimeError(
                f"window {window}: {name} group needs {len(ents)} > {layout.table_blocks} blocks"
            )
    if len(copies) > layout.copy_blocks:
        raise RuntimeError(
            f"window {window}: {len(copies)} roped copies > layout.copy_blocks={layout.copy_blocks}"
        )
    pad = [(EMPTY, 0)] * layout.table_blocks
    table = (
        tuple(upd_entries + pad[len(upd_entries) :]),
        tuple(den_entries + pad[len(den_entries) :]),
    )
    return MergedStep(
        window=window,
        update_window=update_window,
        update_block=update_block,
        window_frames=nvalid,
        frame_positions=tuple(upd_positions + win_positions),
        write_slot=write_slot,
        store_roped=store_roped,
        write_valid=update_window is not None,
        copies=tuple(copies + [(0, 0)] * (layout.copy_blocks - len(copies))),
        table=table,
    )


@dataclass(frozen=True)
class MergedIndex:
    """The tensors of a :class:`MergedStep` (runtime data of the one static graph).

    frame_positions ``[frames]`` int64; write_slot ``[]`` int64; write_tokens ``[T]`` int64 (the slot's
    token indices); write_valid, store_roped ``[]`` bool; copy_tokens ``[copy_blocks*T]`` int64;
    copy_positions ``[copy_blocks*fpb]`` int64; table ``[2, table_blocks, 2]`` int64.
    """

    frame_positions: torch.Tensor
    write_slot: torch.Tensor
    write_tokens: torch.Tensor
    write_valid: torch.Tensor
    store_roped: torch.Tensor
    copy_tokens: torch.Tensor
    copy_positions: torch.Tensor
    table: torch.Tensor

    @classmethod
    def from_step(
        cls, step: MergedStep, layout: MergedLayout, device: torch.device | str = "cpu"
    ) -> MergedIndex:
        t, fpb = layout.tokens_per_block, layout.frames_per_block

        def i64(x: Any) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=device)

        def flag(x: bool) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.bool, device=device)

        return cls(
            frame_positions=i64(step.frame_positions),
            write_slot=i64(step.write_slot),
            write_tokens=i64([step.write_slot * t + i for i in range(t)]),
            write_valid=flag(step.write_valid),
            store_roped=flag(step.store_roped),
            copy_tokens=i64([s * t + i for s, _ in step.copies for i in range(t)]),
            copy_positions=i64([p + i for _, p in step.copies for i in range(fpb)]),
            table=i64([list(map(list, g)) for g in step.table]),
        )

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The fields in declaration order (the graph's index inputs)."""
        return (
            self.frame_positions,
            self.write_slot,
            self.write_tokens,
            self.write_valid,
            self.store_roped,
            self.copy_tokens,
            self.copy_positions,
            self.table,
        )


def merged_forward(
    model: CausalWanModel,
    x: torch.Tensor,
    timesteps: torch.Tensor,
    text_kv: TextKV,
    cache_k: Sequence[torch.Tensor],
    cache_v: Sequence[torch.Tensor],
    frame_positions: torch.Tensor,
    write_slot: torch.Tensor,
    write_tokens: torch.Tensor,
    write_valid: torch.Tensor,
    store_roped: torch.Tensor,
    copy_tokens: torch.Tensor,
    copy_positions: torch.Tensor,
    table: torch.Tensor,
    *,
    layout: MergedLayout,
    backend: str | None = None,
    kv_fp8: bool = False,
    attn_fp8: bool = False,
) -> torch.Tensor:
    """One merged forward (no Python value depends on the window: safe for ``fullgraph`` compile).

    Args:
        model: the DiT.
        x: ``[B, layout.frames, C, H, W]``: update block's clean x0, then the window padded with zeros.
        timesteps: ``[B, layout.frames]`` float32 (update frames at ``context_noise`` = 0).
        text_kv: per-layer text k/v.
        cache_k, cache_v: per-layer KV buffers ``[B, buffer_tokens, H, D]`` (mutated: the update write).
        frame_positions ... table: the tensors of :class:`MergedIndex` (in its field order).
        layout: static sizes. backend: ``nki_kernels.ops`` backend.
        kv_fp8: the cache is an FP8 KV cache: the update write stores
            :func:`rolling_forcing.fp8.kv_fp8_roundtrip` of the new k/v.
        attn_fp8: the self-attention in FP8 (``ops.attention_block_table(fp8=True)``: P.V in e4m3).

    Returns:
        flow prediction of the (padded) window ``[B, layout.frames - frames_per_block, C, H, W]``: the
        update frames only write the cache; in the last layer they stop after their k/v (no query,
        attention output, cross-attention, FFN or head: ``forward_with(context_frames=...)``).
    """
    t, fpb = layout.tokens_per_block, layout.frames_per_block
    nc_frames = layout.copy_blocks * fpb
    q_groups = list(layout.q_groups)
    # last layer: only the window queries remain (the update queries' outputs are never read); the
    # denoise group's entries are kept as they are (it never reads fresh block 0, the update block)
    den_table = table[1:]
    # RoPE tables once per forward, shared by every layer: all frames, and the roped-copy blocks. float64
    # keeps the reference backend bitwise equal to per-layer rope3d; kernels round them to fp32 per call.
    hp, wp = model.cfg.grid_hw
    hd, tdev = model.cfg.head_dim, frame_positions.device
    cos, sin = ops.rope_tables(
        (layout.frames, hp, wp), hd, frame_positions=frame_positions, dtype=torch.float64, device=tdev
    )
    ccos, csin = ops.rope_tables(
        (nc_frames, hp, wp), hd, frame_positions=copy_positions, dtype=torch.float64, device=tdev
    )

    def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Grid) -> torch.Tensor:
        ck, cv = cache_k[layer], cache_v[layer]
        if q.shape[1] == k.shape[1]:
            qr, kr = ops.rope3d_tables(q, k, cos, sin, backend=backend)
            k_upd = kr[:, :t]
        else:  # last layer: q holds the window tokens only; rope the update keys on their own
            k_upd = ops.rope3d_tables_one(k[:, :t].contiguous(), cos[:t], sin[:t], backend=backend)
            qr, kw = ops.rope3d_tables(q, k[:, t:].contiguous(), cos[t:], sin[t:], backend=backend)
            kr = torch.cat([k_upd, kw], dim=1)
        # 1. the update block's clean k/v into its slot (roped unless it is the sink / relative mode)
        k_new = torch.where(store_roped, k_upd, k[:, :t])
        v_new = v[:, :t]
        if kv_fp8:
            k_new, v_new = kv_fp8_roundtrip(k_new), kv_fp8_roundtrip(v_new)
        k_w = torch.where(write_valid, k_new, ck.index_select(1, write_tokens))
        v_w = torch.where(write_valid, v_new, cv.index_select(1, write_tokens))
        ops.kv_cache_write_at(ck, cv, k_w.contiguous(), v_w.contiguous(), write_slot, backend=backend)
        # 2. blocks needing a pass-specific position: roped copies (read after the write)
        gk, gv = ck.index_select(1, copy_tokens), cv.index_select(1, copy_tokens)
        gkr = ops.rope3d_tables_one(gk, ccos, csin, backend=backend)  # keys only: no query is roped here
        # 3. both query groups in one launch (last layer: the denoise group only); ring read in place
        if q.shape[1] == k.shape[1]:
            tab, groups = table, q_groups
        else:
            tab, groups = den_table, q_groups[1:]
        out = ops.attention_block_table(
            qr, [ck, kr, gkr], [cv, v, gv], tab, groups, t, fp8=attn_fp8, backend=backend
        )
        assert isinstance(out, torch.Tensor)
        return out

    return model.forward_with(x, timesteps, text_kv, attn, backend=backend, context_frames=fpb)


CompileSpec = bool | str | Callable[..., Any] | None
"""``None``/``False``: eager; ``True``: ``torch.compile`` default backend; a str or callable: that backend."""


class MergedForward:
    """Callable running :func:`merged_forward`, optionally ``torch.compile(fullgraph=True)``-compiled.

    ``signatures`` records the (shape, dtype) signature of every call's tensor inputs (measured count of
    distinct forward signatures); ``calls`` counts calls.
    """

    def __init__(
        self,
        model: CausalWanModel,
        layout: MergedLayout,
        backend: str | None,
        compile: CompileSpec = None,
        kv_fp8: bool = False,
        attn_fp8: bool = False,
    ) -> None:
        self.model, self.layout, self.backend = model, layout, backend

        def fn(*args: Any) -> torch.Tensor:
            return merged_forward(*args, layout=layout, backend=backend, kv_fp8=kv_fp8, attn_fp8=attn_fp8)

        if compile is None or compile is False:
            self._fn: Callable[..., torch.Tensor] = fn
        elif compile is True:
            self._fn = torch.compile(fn, fullgraph=True)
        else:
            self._fn = torch.compile(fn, fullgraph=True, backend=compile)
        self.compiled = not (compile is None or compile is False)

    def __call__(
        self,
        x: torch.Tensor,
        timesteps: torch.Tensor,
        text_kv: TextKV,
        cache_k: list[torch.Tensor],
        cache_v: list[torch.Tensor],
        idx: MergedIndex,
    ) -> torch.Tensor:
        return self._fn(self.model, x, timesteps, text_kv, cache_k, cache_v, *idx.tensors())


def tensor_signature(*tensors: torch.Tensor) -> tuple[tuple[tuple[int, ...], str], ...]:
    """``((shape, dtype), ...)`` of ``tensors``: two forwards with equal signatures reuse one graph."""
    return tuple((tuple(t.shape), str(t.dtype)) for t in tensors)


__all__ = [
    "EMPTY",
    "SRC_COPY",
    "SRC_FRESH",
    "SRC_RING",
    "CompileSpec",
    "MergedForward",
    "MergedIndex",
    "MergedLayout",
    "MergedStep",
    "copy_blocks",
    "merged_forward",
    "merged_step",
    "tensor_signature",
]
