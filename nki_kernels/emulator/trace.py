"""Instruction trace recorded by the NKI emulator.

Every emulated ISA instruction (and every ``nl`` wrapper, through the instruction it lowers to) appends
one :class:`TraceRecord`.  Records are value objects: two executions of the same instruction at the same
shapes give equal records, so a :class:`Trace` can store them aggregated as ``record -> count``.  That
keeps production-shape traces (millions of instructions) small; ``keep_order=True`` also keeps the
program-order list for debugging small kernels.

The cost model (:mod:`nki_kernels.emulator.cost`) consumes ``Trace.entries()`` only.

Engines: ``"tensor"`` (TensorE / PE), ``"vector"`` (VectorE / DVE), ``"scalar"`` (ScalarE / ACT),
``"gpsimd"`` (GpSimdE / Pool), ``"dma"`` (DMA queues).

DMA descriptors: the HBM side of a DMA is split into maximal contiguous byte runs; each run is one
descriptor.  ``descriptors`` is a histogram ``((run_bytes, count), ...)`` sorted by ``run_bytes``.  A
row-contiguous DMA of a ``[128, 512]`` bf16 tile from a row-major HBM tensor whose rows are longer than
512 elements is ``((1024, 128),)``; a stride-2 element gather of N bf16 values is ``((2, N),)``.  When a
DMA touches no HBM (SBUF to SBUF) the SBUF-side runs are used.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

ENGINES = ("tensor", "vector", "scalar", "gpsimd", "dma")


@dataclass(frozen=True)
class TraceRecord:
    """One emulated instruction.

    Attributes:
        op: ISA name without namespace, e.g. ``"nc_matmul"``, ``"dma_copy"``, ``"activation"``.
        engine: one of :data:`ENGINES`.
        shapes: shapes of the operands, destination first, then sources in signature order.
        dtypes: dtype names (``"bfloat16"``, ``"float32"``, ...) in the same order as ``shapes``.
        buffers: memory space names (``"sbuf"``, ``"psum"``, ``"hbm"``, ``"shared_hbm"``) in the same order.
        partitions: partition count the engine processes (dim 0 of the on-chip operand; 0 for HBM-only DMA).
        free_elems: elements per partition the engine streams (for matmul: the moving free size N).
        bytes_read: bytes read from all sources.
        bytes_written: bytes written to the destination.
        flops: floating-point operations (matmul: 2*K*M*N; elementwise: one per output element per ALU op).
        descriptors: DMA only: histogram of contiguous HBM byte runs, ``((run_bytes, count), ...)``.
        direction: DMA only: ``"hbm->sbuf"``, ``"sbuf->hbm"``, ``"hbm->hbm"``, ``"sbuf->sbuf"``; else ``""``.
        program_id: logical core (``nl.program_id(0)``) that issued it.
        meta: extra static facts as sorted ``(key, value)`` pairs, e.g. ``(("K", 128), ("M", 128), ("N", 512))``
            for ``nc_matmul``, ``(("is_transpose", True),)``.
    """

    op: str
    engine: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    buffers: tuple[str, ...]
    partitions: int
    free_elems: int
    bytes_read: int = 0
    bytes_written: int = 0
    flops: int = 0
    descriptors: tuple[tuple[int, int], ...] = ()
    direction: str = ""
    program_id: int = 0
    meta: tuple[tuple[str, object], ...] = ()

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"TraceRecord.engine must be one of {ENGINES}, got {self.engine!r}")

    @property
    def num_descriptors(self) -> int:
        return sum(c for _, c in self.descriptors)

    def meta_dict(self) -> dict[str, object]:
        return dict(self.meta)


@dataclass
class Trace:
    """Aggregated instruction trace of one kernel launch (all logical cores).

    ``counts`` maps each distinct record to how many times it was issued.  ``order`` holds every record
    in program order when ``keep_order`` is true (small kernels, debugging).
    """

    kernel_name: str = ""
    keep_order: bool = False
    counts: Counter[TraceRecord] = field(default_factory=Counter)
    order: list[TraceRecord] = field(default_factory=list)

    def add(self, record: TraceRecord, count: int = 1) -> None:
        self.counts[record] += count
        if self.keep_order:
            self.order.extend([record] * count)

    def entries(self) -> Iterator[tuple[TraceRecord, int]]:
        """Distinct records with their issue counts, in first-seen order."""
        return iter(self.counts.items())

    def extend(self, other: Trace) -> None:
        for rec, n in other.entries():
            self.add(rec, n)

    @property
    def num_instructions(self) -> int:
        return sum(self.counts.values())

    def count(self, op: str | None = None, engine: str | None = None) -> int:
        return sum(
            n
            for r, n in self.counts.items()
            if (op is None or r.op == op) and (engine is None or r.engine == engine)
        )

    def select(self, op: str | None = None, engine: str | None = None) -> list[tuple[TraceRecord, int]]:
        return [
            (r, n)
            for r, n in self.counts.items()
            if (op is None or r.op == op) and (engine is None or r.engine == engine)
        ]

    def descriptor_histogram(self) -> dict[int, int]:
        """All DMA descriptors of the trace as ``{run_bytes: count}``."""
        hist: Counter[int] = Counter()
        for r, n in self.counts.items():
            for size, c in r.descriptors:
                hist[size] += c * n
        return dict(sorted(hist.items()))

    @staticmethod
    def merged(traces: Iterable[Trace], kernel_name: str = "") -> Trace:
        out = Trace(kernel_name=kernel_name)
        for t in traces:
            out.extend(t)
        return out
