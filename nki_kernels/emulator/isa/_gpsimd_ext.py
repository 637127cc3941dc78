"""GpSimdE instructions of NKI 0.6 beyond ``iota`` / ``affine_select``: ``nc_n_gather``, ``local_gather`` and
``nonzero_with_count`` (exported by :mod:`nki_kernels.emulator.isa`), per their 0.6 docstrings
(aws-neuron/aws-neuron-sdk ``nki/api/nki/isa/__init__.py``).  GpSimd reads and writes SBUF only."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import dtypes as _dt
from .. import start_partition as _sp
from .. import state as _state
from ..errors import DtypeError, LaunchError, MemorySpaceError, OutOfBoundsError, ShapeMismatchError
from ..tensor import NkiTensor, sbuf
from ._common import _emit, _rec
from ._enums import NkiInstruction
from ._events import _use
from ._rules import _free, _onchip

_GPSIMD_CORE_PARTITIONS = 16  # each of the 8 GpSimd cores serves 16 contiguous SBUF partitions


def _sbuf_operands(op: str, launch: _state.Launch, *named: tuple[str, NkiTensor]) -> None:
    for arg, t in named:
        _onchip(t, op, arg, launch)
        if t._st.buffer is not sbuf:
            raise MemorySpaceError(
                f"[memory-space] {op}: {arg}={t._desc()} must be in SBUF (GpSimd cannot access PSUM)"
            )
    _sp.check_all(op, launch.hw.pmax, *named)


def nc_n_gather(dst: NkiTensor, data: NkiTensor, indices: NkiTensor, name: Any = None) -> NkiInstruction:
    """Per partition, ``dst[p, j] = data[p].flatten()[indices[p].flatten()[j]]`` (GpSimd).  All SBUF; same
    partitions; ``dst.dtype == data.dtype``; ``indices`` uint32 in ``[0, data elements per partition)``;
    dst and indices hold the same number of elements per partition."""
    launch = _state.current()
    op = "nc_n_gather"
    _sbuf_operands(op, launch, ("dst", dst), ("data", data), ("indices", indices))
    P = data.shape[0]
    if dst.shape[0] != P or indices.shape[0] != P:
        raise ShapeMismatchError(
            f"[partition-mismatch] {op}: dst{list(dst.shape)}, data{list(data.shape)}, "
            f"indices{list(indices.shape)} must have the same partitions"
        )
    if _free(dst) != _free(indices):
        raise ShapeMismatchError(
            f"[free-size-mismatch] {op}: dst{list(dst.shape)} vs indices{list(indices.shape)}"
        )
    if dst.dtype != data.dtype:
        raise DtypeError(f"[gather-dtype] {op}: dst dtype {dst.dtype} must equal data dtype {data.dtype}")
    if indices.dtype != "uint32":
        raise DtypeError(f"[gather-dtype] {op}: indices must be uint32, got {indices.dtype}")
    key = (op, dst.shape, dst.dtype, data.shape, indices.shape, launch.program_id)
    _emit(launch, key, lambda: _rec(op, "gpsimd", (dst, data, indices), launch, flops=0))
    _use(launch, (data, indices), (dst,))
    if not launch.trace_only:
        F = _free(data)
        idx = np.asarray(indices.read()).reshape(P, -1).astype(np.int64)
        if (idx >= F).any():
            raise OutOfBoundsError(
                f"[out-of-bounds] {op}: index {int(idx.max())} >= {F} elements per partition"
            )
        x = np.asarray(data.read()).reshape(P, F)
        dst.write(np.take_along_axis(x, idx, axis=1).reshape(dst.shape))
    return NkiInstruction(op)


_LOCAL_GATHER_ELEMS = (1, 2, 4, 8, 16, 32)
_LOCAL_GATHER_MAX_INDICES = 4096


def local_gather(
    dst: NkiTensor,
    src_buffer: NkiTensor,
    index: NkiTensor,
    num_elem_per_idx: int = 1,
    num_valid_indices: int | None = None,
    name: Any = None,
) -> NkiInstruction:
    """GpSimd gather inside each core's 16 partitions (0.6 docstring and its numpy example,
    aws-neuron/aws-neuron-sdk ``nki/test/test_nki_isa_local_gather.py``): core ``c`` (partitions
    ``16c .. 16c+15``) flattens its ``index`` rows column-major (partition first) into ``idx``, keeps the
    first ``num_valid_indices`` (default all), and for every partition ``p`` of the core and ``j``:
    ``dst[p, j*n : (j+1)*n] = src_buffer[p].flatten()[idx[j] : idx[j] + n]`` with ``n = num_elem_per_idx``.

    Rules: all SBUF; ``src_buffer``, ``index`` and ``dst`` on the same partitions, a multiple of 16;
    ``index`` uint16; ``n`` in {1, 2, 4, 8, 16, 32}; ``num_valid_indices`` <= the indices per core and
    <= 4096; ``dst.dtype == src_buffer.dtype`` (no casting); dst holds ``num_valid_indices * n`` elements per
    partition.  An index whose ``n`` elements leave the partition is undefined on hardware: raised here."""
    launch = _state.current()
    op = "local_gather"
    _sbuf_operands(op, launch, ("dst", dst), ("src_buffer", src_buffer), ("index", index))
    P = src_buffer.shape[0]
    if index.shape[0] != P or dst.shape[0] != P or P % _GPSIMD_CORE_PARTITIONS:
        raise ShapeMismatchError(
            f"[partition-mismatch] {op}: src_buffer{list(src_buffer.shape)}, index{list(index.shape)} and "
            f"dst{list(dst.shape)} need the same partitions, a multiple of {_GPSIMD_CORE_PARTITIONS}"
        )
    if index.dtype != "uint16":
        raise DtypeError(f"[gather-dtype] {op}: index must be uint16, got {index.dtype}")
    if dst.dtype != src_buffer.dtype:
        raise DtypeError(
            f"[gather-dtype] {op}: dst dtype {dst.dtype} must equal src_buffer's {src_buffer.dtype}"
        )
    n = int(num_elem_per_idx)
    if n not in _LOCAL_GATHER_ELEMS:
        raise ValueError(
            f"[local-gather] {op}: num_elem_per_idx must be one of {_LOCAL_GATHER_ELEMS}, got {n}"
        )
    per_core = _free(index) * _GPSIMD_CORE_PARTITIONS
    nv = per_core if num_valid_indices is None else int(num_valid_indices)
    if not 0 < nv <= min(per_core, _LOCAL_GATHER_MAX_INDICES):
        raise ValueError(
            f"[local-gather] {op}: num_valid_indices {nv} must be in "
            f"[1, {min(per_core, _LOCAL_GATHER_MAX_INDICES)}] "
            f"({per_core} indices per core, at most {_LOCAL_GATHER_MAX_INDICES})"
        )
    if _free(dst) != nv * n:
        raise ShapeMismatchError(
            f"[free-size-mismatch] {op}: dst{list(dst.shape)} must hold {nv} x {n} elements per partition"
        )
    key = (op, dst.shape, dst.dtype, src_buffer.shape, index.shape, n, nv, launch.program_id)
    _emit(launch, key, lambda: _rec(op, "gpsimd", (dst, src_buffer, index), launch, flops=0))
    _use(launch, (src_buffer, index), (dst,))
    if not launch.trace_only:
        F = _free(src_buffer)
        x = np.asarray(src_buffer.read()).reshape(P, F)
        ix = np.asarray(index.read()).reshape(P, -1).astype(np.int64)
        out = np.empty((P, nv, n), dtype=x.dtype)
        for c in range(P // _GPSIMD_CORE_PARTITIONS):
            rows = slice(c * _GPSIMD_CORE_PARTITIONS, (c + 1) * _GPSIMD_CORE_PARTITIONS)
            idx = ix[rows].flatten(order="F")[:nv]
            if (idx + n > F).any():
                raise OutOfBoundsError(
                    f"[out-of-bounds] {op}: core {c} index {int(idx.max())} + {n} elements passes the {F} "
                    "elements of a partition (undefined on hardware)"
                )
            cols = idx[:, None] + np.arange(n)[None, :]
            out[rows] = x[rows][:, cols]
        dst.write(out.reshape(dst.shape))
    return NkiInstruction(op)


def nonzero_with_count(
    dst: NkiTensor, src: NkiTensor, index_offset: int = 0, padding_val: int = -1, name: Any = None
) -> NkiInstruction:
    """On the first partition of each GpSimd core (SBUF partitions 0, 16, ..., 112): ``dst[p] = [indices of
    the nonzero elements of src[p] + index_offset, padding_val..., count]`` (``T + 1`` elements for ``T``
    source elements); other partitions of ``dst`` are left unchanged.  NeuronCore-v3+; src float32/int32,
    dst int32, both SBUF with the same partitions."""
    launch = _state.current()
    op = "nonzero_with_count"
    if launch.hw.nc_version < 3:
        raise LaunchError(f"[nc-version] {op} needs NeuronCore-v3+ (nc_version={launch.hw.nc_version})")
    _sbuf_operands(op, launch, ("dst", dst), ("src", src))
    P, T = src.shape[0], _free(src)
    if dst.shape[0] != P or _free(dst) != T + 1:
        raise ShapeMismatchError(
            f"[nonzero-shape] {op}: dst{list(dst.shape)} must be [{P}, {T + 1}] for src{list(src.shape)}"
        )
    if src.dtype not in ("float32", "int32") or dst.dtype != "int32":
        raise DtypeError(
            f"[nonzero-dtype] {op}: src float32/int32 and dst int32, got {src.dtype} / {dst.dtype}"
        )
    for v, a in ((index_offset, "index_offset"), (padding_val, "padding_val")):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            raise TypeError(f"{op}: {a} must be an int32, got {v!r}")
    key = (op, dst.shape, src.shape, src.dtype, launch.program_id)
    _emit(launch, key, lambda: _rec(op, "gpsimd", (dst, src), launch, flops=0))
    _use(launch, (src,), (dst,))
    if not launch.trace_only:
        start = _sp.tensor_start(src)
        x = np.asarray(src.read()).reshape(P, T)
        y = np.asarray(dst.read()).reshape(P, T + 1).copy()
        for r in range(P):
            if (start + r) % _GPSIMD_CORE_PARTITIONS:
                continue
            nz = np.flatnonzero(x[r] != 0)
            row = np.full(T + 1, int(padding_val), dtype=np.int64)
            row[: nz.size] = nz + int(index_offset)
            row[T] = nz.size
            y[r] = row
        dst.write(_dt.cast(y, "int32").reshape(dst.shape))
    return NkiInstruction(op)


__all__ = ["nc_n_gather", "nonzero_with_count"]
