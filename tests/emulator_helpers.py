"""Kernel-side moves the emulator tests share (inside a kernel run by ``nki_kernels.emulator.run``)."""

from __future__ import annotations

from typing import Any

from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import language as nl


def to_sbuf(x: Any) -> Any:
    """A new SBUF tile of ``x``'s shape and dtype holding ``x`` (one ``dma_copy``)."""
    t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(t, x)
    return t


def to_hbm(t: Any) -> Any:
    """A new shared-HBM tensor of ``t``'s shape and dtype holding ``t`` (one ``dma_copy``): the output."""
    o = nl.ndarray(t.shape, t.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(o, t)
    return o
