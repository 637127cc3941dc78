"""Runtime registers: ``VirtualRegister`` and ``register_alloc/move/load/store``."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import dtypes as _dt
from ..errors import (
    ShapeMismatchError,
)
from ..tensor import NkiTensor


class VirtualRegister:
    """A 32-bit runtime register; in the emulator it simply holds a Python int (``.value``)."""

    __slots__ = ("value", "frozen")

    def __init__(self, state: Any = None, frozen: bool = False) -> None:
        self.value = 0 if state is None else int(state)
        self.frozen = frozen

    def __index__(self) -> int:
        return self.value

    def __int__(self) -> int:
        return self.value

    def __repr__(self) -> str:
        return f"VirtualRegister({self.value})"


# --------------------------------------------------------------------------------------------- registers


def register_alloc(x: Any = None) -> VirtualRegister:
    return VirtualRegister(0 if x is None else int(x))


def register_move(dst: VirtualRegister, src: Any) -> None:
    dst.value = int(src.value if isinstance(src, VirtualRegister) else src)


def register_load(dst: VirtualRegister, src: NkiTensor) -> None:
    if src.size != 1:
        raise ShapeMismatchError(f"register_load: src {src._desc()} must have a single element")
    src.check_in_bounds()  # an out-of-bounds .ap view, also in trace-only runs (no values read there)
    dst.value = 0 if src._st.data is None else int(np.asarray(src.read()).reshape(-1)[0])


def register_store(dst: NkiTensor, src: VirtualRegister) -> None:
    if dst.size != 1:
        raise ShapeMismatchError(f"register_store: dst {dst._desc()} must have a single element")
    dst.check_in_bounds()
    if dst._st.data is not None:
        dst.write(_dt.cast(np.full(dst.shape, src.value, dtype=np.int64), dst.dtype))
