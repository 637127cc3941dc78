"""Per-launch state of the emulator: current program, trace, allocation accounting, hardware limits.

Only one kernel launch runs at a time and only one of its programs at any moment (LNC2 programs run one
after the other, or take turns at cross-core waits: :mod:`~nki_kernels.emulator.lnc`), so the state is a
module-level stack; :func:`current` raises when an NKI op is used outside a launch.
"""

from __future__ import annotations

import warnings
from typing import Any

from .errors import EmulatorWarning, LaunchError, PsumLimitError, SbufCapacityError
from .hw import HwConfig
from .liveness import OnChipLiveness, check_address
from .trace import Trace


class Launch:
    """Mutable state of one kernel launch (all its logical cores)."""

    __slots__ = (
        "hw",
        "trace",
        "trace_only",
        "program_id",
        "num_programs",
        "seq",
        "mem",
        "shared_allocs",
        "shared_index",
        "records",
        "act_acc",
        "epoch",
        "keep_order",
        "checked",
        "keep_events",
        "last",
        "scheduler",
        "epoch_next",
    )

    def __init__(self, hw: HwConfig, trace: Trace, trace_only: bool, num_programs: int) -> None:
        self.hw = hw
        self.trace = trace
        self.trace_only = trace_only
        self.program_id = 0
        self.num_programs = num_programs
        self.seq = 0  # instructions issued in the current program
        self.mem = OnChipLiveness(hw)
        self.shared_allocs: list[Any] = []
        self.shared_index = 0
        self.records: dict[tuple, list] = {}  # key -> [TraceRecord, count]
        # keep_order: note every issue (``note``): for trace.order and/or the event log
        self.keep_order = trace.keep_order or trace.keep_events
        self.keep_events = trace.keep_events
        self.last: Any = None  # the record of the instruction issued last (when keep_order)
        self.act_acc: dict[int, Any] = {}
        self.epoch = 0
        self.epoch_next = 0  # epochs are unique per program run (LNC2 programs may interleave)
        self.scheduler: Any = None  # lnc.Scheduler of a full-arithmetic LNC2 launch
        # trace-only: validation key of an instruction whose checks passed -> its records entry (per program)
        self.checked: dict[tuple, list] = {}

    def start_program(self, pid: int) -> None:
        self.program_id = pid
        self.shared_index = 0
        self.seq = 0
        self.mem = OnChipLiveness(self.hw)
        self.act_acc = {}
        self.new_epoch()
        self.checked = {}

    def new_epoch(self) -> None:
        """A fresh epoch: storages of an earlier one no longer touch the current accounting."""
        self.epoch_next += 1
        self.epoch = self.epoch_next

    def note(self, record: Any) -> None:
        """One issue of ``record`` (called only when ``keep_order``)."""
        self.last = record
        if self.trace.keep_order:
            self.trace.order.append(record)

    def flush(self) -> None:
        """Move the per-key counts into the Trace (first-seen order)."""
        counts = self.trace.counts
        for rec, n in self.records.values():
            counts[rec] += n
        self.records = {}

    # on-chip allocations (last-use liveness, see liveness.py) -----------------------------------------
    def alloc_onchip(
        self, kind: str, pbytes: int, shape: tuple[int, ...], dtype: str, name: str, address: Any = None
    ) -> list:
        """Register an SBUF/PSUM allocation of ``pbytes`` per partition; returns its live record (the
        storage's ``live``).  A single tile larger than the whole budget raises here; the live total is
        checked at the end of the program (:meth:`end_program`)."""
        hw = self.hw
        k = 0 if kind == "sbuf" else 1
        if k == 0:
            if hw.check_sbuf_capacity and pbytes > hw.sbuf_bytes_per_partition:
                raise SbufCapacityError(
                    f"[sbuf-capacity] SBUF tensor {name or '<unnamed>'} {list(shape)} {dtype} needs {pbytes} "
                    f"B/partition, over the {hw.sbuf_bytes_per_partition} B/partition budget "
                    "(HwConfig.sbuf_bytes_per_partition)"
                )
        elif pbytes > hw.psum_bytes_per_partition:
            raise PsumLimitError(
                f"[psum-total] PSUM tensor {name or '<unnamed>'} {list(shape)} {dtype} needs {pbytes} "
                f"B/partition, PSUM has {hw.psum_bytes_per_partition} B/partition ({hw.psum_num_banks} banks "
                f"x {hw.psum_bank_bytes} B)"
            )
        if address is not None:
            address = check_address(address, k, shape, pbytes, name, hw)
        return self.mem.alloc(k, pbytes, shape, dtype, name, address)

    def end_program(self) -> None:
        """Check the program's on-chip live ranges (capacity, placed-tile overlaps); later deaths of its
        storages no longer count."""
        mem = self.mem
        self.mem = OnChipLiveness(self.hw)
        self.new_epoch()
        mem.check(self.program_id, self.seq)


_STACK: list[Launch] = []


def current() -> Launch:
    if not _STACK:
        raise LaunchError(
            "[launch] NKI emulator ops must run inside a kernel launch (call a @nki.jit kernel, "
            "nki.simulate(kernel)(...) or emulator.run(kernel, ...))"
        )
    return _STACK[-1]


def active() -> Launch | None:
    return _STACK[-1] if _STACK else None


def push(launch: Launch) -> None:
    _STACK.append(launch)


def pop() -> None:
    _STACK.pop()


def warn(msg: str) -> None:
    warnings.warn(msg, EmulatorWarning, stacklevel=3)
