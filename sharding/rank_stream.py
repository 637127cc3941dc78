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
from rolling_forcing import sequential
from rolling_forcing.attend import attend_cache
from rolling_forcing.cache import LayerKVCache, RollingKVCache
from rolling_forcing.config import ModelConfig, PipelineConfig
from rolling_forcing.driver import (
    DriverSpec,
    HeldUpdate,
    Plan,
    StreamDriver,
    UpdateMode,
    check_method_stream,
    merged_call_step,
    resolve_positions,
    resolve_update_mode,
)
from rolling_forcing.merged import MergedIndex, MergedLayout
from rolling_forcing.methods import StreamMethod, get_method
from rolling_forcing.model import CausalWanModel, Grid, SelfAttnFn, TextKV
from rolling_forcing.schedule import KeyBlock, PassPlan, WritePass
from rolling_forcing.sequential import RecachePlan
from rolling_forcing.stream import Chunk, ForwardStats, NoiseSource, StreamState
from sharding.attention import (
    ShardGroups,
    local_heads,
    local_tokens,
    query_shard_tokens,
    sharded_attention,
    token_splits,
)
from sharding.collectives import all_gather
from sharding.compiled import CompiledForward, GraphRecord
from sharding.kv_shard import SpKVCache, check_kv_cache_layout, owned_block_tokens
from sharding.stream_checks import PromptSchedule, check_plan, check_prompts

__all__ = ["RankStream"]


