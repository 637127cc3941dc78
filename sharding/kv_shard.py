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

*Compiled* (``compile=``, the merged forward): the ring's bookkeeping stays on the host (which block each
compact slot holds, the refusal of an evicted read), but a forward sees only its product, the tensors of
:class:`RingIndex` (:meth:`CompactRing.begin` builds them; fixed shapes, so they are inputs of the one
graph): :meth:`SpKVCache.assemble` places the gathered shares with one ``index_select`` over slots and
:meth:`SpKVCache.keep` stores the written block with one ``index_copy_``. The text gather has only static
Python values (the token shares of ``text_len`` over ``world``) and a functional all-gather, so it is
traced into the graph: one more collective per layer, no recompile per window.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rolling_forcing.cache import LayerKVCache, RollingKVCache, text_share_range
from rolling_forcing.config import PipelineConfig
from rolling_forcing.schedule import slot_of
from sharding.attention import token_splits
from sharding.collectives import all_gather, all_gather_start, all_gather_wait
from sharding.plan import ShardingPlan

__all__ = [
    "KV_CACHE_LAYOUTS",
    "owned_block_tokens",
    "SpKVCache",
    "check_kv_cache_layout",
    "check_compact_layout",
    "compact_slot",
    "RingIndex",
    "CompactRing",
    "TextKVGather",
    "TextLayer",
    "LayerBox",
]

KV_CACHE_LAYOUTS = ("sp_sharded", "replicated", "sp_compact")
"""How the sharded stream keeps the KV cache within a head group (see the module docstring)."""


def check_kv_cache_layout(kv_cache: object) -> str:
    """``kv_cache`` if it is one of :data:`KV_CACHE_LAYOUTS`, else ``ValueError`` naming the choices."""
    if kv_cache not in KV_CACHE_LAYOUTS:
        raise ValueError(f"kv_cache must be one of {KV_CACHE_LAYOUTS}, got {kv_cache!r}")
    return str(kv_cache)


