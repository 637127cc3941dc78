"""``nki.isa`` for the emulator: one function per hardware instruction, destination first.

Every instruction validates its operands (memory spaces, partitions, per-partition sizes, engine
limits), appends one :class:`~nki_kernels.emulator.trace.TraceRecord` and, unless the launch is
trace-only, computes its result in numpy: inputs up-cast to fp32, math in fp32, result cast to
``dst.dtype`` (round-to-nearest-even; ints round half-even and saturate).
"""

from __future__ import annotations

import enum
import math
from functools import lru_cache
from typing import Any

import numpy as np

from . import dtypes as _dt
from . import opdefs
from . import state as _state
from .errors import (
    DmaTransposeError,
    DtypeError,
    MatmulTileError,
    MemorySpaceError,
    NkiEmulatorError,
    OutOfBoundsError,
    PartitionLimitError,
    PsumLimitError,
    ShapeMismatchError,
)
from .tensor import NkiTensor, psum, sbuf
from .trace import TraceRecord

# --------------------------------------------------------------------------------------------- enums


class engine(enum.Enum):  # noqa: N801 (NKI name)
    unknown = 0
    tensor = 1
    scalar = 2
    gpsimd = 3
    dma = 4
    vector = 5
    sync = 6


tensor_engine = engine.tensor
vector_engine = engine.vector
scalar_engine = engine.scalar
gpsimd_engine = engine.gpsimd
unknown_engine = engine.unknown


class reduce_cmd(enum.Enum):  # noqa: N801
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


class dge_mode(enum.Enum):  # noqa: N801
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class oob_mode(enum.Enum):  # noqa: N801
    error = 0
    skip = 1


class matmul_perf_mode(enum.Enum):  # noqa: N801
    none = "none"
    double_row = "double_row"


class nc_version(enum.Enum):  # noqa: N801
    gen2 = 2
    gen3 = 3
    gen4 = 4


class dma_engine(enum.Enum):  # noqa: N801
    dma = 1
    gpsimd_dma = 2


NkiValidationError = NkiEmulatorError

_FP8_E4M3_PAIR = ("float8_e4m3", "float8_e4m3fn")
_DMA_TRANSPOSE_AXES = ((1, 0), (2, 1, 0), (3, 1, 2, 0))


class NkiInstruction:
    """Handle returned by every ISA call (scheduling hints are accepted and ignored: execution is eager)."""

    __slots__ = ("op",)

    def __init__(self, op: str) -> None:
        self.op = op

    def depends_on(self, *others: Any) -> NkiInstruction:
        return self


class VirtualRegister:
    """A 32-bit runtime register; in the emulator it simply holds a Python int (``.value``)."""

    __slots__ = ("value", "frozen")

    def __init__(self, state: Any = None, frozen: bool = False) -> None:
        self.value = 0 if state is None else int(state)
        self.frozen = frozen

    def __index__(self) -> int:
        return self.value

    def __int__(self) -> int:
        return self.value

    def __repr__(self) -> str:
        return f"VirtualRegister({self.value})"


def get_nc_version() -> nc_version:
    return nc_version(_state.current().hw.nc_version)


def get_nc_sub_version() -> int:
    return 0


_OOB = oob_mode
_DGE = dge_mode

_ENGINE_TRACE = {
    engine.tensor: "tensor",
    engine.vector: "vector",
    engine.scalar: "scalar",
    engine.gpsimd: "gpsimd",
    engine.dma: "dma",
}
# Same mapping keyed by id(member): a dict lookup keyed by an enum member runs Enum.__hash__ (Python code).
_ENGINE_TRACE_ID = {id(k): v for k, v in _ENGINE_TRACE.items()}

# --------------------------------------------------------------------------------------------- helpers


def _emit(launch: _state.Launch, key: tuple, make: Any) -> None:
    """Count one issue of the record for ``key`` (built by ``make()`` on first sight)."""
    ent = launch.records.get(key)
    if ent is None:
        ent = [make(), 0]
        launch.records[key] = ent
    ent[1] += 1
    if launch.keep_order:
        launch.trace.order.append(ent[0])


