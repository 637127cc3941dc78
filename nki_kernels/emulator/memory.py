"""Memory spaces and on-chip storage: ``nl.sbuf`` / ``nl.psum`` / ``nl.hbm`` regions, the ``Storage`` behind
every tensor (with its on-chip byte accounting) and shape normalisation."""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import numpy as np

from . import dtypes as _dt
from . import state as _state


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


_NOT_TRACKED: list = [0, 0]  # the ``live`` record of storages whose liveness is not tracked (HBM)


class Storage:
    """Backing memory of one allocation.

    ``live`` is the on-chip allocation's live record (:mod:`~nki_kernels.emulator.liveness`): every
    instruction stamps ``live[0]`` (last access) with its number, the first one also ``live[1]`` (first
    access); when the storage is garbage-collected the record is handed back to its launch.

    Event-log slots: ``base`` is the allocation a dtype-reinterpreting view shares its bytes with (None
    for an allocation), ``evlog``/``evbuf`` the event log that numbered this allocation and its number.
    """

    __slots__ = ("data", "buffer", "dtype", "shape", "size", "pbytes", "name", "written", "launch", "epoch",
                 "base", "evlog", "evbuf", "live")  # fmt: skip

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
        self.base: Storage | None = None
        self.evlog: Any = None
        self.evbuf = 0
        self.live = _NOT_TRACKED

    def __del__(self) -> None:
        launch = self.launch
        if launch is not None and self.pbytes and launch.epoch == self.epoch:
            launch.mem.close(self.live)


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


@lru_cache(maxsize=65536)
def _pbytes(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape[1:]) * _dt.itemsize(dtype)


@lru_cache(maxsize=65536)
def _row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))
