"""The view methods of :class:`~nki_kernels.emulator.tensor.NkiTensor` (``slice``, ``select``, ``permute``,
``broadcast``, ``reshape``, ``rearrange``, ``view``, ``ap``, ...), as a mixin: each returns a new tensor over
the same storage."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from . import dtypes as _dt
from . import state as _state
from .errors import OutOfBoundsError, PartitionLimitError, ViewError
from .memory import Storage

if TYPE_CHECKING:
    from .tensor import NkiTensor


class TensorViews:
    """View methods of ``NkiTensor`` (its only subclass); they build views with ``self._view`` /
    ``self._make``."""

    __slots__ = ()

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
        if isinstance(index, TensorViews) or _is_register(index):
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
        nst.base = st.base or st  # the same allocation (bytes) for the event log
        nst.live = st.live  # and for liveness: an access through the view is an access of the allocation
        t = self._make(
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
                    f"step must equal the per-partition element count {pstride}, got {pairs[0][0]} in "
                    f"{pattern}"
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
            # NKI 0.6 ``NkiTensor.ap``: indirect_dim is "a dimension in self.shape whose stride scales the
            # offset" (prod(self.shape[indirect_dim+1:]) for a contiguous tensor), so a reshaped view
            # supplies its own strides, not the allocation's.
            if not 0 <= indirect_dim < len(base.shape):
                raise ViewError(
                    f"[ap] indirect_dim {indirect_dim} out of range for the tensor's shape {list(base.shape)}"
                )
            mult = base.strides[indirect_dim]
            if scalar_offset is not None:
                dyn = ("scalar", scalar_offset, mult, st.size, indirect_dim)
            else:
                if indirect_dim != 0:
                    raise ViewError("[ap] vector_offset requires indirect_dim=0")
                if st.buffer.on_chip:
                    raise ViewError("[ap] vector_offset addresses HBM tensors only")
                dyn = ("vector", vector_offset, mult, st.size, 0)
                strides = (0,) + strides[1:]
        t = self._make(st, off, shape, strides, st.dtype, base.name, dyn)
        if dyn is None:
            lo, hi = t.addr_range()
            if lo < 0 or hi >= st.size:
                # An access pattern is metadata: building one that leaves the storage is legal (nki-library
                # builds matmul operands before the test that skips them); an instruction that accesses it
                # is refused (NkiTensor.check_in_bounds, called by every instruction and by read/write).
                t._oob = (
                    f"[out-of-bounds] ap pattern {pattern} offset {off} addresses elements [{lo}, {hi}] of "
                    f"storage {st.name or '<unnamed>'}{list(st.shape)} ({st.size} elements)"
                )
        return t

    def _carry_oob(self: NkiTensor, msg: str) -> None:
        """A view of an out-of-bounds ``.ap`` view keeps its message while it still leaves the storage."""
        lo, hi = self.addr_range()
        self._oob = msg if self._dyn is None and (lo < 0 or hi >= self._st.size) else None

    def check_in_bounds(self: NkiTensor) -> None:
        """Raise the deferred ``[out-of-bounds]`` error of an ``.ap`` view that leaves its storage: building
        such a view is legal (an access pattern is metadata), an instruction accessing it is not."""
        if self._oob is not None:
            raise OutOfBoundsError(self._oob)

    # ---------------------------------------------------------------- addressing helpers


def _is_register(x: Any) -> bool:
    return type(x).__name__ == "VirtualRegister"


def _norm_index(i: Any, n: int, d: int, t: NkiTensor, allow_end: bool) -> int:
    if not isinstance(i, (int, np.integer)):
        raise TypeError(f"index on dim {d} of {t._desc()} must be an int, got {i!r}")
    i = int(i)
    j = i + n if i < 0 else i
    hi = n if allow_end else n - 1
    if not 0 <= j <= hi:
        raise OutOfBoundsError(
            f"[out-of-bounds] index {i} on dim {d} of {t._desc()} is outside [0, "
            f"{n}{']' if allow_end else ')'}"
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
