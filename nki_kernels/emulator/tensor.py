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
from .errors import OutOfBoundsError, PartitionLimitError, ViewError


class MemoryRegion:
    """A memory space (``nl.sbuf``, ``nl.psum``, ``nl.private_hbm`` = ``nl.hbm``, ``nl.shared_hbm``)."""

    __slots__ = ("name", "trace_name", "on_chip")

    def __init__(self, name: str, trace_name: str, on_chip: bool) -> None:
        self.name = name
        self.trace_name = trace_name
        self.on_chip = on_chip

    def __repr__(self) -> str:
        return f"nl.{self.name}"


sbuf = MemoryRegion("sbuf", "sbuf", True)
psum = MemoryRegion("psum", "psum", True)
private_hbm = MemoryRegion("private_hbm", "hbm", False)
shared_hbm = MemoryRegion("shared_hbm", "shared_hbm", False)
hbm = private_hbm
BUFFERS = (sbuf, psum, private_hbm, shared_hbm)


def check_buffer(buffer: Any, arg: str = "buffer") -> MemoryRegion:
    if isinstance(buffer, MemoryRegion):
        return buffer
    raise TypeError(
        f"{arg}: expected a memory region object (nl.sbuf, nl.psum, nl.hbm, nl.shared_hbm), got "
        f"{buffer!r} (string buffer names are rejected since NKI 0.3.0)"
    )


class Storage:
    """Backing memory of one allocation.  Frees its on-chip accounting when garbage-collected."""

    __slots__ = ("data", "buffer", "dtype", "shape", "size", "pbytes", "name", "written", "launch", "epoch")

    def __init__(
        self, shape: tuple[int, ...], dtype: str, buffer: MemoryRegion, name: str, data: np.ndarray | None
    ) -> None:
        self.shape = shape
        self.dtype = dtype
        self.buffer = buffer
        self.name = name
        self.size = math.prod(shape)
        self.data = data
        self.written: np.ndarray | None = None
        self.launch: _state.Launch | None = None
        self.epoch = 0
        self.pbytes = 0

    def __del__(self) -> None:
        launch = self.launch
        if launch is not None and self.pbytes and launch.epoch == self.epoch:
            launch.free_onchip(self.buffer.name, self.pbytes)


def _normalize_shape(shape: Any, arg: str = "shape") -> tuple[int, ...]:
    if type(shape) is tuple:
        try:
            return _shape_cached(shape)
        except TypeError:
            pass
    return _normalize_shape_slow(shape, arg)


@lru_cache(maxsize=65536)
def _shape_cached(shape: tuple) -> tuple[int, ...]:
    return _normalize_shape_slow(shape, "shape")


def _normalize_shape_slow(shape: Any, arg: str = "shape") -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        shape = (int(shape),)
    try:
        out = tuple(int(s) for s in shape)
    except TypeError as e:
        raise TypeError(f"{arg}: expected a tuple of ints, got {shape!r}") from e
    if not out or any(s <= 0 for s in out):
        raise ValueError(f"{arg}: every dim must be a positive int and rank >= 1, got {out}")
    if len(out) > 5:
        raise ValueError(f"{arg}: NKI tensors have at most 5 dims, got {len(out)} ({out})")
    return out


