"""Last-use liveness of on-chip (SBUF / PSUM) allocations, as the NKI compiler's allocator sees them.

A tile occupies its bytes from its **first access** to its **last access** by an instruction (its live
range, as the compiler's allocator sees it), not from the Python allocation until the object dies: the
allocator reuses a tile's bytes once nothing reads or writes it any more.  Each program (logical core)
counts its issued instructions; every instruction stamps the storages of its operands with its number
(``Storage.live``: last access, and first access on the first stamp).  A tile first accessed by
instruction ``first`` and last by ``last`` is live at instructions ``first .. last``; a tile never
accessed occupies nothing.  At the end of each program the live bytes per partition are
summed per instruction; a peak over the budget raises, naming the peak, the instruction and the tiles
live at it.

``address=(partition_offset, byte_offset)`` placement (``nl.ndarray(..., address=...)``) is honoured:
such a tile occupies exactly partitions ``[p, p + shape[0])`` and bytes ``[b, b + bytes/partition)``;
two placed tiles whose ranges overlap while both are live raise.  Placed tiles count towards the
capacity like the others; fragmentation around them is not modelled.
"""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np

from .errors import AllocationError, PsumLimitError, SbufCapacityError
from .hw import HwConfig
from .placement import min_peak

KINDS = ("sbuf", "psum")
_SHOWN = 12  # tiles listed in an error message

# live record of an allocation: [last access, first access, bytes/partition, kind, name, shape, dtype,
# address] (accesses are instruction numbers, -1 = none yet)
LAST, FIRST, PBYTES, KIND, NAME, SHAPE, DTYPE, ADDRESS = range(8)


class OnChipLiveness:
    """The on-chip allocations of one program and their live ranges (see the module docstring)."""

    __slots__ = ("hw", "open", "c_first", "c_last", "c_pbytes", "c_kind", "c_desc", "c_parts", "c_start",
                 "descs", "_desc_index", "placed")  # fmt: skip

    def __init__(self, hw: HwConfig) -> None:
        self.hw = hw
        self.open: dict[int, list] = {}  # id(live) -> live, for storages still referenced
        self.c_first = array("q")  # closed (garbage-collected) allocations, compactly
        self.c_last = array("q")
        self.c_pbytes = array("q")
        self.c_kind = array("B")
        self.c_desc = array("I")
        self.c_parts = array("H")  # partitions of the tile (shape[0])
        self.c_start = array("h")  # address= start partition, -1 when the allocator places it
        self.descs: list[tuple] = []  # interned (name, shape, dtype, address)
        self._desc_index: dict[tuple, int] = {}
        self.placed: list[tuple] = []  # (first, last, kind, p0, p1, b0, b1, desc) of address= tiles

    def alloc(self, kind: int, pbytes: int, shape: tuple, dtype: str, name: str, address: Any) -> list:
        """Register an allocation; returns its live record."""
        live = [-1, -1, pbytes, kind, name, shape, dtype, address]
        self.open[id(live)] = live
        return live

    def close(self, live: list) -> None:
        """The storage of ``live`` was garbage-collected: keep its range compactly."""
        if self.open.pop(id(live), None) is not None:
            self._record(live)

    def _record(self, live: list) -> None:
        last, first, pbytes, kind, name, shape, dtype, address = live
        if last < 0:  # never accessed: the compiler allocates nothing for it
            return
        key = (name, shape, dtype, address)
        d = self._desc_index.get(key)
        if d is None:
            d = self._desc_index[key] = len(self.descs)
            self.descs.append(key)
        self.c_first.append(first)
        self.c_last.append(last)
        self.c_pbytes.append(pbytes)
        self.c_kind.append(kind)
        self.c_desc.append(d)
        self.c_parts.append(shape[0])
        self.c_start.append(-1 if address is None else address[0])
        if address is not None:
            p, b = address
            self.placed.append((first, last, kind, p, p + shape[0], b, b + pbytes, d))

    def _desc(self, d: int, pbytes: int) -> str:
        name, shape, dtype, address = self.descs[d]
        at = f" at address={address}" if address is not None else ""
        return f"{name or '<unnamed>'} {list(shape)} {dtype} ({pbytes} B/partition){at}"

    def check(self, program_id: int, nseq: int) -> None:
        """End of a program: raise if the live bytes ever exceed a budget or placed tiles collide."""
        for live in list(self.open.values()):
            self._record(live)
        self.open.clear()
        if not self.c_first:
            return
        first = np.frombuffer(self.c_first, dtype=np.int64)
        last = np.frombuffer(self.c_last, dtype=np.int64)
        pbytes = np.frombuffer(self.c_pbytes, dtype=np.int64)
        kind = np.frombuffer(self.c_kind, dtype=np.uint8)
        hw = self.hw
        for k, budget, on in ((0, hw.sbuf_bytes_per_partition, hw.check_sbuf_capacity),
                              (1, hw.psum_bytes_per_partition, hw.check_psum_capacity)):  # fmt: skip
            sel = kind == k
            if not on or not sel.any():
                continue
            f, la, p = first[sel], last[sel], pbytes[sel]
            n = max(nseq, int(la.max())) + 2
            # bytes live at instruction t if all tiles shared partitions: first access f <= t, last la >= t
            delta = np.bincount(f, weights=p, minlength=n) - np.bincount(la + 1, weights=p, minlength=n)
            live = np.cumsum(delta)
            if live.max() <= budget:  # fits even with every tile on the same partitions
                continue
            over = self._placed_peak(sel, f, la, p, live, budget)
            if over is None:
                continue
            t, peak, exact = over
            at = np.nonzero((f <= t) & (la >= t))[0]
            at = at[np.lexsort((f[at], -p[at]))]  # largest first, then by first access
            descs = np.frombuffer(self.c_desc, dtype=np.uint32)[sel]
            tiles = "; ".join(self._desc(int(descs[i]), int(p[i])) for i in at[:_SHOWN])
            more = f"; ... and {len(at) - _SHOWN} more" if len(at) > _SHOWN else ""
            where = (
                f"program {program_id}: live {KINDS[k].upper()} peaks at {peak} B/partition at instruction "
                f"#{t} of the program (a tile is live from its first to its last access and occupies its own "
                f"partitions; the peak is that of the best placement of their start partitions"
                f"{'' if exact else ' found in a bounded search'})"
            )
            if k == 0:
                raise SbufCapacityError(
                    f"[sbuf-capacity] {where}, over the {budget} B/partition budget "
                    f"(HwConfig.sbuf_bytes_per_partition); {len(at)} tiles live there: {tiles}{more}"
                )
            raise PsumLimitError(
                f"[psum-total] {where}, over the {budget} B/partition of {hw.psum_num_banks} banks x "
                f"{hw.psum_bank_bytes} B; {len(at)} tiles live there: {tiles}{more}"
            )
        self._check_placed(program_id)

    def _placed_peak(
        self, sel: np.ndarray, f: np.ndarray, la: np.ndarray, p: np.ndarray, live: np.ndarray, budget: int
    ) -> tuple[int, int, bool] | None:
        """Instructions whose all-partitions sum exceeds ``budget``: place the live tiles on their partitions
        (:func:`~nki_kernels.emulator.placement.min_peak`).  Returns the instruction where the best placement
        peaks highest over ``budget`` (the first such on ties) as ``(instruction, peak, exact)``, or None when
        every instruction fits."""
        parts = np.frombuffer(self.c_parts, dtype=np.uint16)[sel]
        start = np.frombuffer(self.c_start, dtype=np.int16)[sel]
        over = np.nonzero(live > budget)[0]
        # the live set changes only where a tile starts or ends: one check per constant stretch
        changes = np.zeros(len(live) + 1, dtype=bool)
        changes[f] = True
        changes[la + 1] = True
        seg = np.cumsum(changes)[over]
        firsts = over[np.r_[True, seg[1:] != seg[:-1]]]
        seen: dict[tuple, tuple[int, bool]] = {}
        worst: tuple[int, int, bool] | None = None
        for t in firsts:
            at = np.nonzero((f <= t) & (la >= t))[0]
            key = tuple(sorted((int(parts[i]), int(p[i]), int(start[i])) for i in at))
            got = seen.get(key)
            if got is None:
                tiles = [(n, b, None if s0 < 0 else s0) for n, b, s0 in key]
                got = seen[key] = min_peak(tiles, budget)
            if got[0] > budget and (worst is None or got[0] > worst[1]):
                worst = (int(t), got[0], got[1])
        return worst

    def _check_placed(self, program_id: int) -> None:
        placed = sorted(self.placed)
        active: list[tuple] = []
        for cur in placed:
            f, la, k, p0, p1, b0, b1, d = cur
            active = [a for a in active if a[1] >= f]  # still live at instruction f
            for a in active:
                if a[2] == k and a[3] < p1 and p0 < a[4] and a[5] < b1 and b0 < a[6]:
                    raise AllocationError(
                        f"[address-overlap] program {program_id}: {KINDS[k].upper()} tiles "
                        f"{self._desc(a[7], a[6] - a[5])} and {self._desc(d, b1 - b0)} overlap (partitions "
                        f"[{max(p0, a[3])}, {min(p1, a[4])}), bytes [{max(b0, a[5])}, {min(b1, a[6])})) "
                        f"while both are live (instructions #{a[0]}..#{a[1]} and #{f}..#{la})"
                    )
            active.append(cur)


