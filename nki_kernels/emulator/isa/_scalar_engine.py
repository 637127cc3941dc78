"""ScalarE instructions: ``activation``, ``activation_reduce``."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import opdefs
from .. import state as _state
from ..errors import (
    ShapeMismatchError,
)
from ..tensor import NkiTensor
from ._common import _apply_binary, _bcast, _count, _emit, _operand, _rec, _store, _vals
from ._enums import _RC, NkiInstruction, reduce_cmd
from ._events import _use
from ._rules import _free, _onchip, _same_pf

# --------------------------------------------------------------------------------------------- ScalarE


def _act_acc(launch: _state.Launch) -> np.ndarray:
    acc = launch.act_acc.get(0)
    if acc is None:
        acc = np.zeros(launch.hw.pmax, dtype=np.float32)
        launch.act_acc[0] = acc
    return acc


def activation(
    dst: NkiTensor,
    op: Any,
    data: NkiTensor,
    bias: Any = None,
    scale: Any = 1.0,
    reduce_op: Any = None,
    reduce_res: NkiTensor | None = None,
    reduce_cmd: reduce_cmd = reduce_cmd.idle,
    name: Any = None,
) -> NkiInstruction:
    """``dst = op(data * scale + bias)`` on ScalarE (fp32 math).

    ``scale``: scalar or (P,1) tensor; ``bias``: (P,1) tensor or scalar.  With ``reduce_op`` the
    activated values are reduced along all free dims into per-partition accumulator registers as
    ``reduce_cmd`` says (reset / reduce / reset_reduce / load_reduce from ``reduce_res``) and the
    registers are written to ``reduce_res`` (P,1).  ``reduce_res`` given with ``reduce_cmd=idle`` is
    treated as ``reset_reduce`` (emulator choice: the register state would otherwise be undefined).
    """
    return _activation("activation", dst, op, data, bias, scale, reduce_op, reduce_res, reduce_cmd)


def activation_reduce(
    dst: NkiTensor,
    op: Any,
    data: NkiTensor,
    reduce_op: Any,
    reduce_res: NkiTensor,
    bias: Any = None,
    scale: Any = 1.0,
    name: Any = None,
) -> NkiInstruction:
    """activation with ``reduce_cmd=reset_reduce``: also reduces the result per partition into reduce_res."""
    return _activation(
        "activation_reduce", dst, op, data, bias, scale, reduce_op, reduce_res, _RC.reset_reduce
    )


def _activation(opname, dst, op, data, bias, scale, reduce_op, reduce_res, rcmd) -> NkiInstruction:
    launch = _state.current()
    pmax = launch.hw.pmax
    if not (  # fast path of _rules._onchip
        type(dst) is NkiTensor
        and dst._st.buffer.on_chip
        and dst.shape[0] <= pmax
        and dst.offset < dst._st.size // dst._st.shape[0]  # start partition 0
    ):
        _onchip(dst, opname, "dst", launch)
    if not (  # fast path of _rules._onchip
        type(data) is NkiTensor
        and data._st.buffer.on_chip
        and data.shape[0] <= pmax
        and data.offset < data._st.size // data._st.shape[0]  # start partition 0
    ):
        _onchip(data, opname, "data", launch)
    if dst.shape != data.shape:
        _same_pf(opname, dst, "dst", data, "data")
    fname = opdefs.op_name(op, "op")
    if fname not in opdefs.ACTIVATION:
        raise ValueError(
            f"{opname}: op={fname} is not a ScalarE activation function ({sorted(opdefs.ACTIVATION)})"
        )
    if not isinstance(rcmd, _RC):
        raise TypeError(f"{opname}: reduce_cmd must be an nisa.reduce_cmd member, got {rcmd!r}")
    P = data.shape[0]
    sc = _operand(scale, P, opname, "scale", launch)
    bi = None if bias is None else _operand(bias, P, opname, "bias", launch)
    rname = None
    if reduce_op is not None or reduce_res is not None:
        if reduce_op is None or reduce_res is None:
            raise ValueError(f"{opname}: reduce_op and reduce_res must be given together")
        rname = opdefs.op_name(reduce_op, "reduce_op")
        opdefs.reduce_fn(rname, "reduce_op")
        _onchip(reduce_res, opname, "reduce_res", launch)
        if reduce_res.shape[0] != P or _free(reduce_res) != 1:
            raise ShapeMismatchError(
                f"[operand-shape] {opname}: reduce_res{list(reduce_res.shape)} must be ({P}, 1)"
            )
        if rcmd is _RC.idle:
            rcmd = _RC.reset_reduce
    key = (opname, fname, dst.shape, dst.dtype, dst._st.buffer, data.shape, data.dtype, data._st.buffer,
           rname, launch.program_id)  # fmt: skip
    if not _count(launch, key):
        ts = (dst, data) + ((reduce_res,) if reduce_res is not None else ())
        _emit(launch, key, lambda: _rec(opname, "scalar", ts, launch, meta=(("func", fname),)))
    ld = reduce_res if rname is not None and rcmd is _RC.load_reduce else None
    _use(launch, (data, scale, bias, ld), (dst, reduce_res if rname is not None else None))
    if launch.trace_only:
        return NkiInstruction(opname)
    x = _vals(data)
    with np.errstate(all="ignore"):
        y = x * _bcast(sc, x.ndim)
        if bi is not None:
            y = y + _bcast(bi, x.ndim)
        y = np.asarray(opdefs.UNARY[fname](y.astype(np.float32)), dtype=np.float32)
    _store(dst, y)
    if rname is not None:
        acc = _act_acc(launch)
        ident = np.float32(opdefs.REDUCE_IDENTITY[rname])
        if rcmd in (_RC.reset, _RC.reset_reduce):
            acc[:P] = ident
        elif rcmd is _RC.load_reduce:
            acc[:P] = _vals(reduce_res).reshape(P)
        if rcmd is not _RC.reset:
            part = opdefs.reduce_fn(rname)(y.reshape(P, -1), axis=(1,))
            acc[:P] = _apply_binary(rname, acc[:P], part.astype(np.float32))
        _store(reduce_res, acc[:P].reshape(reduce_res.shape))
    return NkiInstruction(opname)
