"""A CPU emulator of NKI 0.6 (Neuron 2.32): numpy interpreter, hardware rules, instruction trace.

``nki``, ``language`` (``nl``) and ``isa`` (``nisa``) mirror the real packages; kernels import them
through :mod:`nki_kernels._nki`.  Emulator extensions: :func:`run` (outputs + :class:`Trace`),
:class:`TensorSpec` (trace-only placeholders), :class:`HwConfig` (limits), the error classes.
See ``docs/emulator.md``.
"""

from . import isa, language, nki
from .errors import (
    AllocationError,
    DmaTransposeError,
    DtypeError,
    EmulatorWarning,
    LaunchError,
    MatmulTileError,
    MemorySpaceError,
    NkiEmulatorError,
    OutOfBoundsError,
    PartitionLimitError,
    PsumLimitError,
    SbufCapacityError,
    ShapeMismatchError,
    StartPartitionError,
    ViewError,
)
from .hw import TRN2, HwConfig
from .isa import dma_descriptors
from .nki import Kernel, TensorSpec, jit, run, simulate
from .tensor import NkiTensor
from .trace import Trace, TraceRecord

NKI_VERSION = "0.6.0"
NEURON_SDK_VERSION = "2.32.0"

__all__ = [
    "NEURON_SDK_VERSION",
    "NKI_VERSION",
    "TRN2",
    "AllocationError",
    "DmaTransposeError",
    "DtypeError",
    "EmulatorWarning",
    "HwConfig",
    "Kernel",
    "LaunchError",
    "MatmulTileError",
    "MemorySpaceError",
    "NkiEmulatorError",
    "NkiTensor",
    "OutOfBoundsError",
    "PartitionLimitError",
    "PsumLimitError",
    "SbufCapacityError",
    "ShapeMismatchError",
    "StartPartitionError",
    "TensorSpec",
    "Trace",
    "TraceRecord",
    "ViewError",
    "dma_descriptors",
    "isa",
    "jit",
    "language",
    "nki",
    "run",
    "simulate",
]
