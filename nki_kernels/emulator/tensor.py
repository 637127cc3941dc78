"""NkiTensor: storage + strided view, as in NKI 0.6.

A tensor is ``(storage, offset, shape, strides, dtype)``; element ``(i0, ..., in)`` lives at flat storage
index ``offset + sum(strides[k] * ik)`` (strides in elements).  All view methods return new tensors over
the same storage.  On-chip storage (SBUF/PSUM) is ``[partitions, free...]`` laid out row-major, so the
partition stride is the per-partition element count.

In trace-only mode ``storage.data`` is ``None``: views, bounds and rules work, values do not exist.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from . import dtypes as _dt
from . import state as _state
from .errors import MemorySpaceError, OutOfBoundsError, PartitionLimitError, ViewError
from .memory import (  # noqa: F401 (re-exported: tensor.sbuf etc. as before)
    BUFFERS,
    MemoryRegion,
    Storage,
    _normalize_shape,
    _normalize_shape_slow,
    _pbytes,
    _row_major,
    _shape_cached,
    check_buffer,
    hbm,
    private_hbm,
    psum,
    sbuf,
    shared_hbm,
)
from .tensor_views import TensorViews, _is_register, _norm_index, _reshape_strides  # noqa: F401


def allocate(
    shape: Any, dtype: Any, buffer: MemoryRegion, name: str = "", *, fill: bool = True, address: Any = None
) -> NkiTensor:
    """Allocate a fresh tensor (NaN / 4 sentinel filled unless trace-only).

    On-chip tensors are tracked for last-use liveness (:mod:`~nki_kernels.emulator.liveness`);
    ``address=(partition_offset, byte_offset)`` places one (SBUF/PSUM only)."""
    launch = _state.current()
    shape = _normalize_shape(shape)
    dtype = _dt.normalize(dtype)
    buffer = check_buffer(buffer)
    if address is not None and not buffer.on_chip:
        raise MemorySpaceError(
            f"[address] address={address!r} places SBUF/PSUM tensors only; {name or '<unnamed>'} "
            f"{list(shape)} is in {buffer.name}"
        )
    if buffer.on_chip:
        if shape[0] > launch.hw.pmax:
            raise PartitionLimitError(
                f"[partition-limit] {buffer.name} tensor {name or '<unnamed>'} {list(shape)}: partition dim "
                f"(dim 0) {shape[0]} exceeds the {launch.hw.pmax}-partition limit"
            )
    elif buffer is shared_hbm and launch.num_programs > 1:
        # LNC2: both programs refer to the same shared_hbm allocation (the i-th of each program).
        idx = launch.shared_index
        launch.shared_index += 1
        if idx < len(launch.shared_allocs):  # the other program allocated it first
            st = launch.shared_allocs[idx]
            if st.shape != shape or st.dtype != dtype:
                raise ViewError(
                    f"[lnc-shared-hbm] program {launch.program_id} allocates shared_hbm tensor #{idx} as "
                    f"{list(shape)} {dtype} but the other program allocated {list(st.shape)} {st.dtype}; "
                    "LNC2 "
                    "programs must follow identical control flow"
                )
            return NkiTensor._make(st, 0, shape, _row_major(shape), dtype, name)
    data = None
    if not launch.trace_only:
        npdt = _dt.storage_dtype(dtype)
        size = math.prod(shape)
        if fill:
            data = np.full(size, _dt.sentinel(dtype), dtype=npdt)
        else:
            data = np.empty(size, dtype=npdt)
    st = Storage(shape, dtype, buffer, name, data)
    if buffer.on_chip:
        pbytes = _pbytes(shape, dtype)
        st.live = launch.alloc_onchip(buffer.name, pbytes, shape, dtype, name, address)
        st.pbytes = pbytes
        st.launch = launch
        st.epoch = launch.epoch
        if buffer is psum and data is not None:
            st.written = np.zeros(st.size, dtype=bool)
    elif buffer is shared_hbm and launch.num_programs > 1:
        launch.shared_allocs.append(st)
    return NkiTensor._make(st, 0, shape, _row_major(shape), dtype, name)


def wrap_array(data: np.ndarray | None, shape: tuple[int, ...], dtype: str, buffer: MemoryRegion, name: str):
    """Wrap a flat storage array (or None for trace-only) as a row-major HBM tensor."""
    st = Storage(shape, dtype, buffer, name, data)
    return NkiTensor._make(st, 0, shape, _row_major(shape), dtype, name)


class DynSlice:
    """``nl.ds(start, size)``: the slice ``start:start+size``."""

    __slots__ = ("start", "size")

    def __init__(self, start: int, size: int) -> None:
        self.start = start
        self.size = size

    def __repr__(self) -> str:
        return f"nl.ds({self.start}, {self.size})"


_new = object.__new__


class NkiTensor(TensorViews):
    """A strided view over a storage.  See the module docstring."""

    __slots__ = ("_st", "offset", "shape", "strides", "dtype", "name", "_dyn", "_oob", "__weakref__")

    def __init__(
        self, shape: Any, dtype: Any, storage: Any = None, buffer: Any = sbuf, name: str = ""
    ) -> None:
        shape = _normalize_shape(shape)
        dtype = _dt.normalize(dtype)
        buffer = check_buffer(buffer)
        if isinstance(storage, Storage):
            st = storage
        else:
            data = None
            if storage is not None:
                data = np.ascontiguousarray(storage, dtype=_dt.storage_dtype(dtype)).reshape(-1)
                if data.size != math.prod(shape):
                    raise ValueError(
                        f"storage: has {data.size} elements, shape {shape} needs {math.prod(shape)}"
                    )
            st = Storage(shape, dtype, buffer, name, data)
        self._st = st
        self.offset = 0
        self.shape = shape
        self.strides = _row_major(shape)
        self.dtype = dtype
        self.name = name
        self._dyn = None
        self._oob: str | None = None

    @classmethod
    def _make(cls, st: Storage, offset: int, shape: tuple, strides: tuple, dtype: str, name: str, dyn=None):
        t = object.__new__(cls)
        t._st = st
        t.offset = offset
        t.shape = shape
        t.strides = strides
        t.dtype = dtype
        t.name = name
        t._dyn = dyn
        t._oob = None
        return t

    def _view(self, offset: int, shape: tuple, strides: tuple, dyn: Any = "same") -> NkiTensor:
        t = NkiTensor._make(
            self._st, offset, shape, strides, self.dtype, self.name, self._dyn if dyn == "same" else dyn
        )
        if self._oob is not None:
            t._carry_oob(self._oob)
        return t

    # ---------------------------------------------------------------- properties
    @property
    def buffer(self) -> MemoryRegion:
        return self._st.buffer

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return _dt.itemsize(self.dtype)

    @property
    def storage(self) -> Storage:
        return self._st

    def __repr__(self) -> str:
        return (
            f"NkiTensor({self.name or '<unnamed>'}, shape={list(self.shape)}, dtype={self.dtype}, "
            f"buffer={self._st.buffer!r}, offset={self.offset}, strides={list(self.strides)})"
        )

    def __len__(self) -> int:
        return self.shape[0]

    def _desc(self) -> str:
        return f"{self.name or '<unnamed>'}{list(self.shape)}"

    def is_indirect(self) -> bool:
        return self._dyn is not None

    def is_contiguous(self) -> bool:
        dims = range(1, self.ndim) if self._st.buffer.on_chip else range(self.ndim)
        expect = 1
        for k in reversed(dims):
            if self.shape[k] == 1:
                continue
            if self.strides[k] != expect:
                return False
            expect *= self.shape[k]
        return True

    def get_pattern(self) -> list[list[int]]:
        return [[st, n] for st, n in zip(self.strides, self.shape)]

    # ---------------------------------------------------------------- indexing
    def __getitem__(self, key: Any) -> NkiTensor:
        # Fast path (the common case in kernels): plain ints and unit-step slices with int/None bounds
        # that lie inside the tensor.  Anything else (steps, nl.ds, negative or out-of-range indices,
        # ellipsis, runtime indices, numpy ints, errors) goes through :meth:`_getitem_general`, which
        # computes the same view or raises the rule error.
        if type(key) is not tuple:
            key = (key,)
        shp = self.shape
        nk = len(key)
        nd = len(shp)
        if nk > nd:
            return self._getitem_general(key)
        strd = self.strides
        st = self._st
        offset = self.offset
        shape: tuple[int, ...] = ()
        strides: tuple[int, ...] = ()
        first = True
        for k, n, s in zip(key, shp, strd):
            if k.__class__ is slice:
                start = k.start
                stop = k.stop
                if k.step is not None:
                    return self._getitem_general(key)
                if start is None:
                    if stop is None:  # ':' keeps the dim
                        shape += (n,)
                        strides += (s,)
                        first = False
                        continue
                    start = 0
                elif start.__class__ is not int or start < 0:
                    return self._getitem_general(key)
                else:
                    offset += start * s
                if stop is None:
                    stop = n
                elif stop.__class__ is not int or stop > n:
                    return self._getitem_general(key)
                if stop <= start:  # also catches start >= n
                    return self._getitem_general(key)
                shape += (stop - start,)
                strides += (s,)
            elif k.__class__ is int:
                if not 0 <= k < n:
                    return self._getitem_general(key)
                offset += k * s
                if first and st.buffer.on_chip:  # an int on the partition dim keeps a size-1 dim
                    shape += (1,)
                    strides += (s,)
            else:
                return self._getitem_general(key)
            first = False
        if nk < nd:
            shape += shp[nk:]
            strides += strd[nk:]
        if len(shape) < 2 and (not shape or st.buffer.on_chip):
            shape += (1,)
            strides += (1,)
        t = _new(NkiTensor)
        t._st = st
        t.offset = offset
        t.shape = shape
        t.strides = strides
        t.dtype = self.dtype
        t.name = self.name
        t._dyn = self._dyn
        t._oob = None
        if self._oob is not None:
            t._carry_oob(self._oob)
        return t

    def _getitem_general(self, key: tuple) -> NkiTensor:
        nd = len(self.shape)
        if Ellipsis in key:
            i = next(j for j, k in enumerate(key) if k is Ellipsis)
            if any(k is Ellipsis for k in key[i + 1 :]):
                raise IndexError("an index can only have a single ellipsis ('...')")
            fill = nd - (len(key) - 1)
            key = key[:i] + (slice(None),) * fill + key[i + 1 :]
        if len(key) > nd:
            raise IndexError(f"too many indices for tensor {self._desc()}: {len(key)} > {nd}")
        on_chip = self._st.buffer.on_chip
        offset = self.offset
        shape: list[int] = []
        strides: list[int] = []
        dyn = self._dyn
        dyn_index = None
        for d, k in enumerate(key):
            n = self.shape[d]
            s = self.strides[d]
            if type(k) is slice:
                step = k.step
                if step is None:
                    step = 1
                elif not isinstance(step, (int, np.integer)) or step < 1:
                    raise ViewError(
                        f"[slice] step must be an int >= 1, got {k.step!r} on dim {d} of {self._desc()}"
                    )
                start = k.start
                if start is None:
                    start = 0
                elif type(start) is not int or not 0 <= start < n:
                    start = _norm_index(start, n, d, self, allow_end=False)
                stop = k.stop
                if stop is None:
                    stop = n
                elif type(stop) is not int or not 0 < stop <= n:
                    stop = _norm_index(stop, n, d, self, allow_end=True)
                if stop <= start:
                    raise OutOfBoundsError(
                        f"[out-of-bounds] empty or reversed slice {start}:{stop} on dim {d} of {self._desc()}"
                    )
                cnt = (stop - start + step - 1) // step
                if d == 0 and on_chip and step != 1 and cnt > 1:
                    raise ViewError(
                        f"[partition-stride] stepped slice on the partition dim of {self._desc()} "
                        "(partition striding is illegal on SBUF/PSUM; de-interleave in the DMA instead)"
                    )
                offset += start * s
                shape.append(cnt)
                strides.append(s * step)
            elif isinstance(k, DynSlice):
                start = _norm_index(k.start, n, d, self, allow_end=False)
                size = int(k.size)
                if size < 1 or start + size > n:
                    raise OutOfBoundsError(
                        f"[out-of-bounds] nl.ds({k.start}, {k.size}) exceeds dim {d} of size {n} of "
                        f"{self._desc()}"
                    )
                offset += start * s
                shape.append(size)
                strides.append(s)
            elif isinstance(k, (int, np.integer)):
                i = k if (type(k) is int and 0 <= k < n) else _norm_index(k, n, d, self, allow_end=False)
                offset += i * s
                if d == 0 and on_chip:
                    shape.append(1)
                    strides.append(s)
            elif isinstance(k, NkiTensor) or _is_register(k):
                if dyn_index is not None or dyn is not None:
                    raise ViewError(f"[indirect] only one runtime index per tensor ({self._desc()})")
                if d == 0 and on_chip:
                    raise ViewError(
                        f"[indirect] runtime index on the partition dim of on-chip {self._desc()}"
                    )
                dyn_index = (k, s, d, n)
            else:
                raise TypeError(f"unsupported index {k!r} on dim {d} of {self._desc()}")
        for d in range(len(key), nd):
            shape.append(self.shape[d])
            strides.append(self.strides[d])
        if on_chip and len(shape) < 2 or not shape:
            shape.append(1)
            strides.append(1)
        if dyn_index is not None:
            k, s, d, n = dyn_index
            dyn = ("scalar", k, s, n * s, d)
        return self._view(offset, tuple(shape), tuple(strides), dyn)

    def __setitem__(self, key: Any, value: Any) -> None:
        raise NotImplementedError(
            "NkiTensor.__setitem__ is undocumented in NKI 0.6; write with an nki.isa instruction "
            "(nisa.tensor_copy, nisa.dma_copy, nisa.memset) into the view t[...]"
        )

    def addr_range(self) -> tuple[int, int]:
        lo = hi = self.offset
        for n, s in zip(self.shape, self.strides):
            if s > 0:
                hi += s * (n - 1)
            else:
                lo += s * (n - 1)
        return lo, hi

    def partition_bytes_range(self) -> tuple[int, int]:
        """On-chip: ``[first, last]`` byte offsets touched inside one partition."""
        st = self._st
        pstride = st.size // st.shape[0]
        lo = hi = self.offset % pstride
        shape = self.shape
        if len(shape) == 2:  # the common case, without the generic loop
            n = shape[1]
            s = self.strides[1]
            if s > 0:
                hi += s * (n - 1)
            else:
                lo += s * (n - 1)
        else:
            for n, s in zip(shape[1:], self.strides[1:]):
                if s > 0:
                    hi += s * (n - 1)
                else:
                    lo += s * (n - 1)
        isz = _dt.itemsize(self.dtype)
        return lo * isz, (hi + 1) * isz - 1

    def access_box(self) -> tuple[int, int, int, int]:
        """Bounding box ``(p0, p1, b0, b1)`` of this view's elements: on-chip, partitions ``[p0, p1)`` and the
        byte range ``[b0, b1)`` inside each; HBM, ``p0 = p1 = 0`` and the byte range in the flat storage.
        A runtime-indexed (indirect) view covers the whole storage."""
        st = self._st
        isz = _dt.itemsize(st.dtype)
        on_chip = st.buffer.on_chip
        per_part = st.size // st.shape[0] if on_chip else st.size
        if self._dyn is not None:
            return (0, st.shape[0], 0, per_part * isz) if on_chip else (0, 0, 0, st.size * isz)
        return access_box(on_chip, per_part, isz, self.offset, self.shape, self.strides)

    def start_partition(self) -> int:
        st = self._st
        return self.offset // (st.size // st.shape[0])

    def _resolve_dyn(self, oob_skip: bool = False) -> Any:
        """Return (offset, per-partition offsets or None) with runtime indices applied; None if skipped."""
        kind, idx, mult, limit, _dim = self._dyn
        if kind == "scalar":
            v = _read_index_scalar(idx)
            off = self.offset + v * mult
            t = self._view(off, self.shape, self.strides, None)
            lo, hi = t.addr_range()
            if lo < 0 or hi >= self._st.size:
                if oob_skip:
                    return None
                raise OutOfBoundsError(
                    f"[out-of-bounds] runtime index {v} (x{mult} elements) moves {self._desc()} to elements "
                    f"[{lo}, {hi}] outside storage of {self._st.size} elements (oob_mode=error)"
                )
            return off, None
        vec = np.asarray(idx.read()).reshape(-1).astype(np.int64)
        if vec.size != self.shape[0]:
            raise OutOfBoundsError(f"[vector-offset] {vec.size} offsets for {self.shape[0]} partitions")
        return self.offset, vec * mult

    def flat_indices(self, oob_skip: bool = False) -> np.ndarray | None:
        """Flat storage indices of every element (shape = self.shape); None when skipped (oob skip)."""
        off = self.offset
        per_row = None
        if self._dyn is not None:
            r = self._resolve_dyn(oob_skip)
            if r is None:
                return None
            off, per_row = r
        idx = np.full(self.shape, off, dtype=np.int64)
        for k, (n, s) in enumerate(zip(self.shape, self.strides)):
            if s and n > 1:
                sh = [1] * len(self.shape)
                sh[k] = n
                idx += (np.arange(n, dtype=np.int64) * s).reshape(sh)
        if per_row is not None:
            idx += per_row.reshape((-1,) + (1,) * (len(self.shape) - 1))
            bad = (idx < 0) | (idx >= self._st.size)
            rows_bad = bad.reshape(self.shape[0], -1).any(axis=1)
            if rows_bad.any():
                if not oob_skip:
                    raise OutOfBoundsError(
                        f"[out-of-bounds] vector_offset rows {np.nonzero(rows_bad)[0].tolist()[:8]} address "
                        f"outside storage of {self._st.size} elements (oob_mode=error)"
                    )
                idx = idx.copy()
                idx[rows_bad] = -1
        return idx

    def read(self, oob_skip: bool = False) -> np.ndarray | None:
        """Values of the view as a numpy array in storage dtype (a read-only strided view when possible)."""
        if self._oob is not None:
            raise OutOfBoundsError(self._oob)
        data = self._st.data
        if data is None:
            return None
        if self._dyn is None:
            isz = data.itemsize
            return _as_strided(data[self.offset :], self.shape, tuple(s * isz for s in self.strides), False)
        idx = self.flat_indices(oob_skip)
        if idx is None:
            return None
        out = data[np.maximum(idx, 0)]
        return out

    def write(self, values: np.ndarray, oob_skip: bool = False) -> np.ndarray | None:
        """Store ``values`` (broadcastable to the view, already in storage dtype).  Returns flat indices
        written when the write went through an index array (else None)."""
        if self._oob is not None:
            raise OutOfBoundsError(self._oob)
        data = self._st.data
        if data is None:
            return None
        if self._dyn is None:
            isz = data.itemsize
            view = _as_strided(data[self.offset :], self.shape, tuple(s * isz for s in self.strides), True)
            view[...] = values
            return None
        idx = self.flat_indices(oob_skip)
        if idx is None:
            return None
        vals = np.broadcast_to(np.asarray(values), self.shape)
        keep = idx >= 0
        data[idx[keep]] = vals[keep]
        return idx[keep]

    def written_mask_view(self) -> np.ndarray | None:
        """PSUM only: writable strided view over the per-element 'written by matmul' flags."""
        if self._oob is not None:
            raise OutOfBoundsError(self._oob)
        w = self._st.written
        if w is None:
            return None
        return as_strided(
            w[self.offset :], shape=self.shape, strides=tuple(s * w.itemsize for s in self.strides)
        )


@lru_cache(maxsize=65536)
def access_box(
    on_chip: bool, per_part: int, isz: int, offset: int, shape: tuple, strides: tuple
) -> tuple[int, int, int, int]:
    """Bounding box ``(p0, p1, b0, b1)`` of the strided view ``offset + sum(strides[k] * i_k)``, ``i_k <
    shape[k]``, over a storage of ``per_part`` elements per partition (on-chip) of ``isz`` bytes each:
    on-chip, partitions ``[p0, p1)`` and the bytes ``[b0, b1)`` inside each (free dims that step across
    partitions cover whole partitions); HBM, ``(0, 0, b0, b1)`` in the flat storage."""
    if not on_chip:
        lo = hi = offset
        for n, s in zip(shape, strides):
            if s > 0:
                hi += s * (n - 1)
            else:
                lo += s * (n - 1)
        return 0, 0, lo * isz, (hi + 1) * isz
    ps = per_part
    p0, lo = divmod(offset, ps)
    hi = lo
    for k in range(1, len(shape)):
        s = strides[k]
        if s > 0:
            hi += s * (shape[k] - 1)
        else:
            lo += s * (shape[k] - 1)
    n0 = shape[0]
    s0 = strides[0]
    if lo >= 0 and hi < ps and (n0 == 1 or s0 % ps == 0):
        p1 = p0 + (s0 // ps) * (n0 - 1)
        if p1 < p0:
            p0, p1 = p1, p0
        return p0, p1 + 1, lo * isz, (hi + 1) * isz
    alo = ahi = offset
    for n, s in zip(shape, strides):
        if s > 0:
            ahi += s * (n - 1)
        else:
            alo += s * (n - 1)
    pa, pb = alo // ps, ahi // ps
    if pa == pb:
        return pa, pa + 1, (alo - pa * ps) * isz, (ahi - pa * ps + 1) * isz
    return pa, pb + 1, 0, ps * isz


def _read_index_scalar(idx: Any) -> int:
    if _is_register(idx):
        return int(idx.value)
    if isinstance(idx, NkiTensor):
        if idx.size != 1:
            raise ViewError(f"[indirect] runtime index tensor must have one element, got {idx._desc()}")
        if idx._st.data is None:
            return 0
        return int(np.asarray(idx.read()).reshape(-1)[0].astype(np.int64))
    if isinstance(idx, (int, np.integer)):
        return int(idx)
    raise TypeError(f"runtime index must be a (1,1) SBUF int tensor or VirtualRegister, got {idx!r}")


def _as_strided(a: np.ndarray, shape: tuple, strides: tuple, writeable: bool) -> np.ndarray:
    """``as_strided`` that also works for ml_dtypes' float8_e5m2, whose array-interface type string ('<f1')
    numpy cannot parse back: stride the raw bytes, then view them as the dtype."""
    if a.dtype.str == "<f1":
        return as_strided(a.view(np.uint8), shape=shape, strides=strides, writeable=writeable).view(a.dtype)
    return as_strided(a, shape=shape, strides=strides, writeable=writeable)