def _onchip(t: Any, op: str, arg: str, launch: _state.Launch) -> NkiTensor:
    if not isinstance(t, NkiTensor):
        raise TypeError(f"{op}: {arg} must be an NkiTensor, got {type(t).__name__}")
    if not t._st.buffer.on_chip:
        raise MemorySpaceError(
            f"[memory-space] {op}: operand {arg}={t._desc()} is in {t._st.buffer.name}; this engine reads "
            "and writes SBUF/PSUM only (move HBM data with nisa.dma_copy first)"
        )
    if t.shape[0] > launch.hw.pmax:
        raise PartitionLimitError(
            f"[partition-limit] {op}: {arg}={t._desc()} has {t.shape[0]} partitions, limit {launch.hw.pmax}"
        )
    return t


def _count(launch: _state.Launch, key: tuple) -> bool:
    """Count one more issue of an already-seen record; False when ``key`` is new (caller builds it)."""
    ent = launch.records.get(key)
    if ent is None:
        return False
    ent[1] += 1
    if launch.keep_order:
        launch.trace.order.append(ent[0])
    return True


def _count_checked(launch: _state.Launch, fkey: tuple) -> bool:
    """Trace-only: count one issue of an instruction whose validation key ``fkey`` already passed every
    check in this program (the key holds every input the checks read); False when ``fkey`` is new."""
    ent = launch.checked.get(fkey)
    if ent is None:
        return False
    ent[1] += 1
    if launch.keep_order:
        launch.trace.order.append(ent[0])
    return True


def _free(t: NkiTensor) -> int:
    sh = t.shape
    return sh[1] if len(sh) == 2 else math.prod(sh[1:])


def _same_pf(op: str, a: NkiTensor, an: str, b: NkiTensor, bn: str) -> None:
    if a.shape[0] != b.shape[0]:
        raise ShapeMismatchError(
            f"[partition-mismatch] {op}: number of partitions (dim 0) differs: {an}{list(a.shape)} vs "
            f"{bn}{list(b.shape)}"
        )
    if _free(a) != _free(b):
        raise ShapeMismatchError(
            f"[free-size-mismatch] {op}: elements per partition differ: {an}{list(a.shape)} has {_free(a)}, "
            f"{bn}{list(b.shape)} has {_free(b)}"
        )


def _pick_engine(eng: Any, default: engine, op: str, allowed: tuple[engine, ...]) -> engine:
    if eng is None or eng is engine.unknown:
        return default
    if not isinstance(eng, engine):
        raise TypeError(f"{op}: engine must be an nisa.engine member, got {eng!r} (raw ints are rejected)")
    if eng not in allowed:
        raise ValueError(f"{op}: engine={eng.name} not supported; allowed: {[e.name for e in allowed]}")
    return eng


def _no_gpsimd_psum(op: str, eng: engine, *ts: NkiTensor) -> None:
    if eng is engine.gpsimd:
        for t in ts:
            if t is not None and t._st.buffer is psum:
                raise MemorySpaceError(f"[memory-space] {op}: GpSimd cannot access PSUM ({t._desc()})")


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


def _binary_name(op: Any, op_label: str, arg: str) -> str:
    name = opdefs.op_name(op, arg)
    if name not in opdefs.BINARY:
        raise ValueError(f"{op_label}: {arg}={name} is not a binary ALU op")
    return name


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