class _LayerBox:
    """The KV layer one attention layer works on: the replicated layer itself, or (SP-sharded cache) the
    whole key range assembled inside the layer's local step from the shares the SP group gathered in the
    same collective as the layer's keys (``share`` goes to ``sharded_attention(sp_extra=)``)."""

    def __init__(self, kv: SpKVCache | None, cache: RollingKVCache, layer: int) -> None:
        self.kv, self.layer = kv, layer
        self.lc: LayerKVCache | None = cache.layers[layer] if kv is None else None
        self.share: torch.Tensor | None = None if kv is None else kv.share(layer)

    def open(self, parts: torch.Tensor | None) -> LayerKVCache:
        """The layer, assembled from the gathered ``parts`` ``[sp, ...]`` (SP-sharded) or as it is."""
        if self.kv is not None:
            assert parts is not None, "the SP-sharded cache's shares travel with the keys (sp_extra)"
            self.lc = self.kv.assemble(self.layer, parts)
        assert self.lc is not None
        return self.lc


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
        compile: None (eager) or a ``torch.compile`` spec for the merged forward (True, a backend name
            or callable; :class:`sharding.compiled.CompiledForward`): one graph per forward with the
            collectives inside; :attr:`compiled_graphs` records them. Rolling Forcing merged only.
        kv_cache: ``"sp_sharded"`` (default): within a head group every SP rank keeps only its share of
            every cached block and each attention layer all-gathers the layer's whole key range
            (:mod:`sharding.kv_shard`); ``"replicated"``: every SP rank keeps the whole key range of its
            heads (``sp`` x the memory, no cache traffic). Same stream either way. Every rank must pass
            the same value.

    The stream runs on the one driver of every stream (:class:`rolling_forcing.driver.StreamDriver`);
    this class supplies its forwards (:class:`~rolling_forcing.driver.StreamPasses`:
    :meth:`denoise_pass`, :meth:`merged_pass`, :meth:`update_pass`, :meth:`recache_pass`), each a
    token-sharded :meth:`forward`. The KV cache holds only this rank's heads and, SP-sharded, only its
    tokens of every block (``[B, slots * t_s, H/tp, D]`` per layer and k/v; replicated ``[B, S, H/tp,
    D]``; its text k/v holds all heads: cross-attention is token-sharded); see the module docstring.
    Every rank yields the same chunks. After a stream, :attr:`cache_shape`, :attr:`kv_bytes`,
    :attr:`text_kv_bytes` and :attr:`kv_gather_bytes` give the sizes of what it allocated (measured).
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
        static: bool = False,
        kv_cache: str = "sp_sharded",
        compile: Any = None,
    ) -> None:
        mode = resolve_positions(pipe_cfg, positions)
        check_plan(groups.plan, model_cfg, pipe_cfg)
        self.kv_cache = check_kv_cache_layout(kv_cache)
        if not isinstance(merged, bool):
            raise TypeError(f"merged must be a bool, got {type(merged).__name__}")
        meth = self.method = get_method("rolling-forcing" if method is None else method)
        upd_mode = resolve_update_mode(meth, backend, merged, static)
        self.merged, self.static = upd_mode is not UpdateMode.TWO_PASS, static
        if static:
            self._layout = sequential.static_layout(meth, meth.tokens_per_block(model_cfg), mode)
        else:
            self._layout = MergedLayout.from_configs(model_cfg, pipe_cfg, mode)
        self.model, self.model_cfg, self.pipe_cfg = model, model_cfg, pipe_cfg
        self.groups, self.plan, self.rank = groups, groups.plan, groups.rank
        self.backend, self.positions, self.gather_group = backend, mode, gather_group
        self.heads = local_heads(self.plan, self.rank)
        frames = self._layout.frames if upd_mode is UpdateMode.MERGED else 0
        self._spec = DriverSpec(meth, pipe_cfg, mode, upd_mode, frames)
        self._driver = StreamDriver(model, self._spec, self)
        if compile not in (None, False) and (upd_mode is not UpdateMode.MERGED or meth.sequential):
            raise ValueError(
                "compile= applies to Rolling Forcing's merged forward only (merged=True or None with a "
                f"backend that has ops.attention_block_table), not method={meth.name!r}, merged={merged}"
            )
        self._compiled = CompiledForward(self._merged_forward, compile)
        self.cache: RollingKVCache | None = None
        self._kv: SpKVCache | None = None  # the SP-sharded cache's gather / keep (None: replicated or sp 1)
        # measured, the last stream's allocations on this rank: one layer's k buffer shape, the bytes of
        # every layer's k and v, of the text k/v, and of the largest gathered layer (k + v; 0: no gather)
        self.cache_shape: tuple[int, ...] | None = None
        self.kv_bytes = self.text_kv_bytes = self.kv_gather_bytes = 0
        self.stats = ForwardStats()  # measured: the last stream's forwards by kind and input signature

    @property
    def compiled_graphs(self) -> list[GraphRecord]:
        """Every graph ``compile=`` compiled so far (empty when eager): its collectives and kernel calls."""
        return list(self._compiled.graphs)

    # ---- the stream (the driver of RollingForcingPipeline.stream) ------------------------------------
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
        """Generate ``num_blocks`` blocks; yield each :class:`~rolling_forcing.stream.Chunk` when final.

        Arguments as :meth:`rolling_forcing.pipeline.RollingForcingPipeline.stream`; every rank must pass
        the same text, noise, generator state and ``prompts`` (the noise is drawn replicated).
        ``prompts``: window -> (embeds, recache): at the start of that window the prompt switches exactly
        as the unsharded ``set_prompt(embeds, recache)`` called after the chunk of the window before
        (see :func:`check_prompts` for the errors). :attr:`stats` counts this stream's forwards.
        """
        cfg = self.pipe_cfg
        check_method_stream(self.model, self.method, cfg, text_embeds, num_blocks, self.positions)
        sched: PromptSchedule = dict(prompts) if prompts is not None else {}
        check_prompts(self.model, cfg, sched, text_embeds.shape[0], num_blocks, self.method)
        self.stats = ForwardStats()
        hpc = self.plan.heads_per_core  # the cache: this rank's heads; its text k/v: all heads
        t = self._spec.timing.tokens_per_block(self.model_cfg)
        sp_sharded = self.kv_cache == "sp_sharded" and self.plan.sp > 1
        own = owned_block_tokens(self.plan, t, self.rank) if sp_sharded else None
        st = self._driver.start(
            self.model_cfg, text_embeds, num_blocks, generator=generator, noise=noise, num_heads=hpc,
            block_tokens=own,
        )  # fmt: skip
        self.cache = st.cache
        self._kv = SpKVCache(st.cache, self.plan, self.rank, t, self.groups.sp_group) if sp_sharded else None
        self.cache_shape = tuple(st.cache.layers[0].k.shape)
        self.kv_bytes = st.cache.nbytes
        try:
            yield from self._driver.run(st, lambda plan: sched.get(plan.index))
        finally:
            self.text_kv_bytes = sum(k.nbytes + v.nbytes for k, v in st.cache.text_kv())
            self.kv_gather_bytes = self._kv.gather_bytes if self._kv is not None else 0
            self.cache, self._kv = None, None

    # ---- the passes the driver runs (rolling_forcing.driver.StreamPasses) --------------------------------
    def denoise_pass(self, st: StreamState, plan: Plan, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The denoise forward of ``plan`` (sharded self-attention over the pass's cache keys + own keys)."""
        attn = self._pass_attn(st.cache, plan.denoise, None)
        return self.forward(x, t, st.cache.text_kv(), attn, kind="denoise")

    def merged_pass(
        self, st: StreamState, plan: Plan, held: HeldUpdate | None, x: torch.Tensor, t: torch.Tensor
    ) -> torch.Tensor:
        """One merged forward (:meth:`_merged_attn`): the held update (masked when None) + ``plan``'s window,
        at the index tensors of the same :func:`~rolling_forcing.driver.merged_call_step` as the unsharded
        stream. The update frames only write the cache: the last layer and the head skip them."""
        spec, lay = self._spec, self._layout
        if spec.mode is UpdateMode.BATCHED:  # a sequential method: the held update + one block, eager
            assert held is not None
            attn = self._batched_attn(st.cache, held.write, plan.denoise)
            fpb = spec.timing.frames_per_block
            return self.forward(x, t, st.cache.text_kv(), attn, context_frames=fpb, kind="batched")
        step = merged_call_step(
            spec.method, spec.pipe_cfg, lay, st.num_blocks, plan.index, spec.positions,
            None if held is None else held.plan.index,
        )  # fmt: skip
        idx = MergedIndex.from_step(step, lay, st.cache.layers[0].k.device)
        kind = "static" if spec.method.sequential else "merged"
        if not self._compiled.compiled:
            attn = self._merged_attn(st.cache, idx)
            frames = lay.update_frames
            return self.forward(
                x, t, st.cache.text_kv(), attn, context_frames=frames, kind=kind, index=idx.tensors()
            )
        self.stats.log(kind, x, t, self._token_shard_spec(x), *idx.tensors())  # outside the graph
        out = self._compiled(x, t, st.cache.text_kv(), st.cache, *idx.tensors())
        if self._kv is not None:
            self._kv.note_compiled_gather()
        return out

    def _merged_forward(
        self, x: torch.Tensor, t: torch.Tensor, text_kv: TextKV, cache: RollingKVCache, *index: torch.Tensor
    ) -> torch.Tensor:
        """One merged forward as a function of its tensors (what ``compile=`` compiles: no Python value in
        it depends on the window; the collectives are functional ops of the graph)."""
        idx = MergedIndex(*index)
        attn = self._merged_attn(cache, idx)
        frames = self._layout.update_frames
        return self.forward(x, t, text_kv, attn, context_frames=frames, kind="merged", log=False)

    def _token_shard_spec(self, x: torch.Tensor) -> torch.Tensor:
        """A meta tensor of this rank's token shard ``[B, L_local, dim]`` (for :attr:`stats` signatures)."""
        hp, wp = self.model_cfg.grid_hw
        n_tok = x.shape[1] * hp * wp
        sl = local_tokens(n_tok, self.plan, self.rank)
        return torch.empty((x.shape[0], sl.stop - sl.start, self.model_cfg.dim), dtype=x.dtype, device="meta")

    def update_pass(
        self, st: StreamState, write: WritePass, x: torch.Tensor, t: torch.Tensor, kind: str
    ) -> None:
        """A cache-writing forward of one clean block (cache update or re-cache pass); only its k/v writes
        matter: the last layer stops at them (``context_frames`` = all frames)."""
        attn = self._pass_attn(st.cache, write.pass_, ((write.slot,), write.store_roped))
        self.forward(x, t, st.cache.text_kv(), attn, context_frames=x.shape[1], kind=kind)

    def recache_pass(self, st: StreamState, rp: RecachePlan, x: torch.Tensor, t: torch.Tensor) -> None:
        """LongLive's re-cache forward (:func:`rolling_forcing.sequential.recache_plan`): the written blocks'
        clean k/v under the new prompt; they attend to the protected sink + themselves (read back from the
        cache after the write, like the update pass)."""
        absolute = rp.store_roped
        fpb = self.method.frames_per_block
        own = tuple(
            KeyBlock(b, s, rp.pass_.query_position + i * fpb, absolute)
            for i, (b, s) in enumerate(zip(rp.blocks, rp.slots))
        )
        p = PassPlan(rp.blocks, rp.pass_.query_position, (*rp.pass_.cache_keys, *own), False)
        attn = self._pass_attn(st.cache, p, (rp.slots, rp.store_roped))
        self.forward(x, t, st.cache.text_kv(), attn, context_frames=x.shape[1], kind="recache")

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
        log: bool = True,
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
        merged forward's :class:`~rolling_forcing.merged.MergedIndex`); ``log=False``: the caller counts
        it (a compiled forward is counted outside its graph).
        """
        model, c = self.model, self.model_cfg
        grid = model.check_forward_inputs(x, timesteps, context_frames)
        b, f = x.shape[:2]
        _, hp, wp = grid
        n_tok = f * hp * wp
        n_ctx = context_frames * hp * wp
        sl = local_tokens(n_tok, self.plan, self.rank)
        n_loc = sl.stop - sl.start
        tok, e, e0 = model.embed(x, timesteps)  # replicated, then sliced: a few per cent of one layer
        tok = tok[:, sl].contiguous()  # [B, L_local, dim]
        if log:
            self.stats.log(kind, x, timesteps, tok, *index)
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
        out = self._gather_tokens(out, sizes)
        return model.unpatchify(out, f - context_frames).to(x.dtype)  # out: [B, L - n_ctx, patch_out]

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
        group = self.gather_group if self.gather_group is not None else dist.group.WORLD
        bufs = all_gather(x, world, group)
        return torch.cat([bufs[r, :, :n] for r, n in enumerate(sizes)], dim=1)

    # ---- the cache of one attention layer -------------------------------------------------------------
    def _keep(self, layer: int, lc: LayerKVCache | None) -> None:
        """After a layer that wrote ``lc`` (a :class:`_LayerBox` 's layer): keep this rank's share of it
        (None: the layer's local step did not run on this rank, so it wrote nothing)."""
        if self._kv is not None and lc is not None:
            self._kv.keep(layer, lc)

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
            box = _LayerBox(self._kv, cache, layer)
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
                sp_extra: torch.Tensor | None = None,
            ) -> torch.Tensor:
                lc = box.open(sp_extra)
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
                num_queries=n_q, num_keys=n_tok, attention_fn=local, backend=self.backend, sp_extra=box.share,
            )  # fmt: skip
            assert isinstance(out, torch.Tensor)
            if write is not None:
                self._keep(layer, box.lc)
            return q if write_only else out

        return attn

    def _write_blocks(self, lc: Any, slots: tuple[int, ...], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k, v`` ``[B, len(slots) * T, H, D]`` block by block into ``slots`` of ``lc``."""
        t = lc.tokens_per_block
        for i, slot in enumerate(slots):
            lc.write(slot, k[:, i * t : (i + 1) * t], v[:, i * t : (i + 1) * t], backend=self.backend)

    def _batched_attn(self, cache: RollingKVCache, upd: WritePass, den: PassPlan) -> SelfAttnFn:
        """Sharded self-attention of one batched forward of a sequential method: the unsharded
        :func:`rolling_forcing.attend.batched_update_attn` on this rank's heads and query shard (the 2T
        tokens: the held-back update block ``upd``, then the block to denoise ``den``), the same steps
        and the same layout rule (only whole tensors reach the ops; the query shard is placed in a
        full-length zero tensor). Last layer (``forward(context_frames=fpb)``): the update queries are
        skipped, their zero placeholders unread.
        """
        last = len(self.model.blocks) - 1
        backend = self.backend

        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Grid) -> torch.Tensor:
            n_tok = grid[0] * grid[1] * grid[2]
            t = n_tok // 2
            gb: Grid = (grid[0] // 2, grid[1], grid[2])
            pos = [p + i for p in (upd.pass_.query_position, den.query_position) for i in range(gb[0])]
            box = _LayerBox(self._kv, cache, layer)
            drop = k.shape[1] - q.shape[1]  # leading local tokens without a query (last layer only)
            if drop:
                q = torch.cat([q.new_zeros((q.shape[0], drop, *q.shape[2:])), q], dim=1)
            qsl = query_shard_tokens(n_tok, self.plan, self.rank)
            a, b = qsl.start, qsl.stop
            den_only = layer == last

            def local(
                q_s: torch.Tensor,
                k_all: torch.Tensor,
                v_all: torch.Tensor,
                *,
                scale: float | None,
                return_lse: bool,
                backend: str | None,
                sp_extra: torch.Tensor | None = None,
            ) -> torch.Tensor:
                lc = box.open(sp_extra)
                q_full = q_s.new_zeros(k_all.shape)
                q_full[:, qsl] = q_s
                qr, kr = ops.rope3d(q_full, k_all, grid, frame_positions=pos, backend=backend)
                lc.write(upd.slot, (kr if upd.store_roped else k_all)[:, :t], v_all[:, :t], backend=backend)
                out = q_s.new_zeros(q_s.shape)
                if b > t:  # the shard's denoise queries
                    qd, own = qr[:, max(a, t) : b].contiguous(), (kr, v_all)
                    out[:, max(a, t) - a :] = attend_cache(
                        lc, qd, den.cache_keys, own, gb, backend=backend, own_start=t
                    )
                if a < t and not den_only:  # the shard's update queries
                    qu = qr[:, a : min(b, t)].contiguous()
                    out[:, : min(b, t) - a] = attend_cache(
                        lc, qu, upd.pass_.cache_keys, None, gb, backend=backend
                    )
                return out

            out = sharded_attention(
                q.contiguous(), k.contiguous(), v.contiguous(), self.groups,
                num_queries=n_tok, num_keys=n_tok, attention_fn=local, backend=backend, sp_extra=box.share,
            )  # fmt: skip
            assert isinstance(out, torch.Tensor)
            self._keep(layer, box.lc)
            return out[:, drop:]

        return attn

    def _merged_attn(self, cache: RollingKVCache, idx: MergedIndex) -> SelfAttnFn:
        """Sharded self-attention of one merged forward (``rolling_forcing.merged.merged_forward``'s steps).

        :func:`sharding.attention.sharded_attention` regroups q, k, v to (head group x query shard) and
        gathers every new key of the local heads; the local step then does what the unsharded merged
        forward does, on this rank's heads and query shard: rope all frames at ``idx.frame_positions``
        (the query shard placed in a full-length zero tensor), write the update block's clean k/v into its
        ring slot of the layer from :meth:`_layer` (SP-sharded: each rank then keeps its share), rope the
        copies (sink / relative-mode keys) from the cache, then one ``ops.attention_block_table`` launch over
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
            box = _LayerBox(self._kv, cache, layer)
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
                sp_extra: torch.Tensor | None = None,
            ) -> torch.Tensor:
                lc = box.open(sp_extra)
                ck, cv = lc.k, lc.v
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
                num_queries=n_tok, num_keys=n_tok, attention_fn=local, backend=backend, sp_extra=box.share,
            )  # fmt: skip
            assert isinstance(out, torch.Tensor)
            self._keep(layer, box.lc)
            return out[:, drop:]

        return attn
