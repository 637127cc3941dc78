"""The access hook: each instruction, right after its record is counted, reports the tensors it reads and
writes (``_use``).  That stamps their storages with the instruction's number for last-use liveness
(:mod:`~nki_kernels.emulator.liveness`) and, when the launch records events (``keep_events=True``),
appends the event (:meth:`Trace.iter_events`)."""

from __future__ import annotations

from typing import Any

from .. import state as _state
from ..tensor import NkiTensor

_SPACE = {"sbuf": "sbuf", "psum": "psum", "hbm": "hbm", "shared_hbm": "hbm"}


def _use(launch: _state.Launch, reads: tuple, writes: tuple) -> None:
    """One issued instruction accessed ``reads`` and ``writes`` (non-tensors are skipped).  An operand that
    is an out-of-bounds ``.ap`` view is refused here (trace-only runs read no values)."""
    n = launch.seq = launch.seq + 1
    for t in reads:
        if type(t) is NkiTensor:
            if t._oob is not None:
                t.check_in_bounds()
            live = t._st.live
            if live[0] < 0:  # first access
                live[1] = n
            live[0] = n
    for t in writes:
        if type(t) is NkiTensor:
            if t._oob is not None:
                t.check_in_bounds()
            live = t._st.live
            if live[0] < 0:
                live[1] = n
            live[0] = n
    if launch.keep_events:
        _log(launch, reads, writes)


def _use_rw(launch: _state.Launch, r: NkiTensor, w: NkiTensor) -> None:
    """``_use`` for the common one-read, one-write instruction (no tuples, no loops: hot path)."""
    if r._oob is not None or w._oob is not None:
        _use(launch, (r,), (w,))
        return
    n = launch.seq = launch.seq + 1
    live = r._st.live
    if live[0] < 0:
        live[1] = n
    live[0] = n
    live = w._st.live
    if live[0] < 0:
        live[1] = n
    live[0] = n
    if launch.keep_events:
        _log(launch, (r,), (w,))


def _use_rrw(launch: _state.Launch, r1: NkiTensor, r2: NkiTensor, w: NkiTensor) -> None:
    """``_use`` for two reads and one write (hot path)."""
    if r1._oob is not None or r2._oob is not None or w._oob is not None:
        _use(launch, (r1, r2), (w,))
        return
    n = launch.seq = launch.seq + 1
    live = r1._st.live
    if live[0] < 0:
        live[1] = n
    live[0] = n
    live = r2._st.live
    if live[0] < 0:
        live[1] = n
    live[0] = n
    live = w._st.live
    if live[0] < 0:
        live[1] = n
    live[0] = n
    if launch.keep_events:
        _log(launch, (r1, r2), (w,))


def _add_region(flat: list[int], t: NkiTensor, ev: Any) -> None:
    st = t._st
    root = st.base or st
    if root.evlog is not ev:  # numbered on first sight, once per launch
        root.evlog = ev
        root.evbuf = ev.new_buf(_SPACE[root.buffer.trace_name])
    p0, p1, b0, b1 = t.access_box()
    flat += (root.evbuf, p0 | p1 << 16, b0, b1)


def _log(launch: _state.Launch, reads: tuple, writes: tuple) -> None:
    """Append the event of the instruction just counted (``launch.last``): the regions of the tensors in
    ``reads`` and ``writes`` (non-tensor operands, scalars and ``None``, are skipped).  A dtype view shares
    its allocation's number (``Storage.base``)."""
    ev = launch.trace.events
    flat: list[int] = []
    for t in reads:
        if isinstance(t, NkiTensor):
            _add_region(flat, t, ev)
    nreads = len(flat) >> 2
    for t in writes:
        if isinstance(t, NkiTensor):
            _add_region(flat, t, ev)
    ev.add(launch.last, flat, nreads)
