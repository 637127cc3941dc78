"""On-chip copies and fills: ``tensor_copy``, ``memset``."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import dtypes as _dt
from .. import state as _state
from ..errors import (
    DtypeError,
)
from ..tensor import NkiTensor
from ._common import _count, _count_checked, _emit, _rec, _store
from ._enums import _E, _ENGINE_TRACE_ID, _TC_ENGINES, NkiInstruction, engine
from ._events import _use, _use_rw
from ._rules import _no_gpsimd_psum, _onchip, _pick_engine, _same_pf

# --------------------------------------------------------------------------------------------- copies


def tensor_copy(
    dst: NkiTensor, src: NkiTensor, engine: engine = engine.unknown, name: Any = None
) -> NkiInstruction:
    """On-chip copy with cast (same partitions and elements per partition); Vector by default."""
    launch = _state.current()
    fkey = None
    if launch.trace_only and type(dst) is NkiTensor and type(src) is NkiTensor:
        # start partitions are part of the key: the start-partition rule reads them
        fkey = ("tensor_copy", id(engine), dst.shape, dst.dtype, dst._st.buffer, src.shape, src.dtype,
                src._st.buffer, dst.offset // (dst._st.size // dst._st.shape[0]),
                src.offset // (src._st.size // src._st.shape[0]))  # fmt: skip
        if _count_checked(launch, fkey):
            _use_rw(launch, src, dst)
            return NkiInstruction("tensor_copy")
    op = "tensor_copy"
    pmax = launch.hw.pmax
    if not (  # fast path of _rules._onchip
        type(dst) is NkiTensor
        and dst._st.buffer.on_chip
        and dst.shape[0] <= pmax
        and dst.offset < dst._st.size // dst._st.shape[0]  # start partition 0
    ):
        _onchip(dst, op, "dst", launch)
    if not (  # fast path of _rules._onchip
        type(src) is NkiTensor
        and src._st.buffer.on_chip
        and src.shape[0] <= pmax
        and src.offset < src._st.size // src._st.shape[0]  # start partition 0
    ):
        _onchip(src, op, "src", launch)
    if dst.shape != src.shape:
        _same_pf(op, dst, "dst", src, "src")
    eng = _E.vector if engine is _E.vector else _pick_engine(engine, _E.vector, op, _TC_ENGINES)
    if eng is _E.gpsimd:
        _no_gpsimd_psum(op, eng, dst, src)
    en = _ENGINE_TRACE_ID[id(eng)]
    key = (
        op,
        en,
        dst.shape,
        dst.dtype,
        dst._st.buffer,
        src.shape,
        src.dtype,
        src._st.buffer,
        launch.program_id,
    )
    if not _count(launch, key):
        _emit(launch, key, lambda: _rec(op, en, (dst, src), launch, flops=0))
    _use_rw(launch, src, dst)
    if fkey is not None:
        launch.checked[fkey] = launch.records[key]
    if not launch.trace_only:
        v = np.asarray(src.read())
        if dst.dtype == src.dtype:
            dst.write(v.reshape(dst.shape))
            if dst._st.written is not None:
                dst.written_mask_view()[...] = False
        else:
            _store(dst, _dt.to_fp32(v).reshape(dst.shape))
    return NkiInstruction(op)


def memset(dst: NkiTensor, value: Any, engine: engine = engine.unknown, name: Any = None) -> NkiInstruction:
    """Fill ``dst`` with a constant whose type matches ``dst.dtype`` (int literal for integer tensors)."""
    launch = _state.current()
    op = "memset"
    _onchip(dst, op, "dst", launch)
    eng = _pick_engine(engine, _E.vector, op, (_E.vector, _E.gpsimd, _E.scalar))
    _no_gpsimd_psum(op, eng, dst)
    if _dt.is_int(dst.dtype) and not isinstance(value, (int, np.integer, bool)):
        raise DtypeError(
            f"[memset-dtype] memset value {value!r} must be an int for {dst.dtype} dst {dst._desc()}"
        )
    if dst.dtype in _dt.PACKED_DTYPES and value != 0:
        raise DtypeError(f"[memset-dtype] x4-packed dtype {dst.dtype} accepts only 0, got {value!r}")
    en = _ENGINE_TRACE_ID[id(eng)]
    key = (op, en, dst.shape, dst.dtype, dst._st.buffer, launch.program_id)
    _emit(launch, key, lambda: _rec(op, en, (dst,), launch, flops=0))
    _use(launch, (), (dst,))
    if not launch.trace_only:
        if _dt.is_int(dst.dtype):
            _store(dst, np.full(dst.shape, int(value), dtype=np.int64))
        else:
            _store(dst, np.full(dst.shape, value, dtype=np.float32))
    return NkiInstruction(op)
