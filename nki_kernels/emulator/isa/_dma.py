"""DMA instructions: ``dma_copy``, ``dma_transpose``, and the descriptor split (``dma_descriptors``)."""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import numpy as np

from .. import dtypes as _dt
from .. import state as _state
from ..errors import (
    DmaTransposeError,
    DtypeError,
    MemorySpaceError,
    PartitionLimitError,
    ShapeMismatchError,
)
from ..tensor import NkiTensor, psum, sbuf
from ..trace import TraceRecord
from ._common import _count, _emit
from ._enums import _DGE, _OOB, NkiInstruction, dge_mode, engine, oob_mode
from ._events import _use, _use_rw

_DMA_TRANSPOSE_AXES = ((1, 0), (2, 1, 0), (3, 1, 2, 0))
# --------------------------------------------------------------------------------------------- DMA


@lru_cache(maxsize=65536)
def _run_len(shape: tuple, strides: tuple, onchip: bool) -> int:
    run = 1
    expect = 1
    stop = 1 if onchip else 0
    for k in range(len(shape) - 1, stop - 1, -1):
        n = shape[k]
        if n == 1:
            continue
        if strides[k] != expect:
            break
        run *= n
        expect *= n
    return run


@lru_cache(maxsize=65536)
def _joint_runs(total: int, la: int, lb: int, isz: int) -> tuple[tuple[int, int], ...]:
    if la % lb == 0 or lb % la == 0:
        m = min(la, lb)
        return ((m * isz, total // m),)
    lcm = la * lb // math.gcd(la, lb)
    if lcm > total:
        lcm = total
    pts = sorted(set(range(0, lcm + 1, la)) | set(range(0, lcm + 1, lb)) | {lcm})
    hist: dict[int, int] = {}
    for a, b in zip(pts, pts[1:]):
        hist[b - a] = hist.get(b - a, 0) + 1
    reps = total // lcm
    return tuple(sorted((k * isz, v * reps) for k, v in hist.items()))


def dma_descriptors(dst: NkiTensor, src: NkiTensor) -> tuple[tuple[int, int], ...]:
    """Descriptor histogram ``((run_bytes, count), ...)`` of a DMA ``src -> dst``.

    A descriptor is a maximal run of elements that is contiguous on both sides (an on-chip side never
    merges across partitions); bytes are counted on the HBM side (src if both or neither are HBM).
    """
    total = src.size
    ls = _run_len(src.shape, src.strides, src._st.buffer.on_chip)
    ld = _run_len(dst.shape, dst.strides, dst._st.buffer.on_chip)
    side = dst if (not dst._st.buffer.on_chip and src._st.buffer.on_chip) else src
    return _joint_runs(total, ls, ld, side.itemsize)


def _direction(dst: NkiTensor, src: NkiTensor) -> str:
    a = "sbuf" if src._st.buffer.on_chip else "hbm"
    b = "sbuf" if dst._st.buffer.on_chip else "hbm"
    return f"{a}->{b}"


def _dma_reads(dst: NkiTensor, src: NkiTensor) -> tuple:
    """What a DMA reads: its source, plus the runtime index tensor of a ``.ap(scalar_offset=/vector_offset=)``
    view on either side (the DGE reads it to address the transfer)."""
    if src._dyn is None and dst._dyn is None:
        return (src,)
    idx = tuple(t._dyn[1] for t in (src, dst) if t._dyn is not None and isinstance(t._dyn[1], NkiTensor))
    return (src, *idx)


def _dma_record(op: str, dst: NkiTensor, src: NkiTensor, launch: _state.Launch, meta: tuple = ()) -> None:
    key = (op, dst.shape, dst.strides, dst.dtype, dst._st.buffer, src.shape, src.strides, src.dtype,
           src._st.buffer, dst._dyn is None, src._dyn is None, launch.program_id, meta)  # fmt: skip
    if _count(launch, key):
        if src._dyn is None and dst._dyn is None:
            _use_rw(launch, src, dst)
        else:
            _use(launch, _dma_reads(dst, src), (dst,))
        return

    def make() -> TraceRecord:
        onchip = dst if dst._st.buffer.on_chip else (src if src._st.buffer.on_chip else None)
        parts = onchip.shape[0] if onchip is not None else 0
        n = src.size
        m = meta
        if dst._dyn is not None or src._dyn is not None:
            m = m + (("indirect", (dst._dyn or src._dyn)[0]),)
        return TraceRecord(
            op=op,
            engine="dma",
            shapes=(dst.shape, src.shape),
            dtypes=(dst.dtype, src.dtype),
            buffers=(dst._st.buffer.trace_name, src._st.buffer.trace_name),
            partitions=parts,
            free_elems=n // parts if parts else n,
            bytes_read=n * src.itemsize,
            bytes_written=n * dst.itemsize,
            descriptors=(
                dma_descriptors(dst, src)
                if op != "dma_transpose"
                else (
                    (
                        _run_len(src.shape, src.strides, src._st.buffer.on_chip) * src.itemsize,
                        n // _run_len(src.shape, src.strides, src._st.buffer.on_chip),
                    ),
                )
            ),  # fmt: skip
            direction=_direction(dst, src),
            program_id=launch.program_id,
            meta=tuple(sorted(m)),
        )

    _emit(launch, key, make)
    if src._dyn is None and dst._dyn is None:
        _use_rw(launch, src, dst)
    else:
        _use(launch, _dma_reads(dst, src), (dst,))


def dge_member(mode: Any, op: str) -> dge_mode:
    """``mode`` as an ``nisa.dge_mode`` member: the member itself or its integer value (0 unknown, 1 swdge,
    2 hwdge, 3 none; nki-library passes the values, e.g. ``dge_mode=3`` for a static-descriptor DMA, and
    runs on hardware); anything else is refused."""
    if type(mode) is _DGE:
        return mode
    if type(mode) is int and mode in _DGE_VALUES:
        return _DGE(mode)
    raise TypeError(f"{op}: dge_mode must be an nisa.dge_mode member or its value (0-3), got {mode!r}")


_DGE_VALUES = frozenset(m.value for m in _DGE)


def dma_copy(
    dst: NkiTensor,
    src: NkiTensor,
    priority: Any = None,
    oob_mode: oob_mode = oob_mode.error,
    dge_mode: dge_mode = dge_mode.unknown,
    engine: engine = engine.unknown,
    name: Any = None,
) -> NkiInstruction:
    """``dst = src`` through a DMA queue (HBM<->SBUF, HBM->HBM, SBUF->SBUF; never from PSUM).

    Element counts must match (shapes may differ: elements are paired in row-major view order).
    Converts through fp32 unless ``dge_mode=hwdge`` (then dtypes must match).  Runtime-indexed views
    (``.ap(scalar_offset=/vector_offset=)``) out of bounds raise, or with ``oob_mode=skip`` drop the
    transfer (scalar offset) or the offending rows (vector offset).
    """
    launch = _state.current()
    op = "dma_copy"
    if type(dst) is not NkiTensor or type(src) is not NkiTensor:
        for t, a in ((dst, "dst"), (src, "src")):
            if not isinstance(t, NkiTensor):
                raise TypeError(f"{op}: {a} must be an NkiTensor, got {type(t).__name__}")
    if src._st.buffer is psum:
        raise MemorySpaceError(
            f"[memory-space] dma_copy: src={src._desc()} is in PSUM; DMA cannot read PSUM since NKI 0.3.0 "
            "(copy PSUM->SBUF with nisa.tensor_copy first)"
        )
    if dst._st.buffer is psum:
        raise MemorySpaceError(
            f"[memory-space] dma_copy: dst={dst._desc()} is in PSUM; DMA moves HBM/SBUF only"
        )
    if dst.shape != src.shape and dst.size != src.size:
        raise ShapeMismatchError(
            f"[dma-size] dma_copy: element counts differ: dst{list(dst.shape)} has {dst.size}, "
            f"src{list(src.shape)} has {src.size}"
        )
    pmax = launch.hw.pmax
    if (dst._st.buffer.on_chip and dst.shape[0] > pmax) or (src._st.buffer.on_chip and src.shape[0] > pmax):
        for t, a in ((dst, "dst"), (src, "src")):
            if t._st.buffer.on_chip and t.shape[0] > pmax:
                raise PartitionLimitError(
                    f"[partition-limit] dma_copy: {a}={t._desc()} exceeds {launch.hw.pmax} partitions"
                )
    if type(oob_mode) is not _OOB:
        raise TypeError(f"dma_copy: oob_mode must be an nisa.oob_mode member, got {oob_mode!r}")
    dge_mode = dge_member(dge_mode, op)
    if dge_mode is _DGE.hwdge and dst.dtype != src.dtype:
        raise DtypeError(
            f"[dma-dtype] dma_copy with dge_mode=hwdge needs equal dtypes, got dst {dst.dtype} / src "
            f"{src.dtype} (use .view() or swdge)"
        )
    _dma_record(op, dst, src, launch)
    if launch.trace_only:
        return NkiInstruction(op)
    skip = oob_mode is _OOB.skip
    vals = src.read(oob_skip=skip)
    if vals is None:
        return NkiInstruction(op)
    vals = np.asarray(vals)
    if src._dyn is not None and src._dyn[0] == "vector" and skip:
        # rows skipped on read keep dst's old values
        idx = src.flat_indices(oob_skip=True)
        ok = (idx >= 0).reshape(src.shape[0], -1).all(axis=1)
        if not ok.all():
            old = np.asarray(dst.read()).reshape(src.shape[0], -1).copy()
            new = _cast_dma(vals, dst.dtype, src.dtype).reshape(src.shape[0], -1)
            new[~ok] = old[~ok]
            dst.write(new.reshape(dst.shape))
            return NkiInstruction(op)
    dst.write(_cast_dma(vals, dst.dtype, src.dtype).reshape(dst.shape), oob_skip=skip)
    return NkiInstruction(op)


def _cast_dma(vals: np.ndarray, dst_dtype: str, src_dtype: str) -> np.ndarray:
    if dst_dtype == src_dtype:
        return np.array(vals, copy=True)
    if _dt.is_int(dst_dtype) and _dt.is_int(src_dtype):
        return _dt.cast(vals, dst_dtype)
    return _dt.cast(_dt.to_fp32(vals), dst_dtype)


def _dma_transpose_rules(
    dst: Any, src: Any, axes: Any, dge_mode: Any, oob_mode: Any, launch: _state.Launch, hwdge_shape: bool
) -> tuple[int, ...]:
    """Check the NKI 0.6 ``dma_transpose`` contract; returns the permutation. Messages start with the rule.

    A direct transpose under ``dge_mode.hwdge`` must meet the hardware-DGE rules (source shape, 2-byte
    dtype); under ``dge_mode.unknown`` the compiler chooses, so it is legal when either lowering is
    (:func:`direct_transpose_lowering`).  ``hwdge_shape=False`` (``nl.load_transpose2d``, whose lowering the
    compiler chooses) never applies the hardware-DGE source-shape rule.
    """
    op = "dma_transpose"
    for t, a in ((dst, "dst"), (src, "src")):
        if not isinstance(t, NkiTensor):
            raise TypeError(f"{op}: {a} must be an NkiTensor, got {type(t).__name__}")
    dge_mode = dge_member(dge_mode, op)
    if type(oob_mode) is not _OOB:
        raise TypeError(f"{op}: oob_mode must be an nisa.oob_mode member, got {oob_mode!r}")
    if dst._st.buffer is not sbuf:
        raise MemorySpaceError(f"[memory-space] dma_transpose: dst={dst._desc()} must be in SBUF")
    if src._st.buffer is psum:
        raise MemorySpaceError(f"[memory-space] dma_transpose: src={src._desc()} cannot be in PSUM")
    nd = len(src.shape)
    axes = _DEFAULT_AXES.get(nd, tuple(range(nd - 1, -1, -1))) if axes is None else tuple(map(int, axes))
    if axes not in _DMA_TRANSPOSE_AXES or len(axes) != nd:
        raise DmaTransposeError(
            f"[dma-transpose-axes] axes {axes} not supported for a {nd}-D src{list(src.shape)}; NKI 0.6 "
            "allows (1, 0) for 2-D, (2, 1, 0) for 3-D, (3, 1, 2, 0) for 4-D"
        )
    want = tuple(map(src.shape.__getitem__, axes))
    if dst.shape != want:
        raise DmaTransposeError(
            f"[dma-transpose-shape] dst shape {list(dst.shape)} must equal src{list(src.shape)} permuted by "
            f"{axes} = {list(want)} exactly"
        )
    if dst.dtype != src.dtype:
        raise DtypeError(
            f"[dma-transpose-dtype] dma_transpose needs equal dtypes, got src {src.dtype}, dst {dst.dtype}"
        )
    pmax = launch.hw.pmax
    if src.shape[-1] > pmax:
        raise DmaTransposeError(
            f"[dma-transpose-src-last] dma_transpose: src.shape[-1] must be <= {pmax}, got "
            f"src{list(src.shape)}"
        )
    for t, a in ((dst, "dst"), (src, "src")):
        if t._st.buffer.on_chip and t.shape[0] > pmax:
            raise PartitionLimitError(f"[partition-limit] dma_transpose: {a}={t._desc()} exceeds {pmax}")
    runtime = src._dyn is not None
    gather = runtime and src._dyn[0] == "vector"
    if oob_mode is _OOB.skip and not runtime:
        raise DmaTransposeError(
            f"[dma-transpose-oob] oob_mode=skip is only valid when src uses indirect (runtime) indexing; "
            f"src{list(src.shape)} is a static view"
        )
    if gather:
        if _dt.itemsize(src.dtype) != 2:
            raise DtypeError(
                "[dma-transpose-dtype] an indirect (gather) dma_transpose needs a 2-byte dtype, got "
                f"{src.dtype}"
            )
        _indirect_transpose_rules(src, dge_mode, launch)
        return axes
    if dge_mode is not _DGE.unknown and dge_mode is not _DGE.hwdge:
        raise DmaTransposeError(
            "[dma-transpose-dge] a direct (non-gather) dma_transpose only accepts dge_mode unknown or "
            f"hwdge, got {dge_mode.name} for src{list(src.shape)}"
        )
    direct_transpose_lowering(src.shape, src.dtype, dge_mode is _DGE.hwdge, hwdge_shape)
    return axes


_DEFAULT_AXES = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}  # the NKI 0.6 docstring's permutation per rank
DMA_TRANSPOSE_ITEMSIZES = (2, 4)
"""Trainium2 DMA transpose: "bit-accurate transposition for both 2-byte and 4-byte data types" (trn2
architecture guide, "DMA Transpose")."""


def hwdge_transpose_violation(shape: tuple[int, ...], dtype: str) -> str | None:
    """The hardware-DGE direct-transpose rule ``shape``/``dtype`` break (NKI 0.6 ``dma_transpose``
    docstring), or None: 2-D ``src.shape[0] == 16``; 3-/4-D ``src.shape[0]`` in {1, 2, 4, 8, 16} and
    ``(src.shape[0] * src.shape[-2]) % 16 == 0``; a 2-byte dtype."""
    s0 = shape[0]
    if len(shape) == 2 and s0 != 16:
        return f"a 2-D hardware-DGE dma_transpose needs src.shape[0] == 16, got src{list(shape)}"
    if len(shape) > 2 and (s0 not in (1, 2, 4, 8, 16) or (s0 * shape[-2]) % 16):
        return (
            f"a {len(shape)}-D hardware-DGE dma_transpose needs src.shape[0] in {{1, 2, 4, 8, 16}} and "
            f"(src.shape[0] * src.shape[-2]) % 16 == 0, got src{list(shape)}"
        )
    if _dt.itemsize(dtype) != 2:
        return f"a hardware-DGE dma_transpose needs a 2-byte dtype, got {dtype} ({_dt.itemsize(dtype)} B)"
    return None


def direct_transpose_lowering(
    shape: tuple[int, ...], dtype: str, hwdge_forced: bool, hwdge_shape: bool = True
) -> str:
    """Lowering of a direct (non-gather) ``dma_transpose`` of a ``shape`` ``dtype`` source: ``"hwdge"`` or
    ``"dma"`` (a DMA transpose without hardware DGE, 2- or 4-byte dtypes on trn2).  ``dge_mode.hwdge``
    (``hwdge_forced``) must meet the hardware-DGE rules; ``dge_mode.unknown`` takes hwdge when legal, else
    the plain DMA transpose; where neither is legal the error names both rules.  ``hwdge_shape=False``
    drops the shape part of the hardware-DGE rule (``nl.load_transpose2d``)."""
    why = hwdge_transpose_violation(shape if hwdge_shape else (16,) * len(shape), dtype)
    if why is None:
        return "hwdge"
    if hwdge_forced:
        err = DtypeError if "dtype" in why else DmaTransposeError
        tag = "dma-transpose-dtype" if "dtype" in why else "dma-transpose-hwdge"
        raise err(f"[{tag}] {why} (dge_mode=hwdge; dge_mode=unknown lets the compiler pick another lowering)")
    if _dt.itemsize(dtype) in DMA_TRANSPOSE_ITEMSIZES:
        return "dma"
    raise DtypeError(
        f"[dma-transpose-dtype] dge_mode=unknown: no lowering is legal for src{list(shape)} {dtype}: "
        f"hardware DGE: {why}; DMA transpose: needs a 2- or 4-byte dtype (trn2 architecture guide)"
    )


def _indirect_transpose_rules(src: NkiTensor, dge_mode: Any, launch: _state.Launch) -> None:
    """Documented constraints of the indirect (gather) transpose (software DGE, ``dma_gather_transpose``)."""
    sh = list(src.shape)
    if dge_mode is not _DGE.unknown and dge_mode is not _DGE.swdge:
        raise DmaTransposeError(
            f"[dma-transpose-dge] an indirect (gather) dma_transpose only accepts dge_mode unknown or swdge, "
            f"got {dge_mode.name} for src{sh}"
        )
    if launch.hw.nc_version < 3:
        raise DmaTransposeError(
            "[dma-transpose-indirect] indirect dma_transpose needs trn2+ (nc_version >= 3)"
        )
    if src._st.buffer.on_chip:
        raise DmaTransposeError(f"[dma-transpose-indirect] indirect dma_transpose src{sh} must be in HBM")
    if sh[0] % 16:
        raise DmaTransposeError(
            f"[dma-transpose-indirect] indirect dma_transpose needs src.shape[0] % 16 == 0, got src{sh}"
        )
    if len(sh) == 4 and sh[1] != 1 and sh[2] != 1:
        raise DmaTransposeError(
            f"[dma-transpose-indirect] a 4-D indirect dma_transpose needs src.shape[1] or src.shape[2] == 1, "
            f"got src{sh}"
        )
    idx = src._dyn[1]
    ish = list(idx.shape)
    if len(ish) != 2 or idx.dtype != "uint32" or idx._st.buffer is not sbuf:
        raise DmaTransposeError(
            f"[dma-transpose-indirect] indices must be a 2-D uint32 SBUF tensor, got {idx._desc()} "
            f"{idx.dtype}"
        )
    if not 16 <= ish[0] <= 128 or ish[0] % 16 or (ish[1] > 1 and ish[0] != 128):
        raise DmaTransposeError(
            "[dma-transpose-indirect] indices.shape[0] must be in [16, 128] and a multiple of 16 (exactly "
            f"128 when indices.shape[1] > 1), got indices{ish}"
        )
    if ish[0] * ish[1] < sh[0]:
        raise DmaTransposeError(
            f"[dma-transpose-indirect] indices{ish} hold fewer than src.shape[0] = {sh[0]} row indices"
        )


def dma_transpose(
    dst: NkiTensor,
    src: NkiTensor,
    axes: Any = None,
    priority: Any = None,
    dge_mode: dge_mode = dge_mode.unknown,
    oob_mode: oob_mode = oob_mode.error,
    name: Any = None,
) -> NkiInstruction:
    """Transpose ``src`` (HBM or SBUF) into SBUF ``dst`` with a DMA (NKI 0.6 contract, all enforced).

    * axes (1, 0), (2, 1, 0) or (3, 1, 2, 0) (default: reversed dims); ``dst.shape`` equals the permuted
      ``src.shape`` exactly; equal 2-byte dtypes; ``src.shape[-1] <= 128``.
    * Direct transpose (src not a gather view): ``dge_mode`` unknown or hwdge, and the hardware-DGE source
      rule: 2-D ``src.shape[0] == 16``; 3-/4-D ``src.shape[0]`` in {1, 2, 4, 8, 16} and
      ``(src.shape[0] * src.shape[-2]) % 16 == 0``. ``dge_mode.unknown`` is treated as hwdge (the only
      direct mode the docstring allows besides unknown; see docs/emulator.md).
    * Indirect (gather) transpose, src = ``.ap(vector_offset=idx)`` of HBM: ``dge_mode`` unknown or swdge,
      trn2+, ``src.shape[0] % 16 == 0``, 4-D needs ``src.shape[1]`` or ``[2] == 1``, indices a 2-D uint32
      SBUF tensor with ``shape[0]`` in [16, 128] (multiple of 16). Gather order: one index per src row.
    * ``oob_mode=skip`` (only with a runtime-indexed src): an out-of-range scalar offset drops the
      transfer, out-of-range gather rows leave their dst columns unchanged.
    """
    launch = _state.current()
    axes = _dma_transpose_rules(dst, src, axes, dge_mode, oob_mode, launch, True)
    return _dma_transpose_do(dst, src, axes, oob_mode is _OOB.skip, launch)


def _dma_transpose_do(
    dst: NkiTensor, src: NkiTensor, axes: tuple, skip: bool, launch: _state.Launch
) -> NkiInstruction:
    op = "dma_transpose"
    _dma_record(op, dst, src, launch, (("transpose", True),))
    if launch.trace_only:
        return NkiInstruction(op)
    vals = src.read(oob_skip=skip)
    if vals is None:  # runtime scalar offset out of range, oob_mode=skip: nothing moves
        return NkiInstruction(op)
    new = np.transpose(np.asarray(vals), axes)
    if skip and src._dyn is not None and src._dyn[0] == "vector":
        idx = src.flat_indices(oob_skip=True)
        ok = (idx >= 0).reshape(src.shape[0], -1).all(axis=1)
        if not ok.all():
            mask = np.broadcast_to(ok.reshape((-1,) + (1,) * (len(src.shape) - 1)), src.shape)
            old = np.asarray(dst.read()).copy()
            new = np.where(np.transpose(mask, axes), new, old)
    dst.write(np.ascontiguousarray(new))
    return NkiInstruction(op)
