"""One rank of the sharded stream: :class:`RankStream` runs the window loop of
:class:`rolling_forcing.pipeline.RollingForcingPipeline` (every method of :mod:`rolling_forcing.methods`)
in lockstep with the other ranks, with its forwards split TP (heads) x SP (tokens/queries); the design of
one forward and of the per-head-group KV cache is in :mod:`sharding.pipeline`'s docstring. Use it inside
ranks started any way (``torchrun``, the XLA process group on Trainium); :mod:`sharding.pipeline`
spawns CPU ranks around it.
"""

from __future__ import annotations

from collections.abc import Iterator
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
    renoise_window,
    resolve_positions,
    stream_plans,
    window_input,
)
from rolling_forcing.schedule import KeyBlock, PassPlan, WindowPlan
from rolling_forcing.sequential import StepPlan, recache_plan
from sharding.attention import (
    ShardGroups,
    local_heads,
    local_tokens,
    query_shard_tokens,
    sharded_attention,
    token_splits,
)
from sharding.stream_checks import PromptSchedule, check_plan, check_prompts

__all__ = ["RankStream"]


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
        check_plan(groups.plan, model_cfg, pipe_cfg)
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
        noise: torch.Tensor | NoiseSource | None = None,
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
        src = (
            noise
            if isinstance(noise, NoiseSource)
            else NoiseSource(
                bsz,
                mcfg.latent_frame_shape(),
                fpb,
                num_blocks,
                dtype,
                generator=generator,
                initial_noise=noise,
            )
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
