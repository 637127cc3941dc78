"""Trace bookkeeping (count/emit a record, the trace-only fast path) and value helpers shared by the
instructions."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import dtypes as _dt
from .. import opdefs
from .. import state as _state
from ..errors import (
    ShapeMismatchError,
)
from ..tensor import NkiTensor
from ..trace import TraceRecord
from ._rules import _free, _onchip

# --------------------------------------------------------------------------------------------- helpers


def _emit(launch: _state.Launch, key: tuple, make: Any) -> None:
    """Count one issue of the record for ``key`` (built by ``make()`` on first sight)."""
    ent = launch.records.get(key)
    if ent is None:
        ent = [make(), 0]
        launch.records[key] = ent
    ent[1] += 1
    if launch.keep_order:
        launch.note(ent[0])


def _count(launch: _state.Launch, key: tuple) -> bool:
    """Count one more issue of an already-seen record; False when ``key`` is new (caller builds it)."""
    ent = launch.records.get(key)
    if ent is None:
        return False
    ent[1] += 1
    if launch.keep_order:
        launch.note(ent[0])
    return True


def _count_checked(launch: _state.Launch, fkey: tuple) -> bool:
    """Trace-only: count one issue of an instruction whose validation key ``fkey`` already passed every
    check in this program (the key holds every input the checks read); False when ``fkey`` is new."""
    ent = launch.checked.get(fkey)
    if ent is None:
        return False
    ent[1] += 1
    if launch.keep_order:
        launch.note(ent[0])
    return True


def _sig(t: NkiTensor) -> tuple:
    return (t.shape, t.dtype, t._st.buffer.trace_name)


def _vals(t: NkiTensor) -> np.ndarray:
    """fp32 values of an operand."""
    return _dt.to_fp32(np.asarray(t.read()))


def _store(dst: NkiTensor, values: np.ndarray) -> None:
    """Cast to dst dtype and write; a non-matmul write to PSUM clears its 'written by matmul' state."""
    v = _dt.cast(np.asarray(values).reshape(dst.shape) if np.size(values) == dst.size else values, dst.dtype)
    dst.write(v)
    if dst._st.written is not None:
        dst.written_mask_view()[...] = False


def _operand(x: Any, p: int, op: str, arg: str, launch: _state.Launch) -> Any:
    """Scalar or (P,1) vector operand -> fp32 scalar or [P,1] array (None in trace-only)."""
    if isinstance(x, NkiTensor):
        _onchip(x, op, arg, launch)
        if x.shape[0] != p or _free(x) != 1:
            raise ShapeMismatchError(
                f"[operand-shape] {op}: {arg}={x._desc()} must be a scalar or a ({p}, 1) vector"
            )
        if launch.trace_only:
            return None
        return _vals(x).reshape(p, 1)
    if isinstance(x, (int, float, np.integer, np.floating, bool)):
        return np.float32(x)
    raise TypeError(f"{op}: {arg} must be a Python/numpy scalar or an (P,1) NkiTensor, got {x!r}")


def _bcast(v: Any, ndim: int) -> Any:
    if isinstance(v, np.ndarray) and v.ndim == 2 and ndim != 2:
        return v.reshape((v.shape[0],) + (1,) * (ndim - 1))
    return v


def _apply_binary(name: str, a: Any, b: Any, reverse: bool = False) -> np.ndarray:
    f = opdefs.BINARY[name]
    if reverse:
        a, b = b, a
    with np.errstate(all="ignore"):
        return np.asarray(f(a, b))


UNARY_ALU = frozenset({"abs", "rsqrt"})
"""Unary ALU operators a ``tensor_scalar``-family instruction accepts as ``op0`` / ``op1`` with its operand
``None`` or ``0`` (the NKI 0.6 ``tensor_scalar`` / ``tensor_scalar_reduce`` docstrings: "Must be None or 0
when op0 is a unary operator (e.g., nl.abs)"; ``rsqrt`` is the operator its ``engine`` parameter names)."""


def _scalar_op_name(op: Any, op_label: str, arg: str, operand: Any) -> str:
    """An ALU op of a tensor-scalar instruction: a binary op, or a unary one (:data:`UNARY_ALU`) whose operand
    is ``None`` or ``0``."""
    name = opdefs.op_name(op, arg)
    if name in opdefs.BINARY:
        return name
    if name in UNARY_ALU:
        if operand is None or (
            isinstance(operand, (int, float)) and not isinstance(operand, bool) and operand == 0
        ):
            return name
        raise ValueError(
            f"{op_label}: {arg}={name} is a unary ALU op, its operand must be None or 0, got {operand!r}"
        )
    raise ValueError(
        f"{op_label}: {arg}={name} is not a binary ALU op (nor a unary one: {sorted(UNARY_ALU)})"
    )


def _apply_op(name: str, a: Any, b: Any, reverse: bool = False) -> np.ndarray:
    """``_apply_binary``, or the unary ALU op ``name`` on ``a`` (its operand ignored)."""
    if name in UNARY_ALU:
        with np.errstate(all="ignore"):
            return np.asarray(opdefs.UNARY[name](a))
    return _apply_binary(name, a, b, reverse)


def _binary_name(op: Any, op_label: str, arg: str) -> str:
    name = opdefs.op_name(op, arg)
    if name not in opdefs.BINARY:
        raise ValueError(f"{op_label}: {arg}={name} is not a binary ALU op")
    return name


def _rec(
    op: str, en: str, ts: tuple, launch: _state.Launch, flops: int | None = None, meta: tuple = ()
) -> TraceRecord:
    dst = ts[0]
    srcs = [t for t in ts[1:] if isinstance(t, NkiTensor)]
    return TraceRecord(
        op=op,
        engine=en,
        shapes=tuple(t.shape for t in ts if isinstance(t, NkiTensor)),
        dtypes=tuple(t.dtype for t in ts if isinstance(t, NkiTensor)),
        buffers=tuple(t._st.buffer.trace_name for t in ts if isinstance(t, NkiTensor)),
        partitions=max(t.shape[0] for t in ts if isinstance(t, NkiTensor)),
        free_elems=max(_free(t) for t in ts if isinstance(t, NkiTensor)),
        bytes_read=sum(t.size * t.itemsize for t in srcs),
        bytes_written=dst.size * dst.itemsize,
        flops=dst.size if flops is None else flops,
        program_id=launch.program_id,
        meta=tuple(sorted(meta)),
    )
