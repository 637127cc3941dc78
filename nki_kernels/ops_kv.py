"""The rolling KV-cache ops (``kv_cache_write``, ``kv_cache_slide``, ``kv_cache_write_at``): raw
``torch.library`` ops with their fakes and the public functions, re-exported by :mod:`nki_kernels.ops` (which
documents the backend and validation rules every op follows)."""

from __future__ import annotations

import torch

from nki_kernels import op_dispatch as _d
from nki_kernels.op_checks import (
    _check_cache_block,
    _check_index_tensor,
    _check_int,
    _check_slot,
)
from nki_kernels.op_dispatch import (
    _copy_back,
    _op_backend,
    _run_backend,
)


def _check_no_grad(
    op: str, cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """The KV-cache ops mutate their caches in place and have no backward (torch registers no autograd
    formula for a mutating custom op): with grad mode on, a write would silently drop k/v's gradient or
    leave a cache's history wrong, so any tensor requiring grad is refused here, naming the op."""
    if not torch.is_grad_enabled():
        return
    for name, t in (("cache_k", cache_k), ("cache_v", cache_v), ("k", k), ("v", v)):
        if t.requires_grad:
            raise RuntimeError(
                f"{op} has no backward (an in-place cache write, inference only): {name} requires grad with "
                "grad mode on, and its gradient would be dropped; call it under torch.no_grad() / "
                "torch.inference_mode() or pass detached tensors"
            )


@torch.library.custom_op("nki_ardiff::kv_cache_write", mutates_args=("cache_k", "cache_v"))
def _kv_cache_write_op(
    cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: int, backend: str
) -> None:
    if _run_backend(backend) == "reference":
        from reference.kv_cache import kv_cache_write as ref_write

        ref_write(cache_k, cache_v, k, v, slot)
        return
    res = _d.entry("kv_cache_write")(cache_k, cache_v, k, v, slot)
    _copy_back(res, cache_k, cache_v)


@_kv_cache_write_op.register_fake
def _(cache_k, cache_v, k, v, slot, backend):
    return None


@torch.library.custom_op("nki_ardiff::kv_cache_slide", mutates_args=("cache_k", "cache_v"))
def _kv_cache_slide_op(
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sink_tokens: int,
    backend: str,
) -> None:
    if _run_backend(backend) == "reference":
        from reference.kv_cache import kv_cache_slide as ref_slide

        ref_slide(cache_k, cache_v, k, v, sink_tokens)
        return
    res = _d.entry("kv_cache_slide")(cache_k, cache_v, k, v, sink_tokens)
    _copy_back(res, cache_k, cache_v)


@_kv_cache_slide_op.register_fake
def _(cache_k, cache_v, k, v, sink_tokens, backend):
    return None


@torch.library.custom_op("nki_ardiff::kv_cache_write_at", mutates_args=("cache_k", "cache_v"))
def _kv_cache_write_at_op(
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot: torch.Tensor,
    backend: str,
) -> None:
    s_val = int(slot.item())
    _check_slot(s_val, k.shape[1], cache_k.shape[1])
    if _run_backend(backend) == "reference":
        from reference.kv_cache import kv_cache_write as ref_write

        ref_write(cache_k, cache_v, k, v, s_val)
        return
    # the ring-write kernel takes the slot as a runtime scalar (DMA offset), so a tensor slot maps 1:1
    res = _d.entry("kv_cache_write")(cache_k, cache_v, k, v, s_val)
    _copy_back(res, cache_k, cache_v)


@_kv_cache_write_at_op.register_fake
def _(cache_k, cache_v, k, v, slot, backend):
    return None


def kv_cache_write(
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot: int,
    *,
    backend: str | None = None,
) -> None:
    """Write one block's k/v into ring slot ``slot`` in place: cache tokens ``[slot*T, (slot+1)*T)``.

    Args:
        cache_k, cache_v: ``[B, S, H, D]`` contiguous, mutated in place.
        k, v: ``[B, T, H, D]`` (same B, H, D and dtype as the caches; T >= 1).
        slot: ``0 <= slot`` and ``(slot+1)*T <= S``.
        backend: see module docstring.
    Only the T new tokens are touched. No backward: with grad mode on, a tensor requiring grad raises
    ``RuntimeError`` naming the op (as :func:`kv_cache_slide` and :func:`kv_cache_write_at`).
    """
    _check_cache_block(cache_k, cache_v, k, v)
    _check_int("slot", slot)
    _check_no_grad("kv_cache_write", cache_k, cache_v, k, v)
    _check_slot(slot, k.shape[1], cache_k.shape[1])
    be = _op_backend(backend)
    _kv_cache_write_op(cache_k, cache_v, k, v, int(slot), be)


def kv_cache_slide(
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sink_tokens: int,
    *,
    backend: str | None = None,
) -> None:
    """Contiguous-cache roll in place: keep the sink, evict the oldest block after it, append the new block.

    With T = k.shape[1], S = cache_k.shape[1]: tokens ``[sink_tokens + T, S)`` move to
    ``[sink_tokens, S - T)`` and k/v are written to ``[S - T, S)``.

    Args:
        cache_k, cache_v: ``[B, S, H, D]`` contiguous, mutated in place.
        k, v: ``[B, T, H, D]`` (same B, H, D and dtype as the caches; T >= 1).
        sink_tokens: pinned leading tokens, ``0 <= sink_tokens`` and ``sink_tokens + T <= S``.
        backend: see module docstring.
    """
    _check_cache_block(cache_k, cache_v, k, v)
    _check_int("sink_tokens", sink_tokens)
    _check_no_grad("kv_cache_slide", cache_k, cache_v, k, v)
    t, s = k.shape[1], cache_k.shape[1]
    if sink_tokens < 0 or sink_tokens + t > s:
        raise ValueError(
            f"sink_tokens={sink_tokens} out of range: need 0 <= sink_tokens <= S - T = {s} - {t}"
        )
    be = _op_backend(backend)
    _kv_cache_slide_op(cache_k, cache_v, k, v, int(sink_tokens), be)


def kv_cache_write_at(
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot: torch.Tensor,
    *,
    backend: str | None = None,
) -> None:
    """:func:`kv_cache_write` with the slot given as a 0-d integer **tensor** (static-shape variant).

    Writes tokens ``[slot*T, (slot+1)*T)`` of ``cache_k, cache_v`` ``[B, S, H, D]`` in place with ``k, v``
    ``[B, T, H, D]``. The slot's range (``0 <= slot``, ``(slot+1)*T <= S``) is checked when the op runs.
    """
    _check_cache_block(cache_k, cache_v, k, v)
    _check_index_tensor("slot", slot, shape=())
    _check_no_grad("kv_cache_write_at", cache_k, cache_v, k, v)
    _kv_cache_write_at_op(cache_k, cache_v, k, v, slot, _op_backend(backend))
