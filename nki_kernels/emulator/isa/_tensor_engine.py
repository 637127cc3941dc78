"""TensorE instructions: ``nc_matmul``, ``nc_transpose``."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import dtypes as _dt
from .. import start_partition as _sp
from .. import state as _state
from ..errors import (
    DtypeError,
    MatmulTileError,
    MemorySpaceError,
    PsumLimitError,
    ShapeMismatchError,
)
from ..tensor import NkiTensor, psum, sbuf
from ._common import _count, _count_checked, _emit, _rec, _vals
from ._enums import _E, _ENGINE_TRACE_ID, NkiInstruction, engine, matmul_perf_mode
from ._events import _log, _use_rw
from ._rules import _free, _onchip, _pick_engine

_FP8_E4M3_PAIR = ("float8_e4m3", "float8_e4m3fn")
# --------------------------------------------------------------------------------------------- TensorE


def nc_matmul(
    dst: NkiTensor,
    stationary: NkiTensor,
    moving: NkiTensor,
    is_stationary_onezero: bool = False,
    is_moving_onezero: bool = False,
    is_transpose: bool = False,
    accumulate: bool | None = None,
    tile_position: Any = (),
    tile_size: Any = (),
    perf_mode: matmul_perf_mode = matmul_perf_mode.none,
    name: Any = None,
) -> NkiInstruction:
    """``dst[M, N] (PSUM) (+)= stationary[K, M].T @ moving[K, N]`` on TensorE, fp32 accumulation.

    K (partition dim of both operands) <= 128; M = stationary free size <= 128; N = moving free size
    <= 512 (free dims are flattened); operands in SBUF, dst in PSUM within one 2 KiB bank.
    ``accumulate=False`` overwrites, ``True`` adds (warns where the PSUM element was never written by a
    matmul), ``None`` overwrites elements never written by a matmul and adds onto the others.  A
    non-matmul write (tensor_copy, memset, activation...) to PSUM resets that 'written' state.
    """
    launch = _state.current()
    fkey = None
    if (
        launch.trace_only
        and type(dst) is NkiTensor
        and type(stationary) is NkiTensor
        and type(moving) is NkiTensor
        and (is_transpose is False or is_transpose is True)
        and (accumulate is None or accumulate is False or accumulate is True)
    ):
        dst_st = dst._st
        # the psum-bank check reads dst's offset inside its partition, its shape, strides and dtype; the
        # transpose-mode check reads accumulate; the start-partition rule reads every operand's start
        # partition (divmod: partition, offset inside it); the FP8 rules read perf_mode
        fkey = ("nc_matmul", dst.shape, dst.strides, divmod(dst.offset, dst_st.size // dst_st.shape[0]),
                dst.dtype, dst_st.buffer, stationary.shape, stationary.dtype, stationary._st.buffer,
                moving.shape, moving.dtype, moving._st.buffer, is_transpose, accumulate,
                stationary.offset // (stationary._st.size // stationary._st.shape[0]),
                moving.offset // (moving._st.size // moving._st.shape[0]),
                perf_mode is matmul_perf_mode.double_row)  # fmt: skip
        if _count_checked(launch, fkey):
            _use_matmul(launch, dst, stationary, moving, is_transpose, accumulate)
            return NkiInstruction("nc_matmul")
    hw = launch.hw
    op = "nc_matmul"
    if type(dst) is not NkiTensor or type(stationary) is not NkiTensor or type(moving) is not NkiTensor:
        for t, a in ((dst, "dst"), (stationary, "stationary"), (moving, "moving")):
            if not isinstance(t, NkiTensor):
                raise TypeError(f"nc_matmul: {a} must be an NkiTensor, got {type(t).__name__}")
    if stationary._st.buffer is not sbuf or moving._st.buffer is not sbuf:
        bad = stationary if stationary._st.buffer is not sbuf else moving
        raise MemorySpaceError(
            f"[memory-space] nc_matmul: operands must be in SBUF, {bad._desc()} is in {bad._st.buffer.name}"
        )
    if dst._st.buffer is not psum:
        raise MemorySpaceError(
            f"[memory-space] nc_matmul: dst={dst._desc()} must be in PSUM, is in {dst._st.buffer.name}"
        )
    _sp.check_all(op, hw.pmax, ("dst", dst), ("stationary", stationary), ("moving", moving))
    ss = stationary.shape
    ms = moving.shape
    ds = dst.shape
    K = ss[0]
    M = ss[1] if len(ss) == 2 else math.prod(ss[1:])
    N = ms[1] if len(ms) == 2 else math.prod(ms[1:])
    double = perf_mode is matmul_perf_mode.double_row
    if double or perf_mode is not matmul_perf_mode.none:
        K, M, N = _double_row_dims(stationary, moving, perf_mode, is_transpose, tile_size, hw.nc_version)
    pmax = hw.pmax
    if pmax < ss[0] or ms[0] > pmax:
        raise MatmulTileError(
            f"[matmul-contraction] nc_matmul: contraction (partition) dim must be <= {hw.pmax}: stationary "
            f"{list(stationary.shape)}, moving {list(moving.shape)}"
        )
    if ms[0] != ss[0]:
        raise MatmulTileError(
            f"[matmul-contraction] nc_matmul: stationary{list(stationary.shape)} and "
            f"moving{list(moving.shape)} "
            "must have the same contraction (partition) size"
        )
    if hw.gemm_stationary_fmax < M:
        raise MatmulTileError(
            f"[matmul-stationary] nc_matmul: stationary free size {M} (shape {list(stationary.shape)}) "
            "exceeds "
            f"gemm_stationary_fmax={hw.gemm_stationary_fmax}"
        )
    if hw.gemm_moving_fmax < N:
        raise MatmulTileError(
            f"[matmul-moving] nc_matmul: moving free size {N} (shape {list(moving.shape)}) exceeds "
            f"gemm_moving_fmax={hw.gemm_moving_fmax}"
        )
    if ds[0] != M or (ds[1] if len(ds) == 2 else math.prod(ds[1:])) != N:
        raise ShapeMismatchError(
            f"[matmul-dst] nc_matmul: dst{list(dst.shape)} must be [{M}, {N}] for stationary"
            f"{list(stationary.shape)} and moving{list(moving.shape)}"
        )
    lo, hi = dst.partition_bytes_range()
    if lo // hw.psum_bank_bytes != hi // hw.psum_bank_bytes:
        raise PsumLimitError(
            f"[psum-bank] nc_matmul: dst {dst._desc()} {dst.dtype} spans bytes [{lo}, {hi}] of each "
            "partition, "
            f"crossing a {hw.psum_bank_bytes} B PSUM bank boundary (a matmul tile must fit in one bank)"
        )
    sdt = stationary.dtype
    mdt = moving.dtype
    if sdt != mdt:  # equal dtypes always pair
        f32ish = ("float32", "tfloat32")
        if (sdt in f32ish) != (mdt in f32ish):
            raise DtypeError(
                f"[matmul-dtype] nc_matmul: fp32/tf32 operands only pair with each other, got stationary "
                f"{sdt} and moving {mdt}"
            )
        if sdt in _FP8_E4M3_PAIR and mdt in _FP8_E4M3_PAIR:
            raise DtypeError("[matmul-dtype] nc_matmul: float8_e4m3 and float8_e4m3fn cannot be mixed")
    if is_transpose:
        _transpose_mode_rules(dst, stationary, moving, K, M, N, accumulate)
    elif dst.dtype != "float32" and not (hw.nc_version >= 4 and dst.dtype == "bfloat16"):
        raise DtypeError(f"[matmul-dtype] nc_matmul: dst dtype must be float32 (got {dst.dtype})")
    if accumulate is not None and type(accumulate) is not bool and not isinstance(accumulate, np.bool_):
        raise TypeError(f"nc_matmul: accumulate must be None, True or False, got {accumulate!r}")
    key = (op, ds, dst.dtype, ss, sdt, ms, mdt, launch.program_id, bool(is_transpose), double)
    perf = (("perf_mode", "double_row"),) if double else ()
    ent = launch.records.get(key)
    if ent is None:
        _emit(
            launch,
            key,
            lambda: _rec(
                op, "tensor", (dst, stationary, moving), launch, flops=2 * K * M * N,
                meta=(("K", K), ("M", M), ("N", N), ("dtype", mdt), ("is_transpose", bool(is_transpose)))
                + perf,
            ),
        )  # fmt: skip
    else:
        ent[1] += 1
        if launch.keep_order:
            launch.note(ent[0])
    _use_matmul(launch, dst, stationary, moving, is_transpose, accumulate)
    if fkey is not None:
        launch.checked[fkey] = launch.records[key]
    if launch.trace_only:
        return NkiInstruction(op)
    b = _vals(moving).reshape(K, N)
    if is_transpose:
        if not np.array_equal(b, np.eye(K, dtype=np.float32)):
            bad = np.argwhere(b != np.eye(K, dtype=np.float32))[:4].tolist()
            raise MatmulTileError(
                f"[matmul-transpose] nc_matmul(is_transpose=True): moving{list(moving.shape)} must be the "
                f"[{K}, {K}] identity (transpose mode loads the data as stationary and streams an identity); "
                f"entries (row, col) {bad} differ"
            )
        if hw.nc_version >= 3:  # bit-accurate pass-through: dst = stationary.T, bits unchanged (NaN/Inf too)
            v = np.asarray(stationary.read()).reshape(K, M).T
            dst.write(np.ascontiguousarray(v).reshape(dst.shape))
            wm = dst.written_mask_view()
            if wm is not None:
                wm[...] = True
            return NkiInstruction(op)
    a = _vals(stationary).reshape(K, M)
    res = (a.T @ b).astype(np.float32).reshape(dst.shape)
    wm = dst.written_mask_view()
    if accumulate is False or wm is None:
        out = res
    else:
        cur = _dt.to_fp32(np.asarray(dst.read()))
        if accumulate is True:
            if not wm.all():
                _state.warn(
                    f"nc_matmul accumulate=True onto PSUM {dst._desc()} elements never written by a matmul "
                    "(undefined on hardware)"
                )
            out = cur + res
        else:
            out = np.where(wm, cur + res, res)
    dst.write(_dt.cast(out, dst.dtype))
    if wm is not None:
        wm[...] = True
    return NkiInstruction(op)


def _use_matmul(
    launch: Any, dst: NkiTensor, stationary: NkiTensor, moving: NkiTensor, is_transpose: Any, accumulate: Any
) -> None:
    """Access of one matmul (hot path, inlined): liveness stamps of its three operands; its event reads dst
    too where it may add onto it (accumulate True or None, not in transpose mode).  An out-of-bounds ``.ap``
    operand is refused here (trace-only runs read no values)."""
    if stationary._oob is not None or moving._oob is not None or dst._oob is not None:
        for t in (stationary, moving, dst):
            t.check_in_bounds()
    n = launch.seq = launch.seq + 1
    live = stationary._st.live
    if live[0] < 0:
        live[1] = n
    live[0] = n
    live = moving._st.live
    if live[0] < 0:
        live[1] = n
    live[0] = n
    live = dst._st.live
    if live[0] < 0:
        live[1] = n
    live[0] = n
    if launch.keep_events:
        acc = accumulate is not False and not is_transpose
        _log(launch, (stationary, moving, dst) if acc else (stationary, moving), (dst,))


def _transpose_mode_rules(
    dst: NkiTensor, stationary: NkiTensor, moving: NkiTensor, K: int, M: int, N: int, accumulate: Any
) -> None:
    """``nc_matmul(is_transpose=True)`` contract (NKI 0.6 docstring "Transpose mode"): the data is the
    stationary tile and the moving tile is an identity, so ``dst[M, K] = stationary[K, M].T``, bit-exact
    from NeuronCore-v3 (the instruction ``nc_transpose`` lowers to). Shape/dtype rules are checked in every
    mode; the identity values are checked when values exist (not in trace-only mode)."""
    if N != K:
        raise MatmulTileError(
            f"[matmul-transpose] nc_matmul(is_transpose=True): moving{list(moving.shape)} must be a square "
            f"[{K}, {K}] identity matching stationary{list(stationary.shape)}'s {K} partitions (free size "
            f"{N} != {K})"
        )
    if dst.dtype != stationary.dtype:
        raise DtypeError(
            f"[matmul-transpose] nc_matmul(is_transpose=True) passes the data through: dst dtype {dst.dtype} "
            "must "
            f"equal stationary dtype {stationary.dtype} (as nc_transpose)"
        )
    if accumulate is True:
        raise MatmulTileError(
            "[matmul-transpose] nc_matmul(is_transpose=True) is a data transpose (pass-through), it cannot "
            "accumulate=True onto PSUM"
        )


def nc_transpose(
    dst: NkiTensor, data: NkiTensor, engine: engine = engine.unknown, name: Any = None
) -> NkiInstruction:
    """``dst[F, P] = data[P, F]`` (free dims of data flattened).  TensorE: <= 128x128, SBUF -> PSUM;
    VectorE: <= 32x32, SBUF/PSUM either side.  dst.dtype must equal data.dtype."""
    launch = _state.current()
    fkey = None
    if launch.trace_only and type(dst) is NkiTensor and type(data) is NkiTensor:
        # start partitions are part of the key: the start-partition rule reads them
        fkey = ("nc_transpose", id(engine), dst.shape, dst.dtype, dst._st.buffer, data.shape, data.dtype,
                data._st.buffer, dst.offset // (dst._st.size // dst._st.shape[0]),
                data.offset // (data._st.size // data._st.shape[0]))  # fmt: skip
        if _count_checked(launch, fkey):
            _use_rw(launch, data, dst)
            return NkiInstruction("nc_transpose")
    hw = launch.hw
    op = "nc_transpose"
    pmax = hw.pmax
    if not (  # fast path of _rules._onchip
        type(dst) is NkiTensor
        and dst._st.buffer.on_chip
        and dst.shape[0] <= pmax
        and dst.offset < dst._st.size // dst._st.shape[0]  # start partition 0
    ):
        _onchip(dst, op, "dst", launch)
    if not (  # fast path of _rules._onchip
        type(data) is NkiTensor
        and data._st.buffer.on_chip
        and data.shape[0] <= pmax
        and data.offset < data._st.size // data._st.shape[0]  # start partition 0
    ):
        _onchip(data, op, "data", launch)
    P = data.shape[0]
    F = _free(data)
    if engine is None or engine is _E.unknown:
        eng = _E.tensor if (dst._st.buffer is psum and data._st.buffer is sbuf) else _E.vector
    else:
        eng = _pick_engine(engine, _E.tensor, op, (_E.tensor, _E.vector))
    if dst.shape[0] != F or _free(dst) != P:
        raise ShapeMismatchError(
            f"[transpose-shape] nc_transpose: dst{list(dst.shape)} must be [{F}, {P}] for "
            f"data{list(data.shape)}"
        )
    if dst.dtype != data.dtype:
        raise DtypeError(
            f"[transpose-dtype] nc_transpose: dst dtype {dst.dtype} must equal data dtype {data.dtype}"
        )
    if eng is _E.tensor:
        lim = hw.transpose_pe_max
        if data._st.buffer is not sbuf or dst._st.buffer is not psum:
            raise MemorySpaceError(
                f"[memory-space] nc_transpose on TensorE reads SBUF and writes PSUM: data in "
                f"{data._st.buffer.name}, dst in {dst._st.buffer.name}"
            )
    else:
        lim = hw.transpose_vector_max
    if lim < P or lim < F:
        raise MatmulTileError(
            f"[transpose-size] nc_transpose on {eng.name} engine handles at most {lim}x{lim}, got "
            f"data{list(data.shape)}"
        )
    en = _ENGINE_TRACE_ID[id(eng)]
    key = (
        op,
        en,
        dst.shape,
        dst.dtype,
        dst._st.buffer,
        data.shape,
        data.dtype,
        data._st.buffer,
        launch.program_id,
    )
    if not _count(launch, key):
        meta = (
            (("K", P), ("M", F), ("N", P), ("dtype", data.dtype), ("is_transpose", True))
            if eng is _E.tensor
            else ()
        )
        _emit(
            launch,
            key,
            lambda: _rec(
                op, en, (dst, data), launch, flops=2 * P * F * P if eng is _E.tensor else 0, meta=meta
            ),
        )
    _use_rw(launch, data, dst)
    if fkey is not None:
        launch.checked[fkey] = launch.records[key]
    if not launch.trace_only:
        v = np.asarray(data.read()).reshape(P, F).T
        dst.write(np.ascontiguousarray(v).reshape(dst.shape))
        if dst._st.written is not None:
            dst.written_mask_view()[...] = True
    return NkiInstruction(op)


_DOUBLE_ROW_FP8 = ("float8_e4m3", "float8_e5m2")


def _double_row_dims(
    stationary: NkiTensor,
    moving: NkiTensor,
    perf_mode: Any,
    is_transpose: Any,
    tile_size: Any,
    nc_version: int,
) -> tuple[int, int, int]:
    """``(K, M, N)`` of an FP8 double-row matmul (NKI 0.6 ``nc_matmul`` docstring, trn2 architecture guide
    "double FP8"): stationary ``[Kp, 2, M]``, moving ``[Kp, 2, N]`` (the contraction is split between the
    partition dim and a first free dim of exactly 2: ``K = 2 * Kp``, up to ``[128, 2, 128] x [128, 2, 512]``),
    both float8_e4m3 / float8_e5m2 (+ float8_e4m3fn from NeuronCore-v4), NeuronCore-v3+, not with transpose
    mode or column tiling.  The product is the plain ``stationary.reshape(K, M).T @ moving.reshape(K, N)``."""
    if type(perf_mode) is not matmul_perf_mode:
        raise TypeError(f"nc_matmul: perf_mode must be an nisa.matmul_perf_mode member, got {perf_mode!r}")
    if nc_version < 3:
        raise MatmulTileError(
            "[matmul-double-row] nc_matmul: perf_mode=double_row needs NeuronCore-v3+ "
            f"(nc_version={nc_version})"
        )
    if is_transpose:
        raise MatmulTileError(
            "[matmul-double-row] nc_matmul: perf_mode=double_row cannot be combined with is_transpose"
        )
    if tile_size and len(tuple(tile_size)) == 2 and int(tuple(tile_size)[1]) != 128:
        raise MatmulTileError(
            "[matmul-double-row] nc_matmul: perf_mode=double_row cannot use column tiling "
            f"(tile_size={tile_size})"
        )
    ss, ms = stationary.shape, moving.shape
    if len(ss) != 3 or len(ms) != 3 or ss[1] != 2 or ms[1] != 2:
        raise MatmulTileError(
            f"[matmul-double-row] nc_matmul: perf_mode=double_row needs stationary [K/2, 2, M] and moving "
            f"[K/2, 2, N] (first free dim exactly 2), got stationary{list(ss)} and moving{list(ms)}"
        )
    ok = _DOUBLE_ROW_FP8 + (("float8_e4m3fn",) if nc_version >= 4 else ())
    for t, a in ((stationary, "stationary"), (moving, "moving")):
        if t.dtype not in ok:
            raise DtypeError(
                f"[matmul-double-row] nc_matmul: perf_mode=double_row needs {a} in {list(ok)}, got {t.dtype}"
            )
    return 2 * ss[0], ss[2], ms[2]
