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

**Compact layout** (``kv_cache="sp_compact"``, Rolling Forcing only, ``sp > 1``): the SP-sharded cache
above with two exact savings (the same stream bit for bit, :mod:`tests.test_sharding_compact`):

* *A ring one slot shorter* (:class:`CompactRing`): ``buffer_slots - 1`` slots per layer (7 instead of 8
  for the released config). The schedule's slots (``rolling_forcing.schedule.slot_of``) stay as they
  are inside every forward: :meth:`SpKVCache.assemble` places each block the rank holds at its schedule
  slot of the transient whole-key-range buffer, the forward writes and reads there as before, and
  :meth:`SpKVCache.keep` stores only the blocks the forward wrote, into their compact slot
  (:func:`compact_slot`). The block a write evicts from the compact ring is the oldest one the forward
  reads (the update pass of block ``s`` reads ``s - 6 .. s``, ``s`` written by itself); it was read from
  the transient buffer before the keep, so the write is ordered after its last read. Each forward names
  the blocks it reads (:meth:`CompactRing.begin`): one not held raises, never a silent zero.
* *The text k/v sharded by tokens over all ranks* (:class:`TextKVGather`): every rank keeps
  ``1 / world`` of the cross-attention k/v (near-equal token shares, :func:`rolling_forcing.cache.
  text_share_range`) and each layer all-gathers that layer's k/v (all heads: cross-attention runs
  token-sharded) into a one-layer buffer just before the block uses it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from rolling_forcing.cache import LayerKVCache, RollingKVCache, text_share_range
from rolling_forcing.config import PipelineConfig
from rolling_forcing.schedule import slot_of
from sharding.attention import token_splits
from sharding.collectives import all_gather
from sharding.plan import ShardingPlan

__all__ = [
    "KV_CACHE_LAYOUTS",
    "owned_block_tokens",
    "SpKVCache",
    "check_kv_cache_layout",
    "check_compact_layout",
    "compact_slot",
    "CompactRing",
    "TextKVGather",
    "LayerBox",
]

KV_CACHE_LAYOUTS = ("sp_sharded", "replicated", "sp_compact")
"""How the sharded stream keeps the KV cache within a head group (see the module docstring)."""


def check_kv_cache_layout(kv_cache: object) -> str:
    """``kv_cache`` if it is one of :data:`KV_CACHE_LAYOUTS`, else ``ValueError`` naming the choices."""
    if kv_cache not in KV_CACHE_LAYOUTS:
        raise ValueError(f"kv_cache must be one of {KV_CACHE_LAYOUTS}, got {kv_cache!r}")
    return str(kv_cache)


def check_compact_layout(kv_cache: str, sequential: bool, compile: Any, plan: ShardingPlan) -> None:
    """``ValueError`` if ``kv_cache="sp_compact"`` is asked of a stream it does not apply to: a sequential
    method (its own ring), a compiled forward (the compact maps are host-side per forward) or ``sp < 2``
    (the whole-key-range buffer the ring relies on is the SP gather's)."""
    if kv_cache == "sp_compact" and (sequential or compile not in (None, False) or plan.sp < 2):
        raise ValueError(
            "kv_cache='sp_compact' applies to Rolling Forcing's eager stream with sp > 1 (its ring and text "
            f"maps are host-side per forward), not a sequential method={sequential}, compile={compile!r}, "
            f"plan {plan.name}"
        )


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


def compact_slot(cfg: PipelineConfig, block: int) -> int:
    """Slot of ``block`` in the compact ring (``cfg.buffer_slots - 1`` slots): the sink block(s) in their
    own slots, then a ring of ``ring_slots - 1``: ``sink + (block - sink) % (ring_slots - 1)``."""
    if block < 0:
        raise ValueError(f"block must be >= 0, got {block}")
    if block < cfg.sink_blocks:
        return block
    return cfg.sink_blocks + (block - cfg.sink_blocks) % (cfg.ring_slots - 1)


class CompactRing:
    """Which block each slot of a compact ring holds (host side, the same on every rank), and the slot
    map of the forward running now. Per forward: :meth:`begin` (the blocks it reads and writes), the
    layers (:meth:`SpKVCache.assemble` / :meth:`SpKVCache.keep` use :attr:`src`, :attr:`dst`,
    :attr:`writes`), :meth:`commit`."""

    def __init__(self, cfg: PipelineConfig) -> None:
        if cfg.ring_slots < 2:
            raise ValueError(f"a compact ring needs ring_slots >= 2, got {cfg.ring_slots}")
        self.cfg = cfg
        self.slots = cfg.buffer_slots - 1
        self.held: dict[int, int] = {}  # compact slot -> block
        self.src: list[int] = []  # compact slots of the held blocks ...
        self.dst: list[int] = []  # ... and their schedule slots in the whole-key-range buffer
        self.writes: tuple[int, ...] = ()

    def begin(self, reads: Iterable[int], writes: Sequence[int]) -> None:
        """A forward that reads the cached blocks ``reads`` and writes ``writes`` (in that forward's
        schedule slots). RuntimeError naming the blocks if it reads one the ring does not hold and does
        not write (the compact ring would hand it a zero block)."""
        held = set(self.held.values())
        missing = sorted(set(reads) - held - set(writes))
        if missing:
            raise RuntimeError(
                f"the compact ring holds blocks {sorted(held)}; a forward writing {list(writes)} reads "
                f"{missing} too, which it evicted: this stream needs the full {self.cfg.buffer_slots}-slot "
                "ring (kv_cache='sp_sharded')"
            )
        pairs = sorted((slot_of(self.cfg, b), c) for c, b in self.held.items())
        self.dst, self.src = [f for f, _ in pairs], [c for _, c in pairs]
        self.writes = tuple(writes)

    def commit(self) -> None:
        """After the forward: the written blocks now hold their compact slots (evicting what was there)."""
        for w in self.writes:
            self.held[compact_slot(self.cfg, w)] = w
        self.writes = ()


