"""The rolling KV cache sharded along SP: every rank keeps its head group's share of every cached block,
and each layer's attention gathers the whole key range of those heads from the SP group.

Layout (plan ``tp x sp``, rank ``r = s * tp + g``): rank ``r`` caches heads ``local_heads(plan, r)`` (its
head group ``g``) and, of every block slot, only the tokens :func:`owned_block_tokens` ``(plan, T, r)``
= the ``s``-th of ``token_splits(T, sp)`` (the first ``T % sp`` shards hold one token more). Ownership
is fixed per block position, not per pass: a pass's token shards move with the pass's length (update
block alone, window, merged 18 frames), so a block written by one pass and read by the next must be
owned by a rule that depends on the block only. Per layer the rank stores ``[B, slots * t_s, H/tp, D]``
for k and v, ``1 / (tp sp)`` of the whole cache (up to the rounding of ``T / sp``).

Per attention layer (:class:`SpKVCache`):

1. The SP group's shards of the layer (:meth:`SpKVCache.share`: k and v, zero-padded to the longest) are
   all-gathered in the same collective as the pass's new keys (``sp_extra`` of
   :func:`sharding.attention.sharded_attention`; :meth:`SpKVCache.gather` alone outside a forward) and
   :meth:`SpKVCache.assemble` interleaves them back into whole blocks: a transient ``[B, slots * T, H/tp,
   D]`` buffer, the same tensor a replicated cache would hold.
2. The pass's local step runs unchanged on that buffer (writes of the update block included).
3. :meth:`SpKVCache.keep` copies the rank's own token range of every slot back into its shard.

The gather is the per-layer K/V collective that the communication model of :mod:`sharding.plan`
already prices (it gathers every key of the pass, cached and new), and its buffer is the
``kv_gather_buffer`` item of ``perf.footprint`` (double-buffered there, so the next layer's gather can
run under this layer's attention; one buffer here: the CPU stream does not overlap). A replicated cache
(``kv_cache="replicated"``) keeps the whole key range on every SP rank instead: ``sp`` x the memory, no
cache traffic.
"""

from __future__ import annotations

from typing import Any

import torch

from rolling_forcing.cache import LayerKVCache, RollingKVCache
from sharding.attention import token_splits
from sharding.collectives import all_gather
from sharding.plan import ShardingPlan

__all__ = ["KV_CACHE_LAYOUTS", "owned_block_tokens", "SpKVCache", "check_kv_cache_layout"]

KV_CACHE_LAYOUTS = ("sp_sharded", "replicated")
"""How the sharded stream keeps the KV cache within a head group (see the module docstring)."""


def check_kv_cache_layout(kv_cache: object) -> str:
    """``kv_cache`` if it is one of :data:`KV_CACHE_LAYOUTS`, else ``ValueError`` naming the choices."""
    if kv_cache not in KV_CACHE_LAYOUTS:
        raise ValueError(f"kv_cache must be one of {KV_CACHE_LAYOUTS}, got {kv_cache!r}")
    return str(kv_cache)


def owned_block_tokens(plan: ShardingPlan, tokens_per_block: int, rank: int) -> tuple[int, int]:
    """Tokens ``[a, b)`` of every cached block that ``rank`` keeps: its SP index's share of
    ``token_splits(tokens_per_block, plan.sp)``. ``ValueError`` if a block has fewer tokens than SP ranks
    (a share would be empty)."""
    if tokens_per_block < plan.sp:
        raise ValueError(
            f"a block has {tokens_per_block} tokens, fewer than sp={plan.sp}: the SP-sharded cache needs "
            "at least one token of every block per SP rank"
        )
    splits = token_splits(tokens_per_block, plan.sp)
    s = plan.query_shard(rank)
    a = sum(splits[:s])
    return a, a + splits[s]


