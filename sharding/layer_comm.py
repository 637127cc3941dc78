"""The collectives one attention layer of the sharded stream issues, in issue order, with their bytes.

Pure functions (no torch): what :func:`sharding.attention.sharded_attention` sends for one layer of a
forward of ``tokens`` tokens, with the SP-sharded KV cache of :mod:`sharding.kv_shard` (``kv_cache=
"sp_sharded"``) or a replicated one. Per layer, in the order the code issues them:

1. ``kv_cache`` (SP all-gather, SP-sharded cache and ``sp > 1``): every SP rank's share of the layer's
   cache, ``[2, B, slots, ceil(T / sp), H / tp, D]``. It reads only the cache (written in earlier chunks),
   never the layer's q, k, v: ``independent`` (issued before the projection's results are needed).
2. ``qkv_in`` (TP all-to-all, ``tp > 1``): q, k, v of the token shard (each padded to the longest shard)
   to (head group x query shard). Needs the layer's qkv projection and q/k RMSNorm.
3. ``kv_fresh`` (SP all-gather, ``sp > 1``): the query shard's new k, v of the local heads (padded to the
   longest SP shard). Needs ``qkv_in``.
4. ``out`` (TP all-to-all, ``tp > 1``): the attention output back to token shards. Needs the attention.

Bytes are the busiest rank's: sent for an all-to-all (the ``tp - 1`` chunks that leave the rank),
received for an all-gather (``sp - 1`` peers' parts), padding included, as the code moves them. Times are
*modelled* by the plan's :class:`sharding.plan.CommModel` (``all_to_all_s`` / ``all_gather_s``), with the
plan's rule for groups that span chips. ``hbm_bytes`` is what one rank's HBM moves for the collective
(what it sends read + what it receives written: ``2 x bytes``), the traffic it can take from compute
running at the same time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sharding.plan import ShardingPlan, _spans_chips

__all__ = ["LayerCollective", "ROLES", "GRAPH_OPS", "layer_collectives"]

ROLES = ("kv_cache", "qkv_in", "kv_fresh", "out")
"""The per-layer collectives in issue order (module docstring)."""

GRAPH_OPS = {
    "kv_cache": "all_gather_into_tensor",
    "qkv_in": "all_to_all_single",
    "kv_fresh": "all_gather_into_tensor",
    "out": "all_to_all_single",
    "text_kv": "all_gather_into_tensor",
}
"""The ``_c10d_functional`` op each role is in a compiled forward (:class:`sharding.compiled.GraphRecord`);
``"text_kv"``: the compact layout's per-layer text k/v gather over all ranks (:class:`sharding.kv_shard.
TextKVGather`; priced by ``perf.e2e.compact.text_kv_collective``, not by :func:`layer_collectives`)."""


@dataclass(frozen=True)
class LayerCollective:
    """One collective of one layer: ``role`` (one of :data:`ROLES`), ``group`` ``"tp"`` / ``"sp"``,
    ``bytes`` (busiest rank: sent for all-to-all, received for all-gather), ``time_s`` (*modelled*),
    ``hbm_bytes`` (one rank's HBM traffic for it), ``independent`` (True: needs none of the layer's
    compute, only the cache) and ``latency_s`` (the part of ``time_s`` that does not scale with bytes)."""

    role: str
    group: str
    bytes: int
    time_s: float
    hbm_bytes: int
    independent: bool
    latency_s: float = 0.0
    """The byte-independent part of ``time_s`` (fixed latency + hops): what each piece of a split pays."""

    @property
    def op(self) -> str:
        """The graph op of this collective (:data:`GRAPH_OPS`)."""
        return GRAPH_OPS[self.role]


def _splits(n: int, parts: int) -> list[int]:
    base, extra = divmod(n, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def layer_collectives(
    plan: ShardingPlan,
    *,
    tokens: int,
    cache_slots: int,
    tokens_per_block: int,
    kv_cache: str = "sp_sharded",
) -> tuple[LayerCollective, ...]:
    """The collectives one self-attention layer of the sharded stream issues (module docstring), in order.

    Args:
        plan: the layer's TP x SP plan (its ``shape.head_dim``, ``dtype_bytes``, ``batch`` and ``model``
            are used; ``plan.shape``'s token counts are not: ``tokens`` is).
        tokens: tokens of the forward (every one is a query and a new key; merged forward 18 frames).
        cache_slots: block slots of a layer's KV buffer (sink + ring); tokens_per_block: ``T``.
        kv_cache: ``"sp_sharded"`` (the stream's default) or ``"replicated"`` (no ``kv_cache`` gather).

    Raises ``ValueError`` for a non-positive count or an unknown ``kv_cache``.
    """
    for name, v in (("tokens", tokens), ("cache_slots", cache_slots), ("tokens_per_block", tokens_per_block)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"layer_collectives: {name} must be an int >= 1, got {v!r}")
    if kv_cache not in ("sp_sharded", "replicated"):
        raise ValueError(
            f"layer_collectives: kv_cache must be 'sp_sharded' or 'replicated', got {kv_cache!r}"
        )
    tp, sp, world = plan.tp, plan.sp, plan.world_size
    s, m = plan.shape, plan.model
    row = plan.heads_per_core * s.head_dim * s.dtype_bytes * s.batch  # one token of the local heads
    tp_spans = _spans_chips(range(tp), m.cores_per_chip)
    sp_spans = _spans_chips(range(0, world, tp), m.cores_per_chip)
    splits = _splits(tokens, world)
    tmax = max(splits)
    shard = max(sum(splits[t * tp : (t + 1) * tp]) for t in range(sp))  # longest SP shard of new keys
    out: list[LayerCollective] = []

    def gather(role: str, received: int, independent: bool) -> None:
        t, lat = m.all_gather_s(sp, received, sp_spans), m.all_gather_s(sp, 0, sp_spans)
        out.append(LayerCollective(role, "sp", received, t, 2 * received, independent, lat))

    def a2a(role: str, sent: int) -> None:
        t, lat = m.all_to_all_s(tp, sent, tp_spans), m.all_to_all_s(tp, 0, tp_spans)
        out.append(LayerCollective(role, "tp", sent, t, 2 * sent, False, lat))

    if sp > 1 and kv_cache == "sp_sharded":
        share = 2 * cache_slots * math.ceil(tokens_per_block / sp) * row  # k and v of every slot
        gather("kv_cache", (sp - 1) * share, True)
    if tp > 1:
        a2a("qkv_in", (tp - 1) * 3 * tmax * row)
    if sp > 1:
        gather("kv_fresh", (sp - 1) * 2 * shard * row, False)
    if tp > 1:
        a2a("out", (tp - 1) * tmax * row)
    return tuple(out)
