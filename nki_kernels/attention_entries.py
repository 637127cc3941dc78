"""The torch-facing entries of the attention kernels on the emulator (:func:`attention_emulated`,
:func:`attention_segments_emulated`, used by :mod:`nki_kernels.ops` through :mod:`nki_kernels.attention`,
which re-exports them) and the argument checks the block-table entry shares."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from nki_kernels.hw_limits import PMAX


def _validate(q: Any, k: Any, v: Any, kname: str, vname: str) -> None:
    import torch

    for name, t in (("q", q), (kname, k), (vname, v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(
                f"{name} must be a 4-D torch tensor [B, L, H, D], got {getattr(t, 'shape', t)!r}"
            )
        if t.dtype != q.dtype or t.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"{name} dtype {t.dtype} must be bfloat16 or float32 and match q ({q.dtype})")
    if k.shape != v.shape:
        raise ValueError(f"{vname} shape {tuple(v.shape)} must equal {kname} shape {tuple(k.shape)}")
    if (k.shape[0], k.shape[2], k.shape[3]) != (q.shape[0], q.shape[2], q.shape[3]):
        raise ValueError(f"{kname} shape {tuple(k.shape)} must match q {tuple(q.shape)} in B, H and D")
    if q.shape[3] > PMAX:
        raise ValueError(f"head_dim D={q.shape[3]} must be <= {PMAX} (D lives on the partitions)")


def _check_static(static: object) -> bool:
    if not isinstance(static, bool):
        raise TypeError(f"static must be a bool, got {type(static).__name__}")
    return static


def _check_fp8(fp8: object) -> bool:
    if not isinstance(fp8, bool):
        raise TypeError(f"fp8 must be a bool, got {type(fp8).__name__}")
    return fp8


def fp8_v_scale(v_parts: Sequence[Any], name: str) -> Any:
    """V's FP8 dequantisation scales ``[B, H, D]`` fp32 over the keys of every ``[B, L, H, D]`` tensor in
    ``v_parts`` (:func:`reference.attention_fp8.v_scales`, the one definition); bf16 inputs only."""
    import torch

    from reference.attention_fp8 import v_scales

    if any(t.dtype != torch.bfloat16 for t in v_parts):
        raise TypeError(f"fp8=True needs bfloat16 inputs ({name} is {v_parts[0].dtype})")
    return v_scales(torch.cat([t.float() for t in v_parts], dim=1)).contiguous()


def _finish(res: Any, q: Any, return_lse: bool) -> Any:
    import torch

    from nki_kernels.rope3d import _to_torch

    if return_lse:
        out, lse = res
        return _to_torch(out, q.dtype), _to_torch(lse, torch.float32)
    return _to_torch(res, q.dtype)


def attention_emulated(
    q: Any,
    k: Any,
    v: Any,
    scale: float | None = None,
    return_lse: bool = False,
    lnc: int = 1,
    static: bool = True,
    fp8: bool = False,
) -> Any:
    """Attention through :func:`attention_kernel` on the emulator.

    Args:
        q: torch ``[B, Lq, H, D]``; k, v: ``[B, Lk, H, D]``; bf16 or fp32 (all the same); D <= 128; Lk >= 1.
        scale: softmax scale (default ``1/sqrt(D)``).
        return_lse: also return lse ``[B, Lq, H]`` fp32.
        lnc: logical cores (1 or 2).
        static: the guarded static softmax offset instead of the running max (same results within bf16
            rounding; any row that would overflow is recomputed exactly, see :func:`_guarded_rows`).
        fp8: P.V in e4m3 (:mod:`nki_kernels.attention_fp8`, reference ``reference.attention_fp8``): bf16
            inputs, the streamed static pass (``static``, Lk >= 2048), V's scales over the keys.

    Returns:
        out ``[B, Lq, H, D]`` in q's dtype, or ``(out, lse)``.
    """
    from nki_kernels._nki import launch
    from nki_kernels.attention import attention_kernel

    _validate(q, k, v, "k", "v")
    if k.shape[1] < 1:
        raise ValueError("k must hold at least one key (Lk >= 1)")
    sc = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    extra = {"v_scale": fp8_v_scale([v], "v")} if _check_fp8(fp8) else {}
    res, _ = launch(
        attention_kernel, q.contiguous(), k.contiguous(), v.contiguous(), sc, bool(return_lse),
        static=_check_static(static), lnc=lnc, **extra,
    )  # fmt: skip
    return _finish(res, q, return_lse)


def attention_segments_emulated(
    q: Any,
    kv_k: Any,
    kv_v: Any,
    segments: Sequence[tuple[int, int]],
    scale: float | None = None,
    return_lse: bool = False,
    lnc: int = 1,
    static: bool = True,
    fp8: bool = False,
) -> Any:
    """Attention over ordered ``(start, length)`` segments of KV buffers ``[B, S, H, D]``, read in place.

    Segments with length 0 are skipped; each must satisfy ``0 <= start`` and ``start + length <= S``; at
    least one key in total. Other arguments as :func:`attention_emulated`.
    """
    from nki_kernels._nki import launch
    from nki_kernels.attention import attention_segments_kernel

    _validate(q, kv_k, kv_v, "kv_k", "kv_v")
    s = kv_k.shape[1]
    segs = []
    for i, seg in enumerate(segments):
        start, length = (int(x) for x in seg)
        if start < 0 or length < 0 or start + length > s:
            raise ValueError(
                f"segments[{i}]=({start}, {length}) must satisfy 0 <= start, start + length <= S={s}"
            )
        if length:
            segs.append((start, length))
    if not segs:
        raise ValueError("segments must hold at least one key in total")
    sc = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    extra = {}
    if _check_fp8(fp8):
        extra["v_scale"] = fp8_v_scale([kv_v[:, a : a + n] for a, n in segs], "kv_v")
    res, _ = launch(
        attention_segments_kernel,
        q.contiguous(),
        kv_k.contiguous(),
        kv_v.contiguous(),
        tuple(segs),
        sc,
        bool(return_lse),
        static=_check_static(static),
        lnc=lnc,
        **extra,
    )
    return _finish(res, q, return_lse)
