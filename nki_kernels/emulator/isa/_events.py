"""The ordered event log hook: each instruction, right after its record is counted, reports the tensors
it reads and writes when the launch records events (``keep_events=True``); see :meth:`Trace.iter_events`."""

from __future__ import annotations

from typing import Any

from .. import state as _state
from ..tensor import NkiTensor

_SPACE = {"sbuf": "sbuf", "psum": "psum", "hbm": "hbm", "shared_hbm": "hbm"}


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
