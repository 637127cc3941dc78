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
from ._common import (  # noqa: F401 (private helpers re-exported for nki.language)
    _apply_binary,
    _bcast,
    _binary_name,
    _count,
    _count_checked,
    _emit,
    _operand,
    _rec,
    _sig,
    _store,
    _vals,
)
from ._copy import (  # noqa: F401 (private helpers re-exported for nki.language)
    memset,
    tensor_copy,
)
from ._dma import (  # noqa: F401 (private helpers re-exported for nki.language)
    _DMA_TRANSPOSE_AXES,
    _cast_dma,
    _direction,
    _dma_record,
    _dma_transpose_do,
    _dma_transpose_rules,
    _indirect_transpose_rules,
    _joint_runs,
    _run_len,
    dma_copy,
    dma_descriptors,
    dma_transpose,
)
from ._enums import (  # noqa: F401 (private helpers re-exported for nki.language)
    _DGE,
    _E,
    _ENGINE_TRACE,
    _ENGINE_TRACE_ID,
    _OOB,
    _RC,
    _TC_ENGINES,
    _TT_ENGINES,
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
from ._events import _log, _use, _use_rrw, _use_rw  # noqa: F401
from ._gpsimd import (  # noqa: F401 (private helpers re-exported for nki.language)
    _pattern_values,
    affine_select,
    iota,
)
from ._gpsimd_ext import nc_n_gather, nonzero_with_count  # noqa: F401 (GpSimd gather, nonzero indices)
from ._registers import (  # noqa: F401 (private helpers re-exported for nki.language)
    VirtualRegister,
    register_alloc,
    register_load,
    register_move,
    register_store,
)
from ._rules import (  # noqa: F401 (private helpers re-exported for nki.language)
    _axes,
    _free,
    _no_gpsimd_psum,
    _onchip,
    _pick_engine,
    _same_pf,
)
from ._scalar_engine import (  # noqa: F401 (private helpers re-exported for nki.language)
    _act_acc,
    _activation,
    activation,
    activation_reduce,
)
from ._sync import core_barrier, sendrecv  # noqa: F401 (cross-core, LNC2)
from ._tensor_engine import (  # noqa: F401 (private helpers re-exported for nki.language)
    _FP8_E4M3_PAIR,
    _transpose_mode_rules,
    nc_matmul,
    nc_transpose,
)
from ._vector_engine import (  # noqa: F401 (private helpers re-exported for nki.language)
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

# The names ``from nki.isa import *`` gives, as before the split: the NKI ISA plus the re-exported
# errors, tensor class and memory regions.
__all__ = [n for n in dir() if not n.startswith("_") and n != "annotations"]