def _dma_record(op: str, dst: NkiTensor, src: NkiTensor, launch: _state.Launch, meta: tuple = ()) -> None:
    key = (op, dst.shape, dst.strides, dst.dtype, dst._st.buffer, src.shape, src.strides, src.dtype,
           src._st.buffer, dst._dyn is None, src._dyn is None, launch.program_id, meta)  # fmt: skip
    if _count(launch, key):
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

    ``hwdge_shape=False`` (``nl.load_transpose2d``, whose lowering the compiler chooses) skips only the
    hardware-DGE source-shape rule.
    """
    op = "dma_transpose"
    for t, a in ((dst, "dst"), (src, "src")):
        if not isinstance(t, NkiTensor):
            raise TypeError(f"{op}: {a} must be an NkiTensor, got {type(t).__name__}")
    if type(dge_mode) is not _DGE:
        raise TypeError(f"{op}: dge_mode must be an nisa.dge_mode member, got {dge_mode!r}")
    if type(oob_mode) is not _OOB:
        raise TypeError(f"{op}: oob_mode must be an nisa.oob_mode member, got {oob_mode!r}")
    if dst._st.buffer is not sbuf:
        raise MemorySpaceError(f"[memory-space] dma_transpose: dst={dst._desc()} must be in SBUF")
    if src._st.buffer is psum:
        raise MemorySpaceError(f"[memory-space] dma_transpose: src={src._desc()} cannot be in PSUM")
    nd = len(src.shape)
    axes = tuple(range(nd - 1, -1, -1)) if axes is None else tuple(map(int, axes))
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
    if _dt.itemsize(src.dtype) != 2 or dst.dtype != src.dtype:
        raise DtypeError(
            f"[dma-transpose-dtype] dma_transpose needs equal 2-byte dtypes, got src {src.dtype}, dst {dst.dtype}"
        )
    pmax = launch.hw.pmax
    if src.shape[-1] > pmax:
        raise DmaTransposeError(
            f"[dma-transpose-src-last] dma_transpose: src.shape[-1] must be <= {pmax}, got src{list(src.shape)}"
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
        _indirect_transpose_rules(src, dge_mode, launch)
        return axes
    if dge_mode is not _DGE.unknown and dge_mode is not _DGE.hwdge:
        raise DmaTransposeError(
            f"[dma-transpose-dge] a direct (non-gather) dma_transpose only accepts dge_mode unknown or hwdge, "
            f"got {dge_mode.name} for src{list(src.shape)}"
        )
    if hwdge_shape:
        s0 = src.shape[0]
        if nd == 2:
            if s0 != 16:
                raise DmaTransposeError(
                    f"[dma-transpose-hwdge] a 2-D hardware-DGE dma_transpose needs src.shape[0] == 16, got "
                    f"src{list(src.shape)} (dge_mode={dge_mode.name}: unknown lowers a direct transpose to "
                    "hwdge; split the rows into 16-row pieces or use a 3-D [A, B, C] view)"
                )
        elif s0 not in (1, 2, 4, 8, 16) or (s0 * src.shape[-2]) % 16:
            raise DmaTransposeError(
                f"[dma-transpose-hwdge] a {nd}-D hardware-DGE dma_transpose needs src.shape[0] in "
                f"{{1, 2, 4, 8, 16}} and (src.shape[0] * src.shape[-2]) % 16 == 0, got src{list(src.shape)} "
                f"(dge_mode={dge_mode.name}: unknown lowers a direct transpose to hwdge)"
            )
    return axes


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
            f"[dma-transpose-indirect] indices must be a 2-D uint32 SBUF tensor, got {idx._desc()} {idx.dtype}"
        )
    if not 16 <= ish[0] <= 128 or ish[0] % 16 or (ish[1] > 1 and ish[0] != 128):
        raise DmaTransposeError(
            f"[dma-transpose-indirect] indices.shape[0] must be in [16, 128] and a multiple of 16 (exactly 128 "
            f"when indices.shape[1] > 1), got indices{ish}"
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


# --------------------------------------------------------------------------------------------- copies


def tensor_copy(
    dst: NkiTensor, src: NkiTensor, engine: engine = engine.unknown, name: Any = None
) -> NkiInstruction:
    """On-chip copy with cast (same partitions and elements per partition); Vector by default."""
    launch = _state.current()
    fkey = None
    if launch.trace_only and type(dst) is NkiTensor and type(src) is NkiTensor:
        fkey = ("tensor_copy", id(engine), dst.shape, dst.dtype, dst._st.buffer, src.shape, src.dtype,
                src._st.buffer)  # fmt: skip
        if _count_checked(launch, fkey):
            return NkiInstruction("tensor_copy")
    op = "tensor_copy"
    pmax = launch.hw.pmax
    if not (type(dst) is NkiTensor and dst._st.buffer.on_chip and dst.shape[0] <= pmax):
        _onchip(dst, op, "dst", launch)
    if not (type(src) is NkiTensor and src._st.buffer.on_chip and src.shape[0] <= pmax):
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


_E = engine
_TC_ENGINES = (_E.vector, _E.scalar, _E.gpsimd)
_TT_ENGINES = (_E.vector, _E.gpsimd)


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
    if not launch.trace_only:
        if _dt.is_int(dst.dtype):
            _store(dst, np.full(dst.shape, int(value), dtype=np.int64))
        else:
            _store(dst, np.full(dst.shape, value, dtype=np.float32))
    return NkiInstruction(op)


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
        # the psum-bank check reads dst's offset inside its partition, its shape, strides and dtype
        fkey = ("nc_matmul", dst.shape, dst.strides, dst.offset % (dst_st.size // dst_st.shape[0]), dst.dtype,
                dst_st.buffer, stationary.shape, stationary.dtype, stationary._st.buffer, moving.shape,
                moving.dtype, moving._st.buffer, is_transpose)  # fmt: skip
        if _count_checked(launch, fkey):
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
    ss = stationary.shape
    ms = moving.shape
    ds = dst.shape
    K = ss[0]
    M = ss[1] if len(ss) == 2 else math.prod(ss[1:])
    N = ms[1] if len(ms) == 2 else math.prod(ms[1:])
    pmax = hw.pmax
    if pmax < K or ms[0] > pmax:
        raise MatmulTileError(
            f"[matmul-contraction] nc_matmul: contraction (partition) dim must be <= {hw.pmax}: stationary "
            f"{list(stationary.shape)}, moving {list(moving.shape)}"
        )
    if ms[0] != K:
        raise MatmulTileError(
            f"[matmul-contraction] nc_matmul: stationary{list(stationary.shape)} and moving{list(moving.shape)} "
            "must have the same contraction (partition) size"
        )
    if hw.gemm_stationary_fmax < M:
        raise MatmulTileError(
            f"[matmul-stationary] nc_matmul: stationary free size {M} (shape {list(stationary.shape)}) exceeds "
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
            f"[psum-bank] nc_matmul: dst {dst._desc()} {dst.dtype} spans bytes [{lo}, {hi}] of each partition, "
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
    key = (op, ds, dst.dtype, ss, sdt, ms, mdt, launch.program_id, bool(is_transpose))
    ent = launch.records.get(key)
    if ent is None:
        _emit(
            launch,
            key,
            lambda: _rec(
                op, "tensor", (dst, stationary, moving), launch, flops=2 * K * M * N,
                meta=(("K", K), ("M", M), ("N", N), ("dtype", mdt), ("is_transpose", bool(is_transpose))),
            ),
        )  # fmt: skip
    else:
        ent[1] += 1
        if launch.keep_order:
            launch.trace.order.append(ent[0])
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
            f"[{K}, {K}] identity matching stationary{list(stationary.shape)}'s {K} partitions (free size {N} != {K})"
        )
    if dst.dtype != stationary.dtype:
        raise DtypeError(
            f"[matmul-transpose] nc_matmul(is_transpose=True) passes the data through: dst dtype {dst.dtype} must "
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
        fkey = ("nc_transpose", id(engine), dst.shape, dst.dtype, dst._st.buffer, data.shape, data.dtype,
                data._st.buffer)  # fmt: skip
        if _count_checked(launch, fkey):
            return NkiInstruction("nc_transpose")
    hw = launch.hw
    op = "nc_transpose"
    pmax = hw.pmax
    if not (type(dst) is NkiTensor and dst._st.buffer.on_chip and dst.shape[0] <= pmax):
        _onchip(dst, op, "dst", launch)
    if not (type(data) is NkiTensor and data._st.buffer.on_chip and data.shape[0] <= pmax):
        _onchip(data, op, "data", launch)
    P = data.shape[0]
    F = _free(data)
    if engine is None or engine is _E.unknown:
        eng = _E.tensor if (dst._st.buffer is psum and data._st.buffer is sbuf) else _E.vector
    else:
        eng = _pick_engine(engine, _E.tensor, op, (_E.tensor, _E.vector))
    if dst.shape[0] != F or _free(dst) != P:
        raise ShapeMismatchError(
            f"[transpose-shape] nc_transpose: dst{list(dst.shape)} must be [{F}, {P}] for data{list(data.shape)}"
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
            f"[transpose-size] nc_transpose on {eng.name} engine handles at most {lim}x{lim}, got data{list(data.shape)}"
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
    if fkey is not None:
        launch.checked[fkey] = launch.records[key]
    if not launch.trace_only:
        v = np.asarray(data.read()).reshape(P, F).T
        dst.write(np.ascontiguousarray(v).reshape(dst.shape))
        if dst._st.written is not None:
            dst.written_mask_view()[...] = True
    return NkiInstruction(op)


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


_RC = reduce_cmd


def _activation(opname, dst, op, data, bias, scale, reduce_op, reduce_res, rcmd) -> NkiInstruction:
    launch = _state.current()
    pmax = launch.hw.pmax
    if not (type(dst) is NkiTensor and dst._st.buffer.on_chip and dst.shape[0] <= pmax):
        _onchip(dst, opname, "dst", launch)
    if not (type(data) is NkiTensor and data._st.buffer.on_chip and data.shape[0] <= pmax):
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
    if not (type(dst) is NkiTensor and dst._st.buffer.on_chip and dst.shape[0] <= pmax):
        _onchip(dst, opn, "dst", launch)
    if not (type(data1) is NkiTensor and data1._st.buffer.on_chip and data1.shape[0] <= pmax):
        _onchip(data1, opn, "data1", launch)
    if not (type(data2) is NkiTensor and data2._st.buffer.on_chip and data2.shape[0] <= pmax):
        _onchip(data2, opn, "data2", launch)
    if data1.shape != data2.shape:
        _same_pf(opn, data1, "data1", data2, "data2")
    if dst.shape != data1.shape:
        _same_pf(opn, dst, "dst", data1, "data1")
    if data1._st.buffer is psum and data2._st.buffer is psum:
        raise MemorySpaceError(
            f"[memory-space] tensor_tensor: data1 and data2 cannot both be in PSUM ({data1._desc()}, {data2._desc()})"
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
    if not (type(dst) is NkiTensor and dst._st.buffer.on_chip and dst.shape[0] <= pmax):
        _onchip(dst, opn, "dst", launch)
    if not (type(data) is NkiTensor and data._st.buffer.on_chip and data.shape[0] <= pmax):
        _onchip(data, opn, "data", launch)
    if dst.shape != data.shape:
        _same_pf(opn, dst, "dst", data, "data")
    n0 = _binary_name(op0, opn, "op0")
    n1 = None if op1 is None else _binary_name(op1, opn, "op1")
    if (op1 is None) != (operand1 is None):
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
    o0 = _operand(operand0, P, opn, "operand0", launch)
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
    y = _apply_binary(n0, x, o0, reverse0)
    if n1 is not None:
        y = _apply_binary(n1, y, o1, reverse1)
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
    if not (type(dst) is NkiTensor and dst._st.buffer.on_chip and dst.shape[0] <= pmax):
        _onchip(dst, opn, "dst", launch)
    if not (type(data) is NkiTensor and data._st.buffer.on_chip and data.shape[0] <= pmax):
        _onchip(data, opn, "data", launch)
    if not (type(operand1) is NkiTensor and operand1._st.buffer.on_chip and operand1.shape[0] <= pmax):
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
    if launch.trace_only:
        return NkiInstruction(opn)
    x = _vals(data).reshape(dst.shape)
    y = _apply_binary(n0, x, _bcast(o0, x.ndim), reverse0)
    y = _apply_binary(n1, y, _vals(operand1).reshape(dst.shape), reverse1)
    _store(dst, np.asarray(y, dtype=np.float32))
    return NkiInstruction(opn)


def _axes(axis: Any, nd: int, opn: str) -> tuple[int, ...]:
    ax = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    ax = tuple(sorted(int(a) % nd for a in ax))
    if not ax or 0 in ax:
        raise ValueError(f"{opn}: axis {axis} must name free dims only (axis 0 is the partition dim)")
    if ax != tuple(range(nd - len(ax), nd)):
        raise ValueError(f"{opn}: axis {axis} must be the trailing free dims of a {nd}-D tensor")
    return ax


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
    if not (type(dst) is NkiTensor and dst._st.buffer.on_chip and dst.shape[0] <= pmax):
        _onchip(dst, opn, "dst", launch)
    if not (type(data) is NkiTensor and data._st.buffer.on_chip and data.shape[0] <= pmax):
        _onchip(data, opn, "data", launch)
    rn = opdefs.op_name(op, "op")
    red = opdefs.reduce_fn(rn, "op")
    ax = _axes(axis, data.ndim, opn)
    kept = math.prod(data.shape[1 : data.ndim - len(ax)])
    if dst.shape[0] != data.shape[0] or _free(dst) != kept:
        raise ShapeMismatchError(
            f"[reduce-shape] tensor_reduce: dst{list(dst.shape)} must hold {data.shape[0]} partitions x {kept} "
            f"elements for data{list(data.shape)} reduced over axis {ax}"
        )
    key = (opn, rn, _sig(dst), _sig(data), ax, launch.program_id)
    if not _count(launch, key):
        _emit(
            launch,
            key,
            lambda: _rec(opn, "vector", (dst, data), launch, flops=data.size, meta=(("alu", rn),)),
        )
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
    if not launch.trace_only:
        x = _vals(data).reshape(data.shape[0], -1)
        _store(dst, red(x, axis=(0,)).reshape(dst.shape))
    return NkiInstruction(opn)


def reciprocal(dst: NkiTensor, data: NkiTensor, name: Any = None) -> NkiInstruction:
    """``dst = 1 / data`` on VectorE (fp32)."""
    launch = _state.current()
    opn = "reciprocal"
    pmax = launch.hw.pmax
    if not (type(dst) is NkiTensor and dst._st.buffer.on_chip and dst.shape[0] <= pmax):
        _onchip(dst, opn, "dst", launch)
    if not (type(data) is NkiTensor and data._st.buffer.on_chip and data.shape[0] <= pmax):
        _onchip(data, opn, "data", launch)
    if dst.shape != data.shape:
        _same_pf(opn, dst, "dst", data, "data")
    key = (opn, _sig(dst), _sig(data), launch.program_id)
    if not _count(launch, key):
        _emit(launch, key, lambda: _rec(opn, "vector", (dst, data), launch))
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
    n0 = _binary_name(op0, opn, "op0")
    rn = opdefs.op_name(reduce_op, "reduce_op")
    red = opdefs.reduce_fn(rn, "reduce_op")
    P = data.shape[0]
    o0 = _operand(operand0, P, opn, "operand0", launch)
    if reduce_res is not None:
        _onchip(reduce_res, opn, "reduce_res", launch)
        if reduce_res.shape[0] != P or _free(reduce_res) != 1:
            raise ShapeMismatchError(
                f"[operand-shape] {opn}: reduce_res{list(reduce_res.shape)} must be ({P}, 1)"
            )
    key = (opn, n0, rn, _sig(dst), _sig(data), reduce_res is None, launch.program_id)
    _emit(launch, key, lambda: _rec(opn, "vector", (dst, data), launch, flops=2 * dst.size))
    if launch.trace_only:
        return NkiInstruction(opn)
    x = _vals(data).reshape(dst.shape)
    y = np.asarray(_apply_binary(n0, x, _bcast(o0, x.ndim), reverse0), dtype=np.float32)
    _store(dst, y)
    if reduce_res is not None:
        r = red(y.reshape(P, -1), axis=(1,)).astype(np.float32)
        if reduce_init is not None:
            r = _apply_binary(rn, np.float32(reduce_init), r)
        if reduce_res_negate:
            r = -r
        _store(reduce_res, r.reshape(reduce_res.shape))
    return NkiInstruction(opn)


# --------------------------------------------------------------------------------------------- GpSimdE


def _pattern_values(
    pattern: Any, offset: Any, channel_multiplier: int, dst: NkiTensor, opn: str
) -> np.ndarray | None:
    pairs = [(int(p[0]), int(p[1])) for p in pattern]
    n = math.prod(c for _, c in pairs)
    if n != _free(dst):
        raise ShapeMismatchError(
            f"[pattern-size] {opn}: pattern {pattern} has {n} elements, dst{list(dst.shape)} has {_free(dst)} per partition"
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
    if vals is not None:
        cond = opdefs.BINARY[cname](vals.astype(np.float64), 0.0) != 0
        t = _vals(on_true_tile).reshape(dst.shape)
        _store(dst, np.where(cond, t, np.float32(on_false_value)))
    return NkiInstruction(opn)


# --------------------------------------------------------------------------------------------- registers


def register_alloc(x: Any = None) -> VirtualRegister:
    return VirtualRegister(0 if x is None else int(x))


def register_move(dst: VirtualRegister, src: Any) -> None:
    dst.value = int(src.value if isinstance(src, VirtualRegister) else src)


def register_load(dst: VirtualRegister, src: NkiTensor) -> None:
    if src.size != 1:
        raise ShapeMismatchError(f"register_load: src {src._desc()} must have a single element")
    dst.value = 0 if src._st.data is None else int(np.asarray(src.read()).reshape(-1)[0])


def register_store(dst: NkiTensor, src: VirtualRegister) -> None:
    if dst.size != 1:
        raise ShapeMismatchError(f"register_store: dst {dst._desc()} must have a single element")
    if dst._st.data is not None:
        dst.write(_dt.cast(np.full(dst.shape, src.value, dtype=np.int64), dst.dtype))


__all__ = [
    n
    for n in dir()
    if not n.startswith("_") and n not in ("annotations", "enum", "math", "np", "Any", "lru_cache")
]
_ = OutOfBoundsError
