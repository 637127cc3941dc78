"""Cross-core instructions of NKI 0.6: ``nisa.sendrecv`` and ``nisa.core_barrier`` (NeuronCore-v3+, LNC2),
exported by :mod:`nki_kernels.emulator.isa`.

Both instructions are fully checked and traced in every mode (so the cost model prices them).  With values
(not trace-only) they move data and wait as the hardware does: the programs of the launch take turns
(:mod:`~nki_kernels.emulator.lnc`): ``sendrecv`` posts ``src`` to the peer and waits for the peer's data
into ``dst``; ``core_barrier`` waits until the peer reaches its matching barrier.  Trace-only runs the
programs one after the other and moves nothing.  Rules from the 0.6 docstrings
(aws-neuron/aws-neuron-sdk ``nki/api/nki/isa/__init__.py``).
"""

from __future__ import annotations

from typing import Any

from .. import dtypes as _dt
from .. import state as _state
from ..errors import DtypeError, LaunchError, MemorySpaceError, ShapeMismatchError
from ..tensor import NkiTensor, sbuf, shared_hbm
from ..trace import TraceRecord
from ._common import _emit, _rec
from ._dma import _dma_record
from ._enums import NkiInstruction
from ._enums import dma_engine as _DmaEngine
from ._enums import engine as _Engine
from ._events import _use
from ._rules import _free

_GPSIMD_DMA_BYTES = {4: 1024, 2: 512, 1: 256}  # per-partition limit of dma_engine.gpsimd_dma by dtype size


def _lnc2(op: str, launch: _state.Launch) -> None:
    if launch.hw.nc_version < 3:
        raise LaunchError(f"[nc-version] {op} needs NeuronCore-v3+ (nc_version={launch.hw.nc_version})")
    if launch.num_programs != 2:
        raise LaunchError(
            f"[lnc] {op} is only allowed with LNC enabled (launch kernel[2]); this launch has "
            f"{launch.num_programs} program(s)"
        )


def _scheduler(op: str, launch: _state.Launch) -> Any:
    """The launch's LNC2 scheduler, None in trace-only mode (no values cross then)."""
    if launch.trace_only:
        return None
    if launch.scheduler is None:  # cannot happen for launches made by nki.py; guards direct state use
        raise LaunchError(f"[lnc-sequential] {op}: this launch runs its programs without a scheduler")
    return launch.scheduler


