"""VectorE instructions of NKI 0.6 beyond the core set: statistics, scans, selects, top-8 search,
cross-partition shuffle (exported by :mod:`nki_kernels.emulator.isa` as ``nisa.<name>``).

Semantics follow the NKI 0.6 docstrings (aws-neuron/aws-neuron-sdk ``nki/api/nki/isa/__init__.py``,
https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/nki.isa.html): inputs up-cast to fp32, math
in fp32, one cast to ``dst.dtype``.  Every instruction checks its operands like the core ISA (on-chip,
<= 128 partitions, the start-partition rule) and emits one trace record on the engine that runs it, so the
cost model prices it.  ``max8`` and ``nc_find_index8`` name no engine in the 0.6 docstring; they are traced
on VectorE (its search/select family, NKI ISA guide).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import dtypes as _dt
from .. import opdefs
from .. import start_partition as _sp
from .. import state as _state
from ..errors import DtypeError, MemorySpaceError, ShapeMismatchError
from ..tensor import NkiTensor, psum
from ._common import _apply_binary, _binary_name, _emit, _rec, _store, _vals
from ._enums import NkiInstruction
from ._enums import reduce_cmd as _RC
from ._events import _use
from ._rules import _free, _onchip, _same_pf

FP32_MIN = float(np.finfo(np.float32).min)
BN_STATS_FMAX = 512
_CMP_OPS = ("equal", "less", "less_equal", "greater", "greater_equal")
_VEC_ACC = 1  # key of VectorE's accumulator registers in Launch.act_acc (0 is ScalarE's)


def _checked(op: str, launch: _state.Launch, *named: tuple[str, Any]) -> None:
    """Operands on chip, <= pmax partitions, start partition legal (None entries skipped)."""
    for arg, t in named:
        if t is not None:
            _onchip(t, op, arg, launch)
    _sp.check_all(op, launch.hw.pmax, *named)


def _record(op: str, en: str, ts: tuple, launch: _state.Launch, flops: int, meta: tuple = ()) -> None:
    key = (
        op,
        en,
        tuple((t.shape, t.dtype, t._st.buffer.trace_name) for t in ts),
        flops,
        meta,
        launch.program_id,
    )
    _emit(launch, key, lambda: _rec(op, en, ts, launch, flops=flops, meta=meta))
    _use(launch, ts[1:], ts[:1])  # dst first, then the sources (liveness + event log)


def _vector_acc(launch: _state.Launch) -> np.ndarray:
    acc = launch.act_acc.get(_VEC_ACC)
    if acc is None:
        acc = np.full(launch.hw.pmax, -np.inf, dtype=np.float32)
        launch.act_acc[_VEC_ACC] = acc
    return acc


def _col(x: Any, p: int, op: str, arg: str, launch: _state.Launch) -> Any:
    """A scalar or a (p, 1) tile -> fp32 scalar or [p, 1] array (None in trace-only)."""
    if isinstance(x, NkiTensor):
        _checked(op, launch, (arg, x))
        if x.shape[0] != p or _free(x) != 1:
            raise ShapeMismatchError(f"[operand-shape] {op}: {arg}={x._desc()} must be a scalar or ({p}, 1)")
        return None if launch.trace_only else _vals(x).reshape(p, 1)
    if isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool):
        return np.float32(x)
    raise TypeError(f"{op}: {arg} must be a number or a ({p}, 1) NkiTensor, got {x!r}")


# ------------------------------------------------------------------------------------------ statistics


def bn_stats(dst: NkiTensor, data: NkiTensor, name: Any = None) -> NkiInstruction:
    """Per partition of ``data`` (<= 512 elements, free dims flattened) write 6 fp32 statistics to ``dst``
    ``[P, 6]``: count, mean, variance*count of the even-indexed elements, then the same of the odd ones.
    (An empty half, i.e. one element per partition, gives count 0, mean 0, 0: our choice.)"""
    launch = _state.current()
    op = "bn_stats"
    _checked(op, launch, ("dst", dst), ("data", data))
    P, F = data.shape[0], _free(data)
    if F > BN_STATS_FMAX:
        raise ShapeMismatchError(
            f"[bn-stats-fmax] bn_stats: data{list(data.shape)} has {F} elements per partition, limit "
            f"{BN_STATS_FMAX} (nl.tile_size.bn_stats_fmax; tile it and aggregate with bn_aggr)"
        )
    if dst.shape[0] != P or _free(dst) != 6:
        raise ShapeMismatchError(f"[bn-stats-shape] bn_stats: dst{list(dst.shape)} must be [{P}, 6]")
    _record(op, "vector", (dst, data), launch, flops=3 * data.size)
    if launch.trace_only:
        return NkiInstruction(op)
    x = _vals(data).reshape(P, F).astype(np.float32)
    out = np.zeros((P, 6), dtype=np.float32)
    for k, half in enumerate((x[:, 0::2], x[:, 1::2])):
        n = half.shape[1]
        if n:
            m = half.mean(axis=1, dtype=np.float32)
            out[:, 3 * k] = n
            out[:, 3 * k + 1] = m
            out[:, 3 * k + 2] = ((half - m[:, None]) ** 2).sum(axis=1, dtype=np.float32)
    _store(dst, out)
    return NkiInstruction(op)


def bn_aggr(dst: NkiTensor, data: NkiTensor, name: Any = None) -> NkiInstruction:
    """Combine ``(count, mean, variance*count)`` triples (``data`` free size a multiple of 3, e.g. several
    ``bn_stats`` outputs side by side) into ``dst [P, 2]`` = (mean, population variance), fp32:
    ``mean = sum(c_i m_i) / sum(c_i)``, ``var = sum(M2_i + c_i (m_i - mean)^2) / sum(c_i)``."""
    launch = _state.current()
    op = "bn_aggr"
    _checked(op, launch, ("dst", dst), ("data", data))
    P, F = data.shape[0], _free(data)
    if F % 3:
        raise ShapeMismatchError(
            f"[bn-aggr-shape] bn_aggr: data{list(data.shape)} must hold (count, mean, var*count) triples: "
            f"{F} elements per partition is not a multiple of 3"
        )
    if dst.shape[0] != P or _free(dst) != 2:
        raise ShapeMismatchError(f"[bn-aggr-shape] bn_aggr: dst{list(dst.shape)} must be [{P}, 2]")
    _record(op, "vector", (dst, data), launch, flops=data.size)
    if launch.trace_only:
        return NkiInstruction(op)
    t = _vals(data).reshape(P, F // 3, 3).astype(np.float32)
    c, m, m2 = t[..., 0], t[..., 1], t[..., 2]
    n = c.sum(axis=1, dtype=np.float32)
    with np.errstate(all="ignore"):
        mean = (c * m).sum(axis=1, dtype=np.float32) / n
        var = (m2 + c * (m - mean[:, None]) ** 2).sum(axis=1, dtype=np.float32) / n
    _store(dst, np.stack([mean, var], axis=1))
    return NkiInstruction(op)


# ------------------------------------------------------------------------------------------ scans


def tensor_tensor_scan(
    dst: NkiTensor,
    data0: NkiTensor,
    data1: NkiTensor,
    initial: Any,
    op0: Any,
    op1: Any,
    reverse0: bool = False,
    reverse1: bool = False,
    name: Any = None,
) -> NkiInstruction:
    """Per partition, along the (flattened) free elements i: ``r[i] = op1(op0(data0[i], r[i-1]), data1[i])``
    with ``r[-1] = initial`` (scalar or (P, 1) tile); ``reverse0`` makes data0 the rhs of op0, ``reverse1``
    makes data1 the lhs of op1.  data0 / data1 same partitions and elements, not both in PSUM; fp32 math."""
    launch = _state.current()
    op = "tensor_tensor_scan"
    _checked(op, launch, ("dst", dst), ("data0", data0), ("data1", data1))
    _same_pf(op, data0, "data0", data1, "data1")
    _same_pf(op, dst, "dst", data0, "data0")
    if data0._st.buffer is psum and data1._st.buffer is psum:
        raise MemorySpaceError(f"[memory-space] {op}: data0 and data1 cannot both be in PSUM")
    n0, n1 = _binary_name(op0, op, "op0"), _binary_name(op1, op, "op1")
    P, F = data0.shape[0], _free(data0)
    init = _col(initial, P, op, "initial", launch)
    _record(op, "vector", (dst, data0, data1), launch, flops=2 * dst.size, meta=(("alu", (n0, n1)),))
    if launch.trace_only:
        return NkiInstruction(op)
    a = _vals(data0).reshape(P, F)
    b = _vals(data1).reshape(P, F)
    out = np.empty((P, F), dtype=np.float32)
    prev = np.broadcast_to(np.asarray(init, dtype=np.float32).reshape(-1), (P,)).astype(np.float32)
    for i in range(F):
        x = _apply_binary(n0, prev, a[:, i], reverse=not reverse0).astype(np.float32)
        prev = _apply_binary(n1, x, b[:, i], reverse=reverse1).astype(np.float32)
        out[:, i] = prev
    _store(dst, out)
    return NkiInstruction(op)


_CUMULATIVE_INIT = {"add": 0.0, "subtract": 0.0, "multiply": 1.0, "maximum": -np.inf, "minimum": np.inf}


def tensor_scalar_cumulative(
    dst: NkiTensor,
    src: NkiTensor,
    op0: Any,
    op1: Any,
    imm0: Any,
    imm1: Any = None,
    reduce_cmd: Any = _RC.reset_reduce,
    name: Any = None,
) -> NkiInstruction:
    """Per partition, along the (flattened) free elements: ``reg = op1(op0(src[i], imm0), reg)``,
    ``dst[i] = reg``.  ``reg`` starts from VectorE's accumulator register: ``reset_reduce`` = the identity of
    op1 (add/subtract 0, multiply 1, maximum -inf, minimum +inf), ``load_reduce`` = ``imm1``, ``reduce`` =
    the value left by the previous accumulating instruction; it is left there afterwards.  op1 in add,
    subtract, multiply, maximum, minimum; imm0/imm1 fp32 scalars or (P, 1) tiles; no int32/uint32 data."""
    launch = _state.current()
    op = "tensor_scalar_cumulative"
    _checked(op, launch, ("dst", dst), ("src", src))
    _same_pf(op, dst, "dst", src, "src")
    n0 = _binary_name(op0, op, "op0")
    n1 = _binary_name(op1, op, "op1")
    if n1 not in _CUMULATIVE_INIT:
        raise ValueError(f"{op}: op1 must be one of {sorted(_CUMULATIVE_INIT)}, got {n1}")
    if not isinstance(reduce_cmd, _RC) or reduce_cmd not in (_RC.reset_reduce, _RC.reduce, _RC.load_reduce):
        raise ValueError(f"{op}: reduce_cmd must be reset_reduce, reduce or load_reduce, got {reduce_cmd!r}")
    for t in (dst, src):
        if t.dtype in ("int32", "uint32"):
            raise DtypeError(
                f"[cumulative-dtype] {op}: int32/uint32 are not supported, got {t._desc()} {t.dtype}"
            )
    P, F = src.shape[0], _free(src)
    i0 = _col(imm0, P, op, "imm0", launch)
    if reduce_cmd is _RC.load_reduce and imm1 is None:
        raise ValueError(f"{op}: reduce_cmd=load_reduce needs imm1")
    i1 = None if imm1 is None else _col(imm1, P, op, "imm1", launch)
    _record(op, "vector", (dst, src), launch, flops=2 * dst.size, meta=(("alu", (n0, n1)),))
    if launch.trace_only:
        return NkiInstruction(op)
    acc = _vector_acc(launch)
    if reduce_cmd is _RC.reset_reduce:
        reg = np.full(P, _CUMULATIVE_INIT[n1], dtype=np.float32)
    elif reduce_cmd is _RC.load_reduce:
        reg = np.broadcast_to(np.asarray(i1, np.float32).reshape(-1), (P,)).astype(np.float32)
    else:
        reg = acc[:P].copy()
    x = _vals(src).reshape(P, F)
    c0 = np.broadcast_to(np.asarray(i0, np.float32).reshape(-1), (P,))
    out = np.empty((P, F), dtype=np.float32)
    for i in range(F):
        reg = _apply_binary(n1, _apply_binary(n0, x[:, i], c0), reg).astype(np.float32)
        out[:, i] = reg
    acc[:P] = reg
    _store(dst, out)
    return NkiInstruction(op)


# ------------------------------------------------------------------------------------------ selects


def _cmp_name(x: Any, arg: str) -> str:
    n = opdefs.op_name(x, arg)
    if n not in _CMP_OPS:
        raise ValueError(f"range_select: {arg}={n} must be one of {list(_CMP_OPS)}")
    return n


def _accumulate(launch: _state.Launch, rcmd: Any, rows: np.ndarray | None, p: int, op: str) -> np.ndarray:
    """VectorE max-accumulator step for ``reduce_cmd`` (reset / reduce / reset_reduce / idle)."""
    acc = _vector_acc(launch)
    if rcmd is _RC.load_reduce:
        raise ValueError(f"{op}: reduce_cmd=load_reduce is not documented for this VectorE instruction")
    if rcmd in (_RC.reset, _RC.reset_reduce):
        acc[:p] = -np.inf
    if rcmd in (_RC.reduce, _RC.reset_reduce) and rows is not None:
        acc[:p] = np.maximum(acc[:p], rows)
    return acc[:p]


def range_select(
    dst: NkiTensor,
    on_true_tile: NkiTensor,
    comp_op0: Any,
    comp_op1: Any,
    bound0: NkiTensor,
    bound1: NkiTensor,
    reduce_cmd: Any = _RC.reset_reduce,
    reduce_res: NkiTensor | None = None,
    reduce_op: Any = None,
    range_start: int = 0,
    on_false_value: Any = FP32_MIN,
    name: Any = None,
) -> NkiInstruction:
    """``dst = where(comp_op0(idx, bound0) & comp_op1(idx, bound1), on_true_tile, FP32_MIN)`` with
    ``idx = range_start + free index`` (fp32), and a max-reduction of each row into VectorE's accumulator
    (``reduce_cmd``), written to ``reduce_res`` (P, 1) when given.  NeuronCore-v3+; comparisons in
    {equal, less, less_equal, greater, greater_equal}; bounds fp32 (P, 1); ``on_false_value`` must be
    FP32_MIN and ``reduce_op`` ``nl.maximum`` (hardware constraints in the docstring)."""
    launch = _state.current()
    op = "range_select"
    if launch.hw.nc_version < 3:
        raise DtypeError(f"[nc-version] {op} needs NeuronCore-v3+ (nc_version={launch.hw.nc_version})")
    _checked(op, launch, ("dst", dst), ("on_true_tile", on_true_tile), ("reduce_res", reduce_res))
    _same_pf(op, dst, "dst", on_true_tile, "on_true_tile")
    c0, c1 = _cmp_name(comp_op0, "comp_op0"), _cmp_name(comp_op1, "comp_op1")
    if reduce_op is not None and opdefs.op_name(reduce_op, "reduce_op") != "maximum":
        raise ValueError(f"{op}: reduce_op must be nl.maximum (the only one supported)")
    if on_false_value is not Ellipsis and np.float32(on_false_value) != np.float32(FP32_MIN):
        raise ValueError(f"{op}: on_false_value must be FP32_MIN ({FP32_MIN:.8g}), got {on_false_value!r}")
    if not isinstance(reduce_cmd, _RC):
        raise TypeError(f"{op}: reduce_cmd must be an nisa.reduce_cmd member, got {reduce_cmd!r}")
    if not isinstance(range_start, (int, np.integer)) or isinstance(range_start, bool):
        raise TypeError(f"{op}: range_start must be a compile-time int, got {range_start!r}")
    if _dt.is_int(on_true_tile.dtype):
        raise DtypeError(
            f"[range-select-dtype] {op}: on_true_tile must be a float dtype, got {on_true_tile.dtype}"
        )
    P, F = on_true_tile.shape[0], _free(on_true_tile)
    for b, a in ((bound0, "bound0"), (bound1, "bound1")):
        if not isinstance(b, NkiTensor) or b.dtype != "float32":
            raise DtypeError(f"[range-select-dtype] {op}: {a} must be an fp32 (P, 1) tile, got {b!r}")
    lo = _col(bound0, P, op, "bound0", launch)
    hi = _col(bound1, P, op, "bound1", launch)
    if reduce_res is not None and (reduce_res.shape[0] != P or _free(reduce_res) != 1):
        raise ShapeMismatchError(f"[operand-shape] {op}: reduce_res{list(reduce_res.shape)} must be ({P}, 1)")
    ts = (dst, on_true_tile) + ((reduce_res,) if reduce_res is not None else ())
    _record(op, "vector", ts, launch, flops=3 * dst.size, meta=(("alu", (c0, c1)),))
    if launch.trace_only:
        return NkiInstruction(op)
    idx = (np.float32(range_start) + np.arange(F, dtype=np.float32))[None, :]
    mask = (opdefs.BINARY[c0](idx, lo) != 0) & (opdefs.BINARY[c1](idx, hi) != 0)
    sel = np.where(mask, _vals(on_true_tile).reshape(P, F), np.float32(FP32_MIN)).astype(np.float32)
    _store(dst, sel)
    acc = _accumulate(launch, reduce_cmd, sel.max(axis=1), P, op)
    if reduce_res is not None:
        _store(reduce_res, acc.reshape(reduce_res.shape))
    return NkiInstruction(op)


def select_reduce(
    dst: NkiTensor,
    predicate: NkiTensor,
    on_true: NkiTensor,
    on_false: Any,
    reduce_res: NkiTensor | None = None,
    reduce_cmd: Any = _RC.idle,
    reduce_op: Any = None,
    reverse_pred: bool = False,
    name: Any = None,
) -> NkiInstruction:
    """``dst = where(predicate != 0, on_true, on_false)`` (``reverse_pred`` inverts; on_false an fp32 scalar
    or (P, 1) tile) with an optional per-row max into VectorE's accumulator (``reduce_cmd``) written to
    ``reduce_res`` (P, 1).  predicate an integer dtype; on_true not tf32/int32/uint32; not both on_true and
    predicate in PSUM; ``reduce_op`` ``nl.maximum`` only."""
    launch = _state.current()
    op = "select_reduce"
    _checked(
        op, launch, ("dst", dst), ("predicate", predicate), ("on_true", on_true), ("reduce_res", reduce_res)
    )
    _same_pf(op, dst, "dst", on_true, "on_true")
    _same_pf(op, predicate, "predicate", on_true, "on_true")
    if on_true._st.buffer is psum and predicate._st.buffer is psum:
        raise MemorySpaceError(f"[memory-space] {op}: on_true and predicate cannot both be in PSUM")
    if not _dt.is_int(predicate.dtype):
        raise DtypeError(f"[select-dtype] {op}: predicate must be an integer dtype, got {predicate.dtype}")
    if on_true.dtype in ("tfloat32", "int32", "uint32"):
        raise DtypeError(f"[select-dtype] {op}: on_true dtype {on_true.dtype} is not supported")
    if reduce_op is not None and opdefs.op_name(reduce_op, "reduce_op") != "maximum":
        raise ValueError(f"{op}: reduce_op must be nl.maximum (the only one supported)")
    if not isinstance(reduce_cmd, _RC):
        raise TypeError(f"{op}: reduce_cmd must be an nisa.reduce_cmd member, got {reduce_cmd!r}")
    P, F = on_true.shape[0], _free(on_true)
    fal = _col(on_false, P, op, "on_false", launch)
    if reduce_res is not None and (reduce_res.shape[0] != P or _free(reduce_res) != 1):
        raise ShapeMismatchError(f"[operand-shape] {op}: reduce_res{list(reduce_res.shape)} must be ({P}, 1)")
    ts = (dst, predicate, on_true) + ((reduce_res,) if reduce_res is not None else ())
    _record(op, "vector", ts, launch, flops=dst.size, meta=(("reduce_cmd", reduce_cmd.name),))
    if launch.trace_only:
        return NkiInstruction(op)
    m = np.asarray(predicate.read()).reshape(P, F) != 0
    if reverse_pred:
        m = ~m
    sel = np.where(m, _vals(on_true).reshape(P, F), fal).astype(np.float32)
    _store(dst, sel)
    if reduce_cmd is not _RC.idle or reduce_res is not None:
        acc = _accumulate(launch, reduce_cmd, sel.max(axis=1), P, op)
        if reduce_res is not None:
            _store(reduce_res, acc.reshape(reduce_res.shape))
    return NkiInstruction(op)


# ------------------------------------------------------------------------------------------ top-8 search


def _search_src(op: str, t: NkiTensor, arg: str) -> int:
    f = _free(t)
    if not 8 <= f <= 16384 or t.ndim > 3:
        raise ShapeMismatchError(
            f"[search-shape] {op}: {arg}{list(t.shape)} must be up to 3-D with 8..16384 elements per "
            "partition"
        )
    return f


def _eight(op: str, t: NkiTensor, p: int, arg: str) -> None:
    if t.ndim != 2 or t.shape != (p, 8):
        raise ShapeMismatchError(f"[search-shape] {op}: {arg}{list(t.shape)} must be [{p}, 8]")


def max8(dst: NkiTensor, src: NkiTensor, name: Any = None) -> NkiInstruction:
    """``dst[P, 8]`` = the 8 largest values of each partition of ``src`` (8..16384 elements, up to 3-D),
    descending, compared in fp32 and cast to ``dst.dtype``."""
    launch = _state.current()
    op = "max8"
    _checked(op, launch, ("dst", dst), ("src", src))
    F = _search_src(op, src, "src")
    P = src.shape[0]
    _eight(op, dst, P, "dst")
    _record(op, "vector", (dst, src), launch, flops=src.size)
    if not launch.trace_only:
        x = _vals(src).reshape(P, F)
        _store(dst, -np.sort(-x, axis=1, kind="stable")[:, :8])
    return NkiInstruction(op)


def _first_matches(x: np.ndarray, vals: np.ndarray, order: range) -> np.ndarray:
    """Per row, for each val column in ``order``: the first position of x equal to it not already taken
    by an earlier column of the same value (-1 when none)."""
    P, F = x.shape
    idx = np.full(vals.shape, -1, dtype=np.int64)
    for p in range(P):
        taken: set[int] = set()
        for j in order:
            hits = np.flatnonzero(x[p] == vals[p, j])
            free = [h for h in hits.tolist() if h not in taken]
            if free:
                idx[p, j] = free[0]
                taken.add(free[0])
    return idx


def nc_find_index8(dst: NkiTensor, data: NkiTensor, vals: NkiTensor, name: Any = None) -> NkiInstruction:
    """``dst[P, 8]`` (uint32 or uint16) = index of the first occurrence in ``data`` (8..16384 elements per
    partition, fp32 compare) of each of the 8 ``vals``; a duplicate val takes the next occurrence (ascending
    across columns); a missing val gives all ones (0xFFFFFFFF / 0xFFFF)."""
    launch = _state.current()
    op = "nc_find_index8"
    _checked(op, launch, ("dst", dst), ("data", data), ("vals", vals))
    F = _search_src(op, data, "data")
    P = data.shape[0]
    _eight(op, dst, P, "dst")
    if vals.shape[0] != P or _free(vals) != 8:
        raise ShapeMismatchError(
            f"[search-shape] {op}: vals{list(vals.shape)} must hold 8 values per partition"
        )
    if dst.dtype not in ("uint32", "uint16"):
        raise DtypeError(f"[search-dtype] {op}: dst must be uint32 or uint16, got {dst.dtype}")
    _record(op, "vector", (dst, data, vals), launch, flops=8 * data.size)
    if not launch.trace_only:
        idx = _first_matches(_vals(data).reshape(P, F), _vals(vals).reshape(P, 8), range(8))
        ones = np.iinfo(np.uint32 if dst.dtype == "uint32" else np.uint16).max
        dst.write(np.where(idx < 0, ones, idx).astype(_dt.storage_dtype(dst.dtype)).reshape(dst.shape))
    return NkiInstruction(op)


def nc_match_replace8(
    dst: NkiTensor,
    data: NkiTensor,
    vals: NkiTensor,
    imm: float,
    dst_idx: NkiTensor | None = None,
    name: Any = None,
) -> NkiInstruction:
    """``dst`` = ``data`` with the first occurrence of each of the 8 ``vals`` replaced by ``imm`` (vals taken
    in reverse order i = 7..0, so duplicates fill ``dst_idx`` columns in descending position order); the
    matched positions go to ``dst_idx [P, 8]`` when given (all ones where a val is missing)."""
    launch = _state.current()
    op = "nc_match_replace8"
    _checked(op, launch, ("dst", dst), ("data", data), ("vals", vals), ("dst_idx", dst_idx))
    F = _search_src(op, data, "data")
    P = data.shape[0]
    _same_pf(op, dst, "dst", data, "data")
    if vals.shape[0] != P or _free(vals) != 8:
        raise ShapeMismatchError(
            f"[search-shape] {op}: vals{list(vals.shape)} must hold 8 values per partition"
        )
    if dst_idx is not None:
        _eight(op, dst_idx, P, "dst_idx")
    ts = (dst, data, vals) + ((dst_idx,) if dst_idx is not None else ())
    _record(op, "vector", ts, launch, flops=8 * data.size)
    if not launch.trace_only:
        x = _vals(data).reshape(P, F)
        idx = _first_matches(x, _vals(vals).reshape(P, 8), range(7, -1, -1))
        y = x.copy()
        rows, cols = np.nonzero(idx >= 0)
        y[rows, idx[rows, cols]] = np.float32(imm)
        _store(dst, y)
        if dst_idx is not None:
            ones = np.iinfo(_dt.storage_dtype(dst_idx.dtype)).max if _dt.is_int(dst_idx.dtype) else -1
            dst_idx.write(_dt.cast(np.where(idx < 0, ones, idx), dst_idx.dtype).reshape(dst_idx.shape))
    return NkiInstruction(op)


# ------------------------------------------------------------------------------------------ shuffle


def nc_stream_shuffle(dst: NkiTensor, src: NkiTensor, shuffle_mask: Any, name: Any = None) -> NkiInstruction:
    """Cross-partition move inside each 32-partition quadrant (VectorE): output partition ``32q + i``
    (relative to dst's start) = src partition ``32q + shuffle_mask[i]`` (relative to src's start); ``255``
    leaves it unmodified.  Same dtype and elements per partition; SBUF or PSUM either side; in place allowed.
    Start partitions follow the start-partition rule with
    ``num_active = ceil(max(src, dst partitions)/32)*32``."""
    launch = _state.current()
    op = "nc_stream_shuffle"
    for t, a in ((dst, "dst"), (src, "src")):
        _onchip(t, op, a, launch)
    mask = [int(m) for m in shuffle_mask]
    if len(mask) != 32 or any(not (0 <= m < 32 or m == 255) for m in mask):
        raise ValueError(f"{op}: shuffle_mask must be 32 ints in [0, 32) or 255, got {shuffle_mask!r}")
    if dst.dtype != src.dtype:
        raise DtypeError(f"[shuffle-dtype] {op}: dst dtype {dst.dtype} must equal src dtype {src.dtype}")
    if _free(dst) != _free(src):
        raise ShapeMismatchError(
            f"[free-size-mismatch] {op}: elements per partition differ: dst{list(dst.shape)}, "
            f"src{list(src.shape)}"
        )
    ps, pd = src.shape[0], dst.shape[0]
    active = math.ceil(max(ps, pd) / 32) * 32
    pmax = launch.hw.pmax
    _sp.check(op, "src", src, pmax, num_partitions=min(active, pmax))
    _sp.check(op, "dst", dst, pmax, num_partitions=min(active, pmax))
    for j in range(pd):
        q, i = divmod(j, 32)
        if mask[i] != 255 and 32 * q + mask[i] >= ps:
            raise ShapeMismatchError(
                f"[shuffle-source] {op}: dst partition {j} reads src partition {32 * q + mask[i]} "
                f"(shuffle_mask[{i}] = {mask[i]}) but src{list(src.shape)} has {ps} partitions"
            )
    _record(op, "vector", (dst, src), launch, flops=0, meta=(("mask", tuple(mask)),))
    if not launch.trace_only:
        x = np.asarray(src.read()).reshape(ps, -1)
        y = np.asarray(dst.read()).reshape(pd, -1).copy()
        for j in range(pd):
            q, i = divmod(j, 32)
            if mask[i] != 255:
                y[j] = x[32 * q + mask[i]]
        dst.write(y.reshape(dst.shape))
        if dst._st.written is not None:
            dst.written_mask_view()[...] = False
    return NkiInstruction(op)


__all__ = [
    "bn_aggr",
    "bn_stats",
    "max8",
    "nc_find_index8",
    "nc_match_replace8",
    "nc_stream_shuffle",
    "range_select",
    "select_reduce",
    "tensor_scalar_cumulative",
    "tensor_tensor_scan",
]
