"""Self-attention of one pass over the rolling KV cache: the arithmetic shared by every stream.

Used by the unsharded two-pass stream (:mod:`rolling_forcing.pipeline`) with all heads and by each rank
of the sharded stream (:mod:`sharding.pipeline`) with its head group: the functions only read the head
count from the tensors, so ``H`` below is whatever the cache buffers hold (all heads, or ``H/tp``).

A pass's cache keys (:class:`~rolling_forcing.schedule.KeyBlock`) come in two kinds: blocks roped in
the buffer at the pass's positions (read in place, ``ops.attention_segments``) and blocks that need a
roped copy (the sink; every block in ``"relative"`` mode). The copies and the pass's own keys are
attended in one ``ops.attention`` call; partials over the disjoint key sets are merged exactly with
their log-sum-exp.
"""

from __future__ import annotations

import torch

from nki_kernels import ops
from rolling_forcing import schedule
from rolling_forcing.cache import LayerKVCache
from rolling_forcing.model import Grid
from rolling_forcing.schedule import KeyBlock

__all__ = ["attend_cache", "merge_partials", "rope_cache_copies"]


def merge_partials(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Exact combination of attention partials over disjoint key sets.

    Args:
        parts: non-empty list of ``(out [B, Lq, H, D], lse [B, Lq, H] fp32)``, each normalised over its
            own keys.

    Returns:
        ``sum_i exp(lse_i - logsumexp_i lse_i) * out_i`` ``[B, Lq, H, D]``, summed in fp32 in list order
        and cast to the first output's dtype; a single part is returned as is.
    """
    if not parts:
        raise ValueError("parts must hold at least one (out, lse) partial, got an empty list")
    if len(parts) == 1:
        return parts[0][0]
    lses = torch.stack([lse for _, lse in parts])  # [P, B, Lq, H]
    lse = torch.logsumexp(lses, dim=0)
    out = sum(torch.exp(lses[i] - lse)[..., None] * o.float() for i, (o, _) in enumerate(parts))
    assert isinstance(out, torch.Tensor)
    return out.to(parts[0][0].dtype)


def rope_cache_copies(
    layer: LayerKVCache, keys: list[KeyBlock], grid: Grid, *, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather blocks ``keys`` from ``layer``'s buffers, the keys roped at each block's position.

    Args:
        layer: one layer's cache, buffers ``[B, S, H, D]`` (un-roped keys in the slots of ``keys``).
        keys: non-empty; block ``kb`` occupies ``layer.block(kb.slot)`` and is roped at time positions
            ``kb.position .. kb.position + fpb - 1``, ``fpb = layer.tokens_per_block / (Hp * Wp)``.
        grid: ``(F, Hp, Wp)`` of the pass (only ``Hp, Wp`` are used).
        backend: ``nki_kernels.ops`` backend of the RoPE.

    Returns:
        ``(k, v)`` ``[B, len(keys) * T, H, D]``: roped copies of the keys, and the values (copied).
    """
    if not keys:
        raise ValueError("keys must name at least one cached block, got none")
    hw = grid[1] * grid[2]
    if layer.tokens_per_block % hw:
        raise ValueError(
            f"grid {tuple(grid)}: Hp*Wp = {hw} does not divide the cache's tokens_per_block "
            f"{layer.tokens_per_block}"
        )
    fpb = layer.tokens_per_block // hw
    ks, vs = zip(*(layer.block(kb.slot) for kb in keys))
    k = torch.cat(ks, dim=1).contiguous()
    v = torch.cat(vs, dim=1).contiguous()
    pos = [kb.position + i for kb in keys for i in range(fpb)]
    _, kr = ops.rope3d(k, k, (len(pos), grid[1], grid[2]), frame_positions=pos, backend=backend)
    return kr, v


def attend_cache(
    layer: LayerKVCache,
    qr: torch.Tensor,
    keys: tuple[KeyBlock, ...],
    own: tuple[torch.Tensor, torch.Tensor] | None,
    grid: Grid,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Attention of roped queries over [roped copies] + [own keys] and [blocks read in place].

    Args:
        layer: one layer's cache, buffers ``[B, S, H, D]``.
        qr: roped queries ``[B, Lq, H, D]`` (same dtype as the cache).
        keys: the pass's cache keys (:attr:`~rolling_forcing.schedule.PassPlan.cache_keys`); those with
            ``roped_in_cache`` are read in place, the others roped as copies (:func:`rope_cache_copies`).
        own: the pass's own roped keys and values ``[B, Lk, H, D]`` (denoise pass), or None.
        grid: ``(F, Hp, Wp)`` of the pass.
        backend: ``nki_kernels.ops`` backend of every call.

    Returns:
        ``[B, Lq, H, D]`` in ``qr``'s dtype: softmax attention over the union of the key sets.

    Raises ValueError when there is no key at all (no cache keys and no own keys).
    """
    in_place = [kb for kb in keys if kb.roped_in_cache]
    copies = [kb for kb in keys if not kb.roped_in_cache]
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    if copies:
        ck, cv = rope_cache_copies(layer, copies, grid, backend=backend)
        ks.append(ck)
        vs.append(cv)
    if own is not None:
        ks.append(own[0])
        vs.append(own[1])
    if not ks and not in_place:
        raise ValueError("attend_cache needs keys: no cache keys and own=None")
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []
    if ks:
        k = ks[0] if len(ks) == 1 else torch.cat(ks, dim=1)
        v = vs[0] if len(vs) == 1 else torch.cat(vs, dim=1)
        res = ops.attention(qr, k, v, return_lse=bool(in_place), backend=backend)
        if not in_place:
            assert isinstance(res, torch.Tensor)
            return res
        assert isinstance(res, tuple)
        parts.append(res)
    if in_place:
        segs = schedule.segments(in_place, layer.tokens_per_block)
        res2 = ops.attention_segments(qr, layer.k, layer.v, segs, return_lse=True, backend=backend)
        assert isinstance(res2, tuple)
        parts.append(res2)
    return merge_partials(parts)
