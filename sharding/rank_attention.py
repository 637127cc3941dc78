"""The self-attention of one rank of the sharded stream (:class:`RankAttention`, a part of
:class:`sharding.rank_stream.RankStream`): per pass kind, the function each layer of a token-sharded
forward calls for its self-attention (:func:`sharding.attention.sharded_attention` around the unsharded
pass's local step on this rank's heads and query shard, on the layer's KV cache or, SP-sharded, on the
whole key range assembled for it by :mod:`sharding.kv_shard`). Each rank ropes q and k of its own token
shard (all heads) before the TP all-to-all, so the collectives carry roped q and k (v as is)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from nki_kernels import ops
from rolling_forcing.attend import attend_cache
from rolling_forcing.cache import RollingKVCache
from rolling_forcing.merged import MergedIndex
from rolling_forcing.model import CausalWanModel, Grid, SelfAttnFn
from rolling_forcing.schedule import PassPlan, WritePass
from sharding.attention import ShardGroups, local_tokens, query_shard_tokens, sharded_attention
from sharding.kv_shard import CompactRing, LayerBox, RingIndex, SpKVCache, TextKVGather
from sharding.plan import ShardingPlan

__all__ = ["RankAttention"]


class RankAttention:
    """The self-attention builders of :class:`~sharding.rank_stream.RankStream` (which sets these
    attributes): ``_pass_attn`` (denoise, update, re-cache passes), ``_batched_attn`` (a sequential
    method's batched forward), ``_merged_attn`` (Rolling Forcing's merged forward)."""

    model: CausalWanModel
    groups: ShardGroups
    plan: ShardingPlan
    rank: int
    backend: str | None
    _kv: SpKVCache | None
    _ring: CompactRing | None
    _layout: Any  # MergedLayout, or a sequential method's static layout

    # ---- the cache of one attention layer -------------------------------------------------------------
    def _ring_index(self) -> RingIndex | None:
        """The compact ring's map of the eager forward running now (None: not ``"sp_compact"``)."""
        return None if self._ring is None else self._ring.index

    @staticmethod
    def _after_keys(text: TextKVGather | None, layer: int) -> Callable[[], None] | None:
        """The ``after_keys`` hook of layer ``layer``'s sharded attention: issue the layer's text k/v gather
        (``"sp_compact"``, :meth:`~sharding.kv_shard.TextKVGather.start`); None without ``text``."""
        if text is None:
            return None
        return lambda: text.start(layer)

    # ---- RoPE of this rank's token shard, before the TP all-to-all ----------------------------------------
    def _tables(
        self, grid: Grid, start_frame: int = 0, positions: list[int] | torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 ``(cos, sin)`` ``[L, D/2]`` of all ``L`` tokens of ``grid`` (frame f at ``start_frame +
        f`` or ``positions[f]``): the unsharded forward's tables, of which each rank uses its shard's rows."""
        dev = positions.device if isinstance(positions, torch.Tensor) else None
        hd = self.model.cfg.head_dim
        f64 = torch.float64
        return ops.rope_tables(grid, hd, start_frame, frame_positions=positions, dtype=f64, device=dev)

    def _rope_shard(
        self,
        q: torch.Tensor | None,
        k: torch.Tensor,
        tables: tuple[torch.Tensor, torch.Tensor],
        stored: tuple[int, bool | torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """RoPE of this rank's token shard (all heads), before :func:`sharding.attention.sharded_attention`
        regroups it: the all-to-all and the SP gather then carry roped q and k (RoPE is per token and
        per head, so this is the unsharded arithmetic on this rank's rows of the unsharded ``tables``).

        Args:
            q: ``[B, L_local, H, D]`` (the token shard ``local_tokens(L, plan, rank)``, zero-padded where a
                layer has no query), or None (a write-only layer: only k is roped).
            k: ``[B, L_local, H, D]``, the same tokens.
            tables: ``(cos, sin)`` ``[L, D/2]`` of all ``L`` tokens of the forward (:meth:`_tables`).
            stored: ``(end, store_roped)``: keys of global tokens ``< end`` (the block(s) this forward writes
                to the cache) are sent as the cache stores them: roped when ``store_roped`` (a bool, or a
                ``[]`` bool tensor), else unroped. The local step writes them as received; attention never
                reads them from the new keys (it reads them back from the cache).

        Returns ``(q_roped or None, k_sent)``, each ``[B, L_local, H, D]``.
        """
        cos, sin = tables
        sl = local_tokens(cos.shape[0], self.plan, self.rank)
        if k.shape[1] != sl.stop - sl.start:
            raise ValueError(f"rank {self.rank}: k holds {k.shape[1]} tokens, its token shard is {sl}")
        if sl.stop == sl.start:  # fewer tokens than ranks: an empty shard
            return q, k
        c, s = cos[sl], sin[sl]
        if q is None:
            qr, kr = None, ops.rope3d_tables_one(k.contiguous(), c, s, backend=self.backend)
        else:
            qr, kr = ops.rope3d_tables(q.contiguous(), k.contiguous(), c, s, backend=self.backend)
        if stored is None:
            return qr, kr
        end, store_roped = stored
        u = max(0, min(end - sl.start, k.shape[1]))  # local tokens of the written block(s)
        if u == 0 or store_roped is True:
            return qr, kr
        if store_roped is False:
            head = k[:, :u]
        else:
            head = torch.where(store_roped, kr[:, :u], k[:, :u])
        return qr, torch.cat([head, kr[:, u:]], dim=1)

    def _pass_attn(
        self,
        cache: RollingKVCache,
        p: PassPlan,
        write: tuple[tuple[int, ...], bool] | None,
        text: TextKVGather | None = None,
    ) -> SelfAttnFn:
        """Sharded self-attention of one pass; ``write = (slots, store_roped)`` for a pass that writes its
        blocks (the update pass: one slot; LongLive's re-cache: one per block, in frame order). ``text``:
        the forward's gathered text k/v (``"sp_compact"``), whose layer gather each layer issues after its
        keys' collectives (:meth:`_after_keys`).

        A layer called with no queries (the last layer of ``forward(context_frames=F)``) only writes the
        pass's k/v. :func:`sharding.attention.sharded_attention` still regroups them to all keys of the
        local heads, but it skips the local step of an empty query shard, so such a layer sends one
        placeholder query per rank (the rank's first key; ``num_queries = world``) whose output is dropped.
        """

        tables: dict[Grid, tuple[torch.Tensor, torch.Tensor]] = {}  # once per forward, shared by its layers

        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Grid) -> torch.Tensor:
            box = LayerBox(self._kv, cache, layer, self._ring_index())
            n_tok = grid[0] * grid[1] * grid[2]
            write_only = q.shape[1] == 0
            if write_only and write is None:
                raise ValueError("context_frames=F applies to the cache-update pass only (it writes k/v)")
            if grid not in tables:
                tables[grid] = self._tables(grid, p.query_position)
            # the pass writes all its tokens: their keys travel as the cache stores them
            stored = None if write is None else (n_tok, write[1])
            qr, ks = self._rope_shard(None if write_only else q, k, tables[grid], stored)

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
                lc = box.open(sp_extra)  # q_s, k_all arrive roped (k_all as stored when the pass writes)
                if write is None:
                    return attend_cache(lc, q_s, p.cache_keys, (k_all, v_all), grid, backend=self.backend)
                self._write_blocks(lc, write[0], k_all, v_all)
                if write_only:
                    return q_s.new_zeros(q_s.shape)
                return attend_cache(lc, q_s, p.cache_keys, None, grid, backend=self.backend)

            q_in, n_q = (ks[:, :1], self.plan.world_size) if qr is None else (qr, n_tok)
            out = sharded_attention(
                q_in.contiguous(), ks.contiguous(), v.contiguous(), self.groups,
                num_queries=n_q, num_keys=n_tok, attention_fn=local, backend=self.backend, sp_extra=box.share,
                after_keys=self._after_keys(text, layer),
            )  # fmt: skip
            assert isinstance(out, torch.Tensor)
            if write is not None:
                box.keep()
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
        and the same layout rule (only whole tensors reach the ops). Each rank ropes its token shard
        before the all-to-all (:meth:`_rope_shard`; the update block's keys as the cache stores them).
        Last layer (``forward(context_frames=fpb)``): the update queries are
        skipped, their zero placeholders unread.
        """
        last = len(self.model.blocks) - 1
        backend = self.backend
        tables: dict[Grid, tuple[torch.Tensor, torch.Tensor]] = {}  # once per forward, shared by its layers

        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Grid) -> torch.Tensor:
            n_tok = grid[0] * grid[1] * grid[2]
            t = n_tok // 2
            gb: Grid = (grid[0] // 2, grid[1], grid[2])
            pos = [p + i for p in (upd.pass_.query_position, den.query_position) for i in range(gb[0])]
            box = LayerBox(self._kv, cache, layer, self._ring_index())
            drop = k.shape[1] - q.shape[1]  # leading local tokens without a query (last layer only)
            if drop:
                q = torch.cat([q.new_zeros((q.shape[0], drop, *q.shape[2:])), q], dim=1)
            qsl = query_shard_tokens(n_tok, self.plan, self.rank)
            a, b = qsl.start, qsl.stop
            den_only = layer == last
            if grid not in tables:
                tables[grid] = self._tables(grid, positions=pos)
            # the update block's keys travel as the cache stores them (attention reads it from the cache)
            qr, ks = self._rope_shard(q, k, tables[grid], (t, upd.store_roped))
            assert qr is not None

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
                lc = box.open(sp_extra)  # q_s, k_all arrive roped (the update block's keys as stored)
                lc.write(upd.slot, k_all[:, :t], v_all[:, :t], backend=backend)
                out = q_s.new_zeros(q_s.shape)
                if b > t:  # the shard's denoise queries
                    qd, own = q_s[:, max(a, t) - a :].contiguous(), (k_all, v_all)
                    out[:, max(a, t) - a :] = attend_cache(
                        lc, qd, den.cache_keys, own, gb, backend=backend, own_start=t
                    )
                if a < t and not den_only:  # the shard's update queries
                    qu = q_s[:, : min(b, t) - a].contiguous()
                    out[:, : min(b, t) - a] = attend_cache(
                        lc, qu, upd.pass_.cache_keys, None, gb, backend=backend
                    )
                return out

            out = sharded_attention(
                qr, ks.contiguous(), v.contiguous(), self.groups,
                num_queries=n_tok, num_keys=n_tok, attention_fn=local, backend=backend, sp_extra=box.share,
            )  # fmt: skip
            assert isinstance(out, torch.Tensor)
            box.keep()
            return out[:, drop:]

        return attn

    def _merged_attn(
        self, cache: RollingKVCache, idx: MergedIndex, ring: RingIndex | None, text: TextKVGather | None
    ) -> SelfAttnFn:
        """Sharded self-attention of one merged forward (``rolling_forcing.merged.merged_forward``'s steps).

        Each rank first ropes q and k of its own token shard, all heads, at ``idx.frame_positions``
        (:meth:`_rope_shard`; the update block's keys as the cache stores them), then
        :func:`sharding.attention.sharded_attention` regroups them to (head group x query shard) and
        gathers every new key of the local heads; the local step then does what the unsharded merged
        forward does after its RoPE, on this rank's heads and query shard: write the update block's clean
        k/v into its ring slot of the layer from :meth:`_layer` (SP-sharded: each rank then keeps its
        share), rope the copies (sink / relative-mode keys) from the cache, then one
        ``ops.attention_block_table`` launch over [ring in place, new keys, copies] with the block table
        ``idx.table``. The query shard's tokens
        ``[a, b)`` are split at the update block's end ``T``: its local query groups are the non-empty
        ones of ``(min(b, T) - a, b - max(a, T))`` with the matching table rows (static per rank).

        ``ring``: the compact ring's map of this forward (``kv_cache="sp_compact"``; tensors, so a compiled
        forward takes them as inputs) and ``text`` its gathered text k/v (each layer issues its gather
        after the keys' collectives), None otherwise.

        Last layer (``forward(context_frames=fpb)``): q holds only the local tokens after the update
        block; they are zero-padded back to the full shard (the update queries' outputs are not used) and
        the local step attends the denoise group only (the table's row 1), as the unsharded last layer.
        """
        lay = self._layout
        t = lay.tokens_per_block
        nc_frames = lay.copy_blocks * lay.frames_per_block
        last = len(self.model.blocks) - 1
        backend = self.backend
        hp0, wp0 = self.model.cfg.grid_hw
        # the tables once per forward (all frames at idx.frame_positions), shared by every layer
        tables = self._tables((idx.frame_positions.shape[0], hp0, wp0), positions=idx.frame_positions)

        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Grid) -> torch.Tensor:
            _, hp, wp = grid
            n_tok = grid[0] * hp * wp
            box = LayerBox(self._kv, cache, layer, ring)
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
            # the update block's keys travel as the cache stores them (roped unless sink / relative mode);
            # the block table never reads fresh block 0 (the update block): its readers use the cache
            qr_s, ks = self._rope_shard(q, k, tables, (t, idx.store_roped))
            assert qr_s is not None

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
                lc = box.open(sp_extra)  # q_s, k_all arrive roped (the update block's keys as stored)
                ck, cv = lc.k, lc.v
                # 1. the update block's clean k/v into its slot (roped unless it is the sink / relative)
                k_w = torch.where(idx.write_valid, k_all[:, :t], ck.index_select(1, idx.write_tokens))
                v_w = torch.where(idx.write_valid, v_all[:, :t], cv.index_select(1, idx.write_tokens))
                ops.kv_cache_write_at(
                    ck, cv, k_w.contiguous(), v_w.contiguous(), idx.write_slot, backend=backend
                )
                # 2. roped copies of the blocks needing a pass-specific position (read after the write)
                gk, gv = ck.index_select(1, idx.copy_tokens), cv.index_select(1, idx.copy_tokens)
                gkr = ops.rope3d_positions_one(gk, (nc_frames, hp, wp), idx.copy_positions, backend=backend)
                out = q_s.new_zeros(q_s.shape)
                if not sizes:  # last layer, query shard inside the update block: nothing is read
                    return out
                qr = q_s[:, (n_upd if den_only else 0) :].contiguous()
                # 3. this shard's query groups in one launch; ring blocks read in place
                res = ops.attention_block_table(
                    qr, [ck, k_all, gkr], [cv, v_all, gv], tab, sizes, t, backend=backend
                )
                assert isinstance(res, torch.Tensor)
                out[:, q_s.shape[1] - res.shape[1] :] = res
                return out

            out = sharded_attention(
                qr_s, ks.contiguous(), v.contiguous(), self.groups,
                num_queries=n_tok, num_keys=n_tok, attention_fn=local, backend=backend, sp_extra=box.share,
                after_keys=self._after_keys(text, layer),
            )  # fmt: skip
            assert isinstance(out, torch.Tensor)
            box.keep()
            return out[:, drop:]

        return attn
