"""Rolling KV cache kernels (standalone NKI 0.6 API, imported through :mod:`nki_kernels._nki`).

Caches are HBM buffers ``[B, S, H, D]`` (tokens along dim 1) **written in place**: the kernels write into
their input tensors (as NxDI's cache writers do) and return nothing; the NKI simulator and this project's
emulator copy such writes back into the caller's arrays.

* :func:`kv_cache_write_kernel` — ring write: the new block ``k, v [B, T, H, D]`` goes to tokens
  ``[slot*T, (slot+1)*T)``. ``slot`` is a *runtime* value: a ``(1, 1)`` int32 HBM input loaded into SBUF,
  multiplied by T on VectorE and used as ``scalar_offset`` of an ``.ap()`` view of the cache (indirect on
  the token dim, so the offset is scaled by ``H*D`` elements). One compiled kernel serves every slot; an
  out-of-range slot raises (``oob_mode.error``) rather than writing elsewhere. Only the ``T*H*D`` elements
  of the slot are touched, with HBM->HBM DMAs whose runs are whole blocks (contiguous ``T*H*D`` elements
  per batch row).
* :func:`kv_cache_slide_kernel` — the original contiguous-cache roll: keep the sink ``[0, sink)``, move
  tokens ``[sink+T, S)`` to ``[sink, S-T)`` and write the new block at ``[S-T, S)``. The move is a
  device-side HBM->HBM copy in chunks of at most T tokens, front to back: a chunk's destination never
  overlaps its own source, and it only overwrites tokens that earlier chunks (issued before it, in program
  order) have already read. On hardware this relies on the NKI scheduler keeping program order between
  DMAs whose HBM ranges overlap (it tracks such dependencies); nothing here reorders them.

LNC: ``kernel[2]`` puts the k cache on logical core 0 and the v cache on core 1.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from nki_kernels._nki import nisa, nki, nl


def _block_pattern(batch_stride: int, batch: int, tokens: int, row: int) -> list[list[int]]:
    """``[[batch_stride, B], [row, tokens], [1, row]]``: a token range of every batch row (counts < 2^16)."""
    return [[batch_stride, batch], [row, tokens], [1, row]]


@nki.jit
def kv_cache_write_kernel(cache_k, cache_v, k, v, slot):
    """Write ``k``/``v`` ``[B, T, H, D]`` into ``cache_k``/``cache_v`` ``[B, S, H, D]`` at block ``slot``.

    ``slot`` is an int32 HBM tensor of shape ``(1, 1)`` (runtime value). Writes in place; returns nothing.
    """
    B, S, H, D = cache_k.shape
    T = k.shape[1]
    row = H * D
    pid = nl.program_id(0)
    nprog = nl.num_programs()
    slot_sb = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=slot_sb, src=slot)
    tok_sb = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_scalar(tok_sb, slot_sb, nl.multiply, T, engine=nisa.vector_engine)
    for i, (cache, new) in enumerate(((cache_k, k), (cache_v, v))):
        if i % nprog != pid:
            continue
        dst = cache.ap(_block_pattern(S * row, B, T, row), offset=0, scalar_offset=tok_sb, indirect_dim=1)
        src = new.ap(_block_pattern(T * row, B, T, row), offset=0)
        nisa.dma_copy(dst=dst, src=src, oob_mode=nisa.oob_mode.error)


@nki.jit
def kv_cache_slide_kernel(cache_k, cache_v, k, v, sink_tokens):
    """Roll contiguous caches in place: drop block ``[sink, sink+T)``, shift the rest left, append k/v.

    ``sink_tokens`` is a compile-time int. HBM->HBM copies in chunks of at most T tokens, front to back.
    """
    B, S, H, D = cache_k.shape
    T = k.shape[1]
    row = H * D
    pid = nl.program_id(0)
    nprog = nl.num_programs()
    n_move = S - sink_tokens - T
    for i, (cache, new) in enumerate(((cache_k, k), (cache_v, v))):
        if i % nprog != pid:
            continue
        for c0 in range(0, n_move, T):
            c = min(T, n_move - c0)
            dst = cache.ap(_block_pattern(S * row, B, c, row), offset=(sink_tokens + c0) * row)
            src = cache.ap(_block_pattern(S * row, B, c, row), offset=(sink_tokens + T + c0) * row)
            nisa.dma_copy(dst=dst, src=src)
        dst = cache.ap(_block_pattern(S * row, B, T, row), offset=(S - T) * row)
        src = new.ap(_block_pattern(T * row, B, T, row), offset=0)
        nisa.dma_copy(dst=dst, src=src)


# --------------------------------------------------------------------------------------------------
# torch-facing entries


def _check(cache_k: Any, cache_v: Any, k: Any, v: Any) -> tuple[int, int]:
    import torch

    for name, t in (("cache_k", cache_k), ("cache_v", cache_v), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(
                f"{name} must be a 4-D torch tensor [B, *, H, D], got {getattr(t, 'shape', t)!r}"
            )
        if t.dtype != cache_k.dtype:
            raise TypeError(f"{name} dtype {t.dtype} must match cache_k dtype {cache_k.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous [B, L, H, D]")
    if cache_v.shape != cache_k.shape:
        raise ValueError(
            f"cache_v shape {tuple(cache_v.shape)} must equal cache_k shape {tuple(cache_k.shape)}"
        )
    if v.shape != k.shape:
        raise ValueError(f"v shape {tuple(v.shape)} must equal k shape {tuple(k.shape)}")
    b, s, h, d = cache_k.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, h, d):
        raise ValueError(f"k shape {tuple(k.shape)} must be [B={b}, T, H={h}, D={d}] to match the cache")
    return s, k.shape[1]


def kv_cache_write_emulated(cache_k: Any, cache_v: Any, k: Any, v: Any, slot: int, lnc: int = 1) -> None:
    """Ring write through :func:`kv_cache_write_kernel` on the emulator; modifies the caches in place.

    Args:
        cache_k, cache_v: torch ``[B, S, H, D]`` (bf16/fp32), contiguous; written in place.
        k, v: torch ``[B, T, H, D]``, same dtype.
        slot: block slot, ``0 <= slot`` and ``(slot+1)*T <= S``.
        lnc: logical cores (1 or 2).
    """
    from nki_kernels._nki import launch

    s, t = _check(cache_k, cache_v, k, v)
    if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)):
        raise TypeError(f"slot must be an int, got {type(slot).__name__}")
    if slot < 0 or (slot + 1) * t > s:
        raise ValueError(
            f"slot={slot} with T={t} does not fit a cache of S={s} tokens (need (slot+1)*T <= S)"
        )
    slot_arr = np.array([[int(slot)]], dtype=np.int32)
    launch(kv_cache_write_kernel, cache_k, cache_v, k.contiguous(), v.contiguous(), slot_arr, lnc=lnc)


def kv_cache_slide_emulated(
    cache_k: Any, cache_v: Any, k: Any, v: Any, sink_tokens: int, lnc: int = 1
) -> None:
    """Contiguous roll through :func:`kv_cache_slide_kernel` on the emulator; modifies the caches in place.

    Args:
        cache_k, cache_v: torch ``[B, S, H, D]``, contiguous; written in place.
        k, v: torch ``[B, T, H, D]`` new block.
        sink_tokens: pinned prefix length, ``0 <= sink_tokens`` and ``sink_tokens + T <= S``.
        lnc: logical cores (1 or 2).
    """
    from nki_kernels._nki import launch

    s, t = _check(cache_k, cache_v, k, v)
    if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, (int, np.integer)):
        raise TypeError(f"sink_tokens must be an int, got {type(sink_tokens).__name__}")
    if sink_tokens < 0 or sink_tokens + t > s:
        raise ValueError(f"sink_tokens={sink_tokens} with T={t} does not fit a cache of S={s} tokens")
    launch(kv_cache_slide_kernel, cache_k, cache_v, k.contiguous(), v.contiguous(), int(sink_tokens), lnc=lnc)


__all__ = [
    "kv_cache_slide_emulated",
    "kv_cache_slide_kernel",
    "kv_cache_write_emulated",
    "kv_cache_write_kernel",
]
