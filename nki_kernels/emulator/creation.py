"""``nki.language`` creation ops and memory-space helpers: ``ndarray`` (with ``address=`` placement),
``zeros``/``ones``/``full``/``*_like``, ``ds``, ``shared_identity_matrix`` (SBUF), ``shared_constant``,
``tile_size`` and the ``is_*`` buffer predicates.  Re-exported by :mod:`nki_kernels.emulator.language`."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from . import dtypes as _dt
from . import isa as _isa
from . import state as _state
from .dtypes import uint8
from .errors import MemorySpaceError, ShapeMismatchError
from .tensor import DynSlice, NkiTensor, allocate, check_buffer, private_hbm, psum, sbuf, shared_hbm


class _TileSize:
    """``nl.tile_size``: limits of the current target (the launch's HwConfig; trn2 defaults outside)."""

    @property
    def _hw(self) -> Any:
        launch = _state.active()
        if launch is not None:
            return launch.hw
        from .hw import TRN2

        return TRN2

    @property
    def pmax(self) -> int:
        return self._hw.pmax

    @property
    def psum_bank_fmax(self) -> int:
        return self._hw.psum_bank_fmax

    psum_fmax = psum_bank_fmax

    @property
    def psum_bank_fmax_bytes(self) -> int:
        return self._hw.psum_bank_bytes

    @property
    def psum_num_banks(self) -> int:
        return self._hw.psum_num_banks

    @property
    def gemm_stationary_fmax(self) -> int:
        return self._hw.gemm_stationary_fmax

    @property
    def gemm_moving_fmax(self) -> int:
        return self._hw.gemm_moving_fmax

    bn_stats_fmax = 512

    @property
    def sbuf_fmax_bytes(self) -> int:
        return self._hw.sbuf_bytes_per_partition

    total_available_sbuf_size = sbuf_fmax_bytes

    @property
    def sbuf_fmax(self) -> int:
        return self._hw.sbuf_bytes_per_partition // 4

    @property
    def sbuf_size_bytes(self) -> int:
        return self._hw.sbuf_bytes_per_partition * self._hw.pmax


tile_size = _TileSize()


def is_hbm(buffer: Any) -> bool:
    return buffer is private_hbm or buffer is shared_hbm


def is_on_chip(buffer: Any) -> bool:
    return buffer is sbuf or buffer is psum


def is_psum(buffer: Any) -> bool:
    return buffer is psum


def is_sbuf(buffer: Any) -> bool:
    return buffer is sbuf


# --------------------------------------------------------------------------------------------- creation


def ndarray(shape: Any, dtype: Any, buffer: Any = sbuf, name: str = "", address: Any = None) -> NkiTensor:
    """Allocate an uninitialised tensor (filled with NaN for floats / 4 for ints, as the NKI simulator).

    ``address=(partition_offset, byte_offset)`` places an SBUF/PSUM tensor at that partition and byte
    offset (PSUM: on a 2 KiB bank boundary); placed tensors that overlap while both are live raise
    ``AllocationError`` at the end of the program.  Without it the allocator places the tensor."""
    return allocate(shape, dtype, buffer, name, address=address)


def _filled(shape: Any, value: Any, dtype: Any, buffer: Any, name: str) -> NkiTensor:
    buffer = check_buffer(buffer)
    if not buffer.on_chip:
        raise MemorySpaceError(
            f"[memory-space] creating an HBM tensor with an init value is not supported ({name or shape}); "
            "allocate with nl.ndarray and write it with a DMA"
        )
    t = allocate(shape, dtype, buffer, name)
    v = int(value) if _dt.is_int(t.dtype) else float(value)
    _isa.memset(t, v)
    return t


def zeros(shape: Any, dtype: Any, buffer: Any = sbuf, name: str = "") -> NkiTensor:
    return _filled(shape, 0, dtype, buffer, name)


def ones(shape: Any, dtype: Any, buffer: Any = sbuf, name: str = "") -> NkiTensor:
    return _filled(shape, 1, dtype, buffer, name)


def full(shape: Any, fill_value: Any, dtype: Any, buffer: Any = sbuf, name: str = "") -> NkiTensor:
    return _filled(shape, fill_value, dtype, buffer, name)


def zeros_like(x: NkiTensor, dtype: Any = None, buffer: Any = None, name: str = "") -> NkiTensor:
    return zeros(x.shape, dtype or x.dtype, buffer or x.buffer, name)


def empty_like(x: NkiTensor, dtype: Any = None, buffer: Any = None, name: str = "") -> NkiTensor:
    return ndarray(x.shape, dtype or x.dtype, buffer or x.buffer, name)


def ds(start: int, size: int) -> DynSlice:
    """``nl.ds(start, size)`` == ``start:start+size`` in a subscript."""
    return DynSlice(start, size)


def shared_identity_matrix(n: int, dtype: Any = uint8, dst: Any = None) -> NkiTensor:
    """An ``n x n`` identity matrix **in SBUF** (NKI 0.6: "Create an identity matrix in SBUF"), default
    dtype ``uint8``; ``n <= 128`` (partitions).  The constant lives in shared HBM (as the compiler embeds
    it) and one ``dma_copy`` brings it into a new SBUF tile, or into ``dst`` when given (an SBUF
    ``(n, n)`` tensor), which is returned."""
    launch = _state.current()
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"shared_identity_matrix: n must be a positive int, got {n!r}")
    n = int(n)
    if dst is not None:
        if not isinstance(dst, NkiTensor) or dst.buffer is not sbuf:
            where = dst.buffer.name if isinstance(dst, NkiTensor) else type(dst).__name__
            raise MemorySpaceError(
                f"[memory-space] shared_identity_matrix: dst must be an SBUF tensor (the identity lives in "
                f"SBUF), got {where}"
            )
        if dst.shape[0] != n or dst.size != n * n:
            raise ShapeMismatchError(
                f"[identity-shape] shared_identity_matrix: dst{list(dst.shape)} must hold [{n}, {n}]"
            )
        out = dst
    else:
        out = allocate((n, n), dtype, sbuf, "identity")
    const = allocate((n, n), out.dtype, private_hbm, "identity_const")
    if not launch.trace_only:
        const.write(_dt.cast(np.eye(n, dtype=np.float32), const.dtype).reshape(n, n))
    _isa.dma_copy(out, const)
    return out


def shared_constant(constant: Any) -> NkiTensor:
    """``nl.shared_constant(constant)``: a ``shared_hbm`` tensor holding ``constant`` (NKI 0.6: "a numpy array
    or a file path to a ``.npy`` file"); its shape and dtype are the array's."""
    launch = _state.current()
    if isinstance(constant, (str, os.PathLike)):
        path = os.fspath(constant)
        if not path.endswith(".npy") or not os.path.isfile(path):
            raise ValueError(
                f"shared_constant: constant must be a numpy array or the path of an existing .npy file, "
                f"got {path!r}"
            )
        constant = np.load(path, mmap_mode="r", allow_pickle=False)
    arr = np.asarray(constant)
    t = allocate(arr.shape, _dt.normalize(arr.dtype), shared_hbm, "constant")
    if not launch.trace_only:
        t.write(arr.astype(t.storage.data.dtype))
    return t
