"""One rank of the sharded stream: :class:`RankStream` runs the window loop of
:class:`rolling_forcing.pipeline.RollingForcingPipeline` (every method of :mod:`rolling_forcing.methods`)
in lockstep with the other ranks, with its forwards split TP (heads) x SP (tokens/queries); the design of
one forward and of the per-head-group KV cache is in :mod:`sharding.pipeline`'s docstring. Use it inside
ranks started any way (``torchrun``, the XLA process group on Trainium); :mod:`sharding.pipeline`
spawns CPU ranks around it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from rolling_forcing import sequential
from rolling_forcing.cache import RollingKVCache
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
from rolling_forcing.guidance import guided_embeds
from rolling_forcing.merged import MergedIndex, MergedLayout
from rolling_forcing.methods import StreamMethod, get_method
from rolling_forcing.model import CausalWanModel, Grid, SelfAttnFn, TextKV
from rolling_forcing.schedule import KeyBlock, PassPlan, WritePass, slot_of
from rolling_forcing.sequential import RecachePlan
from rolling_forcing.stream import Chunk, ForwardStats, NoiseSource, StreamState
from sharding.attention import (
    ShardGroups,
    local_heads,
    local_tokens,
    token_splits,
)
from sharding.collectives import all_gather
from sharding.compiled import CompiledForward, GraphRecord
from sharding.kv_shard import (
    CompactRing,
    RingIndex,
    SpKVCache,
    TextKVGather,
    check_compact_layout,
    check_kv_cache_layout,
    owned_block_tokens,
)
from sharding.rank_attention import RankAttention
from sharding.stream_checks import PromptSchedule, check_plan, check_prompts

__all__ = ["RankStream"]


class RankStream(RankAttention):
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
            heads (``sp`` x the memory, no cache traffic); ``"sp_compact"`` (Rolling Forcing, ``sp > 1``,
            eager or ``compile=``): SP-sharded with a ring one slot shorter and the text k/v token-sharded
            over all ranks, gathered per layer (:mod:`sharding.kv_shard`). Same stream in every layout.
            Every rank must pass the same value.

    The stream runs on the one driver of every stream (:class:`rolling_forcing.driver.StreamDriver`);
    this class supplies its forwards (:class:`~rolling_forcing.driver.StreamPasses`:
    :meth:`denoise_pass`, :meth:`merged_pass`, :meth:`update_pass`, :meth:`recache_pass`), each a
    token-sharded :meth:`forward`. The KV cache holds only this rank's heads and, SP-sharded, only its
    tokens of every block (``[B, slots * t_s, H/tp, D]`` per layer and k/v; replicated ``[B, S, H/tp,
    D]``; its text k/v holds all heads: cross-attention is token-sharded); see the module docstring.
    Every rank yields the same chunks. After a stream, :attr:`cache_shape`, :attr:`kv_bytes`,
    :attr:`text_kv_bytes`, :attr:`kv_gather_bytes` and :attr:`text_gather_bytes` (one gathered text k/v
    layer, ``"sp_compact"``) give the sizes of what it allocated (measured).
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
        self._spec = DriverSpec(
            meth, pipe_cfg, mode, upd_mode, frames, model_cfg.guidance_scale, model_cfg.guidance_sigma_min
        )
        self._driver = StreamDriver(model, self._spec, self)
        if compile not in (None, False) and (upd_mode is not UpdateMode.MERGED or meth.sequential):
            raise ValueError(
                "compile= applies to Rolling Forcing's merged forward only (merged=True or None with a "
                f"backend that has ops.attention_block_table), not method={meth.name!r}, merged={merged}"
            )
        check_compact_layout(self.kv_cache, meth.sequential, self.plan)
        self._compiled = CompiledForward(self._merged_forward, compile)
        self.cache: RollingKVCache | None = None
        self._kv: SpKVCache | None = None  # the SP-sharded cache's gather / keep (None: replicated or sp 1)
        self._ring: CompactRing | None = None  # sp_compact: which block each ring slot holds
        self._text_sizes: set[int] = set()  # sp_compact: bytes of the text k/v layers gathered
        # measured, the last stream's allocations on this rank: one layer's k buffer shape, the bytes of
        # every layer's k and v, of the text k/v, and of the largest gathered layer (k + v; 0: no gather)
        self.cache_shape: tuple[int, ...] | None = None
        self.kv_bytes = self.text_kv_bytes = self.kv_gather_bytes = self.text_gather_bytes = 0
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
        if self._spec.guided:  # model_cfg.guidance_scale > 1: [prompt | null prompt]
            sched = {w: (guided_embeds(e), rc) for w, (e, rc) in sched.items()}
            text_embeds = guided_embeds(text_embeds)  # the driver repeats the noise for the null rows
        self.stats = ForwardStats()
        hpc = self.plan.heads_per_core  # the cache: this rank's heads; its text k/v: all heads
        t = self._spec.timing.tokens_per_block(self.model_cfg)
        sp_sharded = self.kv_cache != "replicated" and self.plan.sp > 1
        own = owned_block_tokens(self.plan, t, self.rank) if sp_sharded else None
        ring = self._ring = CompactRing(cfg) if self.kv_cache == "sp_compact" else None
        st = self._driver.start(
            self.model_cfg, text_embeds, num_blocks, generator=generator, noise=noise, num_heads=hpc,
            block_tokens=own, num_slots=None if ring is None else ring.slots,
        )  # fmt: skip
        if ring is not None:  # every rank keeps a token share of the text k/v (gathered per layer)
            st.cache.share_text(self.rank, self.plan.world_size)
        self._text_sizes = set()
        self.cache = st.cache
        kv = SpKVCache(st.cache, self.plan, self.rank, t, self.groups.sp_group, ring) if sp_sharded else None
        self._kv = kv
        self.cache_shape = tuple(st.cache.layers[0].k.shape)
        self.kv_bytes = st.cache.nbytes
        try:
            yield from self._driver.run(st, lambda plan: sched.get(plan.index))
        finally:
            self.text_kv_bytes = sum(k.nbytes + v.nbytes for k, v in st.cache.text_kv())
            self.kv_gather_bytes = self._kv.gather_bytes if self._kv is not None else 0
            self.text_gather_bytes = max(self._text_sizes, default=0)
            self.cache, self._kv, self._ring = None, None, None

    # ---- the passes the driver runs (rolling_forcing.driver.StreamPasses) --------------------------------
    def denoise_pass(self, st: StreamState, plan: Plan, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The denoise forward of ``plan`` (sharded self-attention over the pass's cache keys + own keys)."""
        text = self._text_of(st)
        attn = self._pass_attn(st.cache, plan.denoise, None, self._gathered_text(text))
        self._ring_begin(plan.denoise.cache_keys, ())
        out = self.forward(x, t, text, attn, kind="denoise")
        self._ring_commit()
        return out

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
        if held is None:
            ring = self._ring_begin(plan.denoise.cache_keys, ())
        else:
            ring = self._ring_begin((*held.write.pass_.cache_keys, *plan.denoise.cache_keys), held.write)
        ring_in = () if ring is None else ring.tensors()
        if not self._compiled.compiled:
            out = self._merged_forward(x, t, st.cache.text_kv(), st.cache, ring_in, *idx.tensors(), kind=kind)
        else:
            shard = self._token_shard_spec(x)
            self.stats.log(kind, x, t, shard, *idx.tensors(), *ring_in)  # outside the graph
            out = self._compiled(x, t, st.cache.text_kv(), st.cache, ring_in, *idx.tensors())
            if self._kv is not None:
                self._kv.note_compiled_gather()
            if ring is not None:
                self._text(st.cache.text_kv(), self._text_sizes).note_compiled()
        self._ring_commit()
        return out

    def _merged_forward(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        text_kv: TextKV,
        cache: RollingKVCache,
        ring: tuple[torch.Tensor, ...],
        *index: torch.Tensor,
        kind: str | None = None,
    ) -> torch.Tensor:
        """One merged forward as a function of its tensors (what ``compile=`` compiles: no Python value in
        it depends on the window; the collectives are functional ops of the graph). ``ring``: the compact
        ring's :class:`~sharding.kv_shard.RingIndex` tensors (``"sp_compact"``; its text k/v ``text_kv``
        is then this rank's share, gathered per layer in the graph), ``()`` otherwise; ``index``: the
        :class:`~rolling_forcing.merged.MergedIndex` tensors. ``kind``: eager, the :attr:`stats` kind it is
        counted under; None (compiled): counted by the caller, outside the graph."""
        idx = MergedIndex(*index)
        gathered = self._text(text_kv, None if kind is None else self._text_sizes) if ring else None
        attn = self._merged_attn(cache, idx, RingIndex(*ring) if ring else None, gathered)
        frames = self._layout.update_frames
        text = text_kv if gathered is None else gathered
        log = kind is not None
        return self.forward(
            x, t, text, attn, context_frames=frames, kind=kind or "merged", index=(*index, *ring), log=log
        )

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
        text = self._text_of(st)
        attn = self._pass_attn(
            st.cache, write.pass_, ((write.slot,), write.store_roped), self._gathered_text(text)
        )
        self._ring_begin(write.pass_.cache_keys, write)
        self.forward(x, t, text, attn, context_frames=x.shape[1], kind=kind)
        self._ring_commit()

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

    # ---- the compact layout's host-side maps (kv_cache="sp_compact") -------------------------------------
    def _ring_begin(self, keys: Iterable[KeyBlock], write: WritePass | tuple[()]) -> RingIndex | None:
        """Before a forward reading the cached blocks of ``keys`` and writing ``write``'s block (or nothing):
        the compact ring's slot map (:meth:`sharding.kv_shard.CompactRing.begin`, also kept as the ring's
        ``index`` for the eager passes); None otherwise."""
        if self._ring is None:
            return None
        writes: tuple[int, ...] = ()
        if isinstance(write, WritePass):
            if write.slot != slot_of(self.pipe_cfg, write.block):
                raise RuntimeError(f"block {write.block} written to slot {write.slot}, not its schedule slot")
            writes = (write.block,)
        return self._ring.begin((kb.block for kb in keys), writes)

    def _ring_commit(self) -> None:
        if self._ring is not None:
            self._ring.commit()

    def _text(self, shares: TextKV, sizes: set[int] | None) -> TextKVGather:
        """``"sp_compact"``: the text k/v a forward reads, every rank's share ``shares`` gathered per layer
        over all ranks (:class:`~sharding.kv_shard.TextKVGather`; static Python values only, so a compiled
        forward traces it; ``sizes``: where it records the gathered bytes, None inside a graph)."""
        group = self.gather_group if self.gather_group is not None else dist.group.WORLD
        return TextKVGather(shares, self.model_cfg.text_len, self.rank, self.plan.world_size, group, sizes)

    @staticmethod
    def _gathered_text(text: Sequence[Any]) -> TextKVGather | None:
        return text if isinstance(text, TextKVGather) else None

    def _text_of(self, st: StreamState) -> Sequence[Any]:
        """The text k/v an eager pass reads: the cache's, or (``"sp_compact"``) its shares gathered."""
        return st.cache.text_kv() if self._ring is None else self._text(st.cache.text_kv(), self._text_sizes)

    # ---- one token-sharded forward -------------------------------------------------------------------
    def forward(
        self,
        x: torch.Tensor,
        timesteps: torch.Tensor,
        text_kv: Sequence[tuple[torch.Tensor, torch.Tensor]] | TextKVGather,
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
        ``text_kv``: per layer the text ``(k, v)`` ``[B, text_len, H, D]``, or (``"sp_compact"``) a
        :class:`~sharding.kv_shard.TextKVGather` of this rank's shares, each layer's gather issued by
        ``self_attn`` and waited for by the block's cross-attention (or after the block if it skips it).

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
            if isinstance(text_kv, TextKVGather):  # a gather this rank's block did not read (sp_compact)
                text_kv.finish(i)
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