def sendrecv(
    src: NkiTensor,
    dst: NkiTensor,
    send_to_rank: Any,
    recv_from_rank: Any,
    pipe_id: Any,
    dma_engine: _DmaEngine = _DmaEngine.dma,
    name: Any = None,
) -> NkiInstruction:
    """Send ``src`` to core ``send_to_rank``'s ``dst`` and receive core ``recv_from_rank``'s ``src`` into
    ``dst``.  Rules: NeuronCore-v3+, LNC2 launch, ranks 0 or 1, ``src``/``dst`` in SBUF with equal dtype and
    shape; ``dma_engine.gpsimd_dma`` caps the bytes per partition at 1024 (4-byte) / 512 (2-byte) /
    256 (1-byte dtypes).  Traced as an SBUF->SBUF DMA (``dma_engine.dma``) or a GpSimd instruction
    (``gpsimd_dma``, GpSimd triggers it); with values, waits for the peer's data (module docstring)."""
    launch = _state.current()
    op = "sendrecv"
    _lnc2(op, launch)
    for t, a in ((src, "src"), (dst, "dst")):
        if not isinstance(t, NkiTensor):
            raise TypeError(f"{op}: {a} must be an NkiTensor, got {type(t).__name__}")
        if t._st.buffer is not sbuf:
            raise MemorySpaceError(f"[memory-space] {op}: {a}={t._desc()} must be in SBUF")
    if src.dtype != dst.dtype:
        raise DtypeError(f"[sendrecv-dtype] {op}: src dtype {src.dtype} must equal dst dtype {dst.dtype}")
    if src.shape != dst.shape:
        raise ShapeMismatchError(
            f"[sendrecv-shape] {op}: src{list(src.shape)} and dst{list(dst.shape)} differ"
        )
    for r, a in ((send_to_rank, "send_to_rank"), (recv_from_rank, "recv_from_rank")):
        if int(r) not in (0, 1):
            raise ValueError(f"{op}: {a} must be 0 or 1 (the two cores of an LNC2 pair), got {r!r}")
    if type(dma_engine) is not _DmaEngine:
        raise TypeError(f"{op}: dma_engine must be an nisa.dma_engine member, got {dma_engine!r}")
    meta = (("pipe_id", int(pipe_id)), ("send_to", int(send_to_rank)), ("recv_from", int(recv_from_rank)))
    if dma_engine is _DmaEngine.gpsimd_dma:
        lim = _GPSIMD_DMA_BYTES.get(_dt.itemsize(src.dtype))
        nbytes = _free(src) * _dt.itemsize(src.dtype)
        if lim is not None and nbytes > lim:
            raise ShapeMismatchError(
                f"[sendrecv-gpsimd] {op} with dma_engine.gpsimd_dma moves at most {lim} B per partition for "
                f"{src.dtype}, src{list(src.shape)} has {nbytes} B"
            )
        key = (op, "gpsimd", src.shape, src.dtype, meta, launch.program_id)
        _emit(launch, key, lambda: _rec(op, "gpsimd", (dst, src), launch, flops=0, meta=meta))
        _use(launch, (src,), (dst,))
    else:
        _dma_record(op, dst, src, launch, meta)
    sched = _scheduler(op, launch)
    if sched is not None:
        pid, pipe = launch.program_id, int(pipe_id)
        sched.send(pid, int(send_to_rank), pipe, src.read().copy())  # src's values at issue time
        dst.write(sched.recv(pid, int(recv_from_rank), pipe))
    return NkiInstruction(op)


def core_barrier(
    data: NkiTensor, cores: Any, engine: _Engine = _Engine.gpsimd, name: Any = None
) -> NkiInstruction:
    """Barrier between the two cores of an LNC2 pair on the shared HBM tensor ``data``, executed by
    ``engine`` (default GpSimd; only that engine blocks).  Rules: NeuronCore-v3+, LNC2 launch,
    ``cores == (0, 1)``, ``data`` in ``nl.shared_hbm``.  Traced as one zero-element instruction on the
    engine (a semaphore exchange: the cost model charges its fixed cost); with values, returns once the
    other program has reached its matching barrier."""
    launch = _state.current()
    op = "core_barrier"
    _lnc2(op, launch)
    if not isinstance(data, NkiTensor) or data._st.buffer is not shared_hbm:
        raise MemorySpaceError(f"[memory-space] {op}: data must be a shared HBM tensor, got {data!r}")
    if tuple(int(c) for c in cores) != (0, 1):
        raise ValueError(f"{op}: only cores=(0, 1) is supported, got {cores!r}")
    if type(engine) is not _Engine:
        raise TypeError(f"{op}: engine must be an nisa.engine member, got {engine!r}")
    en = engine.name
    if en not in ("gpsimd", "vector", "scalar"):
        raise ValueError(f"{op}: engine must be gpsimd, vector or scalar, got {engine!r}")
    key = (op, en, data.shape, launch.program_id)
    _emit(
        launch,
        key,
        lambda: TraceRecord(
            op=op,
            engine=en,
            shapes=(data.shape,),
            dtypes=(data.dtype,),
            buffers=(data._st.buffer.trace_name,),
            partitions=0,
            free_elems=0,
            program_id=launch.program_id,
            meta=(("cores", (0, 1)),),
        ),
    )
    _use(launch, (data,), (data,))  # the semaphore exchange reads and writes the shared tensor
    sched = _scheduler(op, launch)
    if sched is not None:
        sched.barrier(launch.program_id)
    return NkiInstruction(op)


__all__ = ["core_barrier", "sendrecv"]
