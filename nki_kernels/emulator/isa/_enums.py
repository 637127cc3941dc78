"""NKI enums (engine, reduce_cmd, dge_mode, ...), the instruction handle and the engine -> trace-name map."""

from __future__ import annotations

import enum
from typing import Any

from .. import state as _state
from ..errors import (
    NkiEmulatorError,
)

# --------------------------------------------------------------------------------------------- enums


class engine(enum.Enum):  # noqa: N801 (NKI name)
    unknown = 0
    tensor = 1
    scalar = 2
    gpsimd = 3
    dma = 4
    vector = 5
    sync = 6


tensor_engine = engine.tensor
vector_engine = engine.vector
scalar_engine = engine.scalar
gpsimd_engine = engine.gpsimd
unknown_engine = engine.unknown


class reduce_cmd(enum.Enum):  # noqa: N801
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


class dge_mode(enum.Enum):  # noqa: N801
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class oob_mode(enum.Enum):  # noqa: N801
    error = 0
    skip = 1


class matmul_perf_mode(enum.Enum):  # noqa: N801
    none = "none"
    double_row = "double_row"


class nc_version(enum.Enum):  # noqa: N801
    """NeuronCore generation: gen2 (trn1/inf2), gen3 (trn2), gen4 (trn3).  Members are ordered by
    generation (``nisa.get_nc_version() >= nisa.nc_version.gen3``, as NKI 0.6 kernels write it); comparing
    with anything but another member raises ``TypeError``."""

    gen2 = 2
    gen3 = 3
    gen4 = 4

    def __lt__(self, other: Any) -> bool:
        if type(other) is not nc_version:
            return NotImplemented
        return self.value < other.value

    def __le__(self, other: Any) -> bool:
        if type(other) is not nc_version:
            return NotImplemented
        return self.value <= other.value

    def __gt__(self, other: Any) -> bool:
        if type(other) is not nc_version:
            return NotImplemented
        return self.value > other.value

    def __ge__(self, other: Any) -> bool:
        if type(other) is not nc_version:
            return NotImplemented
        return self.value >= other.value


class dma_engine(enum.Enum):  # noqa: N801
    dma = 1
    gpsimd_dma = 2


NkiValidationError = NkiEmulatorError


class NkiInstruction:
    """Handle returned by every ISA call (scheduling hints are accepted and ignored: execution is eager)."""

    __slots__ = ("op",)

    def __init__(self, op: str) -> None:
        self.op = op

    def depends_on(self, *others: Any) -> NkiInstruction:
        return self


def get_nc_version() -> nc_version:
    return nc_version(_state.current().hw.nc_version)


def get_nc_sub_version() -> int:
    return 0


_OOB = oob_mode
_DGE = dge_mode

_ENGINE_TRACE = {
    engine.tensor: "tensor",
    engine.vector: "vector",
    engine.scalar: "scalar",
    engine.gpsimd: "gpsimd",
    engine.dma: "dma",
}
# Same mapping keyed by id(member): a dict lookup keyed by an enum member runs Enum.__hash__ (Python code).
_ENGINE_TRACE_ID = {id(k): v for k, v in _ENGINE_TRACE.items()}
_E = engine
_TC_ENGINES = (_E.vector, _E.scalar, _E.gpsimd)
_TT_ENGINES = (_E.vector, _E.gpsimd)

_RC = reduce_cmd
