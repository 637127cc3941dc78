"""The Rolling Forcing stream sharded TP (heads) x SP (tokens/queries) over ``plan.world_size`` ranks.

Every rank runs the same window loop as :class:`rolling_forcing.pipeline.RollingForcingPipeline` in
lockstep; only the forwards are split. By default (``merged``) that is **one merged forward per window**
(the cache update of window w-1's start block at t = 0 and the denoise of window w, 3 + 15 frames,
static shapes, :mod:`rolling_forcing.merged`'s plan); ``merged=False`` runs the two passes (denoise,
then the cache update) separately.

**Per forward** (``L`` tokens of the pass, rank ``r``, plan ``tp x sp``):

* *Outside attention* (adaLN modulation, norms, q/k/v/o projections, cross-attention to the text, FFN,
  head) each rank works on its contiguous **token shard** ``local_tokens(L, plan, r)`` with all heads;
  weights are replicated. The model's own :class:`~rolling_forcing.model.WanBlock` and
  :class:`~rolling_forcing.model.Head` modules run on the shard: the per-frame modulation is expanded to
  one row per token and the block is called with the grid ``(L_local, 1, 1)`` (one "frame" per token),
  which is the same arithmetic as the unsharded per-frame broadcast. The patch embedding and the time
  embedding are computed replicated (a few per cent of one layer) and sliced.
* *Self-attention* goes through :func:`sharding.attention.sharded_attention`: an all-to-all in the TP
  group regroups q, k, v to (head group x query shard), an all-gather in the SP group collects all of
  the pass's new keys of the local heads, then the local step (``attention_fn``) ropes them, writes the
  cache (update pass), and attends over [cache keys] + [own keys] exactly as the unsharded pipeline
  (:func:`rolling_forcing.attend.attend_cache`, the unsharded pipeline's code on ``H/tp`` heads;
  partials merged by log-sum-exp); the inverse all-to-all restores token shards.
* The head's output ``[B, L_local, patch_out]`` is all-gathered over all ranks, so every rank holds the
  full flow prediction; x0, re-noising and the noise draws are then replicated (cheap elementwise work;
  every rank draws the same noise from the same generator state). Every rank therefore yields the same
  chunks; rank 0 hands them to the caller.
* *The merged forward* (:meth:`RankStream._merged_attn`): the same token sharding over 18 frames; the
  local step runs the unsharded merged forward's attention on the local heads and query shard: rope at
  ``MergedIndex.frame_positions``, ``ops.kv_cache_write_at`` of the update block into this rank's
  cache, roped copies, one ``ops.attention_block_table`` with the rows of the query groups the shard
  holds. In the last layer the update tokens of each shard stop after their k/v
  (``forward(context_frames=fpb)``) and only the window's tokens reach the head and its all-gather.
* *The cache-update pass* (two-pass mode) only needs its k/v writes (``forward(...,
  context_frames=F)``, as the unsharded pipeline's ``forward_with(..., context_frames=F)``): its last
  layer stops after the k/v regroup and the write (one placeholder query per rank keeps
  :func:`~sharding.attention.sharded_attention`'s local step running), and the head and its all-gather
  are skipped.

**KV cache per head group.** Rank ``r`` keeps a :class:`~rolling_forcing.cache.RollingKVCache` of only
its heads ``local_heads(plan, r)``: buffers ``[B, S, H/tp, D]``. Within a head group (SP > 1) every SP
rank holds the *whole key range* of its heads. Every query attends to every cached key, so a cache
split along SP would have to be moved every layer of every pass (an all-gather of the whole cache, the
largest tensor of the stream) or be attended locally with queries exchanged and partial outputs merged;
replicating it costs ``sp`` x the cache memory of an SP-split cache but no cache traffic at all: the
only K/V collective is the all-gather of the pass's *new* tokens, which every rank of the group writes
into its own copy (the update pass) or attends directly (the denoise pass).

Use :class:`ShardedRollingForcingPipeline` to run a stream on CPU ranks spawned by
:func:`sharding.launch.launch` (rank 0 streams each chunk back as soon as it is final); use
:class:`RankStream` inside ranks started some other way (``torchrun``, the XLA process group on
Trainium).

**Prompt switches** are a schedule fixed before the stream starts: ``set_prompt(embeds, recache,
window=w)`` on :class:`ShardedRollingForcingPipeline` (or ``prompts={w: (embeds, recache)}`` to
:meth:`RankStream.stream`) is pickled into every rank's job, so every rank applies it at the start of
window ``w`` with no message at all: the ranks stay in lockstep by construction and the result is exactly
the unsharded pipeline's ``set_prompt`` called after the chunk of window ``w - 1`` (the same steps:
a pending merged update of the old prompt runs alone first, text k/v recomputed, optional re-cache of
the clean blocks still cached). A switch *while* the ranks run is refused: they run ahead of the
consumer, so "the next window" would depend on timing. Batch > 1 is untested.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import queue as queue_mod
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from nki_kernels import ops
from rolling_forcing import schedule
from rolling_forcing.attend import attend_cache
from rolling_forcing.cache import RollingKVCache
from rolling_forcing.config import ModelConfig, PipelineConfig
from rolling_forcing.merged import MergedIndex, MergedLayout, merged_step
from rolling_forcing.methods import StreamMethod, get_method
from rolling_forcing.model import (
    CausalWanModel,
    Grid,
    SelfAttnFn,
    TextKV,
    flow_to_x0,
    sinusoidal_embedding_1d,
)
from rolling_forcing.pipeline import (
    Chunk,
    ForwardStats,
    NoiseSource,
    Timing,
    check_method_stream,
    num_calls,
    renoise_window,
    resolve_positions,
    stream_plans,
    window_input,
)
from rolling_forcing.schedule import KeyBlock, PassPlan, WindowPlan
from rolling_forcing.sequential import StepPlan, recache_plan
from sharding.attention import (
    DEFAULT_TIMEOUT_S,
    ShardGroups,
    build_groups,
    local_heads,
    local_tokens,
    query_shard_tokens,
    sharded_attention,
    token_splits,
)
from sharding.launch import DEFAULT_PRELOAD, LaunchError, launch
from sharding.plan import AttentionShape, ShardingPlan
from sharding.plan import plan as make_plan

__all__ = [
    "PromptSchedule",
    "RankStream",
    "ShardedRollingForcingPipeline",
    "attention_shape",
    "pipeline_plan",
]

PRELOAD: tuple[str, ...] = (*DEFAULT_PRELOAD, "rolling_forcing.pipeline", "sharding.pipeline")

PromptSchedule = Mapping[int, tuple[torch.Tensor, bool]]
"""Prompt switches of a stream: window index -> (``text_embeds [B, L<=text_len, text_dim]``, recache)."""


def check_prompts(
    model: CausalWanModel,
    pipe_cfg: PipelineConfig,
    prompts: PromptSchedule,
    batch: int,
    num_blocks: int,
    method: StreamMethod | None = None,
) -> None:
    """Validate a prompt schedule for a stream of ``num_blocks`` blocks and batch ``batch``.

    Windows are the stream's calls (:func:`rolling_forcing.pipeline.stream_plans`); a sequential
    ``method``'s switch must fall on the first step of a block (``window % steps == 0``).

    Raises ``ValueError`` naming the window for a window outside ``[0, num_windows)`` or inside a block,
    embeddings of the wrong shape or batch, and ``TypeError`` for a window that is not an int or a recache
    that is not a bool.
    """
    meth = get_method("rolling-forcing" if method is None else method)
    nw = num_calls(meth, pipe_cfg, num_blocks)
    for w, (emb, recache) in prompts.items():
        if isinstance(w, bool) or not isinstance(w, int):
            raise TypeError(f"prompt switch window must be an int, got {type(w).__name__}")
        if not 0 <= w < nw:
            raise ValueError(f"prompt switch window={w} is outside the stream's windows [0, {nw})")
        if recache is True and meth.recache == "none":
            raise ValueError(f"recache=True at window {w}: method {meth.name!r} has no KV re-cache")
        if meth.sequential and w % meth.steps:
            raise ValueError(
                f"prompt switch window={w} falls inside a block of method {meth.name!r}: switches start a "
                f"block (window = block x {meth.steps})"
            )
        if not isinstance(recache, bool):
            raise TypeError(
                f"recache of the switch at window {w} must be a bool, got {type(recache).__name__}"
            )
        model._check_context(emb)
        if emb.shape[0] != batch:
            raise ValueError(
                f"prompt of the switch at window {w} has batch {emb.shape[0]} != stream batch {batch}"
            )


def attention_shape(model_cfg: ModelConfig, pipe_cfg: PipelineConfig, batch: int = 1) -> AttentionShape:
    """The self-attention shape of a full denoise window of this stream (what the planner models)."""
    return AttentionShape(
        num_queries=pipe_cfg.window_blocks * pipe_cfg.tokens_per_block(model_cfg),
        num_keys=pipe_cfg.key_budget_tokens(model_cfg),
        head_dim=model_cfg.head_dim,
        dtype_bytes=pipe_cfg.torch_dtype.itemsize,
        batch=batch,
    )


def pipeline_plan(
    model_cfg: ModelConfig, pipe_cfg: PipelineConfig, cores: int, *, tp: int | None = None
) -> ShardingPlan:
    """The TP x SP plan of a stream on ``cores`` ranks (``tp`` forces a factorisation).

    Raises ``ValueError`` if no balanced plan exists (see :func:`sharding.plan.plan`) or if a block has
    fewer tokens than ranks (the cache-update pass of one block must give every rank at least a token).
    """
    p = make_plan(model_cfg.num_heads, cores, shape=attention_shape(model_cfg, pipe_cfg), tp=tp)
    _check_plan(p, model_cfg, pipe_cfg)
    return p


def _check_plan(p: ShardingPlan, model_cfg: ModelConfig, pipe_cfg: PipelineConfig) -> None:
    if p.num_heads != model_cfg.num_heads:
        raise ValueError(f"plan is for num_heads={p.num_heads}, the model has {model_cfg.num_heads} heads")
    t = pipe_cfg.tokens_per_block(model_cfg)
    if t < p.world_size:
        raise ValueError(
            f"a block has {t} tokens but the plan has {p.world_size} ranks: the cache-update pass (one "
            "block) needs at least one token per rank; use fewer cores"
        )


class RankStream:
    """One rank's share of a sharded stream; collective: every rank of ``groups.plan`` runs it in lockstep.

    Args:
        model: the DiT, replicated on every rank (weights in ``pipe_cfg``'s dtype).
        model_cfg, pipe_cfg: configurations (``model_cfg.num_heads`` must equal the plan's).
        groups: this rank's process groups from :func:`sharding.attention.build_groups`.
        backend: ``nki_kernels.ops`` backend of every RoPE / attention / cache call.
        positions: ``"absolute"`` or ``"relative"`` (None: ``pipe_cfg.positions``).
        gather_group: group of all ranks for the head-output all-gather (None: the default group).
        merged: True: one merged forward per window (the update of window w-1 + the denoise of window w,
            18 frames, static shapes; :mod:`rolling_forcing.merged`'s plan and ops on this rank's heads);
            False: the two passes separately. Every rank must pass the same value.

    The KV cache holds only this rank's heads (``[B, S, H/tp, D]`` per layer and k/v); see the module
    docstring. Every rank yields the same chunks.
    """

    def __init__(
        self,
        model: CausalWanModel,
        model_cfg: ModelConfig,
        pipe_cfg: PipelineConfig,
        groups: ShardGroups,
        *,
        backend: str | None = None,
        positions: str | None = None,
        gather_group: Any = None,
        merged: bool = False,
        method: str | StreamMethod | None = None,
    ) -> None:
        mode = resolve_positions(pipe_cfg, positions)
        _check_plan(groups.plan, model_cfg, pipe_cfg)
        if not isinstance(merged, bool):
            raise TypeError(f"merged must be a bool, got {type(merged).__name__}")
        self.method = get_method("rolling-forcing" if method is None else method)
        if self.method.sequential and merged:
            raise NotImplementedError(f"merged=True: Rolling Forcing only, not method={self.method.name!r}")
        self._timing: Timing = self.method if self.method.sequential else pipe_cfg
        self.merged = merged
        self._layout = MergedLayout.from_configs(model_cfg, pipe_cfg, mode)
        self.model, self.model_cfg, self.pipe_cfg = model, model_cfg, pipe_cfg
        self.groups, self.plan, self.rank = groups, groups.plan, groups.rank
        self.backend, self.positions, self.gather_group = backend, mode, gather_group
        self.heads = local_heads(self.plan, self.rank)
        self._table = self._timing.scheduler_table()
        self.cache: RollingKVCache | None = None
        self.cache_shape: tuple[int, ...] | None = None  # [B, S, H/tp, D] of the last stream's buffers
        self.stats = (
            ForwardStats()
        )  # measured: forwards of the last stream by kind, distinct input signatures

    # ---- the stream (same loop as RollingForcingPipeline.stream) ------------------------------------
    @torch.no_grad()
    def stream(
        self,
        text_embeds: torch.Tensor,
        num_blocks: int,
        *,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | None = None,
        prompts: PromptSchedule | None = None,
    ) -> Iterator[Chunk]:
        """Generate ``num_blocks`` blocks; yield each :class:`~rolling_forcing.pipeline.Chunk` when final.

        Arguments as :meth:`rolling_forcing.pipeline.RollingForcingPipeline.stream`; every rank must pass
        the same text, noise, generator state and ``prompts`` (the noise is drawn replicated).
        ``prompts``: window -> (embeds, recache): at the start of that window the prompt switches exactly
        as the unsharded ``set_prompt(embeds, recache)`` called after the chunk of the window before
        (see :func:`check_prompts` for the errors). :attr:`stats` counts this stream's forwards.
        """
        cfg, mcfg, tim = self.pipe_cfg, self.model_cfg, self._timing
        check_method_stream(self.model, self.method, cfg, text_embeds, num_blocks, self.positions)
        bsz, dtype, fpb = text_embeds.shape[0], cfg.torch_dtype, tim.frames_per_block
        sched: PromptSchedule = dict(prompts) if prompts is not None else {}
        check_prompts(self.model, cfg, sched, bsz, num_blocks, self.method)
        self.stats = ForwardStats()
        device = self.model.patch_embedding.weight.device
        src = NoiseSource(
            bsz, mcfg.latent_frame_shape(), fpb, num_blocks, dtype, generator=generator, initial_noise=noise
        )
        hpc = self.plan.heads_per_core
        self.cache = cache = RollingKVCache(mcfg, tim, bsz, dtype=dtype, num_heads=hpc)
        self.cache_shape = tuple(cache.layers[0].k.shape)
        text_kv = self.model.text_kv(text_embeds.to(dtype))  # all heads: cross-attention is token-sharded
        noisy: dict[int, torch.Tensor] = {}
        clean_blocks: dict[int, torch.Tensor] = {}  # block -> x0 last cached (for a re-cache)
        if self.merged:
            yield from self._merged_windows(
                cache, text_kv, src, noisy, num_blocks, device, sched, clean_blocks
            )
            self.cache = None
            return
        for plan in stream_plans(self.method, cfg, num_blocks, self.positions):
            w = plan.index
            if w in sched:
                text_kv = self._apply_prompt(cache, sched[w], clean_blocks, num_blocks, plan.start_block)
            x_in, t_in = window_input(tim, plan, src, noisy, device)
            flow = self.forward(x_in, t_in, text_kv, self._denoise_attn(cache, plan), kind="denoise")
            x0 = flow_to_x0(flow, x_in, t_in, self._table)
            renoise_window(tim, self._table, plan, x0, src, noisy)
            clean = x0[:, :fpb].contiguous()
            if plan.update is not None:
                self._update(cache, text_kv, plan, clean, clean_blocks)
            if plan.finished_block is not None:
                yield Chunk(plan.start_block, clean, True, plan.start_block == num_blocks - 1, w)
        self.cache = None

    def _merged_windows(
        self,
        cache: RollingKVCache,
        text_kv: TextKV,
        src: NoiseSource,
        noisy: dict[int, torch.Tensor],
        num_blocks: int,
        device: torch.device,
        prompts: PromptSchedule,
        clean_blocks: dict[int, torch.Tensor],
    ) -> Iterator[Chunk]:
        """The merged window loop (as ``RollingForcingPipeline._merged_windows``).

        At a prompt switch the pending update belongs to the old prompt: it runs alone first
        (:meth:`_update`), as in the unsharded merged stream, and the next merged forward's update is masked.

        Per window w one forward of ``layout.frames`` frames: the clean x0 of window w-1's start block
        (masked for w = 0), then window w padded with zeros. Its index tensors are
        :meth:`~rolling_forcing.merged.MergedIndex.from_step` of the same
        :func:`~rolling_forcing.merged.merged_step` the unsharded merged stream uses.
        """
        cfg, lay = self.pipe_cfg, self._layout
        fpb = cfg.frames_per_block
        pending: tuple[WindowPlan, torch.Tensor] | None = None  # (plan, clean x0 of its start block)
        for w in range(schedule.num_windows(cfg, num_blocks)):
            if w in prompts:
                if pending is not None:
                    self._update(cache, text_kv, pending[0], pending[1], clean_blocks)
                    pending = None
                text_kv = self._apply_prompt(cache, prompts[w], clean_blocks, num_blocks, w)
            plan = schedule.window_plan(cfg, num_blocks, w, self.positions)
            x_win, t_win = window_input(cfg, plan, src, noisy, device)
            bsz, nf = x_win.shape[:2]
            step = merged_step(
                cfg, lay, num_blocks, w, self.positions, pending[0].index if pending is not None else None
            )
            upd = pending[1] if pending is not None else x_win.new_zeros((bsz, fpb, *x_win.shape[2:]))
            pad = x_win.new_zeros((bsz, lay.frames - fpb - nf, *x_win.shape[2:]))
            x = torch.cat([upd, x_win, pad], dim=1)
            t = torch.zeros(bsz, lay.frames, dtype=torch.float32)
            t[:, :fpb] = float(cfg.context_noise)
            t[:, fpb : fpb + nf] = t_win
            idx = MergedIndex.from_step(step, lay, device)
            # the update frames only write the cache: the last layer and the head skip them
            flow = self.forward(
                x, t, text_kv, self._merged_attn(cache, idx), context_frames=fpb, kind="merged",
                index=idx.tensors(),
            )  # fmt: skip
            x0 = flow_to_x0(flow[:, :nf], x_win, t_win, self._table)  # flow: the padded window only
            renoise_window(cfg, self._table, plan, x0, src, noisy)
            if pending is not None:
                self._record_clean(clean_blocks, pending[0].start_block, pending[1])
            clean = x0[:, :fpb].contiguous()
            pending = (plan, clean)  # the last window's update is never read: it is not run
            if plan.finished_block is not None:
                yield Chunk(plan.start_block, clean, True, plan.start_block == num_blocks - 1, w)

    # ---- cache update alone, prompt switch (as RollingForcingPipeline._update / _apply_prompt) ---------
    def _update(
        self,
        cache: RollingKVCache,
        text_kv: TextKV,
        plan: WindowPlan | StepPlan,
        clean: torch.Tensor,
        clean_blocks: dict[int, torch.Tensor],
    ) -> None:
        """The cache-update forward of ``plan``'s start block (x0 ``clean`` ``[B, fpb, C, H, W]``), t = 0."""
        cfg = self._timing
        fpb = cfg.frames_per_block
        t0 = torch.full((clean.shape[0], fpb), float(cfg.context_noise), dtype=torch.float32)
        # only the k/v writes matter: the last layer stops at them (context_frames = all frames)
        self.forward(clean, t0, text_kv, self._update_attn(cache, plan), context_frames=fpb, kind="update")
        self._record_clean(clean_blocks, plan.start_block, clean)

    def _record_clean(self, clean_blocks: dict[int, torch.Tensor], s: int, clean: torch.Tensor) -> None:
        """Remember the x0 of block ``s``, now cached; forget blocks no longer in the cache (sink kept)."""
        cfg = self.pipe_cfg
        clean_blocks[s] = clean
        # the unsharded pipeline's rule, kept identical so a re-cache re-encodes the same blocks
        keep = {0} | set(range(max(1, s - cfg.ring_slots + 1), s + 1))
        for b in [b for b in clean_blocks if b not in keep]:
            del clean_blocks[b]

    def _apply_prompt(
        self,
        cache: RollingKVCache,
        switch: tuple[torch.Tensor, bool],
        clean_blocks: dict[int, torch.Tensor],
        num_blocks: int,
        block: int,
    ) -> TextKV:
        """Switch to ``switch = (embeds, recache)`` before the call of ``block``; return the new text k/v
        (all heads, every rank). A sequential method re-caches as the unsharded ``_recache_window``.

        ``recache``: the clean blocks still cached are re-encoded under the new prompt, oldest first,
        each attending to the cached blocks before it (keys of evicted blocks excluded), exactly as the
        unsharded ``RollingForcingPipeline._apply_prompt``: one update-only forward per block.
        """
        cfg = self.pipe_cfg
        emb, recache = switch
        text_kv = self.model.text_kv(emb.to(cfg.torch_dtype))
        if not recache:
            return text_kv
        if self.method.sequential:
            self._recache_window(cache, text_kv, clean_blocks, block)
            return text_kv
        present = sorted(clean_blocks)
        oldest_ring = min((b for b in present if b >= cfg.sink_blocks), default=0)
        for b in present:
            plan = schedule.window_plan(cfg, num_blocks, b + cfg.window_blocks - 1, self.positions)
            keys = tuple(
                k for k in plan.update.cache_keys if k.block < cfg.sink_blocks or k.block >= oldest_ring
            )
            upd = PassPlan(plan.update.query_blocks, plan.update.query_position, keys, False)
            x = clean_blocks[b]
            t0 = torch.zeros(x.shape[:2], dtype=torch.float32)
            attn = self._pass_attn(cache, upd, ((plan.write_slot,), plan.store_roped))
            self.forward(x, t0, text_kv, attn, context_frames=x.shape[1], kind="update")
        return text_kv

    def _recache_window(
        self, cache: RollingKVCache, text_kv: TextKV, clean_blocks: dict[int, torch.Tensor], block: int
    ) -> None:
        """LongLive's re-cache before ``block`` (:func:`rolling_forcing.sequential.recache_plan`): the
        written blocks' clean k/v under the new prompt; they attend to the protected sink + themselves
        (read back from the cache after the write, like the update pass)."""
        rp = recache_plan(self.method, block, self.positions)
        if rp is None:
            return
        absolute = rp.store_roped
        fpb = self.method.frames_per_block
        own = tuple(
            KeyBlock(b, s, rp.pass_.query_position + i * fpb, absolute)
            for i, (b, s) in enumerate(zip(rp.blocks, rp.slots))
        )
        p = PassPlan(rp.blocks, rp.pass_.query_position, (*rp.pass_.cache_keys, *own), False)
        x = torch.cat([clean_blocks[b] for b in rp.blocks], dim=1)
        t0 = torch.full(x.shape[:2], float(self.method.context_noise), dtype=torch.float32)
        attn = self._pass_attn(cache, p, (rp.slots, rp.store_roped))
        self.forward(x, t0, text_kv, attn, context_frames=x.shape[1], kind="recache")

    # ---- one token-sharded forward -------------------------------------------------------------------
    def forward(
        self,
        x: torch.Tensor,
        timesteps: torch.Tensor,
        text_kv: TextKV,
        self_attn: SelfAttnFn,
        *,
        context_frames: int = 0,
        kind: str = "forward",
        index: tuple[torch.Tensor, ...] = (),
    ) -> torch.Tensor:
        """Flow prediction of ``x`` ``[B, F, C, H, W]`` at ``timesteps`` ``[B, F]``; collective.

        Equals ``model.forward_with(x, timesteps, text_kv, attn, context_frames=...)`` of the unsharded
        model when ``self_attn`` is the sharded counterpart of ``attn``: ``self_attn(layer, q, k, v,
        grid)`` gets this rank's token shard ``[B, L_local, H, D]`` (all heads) and the *full* grid
        ``(F, Hp, Wp)``. Returns the full flow ``[B, F, C, H, W]`` (all-gathered: the same on every rank).

        ``context_frames`` (static int in ``[0, F]``): the leading frames that only feed the KV cache, as
        in the unsharded ``forward_with``. In the last layer the tokens of these frames stop after their
        k/v: on each rank the leading ``drop`` tokens of its shard that lie in them
        (:meth:`context_tokens`) get no query, output projection, cross-attention or FFN, and
        ``self_attn`` gets q of the other ``L_local - drop`` local tokens (the last ones) with all
        ``L_local`` k, v (it must still write them). The head runs on the kept tokens and the all-gather
        collects them, so ``[B, F - context_frames, C, H, W]`` is returned (``[B, 0, C, H, W]`` for
        ``context_frames == F``: no head, no gather).

        Every call is counted in :attr:`stats` under ``kind`` with the signature (shapes, dtypes) of x,
        timesteps, this rank's token shard ``[B, L_local, dim]`` and the extra ``index`` tensors (the
        merged forward's :class:`~rolling_forcing.merged.MergedIndex`).
        """
        model, c = self.model, self.model_cfg
        model._check_latents(x, "x", 1)
        b, f = x.shape[:2]
        if tuple(timesteps.shape) != (b, f):
            raise ValueError(f"timesteps must be [B, F] = {(b, f)}, got {tuple(timesteps.shape)}")
        if isinstance(context_frames, bool) or not isinstance(context_frames, int):
            raise TypeError(f"context_frames must be an int, got {type(context_frames).__name__}")
        if not 0 <= context_frames <= f:
            raise ValueError(f"context_frames must be in [0, F={f}], got {context_frames}")
        hp, wp = c.grid_hw
        grid: Grid = (f, hp, wp)
        n_tok = f * hp * wp
        n_ctx = context_frames * hp * wp
        sl = local_tokens(n_tok, self.plan, self.rank)
        n_loc = sl.stop - sl.start
        dtype = model.patch_embedding.weight.dtype
        tok = model.patch_embedding(x.permute(0, 2, 1, 3, 4).to(dtype)).flatten(2).transpose(1, 2)
        tok = tok[:, sl].contiguous()  # [B, L_local, dim]
        self.stats.log(kind, x, timesteps, tok, *index)
        e = model.time_embedding(sinusoidal_embedding_1d(c.freq_dim, timesteps.flatten()).to(dtype))
        e0 = model.time_projection(e).unflatten(1, (6, c.dim)).unflatten(0, (b, f))  # [B, F, 6, dim]
        frame = torch.arange(sl.start, sl.stop) // (hp * wp)  # frame of each local token
        e0_tok = e0[:, frame]  # [B, L_local, 6, dim]: one modulation row per token
        tok_grid: Grid = (n_loc, 1, 1)  # one "frame" per token: modulation broadcasts row by row

        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, _g: Grid) -> torch.Tensor:
            return self_attn(layer, q, k, v, grid)

        drop = self.context_tokens(n_tok, n_ctx, self.rank)
        last = len(model.blocks) - 1
        for i, blk in enumerate(model.blocks):
            # the last layer keeps none of the local tokens in the context frames (one "frame" each)
            tok = blk(i, tok, e0_tok, tok_grid, text_kv[i], attn, self.backend, drop if i == last else 0)
        if context_frames == f:  # every rank takes this branch: no collective is left unmatched
            return x.new_empty((b, 0, *x.shape[2:]))
        kept = n_loc - drop
        if kept:
            e_tok = e.unflatten(0, (b, f))[:, frame[drop:]].unsqueeze(2)  # [B, kept, 1, dim]
            out = model.head(tok, e_tok, kept).flatten(1, 2)  # [B, kept, patch_out]
        else:  # this rank's whole shard lies in the context frames
            out = tok.new_empty((b, 0, c.patch_out))
        sizes = tuple(
            n - self.context_tokens(n_tok, n_ctx, r)
            for r, n in enumerate(token_splits(n_tok, self.plan.world_size))
        )
        out = self._gather_tokens(out, sizes)  # [B, L - n_ctx, patch_out]
        fo = f - context_frames
        _, ph, pw = c.patch_size
        out = out.view(b, fo, hp, wp, ph, pw, c.out_channels)
        out = torch.einsum("bfhwpqc->bfchpwq", out).reshape(b, fo, c.out_channels, hp * ph, wp * pw)
        return out.to(x.dtype)

    def context_tokens(self, n_tok: int, n_ctx: int, rank: int) -> int:
        """Tokens of ``rank``'s shard of ``n_tok`` among the first ``n_ctx`` (the shard's leading ones)."""
        sl = local_tokens(n_tok, self.plan, rank)
        return max(0, min(sl.stop, n_ctx) - sl.start)

    def _gather_tokens(self, x: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
        """All-gather ``[B, sizes[rank], ...]`` of every rank into ``[B, sum(sizes), ...]`` (rank order)."""
        world = self.plan.world_size
        if world == 1:
            return x
        top = max(sizes)
        if x.shape[1] < top:
            x = torch.cat([x, x.new_zeros((x.shape[0], top - x.shape[1], *x.shape[2:]))], dim=1)
        bufs = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(bufs, x.contiguous(), group=self.gather_group)
        return torch.cat([buf[:, :n] for buf, n in zip(bufs, sizes)], dim=1)

    # ---- self-attention of the two passes ------------------------------------------------------------
    def _rope(
        self, q_s: torch.Tensor, k_all: torch.Tensor, grid: Grid, position: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE of this rank's query shard and of all keys of the pass (local heads).

        The query shard covers tokens ``query_shard_tokens(L, plan, rank)``, not necessarily whole
        frames: it is placed into a zero tensor of the full length, roped with the keys in one call (RoPE
        is per token, so this is the unsharded arithmetic) and sliced back.
        """
        n_tok = k_all.shape[1]
        qsl = query_shard_tokens(n_tok, self.plan, self.rank)
        if q_s.shape[1] == n_tok:
            return ops.rope3d(q_s, k_all, grid, position, backend=self.backend)
        q_full = q_s.new_zeros(k_all.shape)
        q_full[:, qsl] = q_s
        qr, kr = ops.rope3d(q_full, k_all, grid, position, backend=self.backend)
        return qr[:, qsl].contiguous(), kr

    def _denoise_attn(self, cache: RollingKVCache, plan: WindowPlan | StepPlan) -> SelfAttnFn:
        return self._pass_attn(cache, plan.denoise, None)

    def _update_attn(self, cache: RollingKVCache, plan: WindowPlan | StepPlan) -> SelfAttnFn:
        assert plan.update is not None
        return self._pass_attn(cache, plan.update, ((plan.write_slot,), plan.store_roped))

    def _pass_attn(
        self, cache: RollingKVCache, p: PassPlan, write: tuple[tuple[int, ...], bool] | None
    ) -> SelfAttnFn:
        """Sharded self-attention of one pass; ``write = (slots, store_roped)`` for a pass that writes its
        blocks (the update pass: one slot; LongLive's re-cache: one per block, in frame order).

        A layer called with no queries (the last layer of ``forward(context_frames=F)``) only writes the
        pass's k/v. :func:`sharding.attention.sharded_attention` still regroups them to all keys of the
        local heads, but it skips the local step of an empty query shard, so such a layer sends one
        placeholder query per rank (the rank's first key; ``num_queries = world``) whose output is dropped.
        """

        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Grid) -> torch.Tensor:
            lc = cache.layers[layer]
            n_tok = grid[0] * grid[1] * grid[2]
            write_only = q.shape[1] == 0
            if write_only and write is None:
                raise ValueError("context_frames=F applies to the cache-update pass only (it writes k/v)")

            def local(
                q_s: torch.Tensor,
                k_all: torch.Tensor,
                v_all: torch.Tensor,
                *,
                scale: float | None,
                return_lse: bool,
                backend: str | None,
            ) -> torch.Tensor:
                if write_only:
                    assert write is not None
                    slots, store_roped = write
                    if store_roped:
                        _, k_all = ops.rope3d(k_all, k_all, grid, p.query_position, backend=self.backend)
                    self._write_blocks(lc, slots, k_all, v_all)
                    return q_s.new_zeros(q_s.shape)
                qr, kr = self._rope(q_s, k_all, grid, p.query_position)
                if write is None:
                    return attend_cache(lc, qr, p.cache_keys, (kr, v_all), grid, backend=self.backend)
                slots, store_roped = write
                self._write_blocks(lc, slots, kr if store_roped else k_all, v_all)
                return attend_cache(lc, qr, p.cache_keys, None, grid, backend=self.backend)

            q_in, n_q = (k[:, :1], self.plan.world_size) if write_only else (q, n_tok)
            out = sharded_attention(
                q_in.contiguous(), k.contiguous(), v.contiguous(), self.groups,
                num_queries=n_q, num_keys=n_tok, attention_fn=local, backend=self.backend,
            )  # fmt: skip
            assert isinstance(out, torch.Tensor)
            return q if write_only else out

        return attn

    def _write_blocks(self, lc: Any, slots: tuple[int, ...], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k, v`` ``[B, len(slots) * T, H, D]`` block by block into ``slots`` of ``lc``."""
        t = lc.tokens_per_block
        for i, slot in enumerate(slots):
            lc.write(slot, k[:, i * t : (i + 1) * t], v[:, i * t : (i + 1) * t], backend=self.backend)

    def _merged_attn(self, cache: RollingKVCache, idx: MergedIndex) -> SelfAttnFn:
        """Sharded self-attention of one merged forward (``rolling_forcing.merged.merged_forward``'s steps).

        :func:`sharding.attention.sharded_attention` regroups q, k, v to (head group x query shard) and
        gathers every new key of the local heads; the local step then does what the unsharded merged
        forward does, on this rank's heads and query shard: rope all frames at ``idx.frame_positions``
        (the query shard placed in a full-length zero tensor), write the update block's clean k/v into its
        ring slot of this rank's cache (every rank of a head group writes its own copy), rope the copies
        (sink / relative-mode keys) from the cache, then one ``ops.attention_block_table`` launch over
        [ring in place, new keys, copies] with the block table ``idx.table``. The query shard's tokens
        ``[a, b)`` are split at the update block's end ``T``: its local query groups are the non-empty
        ones of ``(min(b, T) - a, b - max(a, T))`` with the matching table rows (static per rank).

        Last layer (``forward(context_frames=fpb)``): q holds only the local tokens after the update
        block; they are zero-padded back to the full shard (the update queries' outputs are not used) and
        the local step attends the denoise group only (the table's row 1), as the unsharded last layer.
        """
        lay = self._layout
        t = lay.tokens_per_block
        nc_frames = lay.copy_blocks * lay.frames_per_block
        last = len(self.model.blocks) - 1
        backend = self.backend

        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Grid) -> torch.Tensor:
            _, hp, wp = grid
            n_tok = grid[0] * hp * wp
            ck, cv = cache.layers[layer].k, cache.layers[layer].v
            drop = k.shape[1] - q.shape[1]  # leading local tokens without a query (last layer only)
            if drop:
                q = torch.cat([q.new_zeros((q.shape[0], drop, *q.shape[2:])), q], dim=1)
            qsl = query_shard_tokens(n_tok, self.plan, self.rank)
            n_upd = max(0, min(qsl.stop, t) - qsl.start)  # query-shard tokens in the update block
            n_den = qsl.stop - qsl.start - n_upd
            den_only = layer == last
            rows = ([] if den_only or not n_upd else [0]) + ([1] if n_den else [])
            sizes = ([] if den_only or not n_upd else [n_upd]) + ([n_den] if n_den else [])
            tab = idx.table[rows]

            def local(
                q_s: torch.Tensor,
                k_all: torch.Tensor,
                v_all: torch.Tensor,
                *,
                scale: float | None,
                return_lse: bool,
                backend: str | None,
            ) -> torch.Tensor:
                q_full = q_s.new_zeros(k_all.shape)
                q_full[:, qsl] = q_s
                qr_full, kr = ops.rope3d_positions(q_full, k_all, grid, idx.frame_positions, backend=backend)
                # 1. the update block's clean k/v into its slot (roped unless it is the sink / relative)
                k_new = torch.where(idx.store_roped, kr[:, :t], k_all[:, :t])
                k_w = torch.where(idx.write_valid, k_new, ck.index_select(1, idx.write_tokens))
                v_w = torch.where(idx.write_valid, v_all[:, :t], cv.index_select(1, idx.write_tokens))
                ops.kv_cache_write_at(
                    ck, cv, k_w.contiguous(), v_w.contiguous(), idx.write_slot, backend=backend
                )
                # 2. roped copies of the blocks needing a pass-specific position (read after the write)
                gk, gv = ck.index_select(1, idx.copy_tokens), cv.index_select(1, idx.copy_tokens)
                _, gkr = ops.rope3d_positions(
                    gk, gk, (nc_frames, hp, wp), idx.copy_positions, backend=backend
                )
                out = q_s.new_zeros(q_s.shape)
                if not sizes:  # last layer, query shard inside the update block: nothing is read
                    return out
                qr = qr_full[:, qsl.start + (n_upd if den_only else 0) : qsl.stop].contiguous()
                # 3. this shard's query groups in one launch; ring blocks read in place
                res = ops.attention_block_table(
                    qr, [ck, kr, gkr], [cv, v_all, gv], tab, sizes, t, backend=backend
                )
                assert isinstance(res, torch.Tensor)
                out[:, q_s.shape[1] - res.shape[1] :] = res
                return out

            out = sharded_attention(
                q.contiguous(), k.contiguous(), v.contiguous(), self.groups,
                num_queries=n_tok, num_keys=n_tok, attention_fn=local, backend=backend,
            )  # fmt: skip
            assert isinstance(out, torch.Tensor)
            return out[:, drop:]

        return attn


# ---- spawning ranks on CPU ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Job:
    """Everything a spawned rank needs (pickled once per rank)."""

    model: CausalWanModel
    model_cfg: ModelConfig
    pipe_cfg: PipelineConfig
    plan: ShardingPlan
    backend: str | None
    positions: str
    text_embeds: torch.Tensor
    num_blocks: int
    generator_state: torch.Tensor
    noise: torch.Tensor | None
    timeout_s: float
    return_latents: bool
    merged: bool
    prompts: tuple[tuple[int, torch.Tensor, bool], ...] = ()
    method: StreamMethod | str = "rolling-forcing"


def _rank_main(rank: int, world: int, job: _Job, chunks: Any) -> dict[str, Any]:
    """Body of one spawned rank: build groups, run the stream, rank 0 puts every chunk on ``chunks``."""
    if world != job.plan.world_size:
        raise ValueError(f"launched {world} ranks for a plan of {job.plan.world_size}")
    groups = build_groups(job.plan, timeout_s=job.timeout_s)
    gather = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=job.timeout_s))
    runner = RankStream(
        job.model, job.model_cfg, job.pipe_cfg, groups,
        backend=job.backend, positions=job.positions, gather_group=gather, merged=job.merged,
        method=job.method,
    )  # fmt: skip
    gen = torch.Generator()
    gen.set_state(job.generator_state)
    kept: list[torch.Tensor] = []
    prompts = {w: (emb, recache) for w, emb, recache in job.prompts}
    for chunk in runner.stream(
        job.text_embeds, job.num_blocks, generator=gen, noise=job.noise, prompts=prompts
    ):
        if rank == 0 and chunks is not None:
            buf = io.BytesIO()
            torch.save((chunk.block, chunk.latents, chunk.final, chunk.last, chunk.window), buf)
            chunks.put(buf.getvalue())
        if job.return_latents:
            kept.append(chunk.latents)
    latents = torch.cat(kept, dim=1) if kept else None
    heads = local_heads(job.plan, rank)
    return {
        "rank": rank,
        "heads": (heads.start, heads.stop),
        "cache_shape": runner.cache_shape,
        "latents": latents,
        "forwards": dict(runner.stats.forwards),
        "signatures": dict(runner.stats.signatures),
    }


class ShardedRollingForcingPipeline:
    """Rolling Forcing on ``cores`` CPU ranks (gloo, spawned per stream); same interface as the pipeline.

    Args:
        model: the DiT (pickled to every rank; weights replicated).
        model_cfg, pipe_cfg: configurations.
        cores: number of ranks (>= 1). ``tp`` forces the heads split (default: the planner's choice at
            this stream's window shape, :func:`pipeline_plan`).
        backend, positions: as :class:`rolling_forcing.pipeline.RollingForcingPipeline`.
        merged: as :class:`~rolling_forcing.pipeline.RollingForcingPipeline`: True: one merged forward
            per window on every rank (:meth:`RankStream._merged_windows`); False: two passes; None
            (default): merged where ``ops.attention_block_table`` runs on ``backend``
            (``ops.has_kernel``), else two-pass. ``self.merged`` tells which. ``merged=True`` on a
            backend without that op raises ``NotImplementedError``.
        compile: not supported for the sharded stream (anything but None/False raises ``ValueError``:
            the ranks run eager forwards).
        method: as :class:`~rolling_forcing.pipeline.RollingForcingPipeline` (a sequential method runs
            two-pass: ``merged`` None -> False, True raises ``NotImplementedError``); its prompt switches
            use ``window`` = the step index, a multiple of the method's steps (the block's first call).
        timeout_s: timeout of every collective: a rank that dies or hangs makes the others fail after
            at most this long and :meth:`stream` raises :class:`sharding.launch.LaunchError` naming it.

    Raises ``ValueError`` for a plan that cannot be built (see :func:`pipeline_plan`).
    """

    def __init__(
        self,
        model: CausalWanModel,
        model_cfg: ModelConfig,
        pipe_cfg: PipelineConfig,
        *,
        cores: int,
        tp: int | None = None,
        backend: str | None = None,
        positions: str | None = None,
        merged: bool | None = None,
        compile: Any = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        method: str | StreamMethod | None = None,
    ) -> None:
        mode = resolve_positions(pipe_cfg, positions)
        self.method = get_method("rolling-forcing" if method is None else method)
        if self.method.sequential and merged:
            raise NotImplementedError(f"merged=True: Rolling Forcing only, not method={self.method.name!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if merged is not None and not isinstance(merged, bool):
            raise TypeError(f"merged must be a bool or None, got {type(merged).__name__}")
        if compile not in (None, False):
            raise ValueError(
                "compile= is not supported by the sharded stream (the ranks run eager forwards; the "
                "collectives inside attention would have to be traced too); use compile=None or cores=1"
            )
        supported = ops.has_kernel("attention_block_table", backend) and not self.method.sequential
        if merged and not supported:
            raise NotImplementedError(
                f"merged=True needs ops.attention_block_table, which backend={backend!r} does not implement; "
                "use merged=False (two passes)"
            )
        self.merged: bool = supported if merged is None else merged
        self.plan = pipeline_plan(model_cfg, pipe_cfg, cores, tp=tp)
        self.model, self.model_cfg, self.pipe_cfg = model, model_cfg, pipe_cfg
        self.backend, self.positions, self.timeout_s = backend, mode, timeout_s
        self.last_results: list[dict[str, Any]] | None = None
        self._prompts: dict[int, tuple[torch.Tensor, bool]] = {}
        self._streaming = False

    def set_prompt(self, text_embeds: torch.Tensor, recache: bool = False, *, window: int) -> None:
        """Schedule a prompt switch at the start of ``window`` of the next :meth:`stream`.

        Same semantics as :meth:`rolling_forcing.pipeline.RollingForcingPipeline.set_prompt` called after
        the chunk of window ``window - 1`` (``chunk.window + 1`` is the window a switch made at that chunk
        takes effect): text k/v recomputed for ``text_embeds`` ``[B, L<=text_len, text_dim]``; with
        ``recache=True`` the clean blocks still cached are re-encoded under the new prompt; in merged mode
        the pending update of the old prompt runs alone first. The schedule is given to every rank when
        the stream starts, so all ranks switch at the same window with no message; it is consumed by that
        stream. A later call for the same window replaces the earlier one.

        Raises ``RuntimeError`` while a stream runs (the ranks run ahead of the consumer, so a switch
        made then could not be placed at a window exactly), ``ValueError``/``TypeError`` for bad
        embeddings, a negative or non-int ``window`` or a non-bool ``recache`` (the window's upper bound
        and the batch are checked by :meth:`stream`, before spawning).
        """
        if self._streaming:
            raise RuntimeError(
                "set_prompt during a running sharded stream is not supported: the ranks run ahead of the "
                "consumer, so the switch could not be placed at a window exactly; schedule it before "
                "stream() with set_prompt(embeds, recache, window=w)"
            )
        if isinstance(window, bool) or not isinstance(window, int):
            raise TypeError(f"window must be an int, got {type(window).__name__}")
        if window < 0:
            raise ValueError(f"window must be >= 0, got {window}")
        if not isinstance(recache, bool):
            raise TypeError(f"recache must be a bool, got {type(recache).__name__}")
        self.model._check_context(text_embeds)
        self._prompts[window] = (text_embeds.detach().clone(), recache)

    def stream(
        self,
        text_embeds: torch.Tensor,
        num_blocks: int,
        *,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | None = None,
        return_latents: bool = False,
    ) -> Iterator[Chunk]:
        """Spawn the ranks, stream the video, yield each chunk as soon as rank 0 has it final.

        Arguments as :meth:`rolling_forcing.pipeline.RollingForcingPipeline.stream` (``generator``'s
        state is copied to every rank; it is not advanced here). ``return_latents``: every rank also
        returns its copy of all latents in :attr:`last_results` (for equivalence checks).

        The prompt switches scheduled with :meth:`set_prompt` apply to this stream (and are consumed);
        every rank's forward counts come back in :attr:`last_results` (``"forwards"``: kind -> count,
        ``"signatures"``: (kind, input signature) -> count, see :attr:`RankStream.stats`).

        Raises :class:`sharding.launch.LaunchError` if a rank fails (its traceback in the message).
        Closing the generator early waits for the ranks to finish the stream.
        """
        cfg = self.pipe_cfg
        check_method_stream(self.model, self.method, cfg, text_embeds, num_blocks, self.positions)  # first
        prompts, self._prompts = self._prompts, {}
        check_prompts(self.model, cfg, prompts, text_embeds.shape[0], num_blocks, self.method)
        state = generator.get_state() if generator is not None else torch.get_rng_state()
        job = _Job(
            self.model, self.model_cfg, cfg, self.plan, self.backend, self.positions,
            text_embeds.detach().clone(), num_blocks, state.clone(),
            None if noise is None else noise.detach().clone(), self.timeout_s, return_latents,
            self.merged, tuple((w, emb, rc) for w, (emb, rc) in sorted(prompts.items())), self.method,
        )  # fmt: skip
        self._streaming = True
        try:
            yield from self._run(job, num_blocks)
        finally:
            self._streaming = False

    def _run(self, job: _Job, num_blocks: int) -> Iterator[Chunk]:
        """Launch the ranks of ``job`` and yield rank 0's chunks as they arrive."""
        cfg = self.pipe_cfg
        ctx: Any = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))
        chunks = ctx.Queue()
        box: dict[str, Any] = {}
        # the launch deadline (2 * timeout + 30 s) must cover the whole stream; dead or stuck ranks are
        # caught by the collectives' own timeout_s (every group above is created with it)
        launch_timeout = self.timeout_s * (num_calls(self.method, cfg, num_blocks) + 1)

        def run() -> None:
            try:
                box["results"] = launch(
                    _rank_main, self.plan.world_size, job, chunks, timeout_s=launch_timeout, preload=PRELOAD
                )
            except BaseException as exc:  # handed to the consuming thread
                box["error"] = exc

        thread = threading.Thread(target=run, name="sharded-stream-launch", daemon=True)
        thread.start()
        received = 0
        try:
            while received < num_blocks:
                try:
                    payload = chunks.get(timeout=0.05)
                except queue_mod.Empty:
                    if thread.is_alive():
                        continue
                    try:
                        payload = chunks.get(timeout=0.5)
                    except queue_mod.Empty:
                        if "error" in box:
                            raise box["error"] from None
                        raise LaunchError(
                            f"the ranks finished after {received} of {num_blocks} chunks", 0
                        ) from None
                block, latents, final, last, window = torch.load(io.BytesIO(payload), weights_only=True)
                received += 1
                yield Chunk(block, latents, final, last, window)
        finally:
            thread.join()
            chunks.close()
        if "error" in box:
            raise box["error"]
        self.last_results = box["results"]
