"""Operand rule checks shared by the instructions: on-chip space, partition limit, matching shapes, engine
choice."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import start_partition as _sp
from .. import state as _state
from ..errors import (
    MemorySpaceError,
    PartitionLimitError,
    ShapeMismatchError,
)
from ..tensor import NkiTensor, psum
from ._enums import engine


def _onchip(t: Any, op: str, arg: str, launch: _state.Launch) -> NkiTensor:
    """The on-chip operand rule: ``t`` is an :class:`NkiTensor` (``TypeError``) in SBUF or PSUM
    (``MemorySpaceError``) with at most ``pmax`` partitions (``PartitionLimitError``) whose start partition
    meets the start-partition rule (:mod:`..start_partition`); returns ``t``.

    The hot instructions inline the passing case, tagged ``# fast path of _rules._onchip``::

        if not (type(x) is NkiTensor and x._st.buffer.on_chip and x.shape[0] <= pmax
                and x.offset < x._st.size // x._st.shape[0]):  # start partition 0
            _onchip(x, op, "x", launch)

    so a rule added here is skipped wherever that condition passes. A new operand rule must therefore be a
    separate check called after this one, never part of the pass condition; tests/test_emulator_onchip_rule.py
    checks every tagged condition against this form and feeds every on-chip instruction an HBM and a
    129-partition operand."""
    if not isinstance(t, NkiTensor):
        raise TypeError(f"{op}: {arg} must be an NkiTensor, got {type(t).__name__}")
    if not t._st.buffer.on_chip:
        raise MemorySpaceError(
            f"[memory-space] {op}: operand {arg}={t._desc()} is in {t._st.buffer.name}; this engine reads "
            "and writes SBUF/PSUM only (move HBM data with nisa.dma_copy first)"
        )
    if t.shape[0] > launch.hw.pmax:
        raise PartitionLimitError(
            f"[partition-limit] {op}: {arg}={t._desc()} has {t.shape[0]} partitions, limit {launch.hw.pmax}"
        )
    st = t._st
    if t.offset >= st.size // st.shape[0]:  # not at partition 0: the start-partition rule decides
        _sp.check(op, arg, t, launch.hw.pmax)
    return t


def _free(t: NkiTensor) -> int:
    sh = t.shape
    return sh[1] if len(sh) == 2 else math.prod(sh[1:])


def _same_pf(op: str, a: NkiTensor, an: str, b: NkiTensor, bn: str) -> None:
    if a.shape[0] != b.shape[0]:
        raise ShapeMismatchError(
            f"[partition-mismatch] {op}: number of partitions (dim 0) differs: {an}{list(a.shape)} vs "
            f"{bn}{list(b.shape)}"
        )
    if _free(a) != _free(b):
        raise ShapeMismatchError(
            f"[free-size-mismatch] {op}: elements per partition differ: {an}{list(a.shape)} has {_free(a)}, "
            f"{bn}{list(b.shape)} has {_free(b)}"
        )


def _pick_engine(eng: Any, default: engine, op: str, allowed: tuple[engine, ...]) -> engine:
    if eng is None or eng is engine.unknown:
        return default
    if not isinstance(eng, engine):
        raise TypeError(f"{op}: engine must be an nisa.engine member, got {eng!r} (raw ints are rejected)")
    if eng not in allowed:
        raise ValueError(f"{op}: engine={eng.name} not supported; allowed: {[e.name for e in allowed]}")
    return eng


def _no_gpsimd_psum(op: str, eng: engine, *ts: NkiTensor) -> None:
    if eng is engine.gpsimd:
        for t in ts:
            if t is not None and t._st.buffer is psum:
                raise MemorySpaceError(f"[memory-space] {op}: GpSimd cannot access PSUM ({t._desc()})")


def _axes(axis: Any, nd: int, opn: str) -> tuple[int, ...]:
    ax = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    ax = tuple(sorted(int(a) % nd for a in ax))
    if not ax or 0 in ax:
        raise ValueError(f"{opn}: axis {axis} must name free dims only (axis 0 is the partition dim)")
    if ax != tuple(range(nd - len(ax), nd)):
        raise ValueError(f"{opn}: axis {axis} must be the trailing free dims of a {nd}-D tensor")
    return ax
