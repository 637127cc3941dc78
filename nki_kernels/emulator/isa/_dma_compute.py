"""``nisa.dma_compute``: scaled element-wise reduction of several tensors inside a DMA engine (NKI 0.6).

Rules and semantics from the 0.6 docstring (aws-neuron/aws-neuron-sdk @ 81ce03a,
``nki/api/nki/isa/__init__.py``, ``dma_compute``):

* ``dst = reduce_op(srcs[0] * scales[0], srcs[1] * scales[1], ...)``, computed in fp32 (every source cast to
  fp32, one cast of the fp32 result to ``dst.dtype``); only ``reduce_op=nl.add``; ``scales`` None or all
  1.0; 1 to 16 sources; every source and ``dst`` hold the same number of elements; HBM or SBUF (never PSUM);
  compile-time addresses (no ``scalar_offset`` view).
* Read-modify-write with a ``vector_offset`` view, exactly 2 sources, ``unique_indices=True``:
  scatter ``dst(HBM)[idx] = dst(HBM)[idx] + src(SBUF)`` (``dst`` in HBM with ``vector_offset``, one source the
  same view as ``dst``, the other in SBUF) or gather ``dst(SBUF) = dst(SBUF) + src(HBM)[idx]`` (``dst`` in
  SBUF, one source in HBM with ``vector_offset``, the other the same view as ``dst``).  ``oob_mode=skip``
  drops out-of-range rows (``dst`` keeps them), ``error`` raises.
* Traced as one DMA record ``dma_compute`` (engine ``dma``) reading every source and writing ``dst``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import dtypes as _dt
from .. import opdefs
from .. import state as _state
from ..errors import MemorySpaceError, ShapeMismatchError, ViewError
from ..tensor import NkiTensor, psum, sbuf
from ..trace import TraceRecord
from ._common import _emit
from ._dma import _direction, dma_descriptors
from ._enums import _OOB, NkiInstruction, oob_mode
from ._events import _use

MAX_SRCS = 16


def _same_view(a: NkiTensor, b: NkiTensor) -> bool:
    return (
        a._st is b._st
        and a.offset == b.offset
        and a.shape == b.shape
        and a.strides == b.strides
        and (a._dyn is b._dyn or (a._dyn is not None and b._dyn is not None and a._dyn[1] is b._dyn[1]))
    )


def _vector(t: NkiTensor) -> bool:
    return t._dyn is not None and t._dyn[0] == "vector"


def _rmw_mode(op: str, dst: NkiTensor, srcs: list[NkiTensor], unique_indices: Any) -> str | None:
    """``"scatter"`` / ``"gather"`` for the read-modify-write forms, None without ``vector_offset``."""
    if not any(_vector(t) for t in (dst, *srcs)):
        return None
    if len(srcs) != 2:
        raise ShapeMismatchError(
            f"[dma-compute-rmw] {op}: read-modify-write with vector_offset takes exactly 2 srcs, "
            f"got {len(srcs)}"
        )
    if unique_indices is not True:
        raise ValueError(f"[dma-compute-rmw] {op}: unique_indices must be True with vector_offset (got "
                         f"{unique_indices!r}; non-unique indices are not supported)")  # fmt: skip
    if _vector(dst):
        if dst._st.buffer.on_chip:
            raise MemorySpaceError(f"[dma-compute-rmw] {op}: a scatter's dst (vector_offset) must be in HBM")
        same = [s for s in srcs if _same_view(s, dst)]
        other = [s for s in srcs if not _same_view(s, dst)]
        if len(same) != 1 or len(other) != 1 or other[0]._st.buffer is not sbuf or _vector(other[0]):
            raise ViewError(
                f"[dma-compute-rmw] {op}: scatter needs one src that is dst's own view and one plain SBUF src"
            )
        return "scatter"
    if dst._st.buffer is not sbuf:
        raise MemorySpaceError(f"[dma-compute-rmw] {op}: a gather's dst must be in SBUF, got {dst._desc()}")
    same = [s for s in srcs if _same_view(s, dst)]
    other = [s for s in srcs if not _same_view(s, dst)]
    if len(same) != 1 or len(other) != 1 or not _vector(other[0]) or other[0]._st.buffer.on_chip:
        raise ViewError(
            f"[dma-compute-rmw] {op}: gather needs one src that is dst itself and one HBM src with "
            "vector_offset"
        )
    return "gather"


def dma_compute(
    dst: NkiTensor,
    srcs: list[NkiTensor],
    reduce_op: Any,
    scales: Any = None,
    unique_indices: bool = True,
    oob_mode: oob_mode = oob_mode.error,
    name: Any = None,
) -> NkiInstruction:
    """``dst = srcs[0] + srcs[1] + ...`` in fp32 on a DMA engine (module docstring: rules and the scatter /
    gather read-modify-write forms).  ``dst`` and every source: same element count, HBM or SBUF."""
    launch = _state.current()
    op = "dma_compute"
    if not isinstance(dst, NkiTensor):
        raise TypeError(f"{op}: dst must be an NkiTensor, got {type(dst).__name__}")
    if not isinstance(srcs, (list, tuple)) or not srcs:
        raise TypeError(f"{op}: srcs must be a non-empty list of tensors, got {srcs!r}")
    srcs = list(srcs)
    if len(srcs) > MAX_SRCS:
        raise ShapeMismatchError(f"[dma-compute-srcs] {op}: at most {MAX_SRCS} srcs, got {len(srcs)}")
    for i, s in enumerate(srcs):
        if not isinstance(s, NkiTensor):
            raise TypeError(f"{op}: srcs[{i}] must be an NkiTensor, got {type(s).__name__}")
    if opdefs.op_name(reduce_op, "reduce_op") != "add":
        raise ValueError(
            f"[dma-compute-op] {op}: reduce_op must be nl.add (the only one supported), got {reduce_op!r}"
        )
    if scales is not None and (len(scales) != len(srcs) or any(float(v) != 1.0 for v in scales)):
        raise ValueError(
            f"[dma-compute-scales] {op}: scales must be None or {len(srcs)} values all 1.0, got {scales!r}"
        )
    if type(oob_mode) is not _OOB:
        raise TypeError(f"{op}: oob_mode must be an nisa.oob_mode member, got {oob_mode!r}")
    for t, a in ((dst, "dst"), *((s, f"srcs[{i}]") for i, s in enumerate(srcs))):
        if t._st.buffer is psum:
            raise MemorySpaceError(
                f"[memory-space] {op}: {a}={t._desc()} is in PSUM; dma_compute uses HBM/SBUF"
            )
        if t._st.buffer.on_chip and t.shape[0] > launch.hw.pmax:
            raise ShapeMismatchError(
                f"[partition-limit] {op}: {a}={t._desc()} exceeds {launch.hw.pmax} partitions"
            )
        if t._dyn is not None and t._dyn[0] == "scalar":
            raise ViewError(
                f"[dma-compute-address] {op}: {a} has a runtime scalar_offset; dma_compute needs "
                "compile-time "
                "addresses (only vector_offset read-modify-write is indirect)"
            )
        if t.size != dst.size:
            raise ShapeMismatchError(
                f"[dma-size] {op}: {a}{list(t.shape)} has {t.size} elements, dst{list(dst.shape)} {dst.size}"
            )
    mode = _rmw_mode(op, dst, srcs, unique_indices)
    _record(op, dst, srcs, launch, mode)
    if launch.trace_only:
        return NkiInstruction(op)
    skip = oob_mode is _OOB.skip
    acc = np.zeros(dst.shape, np.float32)
    ok = None
    for s in srcs:
        if _vector(s):  # validate indices (raise under error), mark skipped rows
            idx = s.flat_indices(oob_skip=skip)
            ok = (idx >= 0).reshape(s.shape[0], -1).all(axis=1) if idx is not None else None
        v = s.read(oob_skip=skip)
        acc = acc + _dt.to_fp32(np.asarray(v)).reshape(dst.shape)
    res = _dt.cast(acc, dst.dtype)
    if mode == "scatter":
        dst.write(res.reshape(dst.shape), oob_skip=skip)  # out-of-range rows are not written
    elif mode == "gather" and ok is not None and not ok.all():
        old = np.asarray(dst.read()).reshape(dst.shape[0], -1)
        new = res.reshape(dst.shape[0], -1).copy()
        new[~ok] = old[~ok]
        dst.write(new.reshape(dst.shape))
    else:
        dst.write(res.reshape(dst.shape))
    return NkiInstruction(op)


def _record(op: str, dst: NkiTensor, srcs: list[NkiTensor], launch: _state.Launch, mode: str | None) -> None:
    sig = tuple((s.shape, s.strides, s.dtype, s._st.buffer, s._dyn is None) for s in srcs)
    key = (
        op,
        dst.shape,
        dst.strides,
        dst.dtype,
        dst._st.buffer,
        dst._dyn is None,
        sig,
        launch.program_id,
        mode,
    )

    def make() -> TraceRecord:
        onchip = next((t for t in (dst, *srcs) if t._st.buffer.on_chip), None)
        parts = onchip.shape[0] if onchip is not None else 0
        n = dst.size
        hist: dict[int, int] = {}
        for s in srcs:
            for run, cnt in dma_descriptors(dst, s):
                hist[run] = hist.get(run, 0) + cnt
        meta: tuple = (("reduce_op", "add"), ("srcs", len(srcs)))
        if mode is not None:
            meta += (("indirect", "vector"), ("rmw", mode))
        return TraceRecord(
            op=op,
            engine="dma",
            shapes=(dst.shape, *(s.shape for s in srcs)),
            dtypes=(dst.dtype, *(s.dtype for s in srcs)),
            buffers=(dst._st.buffer.trace_name, *(s._st.buffer.trace_name for s in srcs)),
            partitions=parts,
            free_elems=n // parts if parts else n,
            bytes_read=sum(s.size * s.itemsize for s in srcs),
            bytes_written=n * dst.itemsize,
            flops=n * (len(srcs) - 1),
            descriptors=tuple(sorted(hist.items())),
            direction=_direction(dst, srcs[0]),
            program_id=launch.program_id,
            meta=tuple(sorted(meta)),
        )

    _emit(launch, key, make)
    idx = tuple(t._dyn[1] for t in (dst, *srcs) if t._dyn is not None and isinstance(t._dyn[1], NkiTensor))
    _use(launch, (*srcs, *idx), (dst,))
