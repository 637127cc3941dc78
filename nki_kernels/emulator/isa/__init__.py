"""``nki.isa`` for the emulator: one function per hardware instruction, destination first.

Every instruction validates its operands (memory spaces, partitions, per-partition sizes, engine
limits), appends one :class:`~nki_kernels.emulator.trace.TraceRecord` and, unless the launch is
trace-only, computes its result in numpy: inputs up-cast to fp32, math in fp32, result cast to
``dst.dtype`` (round-to-nearest-even; ints round half-even and saturate).

One module per engine family, so an instruction's semantics, its rule checks and its trace record sit
together: ``_dma`` (``dma_copy``, ``dma_transpose``, descriptors), ``_tensor_engine`` (``nc_matmul``,
``nc_transpose``), ``_scalar_engine`` (``activation*``), ``_vector_engine`` (``tensor_tensor``,
``tensor_scalar``, reductions, ...), ``_gpsimd`` (``iota``, ``affine_select``), ``_copy`` (``tensor_copy``,
``memset``), ``_registers``, ``_vector_ext`` (``bn_stats``/``bn_aggr``, ``tensor_tensor_scan``,
``range_select``, ``select_reduce``, ``max8``, ``nc_find_index8``, ``nc_match_replace8``,
``nc_stream_shuffle``), ``_sync`` (``sendrecv``, ``core_barrier``), ``constants``; shared operand checks live
in ``_rules``, trace bookkeeping and value helpers in ``_common``, the enums in ``_enums``.  Import
instructions from this package (``nki.isa``), not from the submodules.
"""

from __future__ import annotations

from .. import opdefs  # noqa: F401 (re-exported, as before the split)
from ..errors import (  # noqa: F401 (re-exported)
    DmaTransposeError,
    DtypeError,
    MatmulTileError,
    MemorySpaceError,
    NkiEmulatorError,
    OutOfBoundsError,
    PartitionLimitError,
    PsumLimitError,
    ShapeMismatchError,
)
from ..tensor import NkiTensor, psum, sbuf  # noqa: F401 (re-exported)
from ..trace import TraceRecord  # noqa: F401 (re-exported)
from . import constants  # noqa: F401 (nki.isa.constants: the enums under their module path)
from ._common import _emit, _store, _vals
from ._copy import memset, tensor_copy  # noqa: F401
from ._dma import (  # noqa: F401
    _dma_record,
    _dma_transpose_do,
    _dma_transpose_rules,
    dma_copy,
    dma_descriptors,
    dma_transpose,
)
from ._dma_compute import dma_compute  # noqa: F401 (DMA-engine scaled reduction, scatter/gather RMW)
from ._enums import (  # noqa: F401
    NkiInstruction,
    NkiValidationError,
    dge_mode,
    dma_engine,
    engine,
    get_nc_sub_version,
    get_nc_version,
    gpsimd_engine,
    matmul_perf_mode,
    nc_version,
    oob_mode,
    reduce_cmd,
    scalar_engine,
    tensor_engine,
    unknown_engine,
    vector_engine,
)
from ._events import _use_rw
from ._gpsimd import affine_select, iota  # noqa: F401
from ._gpsimd_ext import local_gather, nc_n_gather, nonzero_with_count  # noqa: F401 (GpSimd gathers, nonzero)
from ._mx import nc_matmul_mx, quantize_mx  # noqa: F401 (MX quantize / matmul, NeuronCore-v4)
from ._registers import (  # noqa: F401
    VirtualRegister,
    register_alloc,
    register_load,
    register_move,
    register_store,
)
from ._rules import _axes
from ._scalar_engine import activation, activation_reduce  # noqa: F401
from ._sync import core_barrier, sendrecv  # noqa: F401 (cross-core, LNC2)
from ._tensor_engine import nc_matmul, nc_transpose  # noqa: F401
from ._vector_engine import (  # noqa: F401
    reciprocal,
    scalar_tensor_tensor,
    tensor_copy_predicated,
    tensor_partition_reduce,
    tensor_reduce,
    tensor_scalar,
    tensor_scalar_reduce,
    tensor_tensor,
)
from ._vector_ext import (  # noqa: F401 (VectorE statistics, scans, selects, top-8 search, shuffle)
    bn_aggr,
    bn_stats,
    max8,
    nc_find_index8,
    nc_match_replace8,
    nc_stream_shuffle,
    range_select,
    select_reduce,
    tensor_scalar_cumulative,
    tensor_tensor_scan,
)

# The instruction-building API the rest of the emulator uses (the ``nl.*`` ops of language.py build their
# instructions with it, collectives.py records its DMAs with it): public names so no module outside this
# package reaches into its privates. Not part of ``nki.isa`` (kept out of ``__all__``).
emit = _emit
"""``emit(launch, key, make)``: count one issue of the record for ``key`` (built by ``make()`` on first
sight)."""
use_rw = _use_rw
"""``use_rw(launch, read, write)``: liveness and event bookkeeping of a one-read, one-write instruction."""
fp32_values = _vals
"""``fp32_values(t)``: the operand's values as an fp32 numpy array."""
store_values = _store
"""``store_values(dst, values)``: cast to dst's dtype and write (clears PSUM's written-by-matmul state)."""
free_axes = _axes
"""``free_axes(axis, ndim, op)``: normalise a reduction axis to trailing free dims (ValueError otherwise)."""
dma_transpose_rules = _dma_transpose_rules
"""``dma_transpose_rules(dst, src, axes, dge_mode, oob_mode, launch, hwdge_shape)``: the ``dma_transpose``
operand rules; returns the permutation."""
dma_transpose_do = _dma_transpose_do
"""``dma_transpose_do(dst, src, axes, skip, launch)``: record (and, unless trace-only, perform) a checked
``dma_transpose``."""
dma_record = _dma_record
"""``dma_record(op, dst, src, launch, meta=())``: count one DMA's TraceRecord (built on first sight) and its
accesses (``dma_copy`` and the collectives' transfers)."""
INTERNAL_API = (
    "dma_record",
    "dma_transpose_do",
    "dma_transpose_rules",
    "emit",
    "fp32_values",
    "free_axes",
    "store_values",
    "use_rw",
)

# The names ``from nki.isa import *`` gives, as before the split: the NKI ISA plus the re-exported
# errors, tensor class and memory regions.
__all__ = [
    n for n in dir() if not n.startswith("_") and n not in (*INTERNAL_API, "INTERNAL_API", "annotations")
]