def allocate(shape: Any, dtype: Any, buffer: MemoryRegion, name: str = "", *, fill: bool = True) -> NkiTensor:
    """Allocate a fresh tensor (NaN / 4 sentinel filled unless trace-only)."""
    launch = _state.current()
    shape = _normalize_shape(shape)
    dtype = _dt.normalize(dtype)
    buffer = check_buffer(buffer)
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
        if launch.program_id > 0 and idx < len(launch.shared_allocs):
            st = launch.shared_allocs[idx]
            if st.shape != shape or st.dtype != dtype:
                raise ViewError(
                    f"[lnc-shared-hbm] program {launch.program_id} allocates shared_hbm tensor #{idx} as "
                    f"{list(shape)} {dtype} but program 0 allocated {list(st.shape)} {st.dtype}; LNC2 "
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
        if buffer is sbuf and launch.sbuf_used + pbytes <= launch.hw.sbuf_bytes_per_partition:
            launch.sbuf_used += pbytes
        else:
            launch.alloc_onchip(buffer.name, pbytes, shape, dtype, name)
        st.pbytes = pbytes
        st.launch = launch
        st.epoch = launch.epoch
        if buffer is psum and data is not None:
            st.written = np.zeros(st.size, dtype=bool)
    elif buffer is shared_hbm and launch.num_programs > 1 and launch.program_id == 0:
        launch.shared_allocs.append(st)
    return NkiTensor._make(st, 0, shape, _row_major(shape), dtype, name)


@lru_cache(maxsize=65536)
def _pbytes(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape[1:]) * _dt.itemsize(dtype)


def wrap_array(data: np.ndarray | None, shape: tuple[int, ...], dtype: str, buffer: MemoryRegion, name: str):
    """Wrap a flat storage array (or None for trace-only) as a row-major HBM tensor."""
    st = Storage(shape, dtype, buffer, name, data)
    return NkiTensor._make(st, 0, shape, _row_major(shape), dtype, name)


@lru_cache(maxsize=65536)
def _row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


class DynSlice:
    """``nl.ds(start, size)``: the slice ``start:start+size``."""

    __slots__ = ("start", "size")

    def __init__(self, start: int, size: int) -> None:
        self.start = start
        self.size = size

    def __repr__(self) -> str:
        return f"nl.ds({self.start}, {self.size})"


_new = object.__new__


class NkiTensor:
    """A strided view over a storage.  See the module docstring."""

    __slots__ = ("_st", "offset", "shape", "strides", "dtype", "name", "_dyn", "__weakref__")

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
        return t

    def _view(self, offset: int, shape: tuple, strides: tuple, dyn: Any = "same") -> NkiTensor:
        return NkiTensor._make(
            self._st, offset, shape, strides, self.dtype, self.name, self._dyn if dyn == "same" else dyn
        )

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
                        f"[out-of-bounds] nl.ds({k.start}, {k.size}) exceeds dim {d} of size {n} of {self._desc()}"
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

    # ---------------------------------------------------------------- view methods
    def _dim(self, dim: int, what: str) -> int:
        nd = len(self.shape)
        if not isinstance(dim, (int, np.integer)) or not -nd <= dim < nd:
            raise ViewError(f"[{what}] dim {dim!r} out of range for {self._desc()}")
        return int(dim) % nd

    def slice(self, dim: int, start: int, end: int, step: int = 1) -> NkiTensor:
        d = self._dim(dim, "slice")
        n = self.shape[d]
        if not (0 <= start < end <= n) or step < 1:
            raise OutOfBoundsError(
                f"[out-of-bounds] slice(dim={d}, start={start}, end={end}, step={step}) needs "
                f"0 <= start < end <= {n} and step >= 1 on {self._desc()}"
            )
        key = [slice(None)] * len(self.shape)
        key[d] = slice(start, end, step)
        return self[tuple(key)]

    def select(self, dim: int, index: Any) -> NkiTensor:
        d = self._dim(dim, "select")
        if isinstance(index, NkiTensor) or _is_register(index):
            key: list[Any] = [slice(None)] * len(self.shape)
            key[d] = index
            return self[tuple(key)]
        n = self.shape[d]
        i = _norm_index(index, n, d, self, allow_end=False)
        shape = self.shape[:d] + self.shape[d + 1 :]
        strides = self.strides[:d] + self.strides[d + 1 :]
        if self._st.buffer.on_chip and d == 0:
            raise ViewError(f"[select] cannot drop the partition dim of on-chip {self._desc()}")
        if not shape:
            shape, strides = (1,), (1,)
        return self._view(self.offset + i * self.strides[d], shape, strides)

    def permute(self, dims: Any) -> NkiTensor:
        dims = tuple(int(x) for x in dims)
        if sorted(dims) != list(range(len(self.shape))):
            raise ViewError(f"[permute] {dims} is not a permutation of the dims of {self._desc()}")
        if self._st.buffer.on_chip and dims[0] != 0:
            raise ViewError(f"[permute] on-chip {self._desc()} must keep the partition dim first, got {dims}")
        return self._view(
            self.offset, tuple(self.shape[i] for i in dims), tuple(self.strides[i] for i in dims)
        )

    def broadcast(self, dim: int, size: int) -> NkiTensor:
        d = self._dim(dim, "broadcast")
        if self.shape[d] != 1:
            raise ViewError(f"[broadcast] dim {d} of {self._desc()} has size {self.shape[d]}, must be 1")
        if self._st.buffer.on_chip and d == 0:
            raise ViewError(f"[broadcast] cannot broadcast the partition dim of on-chip {self._desc()}")
        shape = list(self.shape)
        strides = list(self.strides)
        shape[d] = int(size)
        strides[d] = 0
        return self._view(self.offset, tuple(shape), tuple(strides))

    def expand_dim(self, dim: int) -> NkiTensor:
        nd = len(self.shape)
        if not -nd - 1 <= dim <= nd:
            raise ViewError(f"[expand_dim] dim {dim} out of range for {self._desc()}")
        d = dim % (nd + 1)
        if self._st.buffer.on_chip and d == 0:
            raise ViewError(f"[expand_dim] dim 0 is forbidden on on-chip {self._desc()}")
        if nd >= 5:
            raise ViewError(f"[expand_dim] {self._desc()} already has 5 dims")
        return self._view(
            self.offset, self.shape[:d] + (1,) + self.shape[d:], self.strides[:d] + (1,) + self.strides[d:]
        )

    def squeeze_dim(self, dim: int) -> NkiTensor:
        d = self._dim(dim, "squeeze_dim")
        if self.shape[d] != 1:
            raise ViewError(f"[squeeze_dim] dim {d} of {self._desc()} has size {self.shape[d]}, must be 1")
        if self._st.buffer.on_chip and d == 0:
            raise ViewError(f"[squeeze_dim] dim 0 is forbidden on on-chip {self._desc()}")
        if len(self.shape) == 1:
            raise ViewError(f"[squeeze_dim] cannot squeeze the only dim of {self._desc()}")
        return self._view(
            self.offset, self.shape[:d] + self.shape[d + 1 :], self.strides[:d] + self.strides[d + 1 :]
        )

    def reshape_dim(self, dim: int, shape: Any) -> NkiTensor:
        d = self._dim(dim, "reshape_dim")
        n = self.shape[d]
        new = [int(x) for x in shape]
        if new.count(-1) > 1:
            raise ViewError(f"[reshape_dim] at most one -1 allowed, got {new}")
        if -1 in new:
            rest = math.prod(x for x in new if x != -1)
            if rest <= 0 or n % rest:
                raise ViewError(f"[reshape_dim] cannot infer -1 in {new} for dim {d} of size {n}")
            new[new.index(-1)] = n // rest
        if math.prod(new) != n or any(x <= 0 for x in new):
            raise ViewError(f"[reshape_dim] {new} does not multiply to dim {d} size {n} of {self._desc()}")
        if self._st.buffer.on_chip and d == 0 and len([x for x in new if x != 1]) > 1:
            raise ViewError(f"[reshape_dim] cannot split the partition dim of on-chip {self._desc()}")
        s = self.strides[d]
        sub = []
        acc = s
        for x in reversed(new):
            sub.append(acc)
            acc *= x
        sub.reverse()
        shape2 = self.shape[:d] + tuple(new) + self.shape[d + 1 :]
        if len(shape2) > 5:
            raise ViewError(f"[reshape_dim] result {shape2} has more than 5 dims")
        return self._view(self.offset, shape2, self.strides[:d] + tuple(sub) + self.strides[d + 1 :])

    def flatten_dims(self, start_dim: int, end_dim: int) -> NkiTensor:
        a = self._dim(start_dim, "flatten_dims")
        b = self._dim(end_dim, "flatten_dims")
        if a > b:
            raise ViewError(f"[flatten_dims] start_dim {a} > end_dim {b}")
        if self._st.buffer.on_chip and a == 0 and b > 0:
            raise ViewError(f"[flatten_dims] start_dim must be > 0 on on-chip {self._desc()}")
        for k in range(a, b):
            if (
                self.shape[k] != 1
                and self.shape[k + 1] != 1
                and self.strides[k] != self.strides[k + 1] * self.shape[k + 1]
            ):
                raise ViewError(
                    f"[flatten_dims] dims {a}..{b} of {self._desc()} (strides {list(self.strides)}) are not "
                    "contiguous in memory"
                )
        inner = b
        while inner > a and self.shape[inner] == 1:
            inner -= 1
        n = math.prod(self.shape[a : b + 1])
        return self._view(
            self.offset,
            self.shape[:a] + (n,) + self.shape[b + 1 :],
            self.strides[:a] + (self.strides[inner],) + self.strides[b + 1 :],
        )

    def reshape(self, shape: Any) -> NkiTensor:
        new = [int(x) for x in (shape if not isinstance(shape, (int, np.integer)) else (shape,))]
        if -1 in new:
            rest = math.prod(x for x in new if x != -1)
            new[new.index(-1)] = self.size // rest if rest else 0
        if math.prod(new) != self.size:
            raise ViewError(f"[reshape] {new} has {math.prod(new)} elements, {self._desc()} has {self.size}")
        if self._st.buffer.on_chip and new[0] != self.shape[0]:
            raise ViewError(f"[reshape] on-chip {self._desc()} must keep shape[0]={self.shape[0]}, got {new}")
        # Express the new shape with the current strides: merge current dims into contiguous groups.
        strides = _reshape_strides(self.shape, self.strides, tuple(new))
        if strides is None:
            raise ViewError(
                f"[reshape] the strides {list(self.strides)} of {self._desc()} cannot express shape {new} "
                "without a copy (e.g. after permute or a stepped slice)"
            )
        return self._view(self.offset, tuple(new), strides)

    def rearrange(self, src_pattern: Any, dst_pattern: Any, fixed_sizes: Any = None) -> NkiTensor:
        """einops-style view: ``src_pattern``/``dst_pattern`` are tuples whose items are names or tuples of
        names (a tuple in src splits a dim, in dst merges dims); ``fixed_sizes`` maps split names to sizes."""
        sizes = dict(fixed_sizes or {})
        src = [x if isinstance(x, tuple) else (x,) for x in src_pattern]
        if len(src) != len(self.shape):
            raise ViewError(
                f"[rearrange] src pattern {src_pattern} has {len(src)} dims, tensor has {self.ndim}"
            )
        t = self
        # split dims from the last to keep indices valid
        for d in reversed(range(len(src))):
            names = src[d]
            if len(names) > 1:
                t = t.reshape_dim(d, [sizes.get(nm, -1) for nm in names])
        flat_names = [nm for g in src for nm in g]
        dst = [x if isinstance(x, tuple) else (x,) for x in dst_pattern]
        order = [flat_names.index(nm) for g in dst for nm in g]
        if sorted(order) != list(range(len(flat_names))):
            raise ViewError(f"[rearrange] dst pattern {dst_pattern} must use each src name once")
        t = t.permute(order)
        pos = 0
        out = t
        # merge groups from the last one
        starts = []
        for g in dst:
            starts.append((pos, pos + len(g) - 1))
            pos += len(g)
        for a, b in reversed(starts):
            if b > a:
                out = out.flatten_dims(a, b)
        return out

    def view(self, dtype: Any) -> NkiTensor:
        dtype = _dt.normalize(dtype)
        if self._dyn is not None:
            raise ViewError(f"[view] not allowed after a dynamic select ({self._desc()})")
        old, new = self.itemsize, _dt.itemsize(dtype)
        if self.strides[-1] != 1:
            raise ViewError(f"[view] the last dim of {self._desc()} must be contiguous")
        if (self.shape[-1] * old) % new or (self.offset * old) % new:
            raise ViewError(
                f"[view] last dim {self.shape[-1]} x {old} B is not divisible into {new}-byte elements"
            )
        for s in self.strides[:-1]:
            if (s * old) % new:
                raise ViewError(f"[view] stride {s} of {self._desc()} not expressible in {dtype} elements")
        # storage reinterpretation: build a new Storage sharing the bytes
        st = self._st
        data = None if st.data is None else st.data.view(_dt.storage_dtype(dtype))
        nshape = st.shape[:-1] + (st.shape[-1] * old // new,)
        nst = Storage(nshape, dtype, st.buffer, st.name, data)
        nst.written = None
        t = NkiTensor._make(
            nst,
            self.offset * old // new,
            self.shape[:-1] + (self.shape[-1] * old // new,),
            tuple(s * old // new for s in self.strides[:-1]) + (1,),
            dtype,
            self.name,
        )
        return t

    def vector_select(self, dim: int, vector_offset: NkiTensor) -> NkiTensor:
        if self._st.buffer.on_chip:
            raise ViewError(f"[vector_select] only on HBM tensors, {self._desc()} is {self.buffer!r}")
        if dim != 0:
            raise ViewError(f"[vector_select] dim must be 0, got {dim}")
        p = vector_offset.shape[0]
        return self._view(
            self.offset,
            (p,) + self.shape[1:],
            (0,) + self.strides[1:],
            ("vector", vector_offset, self.strides[0], self.strides[0] * self.shape[0], 0),
        )

    def ap(
        self,
        pattern: Any,
        offset: Any = None,
        scalar_offset: Any = None,
        vector_offset: Any = None,
        indirect_dim: int = 0,
        dtype: Any = None,
    ) -> NkiTensor:
        st = self._st
        base = self
        if dtype is not None:
            base = self.view(dtype) if _dt.normalize(dtype) != self.dtype else self
            st = base._st
        pairs = [(int(p[0]), int(p[1])) for p in pattern]
        if not pairs or any(n < 1 for _, n in pairs):
            raise ViewError(f"[ap] pattern {pattern} must be non-empty [[step, count], ...] with counts >= 1")
        if len(pairs) > 5:
            raise ViewError(f"[ap] pattern {pattern} has more than 5 dims")
        off = base.offset if offset is None else int(offset)
        if st.buffer.on_chip:
            pstride = st.size // st.shape[0]
            if pairs[0][0] != pstride and pairs[0][1] != 1:
                raise ViewError(
                    f"[ap-partition] on {st.buffer.name} the first pattern pair is the partition dim and its "
                    f"step must equal the per-partition element count {pstride}, got {pairs[0][0]} in {pattern}"
                )
            if pairs[0][1] > _state.current().hw.pmax:
                raise PartitionLimitError(
                    f"[partition-limit] ap pattern {pattern} on {base._desc()} has {pairs[0][1]} partitions"
                )
        if scalar_offset is not None and vector_offset is not None:
            raise ViewError("[ap] scalar_offset and vector_offset are exclusive")
        shape = tuple(n for _, n in pairs)
        strides = tuple(s for s, _ in pairs)
        dyn = None
        if scalar_offset is not None or vector_offset is not None:
            if not 0 <= indirect_dim < len(st.shape):
                raise ViewError(f"[ap] indirect_dim {indirect_dim} out of range for storage {list(st.shape)}")
            mult = math.prod(st.shape[indirect_dim + 1 :])
            if scalar_offset is not None:
                dyn = ("scalar", scalar_offset, mult, st.size, indirect_dim)
            else:
                if indirect_dim != 0:
                    raise ViewError("[ap] vector_offset requires indirect_dim=0")
                if st.buffer.on_chip:
                    raise ViewError("[ap] vector_offset addresses HBM tensors only")
                dyn = ("vector", vector_offset, mult, st.size, 0)
                strides = (0,) + strides[1:]
        t = NkiTensor._make(st, off, shape, strides, st.dtype, base.name, dyn)
        if dyn is None:
            lo, hi = t.addr_range()
            if lo < 0 or hi >= st.size:
                raise OutOfBoundsError(
                    f"[out-of-bounds] ap pattern {pattern} offset {off} addresses elements [{lo}, {hi}] of "
                    f"storage {st.name or '<unnamed>'}{list(st.shape)} ({st.size} elements)"
                )
        return t

    # ---------------------------------------------------------------- addressing helpers
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
        data = self._st.data
        if data is None:
            return None
        if self._dyn is None:
            isz = data.itemsize
            return as_strided(
                data[self.offset :],
                shape=self.shape,
                strides=tuple(s * isz for s in self.strides),
                writeable=False,
            )
        idx = self.flat_indices(oob_skip)
        if idx is None:
            return None
        out = data[np.maximum(idx, 0)]
        return out

    def write(self, values: np.ndarray, oob_skip: bool = False) -> np.ndarray | None:
        """Store ``values`` (broadcastable to the view, already in storage dtype).  Returns flat indices
        written when the write went through an index array (else None)."""
        data = self._st.data
        if data is None:
            return None
        if self._dyn is None:
            isz = data.itemsize
            view = as_strided(
                data[self.offset :], shape=self.shape, strides=tuple(s * isz for s in self.strides)
            )
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
        w = self._st.written
        if w is None:
            return None
        return as_strided(
            w[self.offset :], shape=self.shape, strides=tuple(s * w.itemsize for s in self.strides)
        )


def _is_register(x: Any) -> bool:
    return type(x).__name__ == "VirtualRegister"


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


def _norm_index(i: Any, n: int, d: int, t: NkiTensor, allow_end: bool) -> int:
    if not isinstance(i, (int, np.integer)):
        raise TypeError(f"index on dim {d} of {t._desc()} must be an int, got {i!r}")
    i = int(i)
    j = i + n if i < 0 else i
    hi = n if allow_end else n - 1
    if not 0 <= j <= hi:
        raise OutOfBoundsError(
            f"[out-of-bounds] index {i} on dim {d} of {t._desc()} is outside [0, {n}{']' if allow_end else ')'}"
        )
    return j


def _reshape_strides(shape: tuple, strides: tuple, new: tuple) -> tuple | None:
    """Strides expressing ``new`` over a view (numpy's attempt_nocopy_reshape logic)."""
    old = [(n, s) for n, s in zip(shape, strides) if n != 1]
    newstrides = [0] * len(new)
    oi = ni = 0
    on = len(old)
    nn = len(new)
    # handle size-1 new dims
    while ni < nn and oi < on:
        np_ = new[ni]
        op = old[oi][0]
        nj, oj = ni + 1, oi + 1
        while np_ != op:
            if np_ < op:
                np_ *= new[nj]
                nj += 1
            else:
                op *= old[oj][0]
                oj += 1
        for k in range(oi, oj - 1):
            if old[k][1] != old[k + 1][0] * old[k + 1][1]:
                return None
        newstrides[nj - 1] = old[oj - 1][1]
        for k in range(nj - 1, ni, -1):
            newstrides[k - 1] = newstrides[k] * new[k]
        ni, oi = nj, oj
    for k in range(ni, nn):
        newstrides[k] = 1
    # size-1 new dims got a placeholder; fine
    return tuple(newstrides)
