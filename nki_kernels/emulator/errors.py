"""Errors raised by the NKI emulator when a kernel breaks a hardware or API rule.

Every message starts with the rule's name in brackets, e.g. ``[partition-limit]``, and names the
offending operand and shape.
"""

from __future__ import annotations


class NkiEmulatorError(Exception):
    """Base class: a kernel broke an NKI rule the emulator enforces."""


class PartitionLimitError(NkiEmulatorError):
    """An on-chip tensor or operand has more than ``pmax`` (128) partitions."""


class PsumLimitError(NkiEmulatorError):
    """PSUM bank (2 KiB/partition per matmul tile) or total (16 KiB/partition) exceeded."""


class SbufCapacityError(NkiEmulatorError):
    """Live SBUF allocations exceed the per-partition capacity."""


class AllocationError(NkiEmulatorError, ValueError):
    """``address=`` placement broken: malformed, out of range, PSUM not bank-aligned, or overlapping another
    placed tile while both are live."""


class MatmulTileError(NkiEmulatorError):
    """nc_matmul / nc_transpose operand limits (contraction, stationary, moving sizes, dtypes)."""


class MemorySpaceError(NkiEmulatorError):
    """An operand lives in a memory space the instruction cannot access."""


class OutOfBoundsError(NkiEmulatorError, IndexError):
    """A static slice or a runtime (indirect) address falls outside the tensor/storage."""


class ShapeMismatchError(NkiEmulatorError, ValueError):
    """Operands of an instruction have incompatible shapes."""


class ViewError(NkiEmulatorError, ValueError):
    """An illegal tensor view (permute/broadcast/reshape/ap rule broken)."""


class DmaTransposeError(NkiEmulatorError, ValueError):
    """``nisa.dma_transpose`` contract broken (axes, exact dst shape, hardware-DGE source shape, indirect
    rules)."""


class DtypeError(NkiEmulatorError, TypeError):
    """An operand dtype the instruction does not accept."""


class LaunchError(NkiEmulatorError, ValueError):
    """Bad kernel launch: unsupported lnc, bad arguments, op called outside a kernel."""


class EmulatorWarning(UserWarning):
    """Behaviour that is undefined on hardware (e.g. accumulate=True onto never-written PSUM)."""


class StartPartitionError(PartitionLimitError):
    """A compute-engine SBUF/PSUM access starts at a partition its partition count does not allow
    (>64 partitions: 0; 33-64: 0 or 64; <=32: 0/32/64/96)."""
