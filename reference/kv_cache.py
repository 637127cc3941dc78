"""Pure-PyTorch reference for the rolling KV cache operations (plain torch indexing, in place).

Caches are ``[B, S, H, D]`` buffers (tokens along dim 1); a block of new keys/values is ``[B, T, H, D]``.

Depends on torch only.
"""

from __future__ import annotations

import torch


def kv_cache_write(
    cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: int
) -> None:
    """Write one block into its ring slot, in place: tokens ``[slot*T, (slot+1)*T)`` with T = k.shape[1].

    Args:
        cache_k, cache_v: ``[B, S, H, D]``, modified in place.
        k, v: ``[B, T, H, D]`` new block.
        slot: block slot index, ``0 <= slot`` and ``(slot+1)*T <= S``.
    """
    t = k.shape[1]
    lo, hi = slot * t, (slot + 1) * t
    if slot < 0 or hi > cache_k.shape[1]:
        raise ValueError(f"slot {slot} with T={t} does not fit a cache of S={cache_k.shape[1]} tokens")
    cache_k[:, lo:hi] = k
    cache_v[:, lo:hi] = v


def kv_cache_slide(
    cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink_tokens: int
) -> None:
    """Contiguous-cache roll, in place: evict the oldest non-sink block and append the new one.

    With T = k.shape[1] and S = cache_k.shape[1]: tokens ``[0, sink_tokens)`` stay; tokens
    ``[sink_tokens + T, S)`` move to ``[sink_tokens, S - T)`` (the block right after the sink is dropped);
    the new block is written to ``[S - T, S)``. Requires ``0 <= sink_tokens`` and ``sink_tokens + T <= S``.
    """
    s, t = cache_k.shape[1], k.shape[1]
    if sink_tokens < 0 or sink_tokens + t > s:
        raise ValueError(f"sink_tokens={sink_tokens} with T={t} does not fit a cache of S={s} tokens")
    for cache, new in ((cache_k, k), (cache_v, v)):
        cache[:, sink_tokens : s - t] = cache[:, sink_tokens + t : s].clone()
        cache[:, s - t : s] = new


__all__ = ["kv_cache_slide", "kv_cache_write"]
