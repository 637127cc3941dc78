"""GpSimdE instructions: ``iota``, ``affine_select``."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import dtypes as _dt
from .. import opdefs
from .. import state as _state
from ..errors import (
    MemorySpaceError,
    ShapeMismatchError,
)
from ..tensor import NkiTensor, sbuf
from ._common import _emit, _rec, _sig, _store, _vals
from ._enums import NkiInstruction
from ._events import _use
from ._rules import _free, _onchip, _same_pf

# --------------------------------------------------------------------------------------------- GpSimdE


def _pattern_values(
    pattern: Any, offset: Any, channel_multiplier: int, dst: NkiTensor, opn: str
) -> np.ndarray | None:
    pairs = [(int(p[0]), int(p[1])) for p in pattern]
    n = math.prod(c for _, c in pairs)
    if n != _free(dst):
        raise ShapeMismatchError(
            f"[pattern-size] {opn}: pattern {pattern} has {n} elements, dst{list(dst.shape)} has "
            f"{_free(dst)} per partition"
        )
    if _state.current().trace_only:
        return None
    P = dst.shape[0]
    v = np.zeros([c for _, c in pairs], dtype=np.int64)
    for k, (s, c) in enumerate(pairs):
        sh = [1] * len(pairs)
        sh[k] = c
        v = v + (np.arange(c, dtype=np.int64) * s).reshape(sh)
    off = int(offset) if not isinstance(offset, NkiTensor) else int(np.asarray(offset.read()).reshape(-1)[0])
    out = off + np.arange(P, dtype=np.int64).reshape((P,) + (1,) * v.ndim) * int(channel_multiplier) + v[None]
    return out.reshape(dst.shape)


def iota(
    dst: NkiTensor, pattern: Any, offset: Any = 0, channel_multiplier: int = 0, name: Any = None
) -> NkiInstruction:
    """``dst[p, i...] = offset + p * channel_multiplier + sum(step_k * i_k)`` over ``pattern`` (int32 math,
    cast to dst.dtype); SBUF only."""
    launch = _state.current()
    opn = "iota"
    _onchip(dst, opn, "dst", launch)
    if dst._st.buffer is not sbuf:
        raise MemorySpaceError(f"[memory-space] iota: dst={dst._desc()} must be in SBUF")
    vals = _pattern_values(pattern, offset, channel_multiplier, dst, opn)
    key = (opn, _sig(dst), launch.program_id)
    _emit(launch, key, lambda: _rec(opn, "gpsimd", (dst,), launch))
    _use(launch, (offset,), (dst,))
    if vals is not None:
        _store(dst, vals if _dt.is_int(dst.dtype) else vals.astype(np.float32))
    return NkiInstruction(opn)


def affine_select(
    dst: NkiTensor,
    pattern: Any,
    channel_multiplier: int,
    on_true_tile: NkiTensor,
    on_false_value: Any,
    cmp_op: Any = None,
    offset: Any = 0,
    name: Any = None,
) -> NkiInstruction:
    """``dst = on_true_tile where cmp_op(offset + p*channel_multiplier + sum(step*i), 0) else on_false_value``
    (default ``cmp_op`` = ``nl.equal``); dst and on_true_tile in SBUF."""
    launch = _state.current()
    opn = "affine_select"
    _onchip(dst, opn, "dst", launch)
    _onchip(on_true_tile, opn, "on_true_tile", launch)
    for t, a in ((dst, "dst"), (on_true_tile, "on_true_tile")):
        if t._st.buffer is not sbuf:
            raise MemorySpaceError(f"[memory-space] affine_select: {a}={t._desc()} must be in SBUF")
    _same_pf(opn, dst, "dst", on_true_tile, "on_true_tile")
    cname = "equal" if cmp_op is None else opdefs.op_name(cmp_op, "cmp_op")
    vals = _pattern_values(pattern, offset, channel_multiplier, dst, opn)
    key = (opn, cname, _sig(dst), _sig(on_true_tile), launch.program_id)
    _emit(launch, key, lambda: _rec(opn, "gpsimd", (dst, on_true_tile), launch))
    _use(launch, (on_true_tile, offset), (dst,))
    if vals is not None:
        cond = opdefs.BINARY[cname](vals.astype(np.float64), 0.0) != 0
        t = _vals(on_true_tile).reshape(dst.shape)
        _store(dst, np.where(cond, t, np.float32(on_false_value)))
    return NkiInstruction(opn)