class SpKVCache:
    """This rank's SP share of the cache and the per-layer gather / keep of the whole key range.

    Args:
        cache: this rank's :class:`~rolling_forcing.cache.RollingKVCache`, built with
            ``block_tokens=owned_block_tokens(plan, T, rank)`` and the head group's heads.
        plan, rank: the sharding plan and this rank.
        tokens_per_block: ``T`` (whole blocks).
        sp_group: the SP process group of this rank (None when ``plan.sp == 1``).
    """

    def __init__(
        self, cache: RollingKVCache, plan: ShardingPlan, rank: int, tokens_per_block: int, sp_group: Any
    ) -> None:
        own = owned_block_tokens(plan, tokens_per_block, rank)
        if cache.block_tokens != own:
            raise ValueError(f"cache keeps tokens {cache.block_tokens} of each block, rank {rank} owns {own}")
        self.cache, self.plan, self.tokens_per_block, self.sp_group = cache, plan, tokens_per_block, sp_group
        self.splits = token_splits(tokens_per_block, plan.sp)
        self.own = own
        # measured: the sizes (bytes, k + v) of the layers gathered in this stream; a set, added to (not
        # read) inside a forward, so a compiled forward neither guards on it nor recompiles as it grows
        self._gathered: set[int] = set()

    def share(self, layer: int) -> torch.Tensor:
        """This rank's share of layer ``layer``, k and v stacked and zero-padded to the longest share:
        ``[2, B, slots, max(splits), H/tp, D]`` (what every SP rank contributes to the layer's gather)."""
        lc = self.cache.layers[layer]
        tmax = max(self.splits)
        b, _, h, d = lc.k.shape
        kv = torch.stack([lc.k, lc.v]).view(2, b, lc.num_slots, lc.tokens_per_block, h, d)
        if lc.tokens_per_block < tmax:
            pad = kv.new_zeros((2, b, lc.num_slots, tmax - lc.tokens_per_block, h, d))
            kv = torch.cat([kv, pad], dim=3)
        return kv

    def assemble(self, layer: int, parts: torch.Tensor) -> LayerKVCache:
        """Layer ``layer`` with every token of every slot from the SP group's gathered :meth:`share` s
        ``parts`` ``[sp, 2, B, slots, max(splits), H/tp, D]`` (SP-rank order): ``k, v`` ``[B, slots * T,
        H/tp, D]`` in a new buffer."""
        lc = self.cache.layers[layer]
        t = self.tokens_per_block
        b, _, h, d = lc.k.shape
        full = torch.cat([parts[i, :, :, :, :n] for i, n in enumerate(self.splits)], dim=3)
        full = full.reshape(2, b, lc.num_slots * t, h, d)
        if not torch.compiler.is_compiling():  # a compiled forward is noted by note_compiled_gather
            self._gathered.add(full.numel() * full.element_size())
        return LayerKVCache(full[0], full[1], t, lc.text_k, lc.text_v, fp8=lc.fp8)

    def gather(self, layer: int) -> LayerKVCache:
        """:meth:`assemble` of the all-gathered :meth:`share` s; collective over the SP group (every SP rank
        calls it for the layer). The sharded stream fuses this gather into its attention's K/V gather
        instead (:func:`sharding.attention.sharded_attention` ``sp_extra``): one collective per layer."""
        return self.assemble(layer, all_gather(self.share(layer), self.plan.sp, self.sp_group))

    def note_compiled_gather(self) -> None:
        """Record the gathered layer of a compiled forward (its graph cannot record it without guarding on
        the record): the same buffer as :meth:`gather` allocates, ``2 x [B, slots * T, H/tp, D]``."""
        lc = self.cache.layers[0]
        b, _, h, d = lc.k.shape
        self._gathered.add(2 * b * lc.num_slots * self.tokens_per_block * h * d * lc.k.element_size())

    @property
    def gather_bytes(self) -> int:
        """Largest gathered layer (k + v) of this stream, in bytes (0 before the first gather)."""
        return max(self._gathered, default=0)

    def keep(self, layer: int, full: LayerKVCache) -> None:
        """Copy this rank's tokens of every slot of ``full`` (from :meth:`gather`, after the layer's
        writes) back into its share of layer ``layer``; local, no collective."""
        lc = self.cache.layers[layer]
        b, _, h, d = full.k.shape
        a, e = self.own
        for mine, whole in ((lc.k, full.k), (lc.v, full.v)):
            blocks = whole.view(b, lc.num_slots, self.tokens_per_block, h, d)[:, :, a:e]
            mine.copy_(blocks.reshape(mine.shape))