def check_compact_layout(kv_cache: str, sequential: bool, plan: ShardingPlan) -> None:
    """``ValueError`` if ``kv_cache="sp_compact"`` is asked of a stream it does not apply to: a sequential
    method (it keeps its own ring, which the compact slot rule does not describe) or ``sp < 2`` (the
    whole-key-range buffer the ring relies on is the SP gather's). Eager and ``compile=`` both apply (the
    compiled forward takes the ring's map as :class:`RingIndex` tensors)."""
    if kv_cache != "sp_compact":
        return
    head = "kv_cache='sp_compact' applies to Rolling Forcing's stream with sp > 1 (eager or compile=)"
    if sequential:
        raise ValueError(f"{head}, not a sequential method (it keeps its own ring, not the compact one)")
    if plan.sp < 2:
        raise ValueError(
            f"{head}, not plan {plan.name} (sp={plan.sp}): the compact ring reads every block through the "
            "SP gather's whole-key-range buffer"
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


@dataclass(frozen=True)
class RingIndex:
    """The compact ring's slot map of one forward as tensors (fixed shapes: inputs of a compiled graph).

    place: ``[buffer_slots]`` int64: per schedule slot of the whole-key-range buffer, the compact slot
        whose block :meth:`SpKVCache.assemble` puts there, or ``slots`` (one past the ring: a zero block)
        where the ring holds no block for that slot.
    keep_from: ``[1]`` int64: the schedule slot of the block the forward writes (0 when it writes none).
    keep_to: ``[1]`` int64: that block's compact slot (0 when it writes none).
    keep_valid: ``[]`` bool: whether the forward writes a block (:meth:`SpKVCache.keep` stores it).
    """

    place: torch.Tensor
    keep_from: torch.Tensor
    keep_to: torch.Tensor
    keep_valid: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fields in declaration order (the compiled forward's ring inputs)."""
        return self.place, self.keep_from, self.keep_to, self.keep_valid


class CompactRing:
    """Which block each slot of a compact ring holds (host side, the same on every rank), and the slot
    map of the forward running now. Per forward: :meth:`begin` (the blocks it reads and writes; builds
    :attr:`index`), the layers (:meth:`SpKVCache.assemble` / :meth:`SpKVCache.keep` use :attr:`index`),
    :meth:`commit`. :attr:`src` / :attr:`dst` (the compact and schedule slots of the held blocks) and
    :attr:`writes` are the same map on the host."""

    def __init__(self, cfg: PipelineConfig, device: torch.device | str = "cpu") -> None:
        if cfg.ring_slots < 2:
            raise ValueError(f"a compact ring needs ring_slots >= 2, got {cfg.ring_slots}")
        self.cfg, self.device = cfg, device
        self.slots = cfg.buffer_slots - 1
        self.held: dict[int, int] = {}  # compact slot -> block
        self.src: list[int] = []  # compact slots of the held blocks ...
        self.dst: list[int] = []  # ... and their schedule slots in the whole-key-range buffer
        self.writes: tuple[int, ...] = ()
        self.index: RingIndex | None = None  # the map of the forward running now (None between forwards)

    def begin(self, reads: Iterable[int], writes: Sequence[int]) -> RingIndex:
        """A forward that reads the cached blocks ``reads`` and writes ``writes`` (at most one block, in its
        schedule slot); returns (and keeps in :attr:`index`) its :class:`RingIndex`. RuntimeError naming
        the blocks if it reads one the ring does not hold and does not write (the compact ring would hand
        it a zero block); ValueError for more than one written block."""
        if len(writes) > 1:
            raise ValueError(f"a forward on the compact ring writes at most one block, got {list(writes)}")
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
        place = [self.slots] * self.cfg.buffer_slots
        for f, c in pairs:
            place[f] = c
        w = self.writes[0] if self.writes else None

        def i64(x: Any) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=self.device)

        self.index = RingIndex(
            place=i64(place),
            keep_from=i64([0 if w is None else slot_of(self.cfg, w)]),
            keep_to=i64([0 if w is None else compact_slot(self.cfg, w)]),
            keep_valid=torch.tensor(w is not None, dtype=torch.bool, device=self.device),
        )
        return self.index

    def commit(self) -> None:
        """After the forward: the written blocks now hold their compact slots (evicting what was there)."""
        for w in self.writes:
            self.held[compact_slot(self.cfg, w)] = w
        self.writes = ()
        self.index = None


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
        self.compact = ring is not None  # a bool, so a compiled forward guards on no ring object
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

    def assemble(self, layer: int, parts: torch.Tensor, index: RingIndex | None = None) -> LayerKVCache:
        """Layer ``layer`` with every token of every slot from the SP group's gathered :meth:`share` s
        ``parts`` ``[sp, 2, B, slots, max(splits), H/tp, D]`` (SP-rank order): ``k, v`` ``[B, full_slots *
        T, H/tp, D]`` in a new buffer. Compact ring (``index``, the forward's :class:`RingIndex`; required
        then): each held block at its schedule slot (``index.place``), the other slots zero (no forward
        reads them: :meth:`CompactRing.begin`)."""
        lc = self.cache.layers[layer]
        t = self.tokens_per_block
        b, _, h, d = lc.k.shape
        full = torch.cat([parts[i, :, :, :, :n] for i, n in enumerate(self.splits)], dim=3)
        if self.compact:
            if index is None:
                raise ValueError("the compact ring's layers are assembled with the forward's RingIndex")
            zero = full.new_zeros((2, b, 1, t, h, d))  # compact slot `slots`: no block
            full = torch.cat([full, zero], dim=2).index_select(2, index.place)
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

    def keep(self, layer: int, full: LayerKVCache, index: RingIndex | None = None) -> None:
        """Copy this rank's tokens of every slot of ``full`` (from :meth:`gather`, after the layer's
        writes) back into its share of layer ``layer``; local, no collective. Compact ring (``index``,
        required then): only the block the forward wrote (``index.keep_from``, if ``index.keep_valid``),
        into its compact slot ``index.keep_to``."""
        lc = self.cache.layers[layer]
        b, _, h, d = full.k.shape
        a, e = self.own
        if self.compact and index is None:
            raise ValueError("the compact ring's layers are kept with the forward's RingIndex")
        for mine, whole in ((lc.k, full.k), (lc.v, full.v)):
            blocks = whole.view(b, self.full_slots, self.tokens_per_block, h, d)[:, :, a:e]
            if index is None:
                mine.copy_(blocks.reshape(mine.shape))
                continue
            share = mine.view(b, lc.num_slots, e - a, h, d)
            new = blocks.index_select(1, index.keep_from)
            old = share.index_select(1, index.keep_to)  # kept as it is when the forward writes nothing
            share.index_copy_(1, index.keep_to, torch.where(index.keep_valid, new, old))


class TextKVGather(Sequence["TextLayer"]):
    """The text k/v of a forward when every rank keeps a token share of it (``kv_cache="sp_compact"``):
    layer ``i``'s shares all-gathered over ``group`` (``world`` ranks; every rank gathers the same layers
    in the same order: collective) into ``(k, v)`` ``[B, text_len, H, D]``, the whole layer.

    Per layer, in the order the end-to-end model schedules it (``perf.e2e.overlap.layer_program``, role
    ``"text_kv"``): :meth:`start` issues the gather after the layer's self-attention collectives (the
    sharded attention's ``after_keys`` hook: the collective stream is idle under the attention), item
    ``i`` (a :class:`TextLayer`, what the block gets as its text k/v) waits for it when the
    cross-attention unpacks it, and :meth:`finish` waits for a gather the block did not read (a rank whose
    last-layer tokens all lie in the context frames skips its cross-attention; the wait keeps the
    collective in a compiled graph). Eagerly the gather completes when issued
    (:func:`sharding.collectives.all_gather_start`).

    Args:
        shares: per layer this rank's ``(k, v)`` ``[B, n_r, H, D]`` (:meth:`RollingKVCache.text_kv` of a
            cache with ``share_text(rank, world)``).
        text_len: the whole prompt's token count (the model's ``text_len``).
        rank, world, group: this rank, the ranks sharing the text and their group.
        sizes: a set the gathered layers' bytes (k + v) are added to (measured); None: not recorded (a
            compiled forward: its graph would guard on the set; :meth:`note_compiled` records it outside).
    """

    def __init__(
        self,
        shares: list[tuple[torch.Tensor, torch.Tensor]],
        text_len: int,
        rank: int,
        world: int,
        group: Any,
        sizes: set[int] | None,
    ) -> None:
        self.shares, self.world, self.group, self.sizes = shares, world, group, sizes
        self.splits = [text_share_range(text_len, r, world) for r in range(world)]
        a, b = self.splits[rank]
        if shares and shares[0][0].shape[1] != b - a:
            raise ValueError(f"rank {rank} holds {shares[0][0].shape[1]} text tokens, its share is {b - a}")
        self._started: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (issued, padded share)

    def __len__(self) -> int:
        return len(self.shares)

    def __getitem__(self, i: int) -> TextLayer:  # type: ignore[override]
        return TextLayer(self, i)

    def start(self, i: int) -> None:
        """Issue layer ``i``'s all-gather (once): every rank's share, zero-padded to the longest."""
        if i in self._started:
            return
        k, v = self.shares[i]
        top = max(b - a for a, b in self.splits)
        kv = torch.stack([k, v])  # [2, B, n_r, H, D]
        if kv.shape[2] < top:
            kv = torch.cat([kv, kv.new_zeros((*kv.shape[:2], top - kv.shape[2], *kv.shape[3:]))], dim=2)
        self._started[i] = (all_gather_start(kv, self.group), kv)

    def wait(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s whole text ``(k, v)`` ``[B, text_len, H, D]`` (issuing its gather if not yet)."""
        self.start(i)
        started, kv = self._started.pop(i)
        parts = all_gather_wait(started, self.world, kv)
        full = torch.cat([parts[r, :, :, : b - a] for r, (a, b) in enumerate(self.splits)], dim=2)
        if self.sizes is not None:  # a compiled forward is noted by note_compiled
            self.sizes.add(full.numel() * full.element_size())
        return full[0], full[1]

    def finish(self, i: int) -> None:
        """After layer ``i``'s block: wait for its gather if the block did not (result unused)."""
        if i in self._started:
            self.wait(i)

    def note_compiled(self) -> None:
        """Record the gathered layer of a compiled forward (its graph cannot record it without guarding on
        the record): ``2 x [B, text_len, H, D]``, the buffer :meth:`wait` returns."""
        if self.shares and self.sizes is not None:
            k = self.shares[0][0]
            b, _, h, d = k.shape
            self.sizes.add(2 * b * self.splits[-1][1] * h * d * k.element_size())


class TextLayer:
    """Layer ``i``'s text k/v of a :class:`TextKVGather`, gathered when unpacked: ``k, v = layer`` waits
    for the layer's all-gather (:meth:`TextKVGather.wait`) where the block's cross-attention reads it."""

    def __init__(self, text: TextKVGather, i: int) -> None:
        self.text, self.i = text, i

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.text.wait(self.i))


class LayerBox:
    """The KV layer one attention layer works on: the replicated layer itself, or (SP-sharded cache) the
    whole key range assembled inside the layer's local step from the shares the SP group gathered in the
    same collective as the layer's keys (``share`` goes to ``sharded_attention(sp_extra=)``); ``index``:
    the forward's compact ring map (``kv_cache="sp_compact"``), None otherwise."""

    def __init__(
        self, kv: SpKVCache | None, cache: RollingKVCache, layer: int, index: RingIndex | None = None
    ) -> None:
        self.kv, self.layer, self.index = kv, layer, index
        self.lc: LayerKVCache | None = cache.layers[layer] if kv is None else None
        self.share: torch.Tensor | None = None if kv is None else kv.share(layer)

    def open(self, parts: torch.Tensor | None) -> LayerKVCache:
        """The layer, assembled from the gathered ``parts`` ``[sp, ...]`` (SP-sharded) or as it is."""
        if self.kv is not None:
            assert parts is not None, "the SP-sharded cache's shares travel with the keys (sp_extra)"
            self.lc = self.kv.assemble(self.layer, parts, self.index)
        assert self.lc is not None
        return self.lc

    def keep(self) -> None:
        """After a layer that wrote the opened layer: keep this rank's share (:meth:`SpKVCache.keep`). Nothing
        for a replicated layer (written in place) or when the local step did not run on this rank (it
        opened and wrote nothing)."""
        if self.kv is not None and self.lc is not None:
            self.kv.keep(self.layer, self.lc, self.index)
