"""VectorE instructions: ``tensor_tensor``, ``tensor_scalar``, ``scalar_tensor_tensor``, reductions,
``reciprocal``, ``tensor_copy_predicated``, ``tensor_scalar_reduce``."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import dtypes as _dt
from .. import opdefs
from .. import state as _state
from ..errors import (
    DtypeError,
    MemorySpaceError,
    ShapeMismatchError,
)
from ..tensor import NkiTensor, psum
from ._common import (
    UNARY_ALU,
    _apply_binary,
    _apply_op,
    _bcast,
    _binary_name,
    _count,
    _emit,
    _operand,
    _rec,
    _scalar_op_name,
    _sig,
    _store,
    _vals,
)
from ._enums import _E, _ENGINE_TRACE_ID, _TC_ENGINES, _TT_ENGINES, NkiInstruction, engine, reduce_cmd
from ._events import _use, _use_rrw, _use_rw
from ._rules import _axes, _free, _no_gpsimd_psum, _onchip, _pick_engine, _same_pf

# --------------------------------------------------------------------------------------------- VectorE


def tensor_tensor(
    dst: NkiTensor,
    data1: NkiTensor,
    data2: NkiTensor,
    op: Any,
    engine: engine = engine.unknown,
    name: Any = None,
) -> NkiInstruction:
    """``dst = data1 op data2`` elementwise (same partitions and elements per partition, no broadcasting;
    at most one operand in PSUM).  Arithmetic in fp32; bit-vector ops on integers."""
    launch = _state.current()
    opn = "tensor_tensor"
    pmax = launch.hw.pmax
    if not (  # fast path of _rules._onchip
        type(dst) is NkiTensor
        and dst._st.buffer.on_chip
        and dst.shape[0] <= pmax
        and dst.offset < dst._st.size // dst._st.shape[0]  # start partition 0
    ):
        _onchip(dst, opn, "dst", launch)
    if not (  # fast path of _rules._onchip
        type(data1) is NkiTensor
        and data1._st.buffer.on_chip
        and data1.shape[0] <= pmax
        and data1.offset < data1._st.size // data1._st.shape[0]  # start partition 0
    ):
        _onchip(data1, opn, "data1", launch)
    if not (  # fast path of _rules._onchip
        type(data2) is NkiTensor
        and data2._st.buffer.on_chip
        and data2.shape[0] <= pmax
        and data2.offset < data2._st.size // data2._st.shape[0]  # start partition 0
    ):
        _onchip(data2, opn, "data2", launch)
    if data1.shape != data2.shape:
        _same_pf(opn, data1, "data1", data2, "data2")
    if dst.shape != data1.shape:
        _same_pf(opn, dst, "dst", data1, "data1")
    if data1._st.buffer is psum and data2._st.buffer is psum:
        raise MemorySpaceError(
            f"[memory-space] tensor_tensor: data1 and data2 cannot both be in PSUM ({data1._desc()}, "
            f"{data2._desc()})"
        )
    name_ = _binary_name(op, opn, "op")
    default = _E.gpsimd if name_ == "power" else _E.vector
    eng = engine if engine is _E.vector else _pick_engine(engine, default, opn, _TT_ENGINES)
    if eng is _E.gpsimd:
        _no_gpsimd_psum(opn, eng, dst, data1, data2)
    bitvec = name_ in opdefs.BITVEC
    if bitvec and not all(_dt.is_int(t.dtype) for t in (dst, data1, data2)):
        raise DtypeError(f"[bitvec-dtype] tensor_tensor op={name_} needs integer dtypes")
    en = _ENGINE_TRACE_ID[id(eng)]
    key = (opn, en, name_, _sig(dst), _sig(data1), _sig(data2), launch.program_id)
    if not _count(launch, key):
        _emit(launch, key, lambda: _rec(opn, en, (dst, data1, data2), launch, meta=(("alu", name_),)))
    _use_rrw(launch, data1, data2, dst)
    if launch.trace_only:
        return NkiInstruction(opn)
    if bitvec:
        a = np.asarray(data1.read()).astype(np.int64).reshape(dst.shape)
        b = np.asarray(data2.read()).astype(np.int64).reshape(dst.shape)
        _store(dst, _apply_binary(name_, a, b))
    else:
        a = _vals(data1).reshape(dst.shape)
        b = _vals(data2).reshape(dst.shape)
        _store(dst, _apply_binary(name_, a, b).astype(np.float32))
    return NkiInstruction(opn)


def tensor_scalar(
    dst: NkiTensor,
    data: NkiTensor,
    op0: Any,
    operand0: Any,
    reverse0: bool = False,
    op1: Any = None,
    operand1: Any = None,
    reverse1: bool = False,
    engine: engine = engine.unknown,
    name: Any = None,
) -> NkiInstruction:
    """``dst = (data op0 operand0) op1 operand1``; operands are scalars or (P,1) vectors broadcast along the
    free dims; ``reverse*`` puts the operand first."""
    launch = _state.current()
    opn = "tensor_scalar"
    pmax = launch.hw.pmax
    if not (  # fast path of _rules._onchip
        type(dst) is NkiTensor
        and dst._st.buffer.on_chip
        and dst.shape[0] <= pmax
        and dst.offset < dst._st.size // dst._st.shape[0]  # start partition 0
    ):
        _onchip(dst, opn, "dst", launch)
    if not (  # fast path of _rules._onchip
        type(data) is NkiTensor
        and data._st.buffer.on_chip
        and data.shape[0] <= pmax
        and data.offset < data._st.size // data._st.shape[0]  # start partition 0
    ):
        _onchip(data, opn, "data", launch)
    if dst.shape != data.shape:
        _same_pf(opn, dst, "dst", data, "data")
    n0 = _scalar_op_name(op0, opn, "op0", operand0)
    n1 = None if op1 is None else _scalar_op_name(op1, opn, "op1", operand1)
    if (op1 is None and operand1 is not None) or (
        n1 is not None and n1 not in UNARY_ALU and operand1 is None
    ):
        raise ValueError("tensor_scalar: op1 and operand1 must be given together")
    eng = _E.vector if engine is _E.vector else _pick_engine(engine, _E.vector, opn, _TC_ENGINES)
    if eng is _E.gpsimd:
        _no_gpsimd_psum(opn, eng, dst, data)
    P = data.shape[0]
    bitvec = n0 in opdefs.BITVEC or (n1 in opdefs.BITVEC)
    if bitvec and not (_dt.is_int(data.dtype) and _dt.is_int(dst.dtype)):
        raise DtypeError(
            f"[bitvec-dtype] tensor_scalar bit-vector op needs integer data/dst, got {data.dtype}/{dst.dtype}"
        )
    o0 = np.float32(0) if operand0 is None else _operand(operand0, P, opn, "operand0", launch)
    o1 = None if operand1 is None else _operand(operand1, P, opn, "operand1", launch)
    en = _ENGINE_TRACE_ID[id(eng)]
    vec0 = isinstance(operand0, NkiTensor)
    vec1 = isinstance(operand1, NkiTensor)
    key = (opn, en, n0, n1, _sig(dst), _sig(data), vec0, vec1, launch.program_id)
    if not _count(launch, key):
        nops = 1 if n1 is None else 2
        extra = tuple(t for t in (operand0, operand1) if isinstance(t, NkiTensor))
        _emit(
            launch,
            key,
            lambda: _rec(
                opn, en, (dst, data) + extra, launch, flops=nops * dst.size, meta=(("alu", (n0, n1)),)
            ),
        )
    _use(launch, (data, operand0, operand1), (dst,))
    if launch.trace_only:
        return NkiInstruction(opn)
    if bitvec:
        x = np.asarray(data.read()).astype(np.int64).reshape(dst.shape)
        o0 = _bcast(np.asarray(o0).astype(np.int64), x.ndim)
        if o1 is not None:
            o1 = _bcast(np.asarray(o1).astype(np.int64), x.ndim)
    else:
        x = _vals(data).reshape(dst.shape)
        o0 = _bcast(o0, x.ndim)
        o1 = _bcast(o1, x.ndim)
    y = _apply_op(n0, x, o0, reverse0)
    if n1 is not None:
        y = _apply_op(n1, y, o1, reverse1)
    _store(dst, y if bitvec else np.asarray(y, dtype=np.float32))
    return NkiInstruction(opn)


def scalar_tensor_tensor(
    dst: NkiTensor,
    data: NkiTensor,
    op0: Any,
    operand0: Any,
    op1: Any,
    operand1: NkiTensor,
    reverse0: bool = False,
    reverse1: bool = False,
    name: Any = None,
) -> NkiInstruction:
    """``dst = (data op0 operand0) op1 operand1``: operand0 scalar or (P,1), operand1 a full tile."""
    launch = _state.current()
    opn = "scalar_tensor_tensor"
    pmax = launch.hw.pmax
    if not (  # fast path of _rules._onchip
        type(dst) is NkiTensor
        and dst._st.buffer.on_chip
        and dst.shape[0] <= pmax
        and dst.offset < dst._st.size // dst._st.shape[0]  # start partition 0
    ):
        _onchip(dst, opn, "dst", launch)
    if not (  # fast path of _rules._onchip
        type(data) is NkiTensor
        and data._st.buffer.on_chip
        and data.shape[0] <= pmax
        and data.offset < data._st.size // data._st.shape[0]  # start partition 0
    ):
        _onchip(data, opn, "data", launch)
    if not (  # fast path of _rules._onchip
        type(operand1) is NkiTensor
        and operand1._st.buffer.on_chip
        and operand1.shape[0] <= pmax
        and operand1.offset < operand1._st.size // operand1._st.shape[0]  # start partition 0
    ):
        _onchip(operand1, opn, "operand1", launch)
    if dst.shape != data.shape:
        _same_pf(opn, dst, "dst", data, "data")
    if data.shape != operand1.shape:
        _same_pf(opn, data, "data", operand1, "operand1")
    if data._st.buffer is psum and operand1._st.buffer is psum:
        raise MemorySpaceError(
            "[memory-space] scalar_tensor_tensor: data and operand1 cannot both be in PSUM"
        )
    n0 = _binary_name(op0, opn, "op0")
    n1 = _binary_name(op1, opn, "op1")
    P = data.shape[0]
    o0 = _operand(operand0, P, opn, "operand0", launch)
    key = (
        opn,
        n0,
        n1,
        _sig(dst),
        _sig(data),
        _sig(operand1),
        isinstance(operand0, NkiTensor),
        launch.program_id,
    )
    if not _count(launch, key):
        _emit(
            launch,
            key,
            lambda: _rec(
                opn, "vector", (dst, data, operand1), launch, flops=2 * dst.size, meta=(("alu", (n0, n1)),)
            ),
        )
    _use(launch, (data, operand0, operand1), (dst,))
    if launch.trace_only:
        return NkiInstruction(opn)
    x = _vals(data).reshape(dst.shape)
    y = _apply_binary(n0, x, _bcast(o0, x.ndim), reverse0)
    y = _apply_binary(n1, y, _vals(operand1).reshape(dst.shape), reverse1)
    _store(dst, np.asarray(y, dtype=np.float32))
    return NkiInstruction(opn)


def tensor_reduce(
    dst: NkiTensor,
    op: Any,
    data: NkiTensor,
    axis: Any,
    negate: bool = False,
    keepdims: bool = False,
    name: Any = None,
) -> NkiInstruction:
    """Reduce ``data`` with ``op`` over its trailing free ``axis`` (int or tuple) into ``dst`` (fp32 math,
    ``negate`` multiplies the result by -1)."""
    launch = _state.current()
    opn = "tensor_reduce"
    pmax = launch.hw.pmax
    if not (  # fast path of _rules._onchip
        type(dst) is NkiTensor
        and dst._st.buffer.on_chip
        and dst.shape[0] <= pmax
        and dst.offset < dst._st.size // dst._st.shape[0]  # start partition 0
    ):
        _onchip(dst, opn, "dst", launch)
    if not (  # fast path of _rules._onchip
        type(data) is NkiTensor
        and data._st.buffer.on_chip
        and data.shape[0] <= pmax
        and data.offset < data._st.size // data._st.shape[0]  # start partition 0
    ):
        _onchip(data, opn, "data", launch)
    rn = opdefs.op_name(op, "op")
    red = opdefs.reduce_fn(rn, "op")
    ax = _axes(axis, data.ndim, opn)
    kept = math.prod(data.shape[1 : data.ndim - len(ax)])
    if dst.shape[0] != data.shape[0] or _free(dst) != kept:
        raise ShapeMismatchError(
            f"[reduce-shape] tensor_reduce: dst{list(dst.shape)} must hold {data.shape[0]} partitions x "
            f"{kept} elements for data{list(data.shape)} reduced over axis {ax}"
        )
    key = (opn, rn, _sig(dst), _sig(data), ax, launch.program_id)
    if not _count(launch, key):
        _emit(
            launch,
            key,
            lambda: _rec(opn, "vector", (dst, data), launch, flops=data.size, meta=(("alu", rn),)),
        )
    _use_rw(launch, data, dst)
    if launch.trace_only:
        return NkiInstruction(opn)
    if rn in opdefs.BITVEC:
        x = np.asarray(data.read()).astype(np.int64)
    else:
        x = _vals(data)
    with np.errstate(all="ignore"):
        y = red(x, axis=ax, keepdims=keepdims)
        if negate:
            y = -y
    _store(dst, np.asarray(y).reshape(dst.shape))
    return NkiInstruction(opn)


def tensor_partition_reduce(dst: NkiTensor, op: Any, data: NkiTensor, name: Any = None) -> NkiInstruction:
    """Reduce across partitions on GpSimd: ``dst[1, F] = reduce_p data[p, F]`` (SBUF only)."""
    launch = _state.current()
    opn = "tensor_partition_reduce"
    _onchip(dst, opn, "dst", launch)
    _onchip(data, opn, "data", launch)
    _no_gpsimd_psum(opn, _E.gpsimd, dst, data)
    rn = opdefs.op_name(op, "op")
    red = opdefs.reduce_fn(rn, "op")
    if dst.shape[0] != 1 or _free(dst) != _free(data):
        raise ShapeMismatchError(
            f"[reduce-shape] tensor_partition_reduce: dst{list(dst.shape)} must be [1, {_free(data)}]"
        )
    key = (opn, rn, _sig(dst), _sig(data), launch.program_id)
    _emit(launch, key, lambda: _rec(opn, "gpsimd", (dst, data), launch, flops=data.size))
    _use_rw(launch, data, dst)
    if not launch.trace_only:
        x = _vals(data).reshape(data.shape[0], -1)
        _store(dst, red(x, axis=(0,)).reshape(dst.shape))
    return NkiInstruction(opn)


def reciprocal(dst: NkiTensor, data: NkiTensor, name: Any = None) -> NkiInstruction:
    """``dst = 1 / data`` on VectorE (fp32)."""
    launch = _state.current()
    opn = "reciprocal"
    pmax = launch.hw.pmax
    if not (  # fast path of _rules._onchip
        type(dst) is NkiTensor
        and dst._st.buffer.on_chip
        and dst.shape[0] <= pmax
        and dst.offset < dst._st.size // dst._st.shape[0]  # start partition 0
    ):
        _onchip(dst, opn, "dst", launch)
    if not (  # fast path of _rules._onchip
        type(data) is NkiTensor
        and data._st.buffer.on_chip
        and data.shape[0] <= pmax
        and data.offset < data._st.size // data._st.shape[0]  # start partition 0
    ):
        _onchip(data, opn, "data", launch)
    if dst.shape != data.shape:
        _same_pf(opn, dst, "dst", data, "data")
    key = (opn, _sig(dst), _sig(data), launch.program_id)
    if not _count(launch, key):
        _emit(launch, key, lambda: _rec(opn, "vector", (dst, data), launch))
    _use_rw(launch, data, dst)
    if not launch.trace_only:
        with np.errstate(all="ignore"):
            _store(dst, (np.float32(1) / _vals(data)).reshape(dst.shape))
    return NkiInstruction(opn)


def tensor_copy_predicated(
    dst: NkiTensor, src: NkiTensor, predicate: NkiTensor, reverse_pred: bool = False, name: Any = None
) -> NkiInstruction:
    """Copy ``src`` into ``dst`` where ``predicate`` is non-zero (zero if ``reverse_pred``); VectorE."""
    launch = _state.current()
    opn = "tensor_copy_predicated"
    for t, a in ((dst, "dst"), (src, "src"), (predicate, "predicate")):
        _onchip(t, opn, a, launch)
    _same_pf(opn, dst, "dst", src, "src")
    _same_pf(opn, dst, "dst", predicate, "predicate")
    key = (opn, _sig(dst), _sig(src), _sig(predicate), launch.program_id)
    _emit(launch, key, lambda: _rec(opn, "vector", (dst, src, predicate), launch))
    _use(launch, (src, predicate, dst), (dst,))  # a merge: dst keeps its values where the predicate is off
    if not launch.trace_only:
        m = np.asarray(predicate.read()).reshape(dst.shape).astype(np.float32) != 0
        if reverse_pred:
            m = ~m
        cur = np.asarray(dst.read()).copy()
        new = _dt.cast(_vals(src).reshape(dst.shape), dst.dtype)
        cur[m] = new[m]
        dst.write(cur)
    return NkiInstruction(opn)


def tensor_scalar_reduce(
    dst: NkiTensor,
    data: NkiTensor,
    op0: Any,
    operand0: Any,
    reduce_op: Any,
    reduce_res: NkiTensor | None = None,
    reverse0: bool = False,
    reduce_cmd: reduce_cmd = reduce_cmd.reset_reduce,
    reduce_init: Any = None,
    reduce_res_negate: bool = False,
    name: Any = None,
) -> NkiInstruction:
    """``dst = data op0 operand0``, and ``reduce_res (P,1) = reduce_op`` over the free dims of the result."""
    launch = _state.current()
    opn = "tensor_scalar_reduce"
    _onchip(dst, opn, "dst", launch)
    _onchip(data, opn, "data", launch)
    _same_pf(opn, dst, "dst", data, "data")
    n0 = _scalar_op_name(op0, opn, "op0", operand0)
    rn = opdefs.op_name(reduce_op, "reduce_op")
    red = opdefs.reduce_fn(rn, "reduce_op")
    P = data.shape[0]
    o0 = np.float32(0) if operand0 is None else _operand(operand0, P, opn, "operand0", launch)
    if reduce_res is not None:
        _onchip(reduce_res, opn, "reduce_res", launch)
        if reduce_res.shape[0] != P or _free(reduce_res) != 1:
            raise ShapeMismatchError(
                f"[operand-shape] {opn}: reduce_res{list(reduce_res.shape)} must be ({P}, 1)"
            )
    key = (opn, n0, rn, _sig(dst), _sig(data), reduce_res is None, launch.program_id)
    _emit(launch, key, lambda: _rec(opn, "vector", (dst, data), launch, flops=2 * dst.size))
    _use(launch, (data, operand0), (dst, reduce_res))
    if launch.trace_only:
        return NkiInstruction(opn)
    x = _vals(data).reshape(dst.shape)
    y = np.asarray(_apply_op(n0, x, _bcast(o0, x.ndim), reverse0), dtype=np.float32)
    _store(dst, y)
    if reduce_res is not None:
        r = red(y.reshape(P, -1), axis=(1,)).astype(np.float32)
        if reduce_init is not None:
            r = _apply_binary(rn, np.float32(reduce_init), r)
        if reduce_res_negate:
            r = -r
        _store(reduce_res, r.reshape(reduce_res.shape))
    return NkiInstruction(opn)