def check_address(address: Any, kind: int, shape: tuple, pbytes: int, name: str, hw: HwConfig) -> tuple:
    """Validate ``address=(partition_offset, byte_offset)`` of an on-chip allocation; returns it as ints."""
    desc = f"{KINDS[kind]} tensor {name or '<unnamed>'} {list(shape)}"
    if not isinstance(address, (tuple, list)) or len(address) != 2:
        raise AllocationError(
            f"[address] {desc}: address must be (partition_offset, byte_offset), got {address!r}"
        )
    try:
        p, b = (int(x) for x in address)
    except (TypeError, ValueError) as e:
        raise AllocationError(f"[address] {desc}: address entries must be ints, got {address!r}") from e
    if p < 0 or b < 0 or p != address[0] or b != address[1]:
        raise AllocationError(f"[address] {desc}: address entries must be non-negative ints, got {address!r}")
    if p + shape[0] > hw.pmax:
        raise AllocationError(
            f"[address] {desc}: partitions [{p}, {p + shape[0]}) pass the {hw.pmax}-partition limit"
        )
    budget = hw.sbuf_bytes_per_partition if kind == 0 else hw.psum_bytes_per_partition
    if b + pbytes > budget:
        raise AllocationError(
            f"[address] {desc}: bytes [{b}, {b + pbytes}) of each partition pass the {budget} B/partition "
            f"of {KINDS[kind].upper()}"
        )
    if kind == 1 and b % hw.psum_bank_bytes:
        raise AllocationError(
            f"[address] {desc}: a PSUM allocation must start on a {hw.psum_bank_bytes} B bank boundary, got "
            f"byte offset {b}"
        )
    return (p, b)