class SpKVCache:
    """This rank's SP share of the cache and the per-layer gather / keep of the whole key range.

    Args:
        cache: this rank's :class:`~rolling_forcing.cache.RollingKVCache`, built with
            ``block_tokens=owned_block_tokens(plan, T, rank)`` and the head group's heads (with ``ring``:
            ``num_slots=ring.slots``).
        plan, rank: the sharding plan and this rank.
        tokens_per_block: ``T`` (whole blocks).
        sp_group: the SP process group of this rank (None when ``plan.sp == 1``).
        ring: the compact ring's map (``kv_cache="sp_compact"``), None: the cache has every schedule slot.
    """

    def __init__(
        self,
        cache: RollingKVCache,
        plan: ShardingPlan,
        rank: int,
        tokens_per_block: int,
        sp_group: Any,
        ring: CompactRing | None = None,
    ) -> None:
        own = owned_block_tokens(plan, tokens_per_block, rank)
        if cache.block_tokens != own:
            raise ValueError(f"cache keeps tokens {cache.block_tokens} of each block, rank {rank} owns {own}")
        if ring is not None and cache.layers[0].num_slots != ring.slots:
            raise ValueError(f"cache has {cache.layers[0].num_slots} slots, the compact ring {ring.slots}")
        self.ring = ring
        self.full_slots = cache.layers[0].num_slots if ring is None else ring.cfg.buffer_slots
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
        if self.ring is None:
            full = torch.cat([parts[i, :, :, :, :n] for i, n in enumerate(self.splits)], dim=3)
        else:  # each held block at its schedule slot; the others zero (no forward reads them: begin())
            full = parts.new_zeros((2, b, self.full_slots, t, h, d))
            src, dst, a = self.ring.src, self.ring.dst, 0
            for i, n in enumerate(self.splits):
                if dst:
                    full[:, :, dst, a : a + n] = parts[i][:, :, src, :n]
                a += n
        full = full.reshape(2, b, self.full_slots * t, h, d)
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
        self._gathered.add(2 * b * self.full_slots * self.tokens_per_block * h * d * lc.k.element_size())

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
            blocks = whole.view(b, self.full_slots, self.tokens_per_block, h, d)[:, :, a:e]
            if self.ring is None:
                mine.copy_(blocks.reshape(mine.shape))
                continue
            cfg, share = self.ring.cfg, mine.view(b, lc.num_slots, e - a, h, d)
            for w in self.ring.writes:  # only the blocks this forward wrote, into their compact slots
                share[:, compact_slot(cfg, w)] = blocks[:, slot_of(cfg, w)]


class TextKVGather(Sequence[tuple[torch.Tensor, torch.Tensor]]):
    """The text k/v of a forward when every rank keeps a token share of it (``kv_cache="sp_compact"``):
    item ``i`` all-gathers layer ``i``'s shares over ``group`` (``world`` ranks, every rank asks for the
    same layers in the same order: collective) into ``(k, v)`` ``[B, text_len, H, D]``, the whole layer.

    Args:
        shares: per layer this rank's ``(k, v)`` ``[B, n_r, H, D]`` (:meth:`RollingKVCache.text_kv` of a
            cache with ``share_text(rank, world)``).
        text_len: the whole prompt's token count (the model's ``text_len``).
        rank, world, group: this rank, the ranks sharing the text and their group.
        sizes: a set the gathered layers' bytes (k + v) are added to (measured).
    """

    def __init__(
        self,
        shares: list[tuple[torch.Tensor, torch.Tensor]],
        text_len: int,
        rank: int,
        world: int,
        group: Any,
        sizes: set[int],
    ) -> None:
        self.shares, self.world, self.group, self.sizes = shares, world, group, sizes
        self.splits = [text_share_range(text_len, r, world) for r in range(world)]
        a, b = self.splits[rank]
        if shares and shares[0][0].shape[1] != b - a:
            raise ValueError(f"rank {rank} holds {shares[0][0].shape[1]} text tokens, its share is {b - a}")

    def __len__(self) -> int:
        return len(self.shares)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        k, v = self.shares[i]
        top = max(b - a for a, b in self.splits)
        kv = torch.stack([k, v])  # [2, B, n_r, H, D]
        if kv.shape[2] < top:
            kv = torch.cat([kv, kv.new_zeros((*kv.shape[:2], top - kv.shape[2], *kv.shape[3:]))], dim=2)
        parts = all_gather(kv, self.world, self.group)
        full = torch.cat([parts[r, :, :, : b - a] for r, (a, b) in enumerate(self.splits)], dim=2)
        self.sizes.add(full.numel() * full.element_size())
        return full[0], full[1]


class LayerBox:
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
