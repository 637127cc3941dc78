"""Instruction trace recorded by the NKI emulator.

Every emulated ISA instruction (and every ``nl`` wrapper, through the instruction it lowers to) appends
one :class:`TraceRecord`.  Records are value objects: two executions of the same instruction at the same
shapes give equal records, so a :class:`Trace` can store them aggregated as ``record -> count``.  That
keeps production-shape traces (millions of instructions) small; ``keep_order=True`` also keeps the
program-order list for debugging small kernels.

The cost model (:mod:`nki_kernels.emulator.cost`) consumes ``Trace.entries()``; with ``keep_events=True``
the trace also holds the ordered **event log** (:meth:`Trace.iter_events`): for every issued instruction,
in program order (the programs of an LNC launch one after another), its record and the memory
:class:`Region` s it reads and writes, from which a dependency-aware schedule can be built.

Engines: ``"tensor"`` (TensorE / PE), ``"vector"`` (VectorE / DVE), ``"scalar"`` (ScalarE / ACT),
``"gpsimd"`` (GpSimdE / Pool), ``"dma"`` (DMA queues).

DMA descriptors: the HBM side of a DMA is split into maximal contiguous byte runs; each run is one
descriptor.  ``descriptors`` is a histogram ``((run_bytes, count), ...)`` sorted by ``run_bytes``.  A
row-contiguous DMA of a ``[128, 512]`` bf16 tile from a row-major HBM tensor whose rows are longer than
512 elements is ``((1024, 128),)``; a stride-2 element gather of N bf16 values is ``((2, N),)``.  When a
DMA touches no HBM (SBUF to SBUF) the SBUF-side runs are used.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

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
        meta: extra static facts as sorted ``(key, value)`` pairs, e.g.
            ``(("K", 128), ("M", 128), ("N", 512))`` for ``nc_matmul``, ``(("is_transpose", True),)``.
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


class Region(NamedTuple):
    """A memory region one instruction reads or writes (the bounding box of its access pattern).

    Attributes:
        space: ``"sbuf"``, ``"psum"`` or ``"hbm"`` (private and shared HBM are both ``"hbm"``).
        buf: id of the allocation (storage), unique within the launch and never reused in it; a
            dtype-reinterpreting view (``t.view(dtype)``, ``.ap(dtype=)``) keeps its allocation's id.
        p0, p1: on-chip: the partitions ``[p0, p1)`` the access touches; HBM: ``0, 0``.
        b0, b1: on-chip: the byte range ``[b0, b1)`` the access covers within each of those partitions;
            HBM: the byte range in the tensor's flat row-major storage.  A strided view covers its
            lowest to its highest element (+ itemsize); a runtime-indexed (indirect) access covers the
            whole storage.
    """

    space: str
    buf: int
    p0: int
    p1: int
    b0: int
    b1: int


SPACES = ("sbuf", "psum", "hbm")


class EventLog:
    """Program-order log of issued instructions with the regions each reads and writes, stored compactly.

    ``ev`` holds two uint32 per event: ``record index << 8 | number of reads`` and the end of the event's
    slice of ``rg``; ``rg`` holds four per region: allocation id, ``p0 | p1 << 16``, ``b0``, ``b1`` (it
    widens to uint64 if a byte offset passes 4 GiB).  So an event with two regions takes 40 bytes.
    Records are interned (a few distinct objects); a buffer's space is stored once; :class:`Region`
    tuples are built only when iterated.
    """

    __slots__ = ("records", "_rec_index", "ev", "rg", "buf_space")

    def __init__(self) -> None:
        self.records: list[TraceRecord] = []
        self._rec_index: dict[int, int] = {}  # id(record) -> index in records (records are kept alive)
        self.ev = array("I")
        self.rg = array("I")
        self.buf_space = array("B", [0])  # buf ids start at 1; index into SPACES

    def __len__(self) -> int:
        return len(self.ev) // 2

    def new_buf(self, space: str) -> int:
        """A fresh allocation id in ``space`` (one of :data:`SPACES`)."""
        self.buf_space.append(SPACES.index(space))
        return len(self.buf_space) - 1

    def add(self, record: TraceRecord, regions: list[int], nreads: int) -> None:
        """Append one event: ``regions`` is the flat ``buf, p0 | p1 << 16, b0, b1`` of its reads, then of
        its writes; the first ``nreads`` regions are reads."""
        i = self._rec_index.get(id(record))
        if i is None:
            i = self._rec_index[id(record)] = len(self.records)
            self.records.append(record)
        rg = self.rg
        n0 = len(rg)
        try:
            rg.extend(regions)
        except OverflowError:  # a byte offset past 4 GiB: widen, dropping this event's partial append
            self.rg = rg = array("Q", rg[:n0])
            rg.extend(regions)
        self.ev.extend((i << 8 | nreads, len(rg)))

    def nbytes(self) -> int:
        """Bytes held by the arrays (the interned records not counted)."""
        return sum(a.itemsize * len(a) for a in (self.ev, self.rg, self.buf_space))

    def iter(
        self, canon: dict | None = None
    ) -> Iterator[tuple[TraceRecord, tuple[Region, ...], tuple[Region, ...]]]:
        """Events as ``(record, reads, writes)``; ``canon`` maps a record to the equal object to yield."""
        recs = [canon.get(r, r) for r in self.records] if canon is not None else self.records
        space = [SPACES[s] for s in self.buf_space]
        ev, rg = self.ev, self.rg
        start = 0
        for j in range(0, len(ev), 2):
            head, end = ev[j], ev[j + 1]
            regs = []
            for k in range(start, end, 4):
                b, pp = rg[k], rg[k + 1]
                regs.append(Region(space[b], b, pp & 0xFFFF, pp >> 16, rg[k + 2], rg[k + 3]))
            nr = head & 0xFF
            yield recs[head >> 8], tuple(regs[:nr]), tuple(regs[nr:])
            start = end


@dataclass
class Trace:
    """Aggregated instruction trace of one kernel launch (all logical cores).

    ``counts`` maps each distinct record to how many times it was issued.  ``order`` holds every record
    in program order when ``keep_order`` is true (small kernels, debugging).  ``keep_events=True`` also
    keeps the ordered event log (:meth:`iter_events`); merged/extended traces carry no events.
    """

    kernel_name: str = ""
    keep_order: bool = False
    counts: Counter[TraceRecord] = field(default_factory=Counter)
    order: list[TraceRecord] = field(default_factory=list)
    keep_events: bool = False
    events: EventLog | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.keep_events and self.events is None:
            self.events = EventLog()

    @property
    def events_available(self) -> bool:
        """True when this trace holds the ordered event log (recorded with ``keep_events=True``)."""
        return self.events is not None

    def iter_events(self) -> Iterator[tuple[TraceRecord, tuple[Region, ...], tuple[Region, ...]]]:
        """``(record, reads, writes)`` for every issued instruction (compute and DMA), in program order.

        ``record`` is the object counted in :attr:`counts`; ``reads`` are the regions of every operand
        the instruction reads (sources, plus the destination where it accumulates or merges: ``nc_matmul``
        with ``accumulate`` True or None (not in transpose mode), ``tensor_copy_predicated``, and
        ``reduce_res`` of an ``activation`` with ``reduce_cmd=load_reduce``); ``writes`` are the
        destinations.  Tuples are built lazily.  Raises ``ValueError`` unless recorded with
        ``keep_events=True``.
        """
        if self.events is None:
            raise ValueError(
                "Trace.iter_events: this trace has no event log; record it with keep_events=True "
                "(emulator.run(..., keep_events=True))"
            )
        return self.events.iter({r: r for r in self.counts})

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
