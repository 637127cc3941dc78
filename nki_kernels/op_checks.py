"""Argument checks shared by the ops of :mod:`nki_kernels.ops` (one place per rule; every message names the
argument and the rule, ``TypeError`` for a wrong type or dtype, ``ValueError`` for a wrong shape or value)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

_DTYPES = (torch.bfloat16, torch.float32)


_IntLike = (int, torch.SymInt)


def _check_tensor(
    name: str, t: Any, rank: int | tuple[int, ...] | None = 4, layout: str = "[B, L, H, D]"
) -> None:
    """``t`` is a contiguous bf16/fp32 tensor of ``rank`` (an int, a tuple of allowed ranks, or ``None``
    for any) in ``layout`` (named in the messages): ``TypeError`` for the type or dtype, ``ValueError``
    for the rank or a non-contiguous view. Every op's tensor check."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    ranks = (rank,) if isinstance(rank, int) else rank
    if ranks is not None and t.dim() not in ranks:
        allowed = " or ".join(str(r) for r in ranks)
        raise ValueError(f"{name} must have rank {allowed} ({layout}), got shape {tuple(t.shape)}")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{name} must be torch.bfloat16 or torch.float32, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous {layout} (the kernels address it row-major); call .contiguous()"
        )


def _check_same(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    first, t0 = names[0], tensors[0]
    for name, t in zip(names[1:], tensors[1:]):
        if t.dtype != t0.dtype:
            raise TypeError(f"{name} dtype {t.dtype} must match {first} dtype {t0.dtype}")
        if t.device != t0.device:
            raise ValueError(f"{name} is on {t.device} but {first} is on {t0.device}")


def _check_dims(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor, dims: dict[int, str]) -> None:
    for d, label in dims.items():
        if t.shape[d] != ref.shape[d]:
            raise ValueError(
                f"{name} {label} ({name}.shape[{d}]={t.shape[d]}) must match {ref_name} "
                f"({ref_name}.shape[{d}]={ref.shape[d]}); shapes {tuple(t.shape)} vs {tuple(ref.shape)}"
            )


def _check_int(name: str, x: Any) -> None:
    if isinstance(x, bool) or not isinstance(x, _IntLike):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")


def _int_values(name: str, t: torch.Tensor) -> list[Any]:
    """Runtime (eager, inside an op) integer values of an index tensor."""
    return t.tolist()


def _resolve_scale(scale: float | None, d: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be finite and > 0, got {scale}")
    return float(scale)


def _check_bool(name: str, x: Any) -> None:
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__}")


def check_segments(segments: Any, total: int, name: str = "segments") -> list[tuple[int, int]]:
    """Validate ordered ``(start, length)`` segments over ``total`` tokens; return them as int pairs.

    Rules: at least one segment; each ``length >= 1``, ``start >= 0``, ``start + length <= total``; no two
    segments overlap (order is free: keys follow the given order).
    """
    if isinstance(segments, (str, bytes)) or not isinstance(segments, Sequence) or len(segments) == 0:
        raise ValueError(f"{name} must be a non-empty sequence of (start, length) pairs, got {segments!r}")
    out: list[tuple[int, int]] = []
    for i, seg in enumerate(segments):
        if isinstance(seg, (str, bytes)) or not isinstance(seg, Sequence) or len(seg) != 2:
            raise ValueError(f"{name}[{i}] must be a (start, length) pair, got {seg!r}")
        s, n = seg
        _check_int(f"{name}[{i}].start", s)
        _check_int(f"{name}[{i}].length", n)
        if n < 1:
            raise ValueError(f"{name}[{i}] = ({s}, {n}) is empty: length must be >= 1")
        if s < 0 or s + n > total:
            raise ValueError(f"{name}[{i}] = ({s}, {n}) is out of bounds of the KV buffer [0, {total})")
        out.append((s, n))
    ordered = sorted(out)
    for (s0, n0), (s1, n1) in zip(ordered, ordered[1:]):
        if s0 + n0 > s1:
            raise ValueError(f"{name} overlap: ({s0}, {n0}) and ({s1}, {n1}) share tokens")
    return out


def _check_same_shape(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """``t`` has exactly ``ref``'s shape (``ValueError`` naming both and their shapes)."""
    if tuple(t.shape) != tuple(ref.shape):
        raise ValueError(f"{name} shape {tuple(t.shape)} must equal {ref_name} shape {tuple(ref.shape)}")


def _check_linear_bias(bias: torch.Tensor, n: int, x: torch.Tensor, weight_name: str) -> None:
    """A linear layer's ``bias``: ``[N]`` (N from ``weight_name``'s dim 1), x's dtype or fp32, x's device."""
    _check_tensor("bias", bias, 1, "[N]")
    if bias.shape[0] != n:
        raise ValueError(
            f"bias must be [N] with N={n} ({weight_name}.shape[1]), got shape {tuple(bias.shape)}"
        )
    if bias.dtype not in (x.dtype, torch.float32):
        raise TypeError(f"bias dtype {bias.dtype} must be x's dtype {x.dtype} or torch.float32")
    if bias.device != x.device:
        raise ValueError(f"bias is on {bias.device} but x is on {x.device}")


def _check_tokens(name: str, t: torch.Tensor, length: str) -> None:
    """A ``[B, L, H, D]`` tensor holds at least one token (``length``: its name for L, e.g. ``"Lq"``)."""
    if t.shape[1] < 1:
        raise ValueError(f"{name} must have {length} >= 1 tokens, got shape {tuple(t.shape)}")


def _check_cache_block(
    cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    _check_tensor("cache_k", cache_k)
    _check_tensor("cache_v", cache_v)
    _check_tensor("k", k)
    _check_tensor("v", v)
    _check_same(("cache_k", "cache_v", "k", "v"), (cache_k, cache_v, k, v))
    _check_same_shape("cache_v", cache_v, "cache_k", cache_k)
    _check_same_shape("v", v, "k", k)
    _check_dims("k", k, "cache_k", cache_k, {0: "batch B", 2: "heads H", 3: "head_dim D"})
    if k.shape[1] < 1:
        raise ValueError(f"k must hold a block of T >= 1 tokens, got shape {tuple(k.shape)}")


def _check_index_tensor(
    name: str, t: Any, shape: tuple[int, ...] | None = None, rank: int | None = None
) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor, got {type(t).__name__}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor (int32/int64), got {t.dtype}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if rank is not None and t.dim() != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {tuple(t.shape)}")


TABLE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64)
"""dtypes of RoPE cos/sin tables: float32 is what the kernels consume; float64 keeps the reference exact."""


def _check_grid(grid: Any) -> tuple[int, int, int]:
    if isinstance(grid, (str, bytes)) or not isinstance(grid, Sequence) or len(grid) != 3:
        raise ValueError(f"grid must be a sequence (F, Hp, Wp) of 3 ints, got {grid!r}")
    for i, g in enumerate(grid):
        _check_int(f"grid[{i}]", g)
        if g < 1:
            raise ValueError(f"grid[{i}] must be >= 1, got grid={tuple(grid)}")
    f, hp, wp = (int(g) for g in grid)
    return f, hp, wp


def _check_qk_pair(q: Any, k: Any) -> None:
    """q and k of a RoPE op: ``[B, L, H, D]`` tensors of one dtype and device, equal shapes, D even."""
    _check_tensor("q", q)
    _check_tensor("k", k)
    _check_same(("q", "k"), (q, k))
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k shape {tuple(k.shape)} must equal q shape {tuple(q.shape)} ([B, L, H, D])")
    if q.shape[3] % 2:
        raise ValueError(f"q/k head_dim D={q.shape[3]} must be even (interleaved complex pairs)")


def _check_grid_tokens(grid: Any, tokens: int) -> tuple[int, int, int]:
    """:func:`_check_grid` plus ``F*Hp*Wp == tokens`` (the q/k length)."""
    f, hp, wp = _check_grid(grid)
    if f * hp * wp != tokens:
        raise ValueError(
            f"grid {tuple(grid)} gives F*Hp*Wp={f * hp * wp} tokens but q/k have L={tokens} (dim 1)"
        )
    return f, hp, wp


def _check_positions_nonneg(positions: Sequence[int], name: str = "frame_positions") -> None:
    """Every time position ``>= 0``."""
    for i, p in enumerate(positions):
        if p < 0:
            raise ValueError(f"{name}[{i}] must be >= 0, got {p}")


def _check_slot(slot: int, t: int, s: int) -> None:
    """A ring slot of a KV cache of ``s`` tokens taking blocks of ``t``: ``0 <= slot``,
    ``(slot+1)*t <= s``."""
    if slot < 0 or (slot + 1) * t > s:
        raise ValueError(
            f"slot={slot} out of range: need 0 <= slot and (slot+1)*T <= S with T={t}, S={s} "
            f"(valid slots 0..{s // t - 1})"
        )
