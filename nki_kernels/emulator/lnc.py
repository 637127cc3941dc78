"""The two programs of an LNC2 launch with values that cross the cores (``sendrecv``, ``core_barrier``).

The emulator runs one instruction at a time.  A full-arithmetic (not trace-only) LNC2 launch runs each
program in its own thread, but only one thread runs at any moment (a baton), so execution stays
deterministic: program 0 runs until it must wait for program 1 (a ``core_barrier`` program 1 has not reached,
or a ``sendrecv`` whose data program 1 has not sent), then program 1 runs until it waits or finishes, and so
on.  Shared HBM is one storage for both programs (the i-th ``shared_hbm`` allocation of either program), so
what one core writes before a barrier is what the other reads after it.

* ``core_barrier``: the k-th barrier of a program returns once the other program has reached its k-th
  barrier (or raises ``LaunchError [lnc-deadlock]`` if the other program finished without reaching it).
* ``sendrecv(src, dst, send_to_rank, recv_from_rank, pipe_id)``: the send is posted at once with ``src``'s
  values at issue time; the receive waits for the matching send (from ``recv_from_rank`` to this program,
  same ``pipe_id``, in order) and writes it into ``dst``.

Each program keeps its own per-program state of the :class:`~nki_kernels.emulator.state.Launch` (program id,
instruction counter, on-chip liveness, accumulator registers, trace-only validation keys), swapped with the
baton.  Trace-only launches keep running program 0 then program 1 (no values cross).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from . import state as _state
from .errors import LaunchError

_PER_PROGRAM = ("program_id", "shared_index", "seq", "mem", "act_acc", "epoch", "checked")


class _Abort(BaseException):
    """Unwinds a waiting program when the other one failed."""


class Scheduler:
    """Runs the programs of one LNC2 launch with a baton (see the module docstring)."""

    def __init__(self, launch: _state.Launch, n: int) -> None:
        self.launch = launch
        self.n = n
        self.cv = threading.Condition()
        self.turn = 0
        self.done = [False] * n
        self.state: list[dict[str, Any]] = [{} for _ in range(n)]
        self.barriers = [0] * n
        self.mail: dict[tuple[int, int, int], deque] = {}
        self.error: BaseException | None = None
        self.events = 0  # barrier arrivals, sends and finished programs: what can end a wait
        self.waiting: list[str | None] = [None] * n
        self.results: list[Any] = [None] * n

    # baton -------------------------------------------------------------------------------------------
    def _save(self, pid: int) -> None:
        self.state[pid] = {k: getattr(self.launch, k) for k in _PER_PROGRAM}

    def _restore(self, pid: int) -> None:
        for k, v in self.state[pid].items():
            setattr(self.launch, k, v)

    def _wait_turn(self, pid: int) -> None:
        with self.cv:
            while self.turn != pid and self.error is None:
                self.cv.wait()
            if self.error is not None:
                raise _Abort
        self._restore(pid)

    def _pass(self, pid: int) -> None:
        """Hand the baton to the other program (if it can still run); caller holds no lock."""
        self._save(pid)
        with self.cv:
            other = 1 - pid
            self.turn = other if not self.done[other] else pid
            self.cv.notify_all()

    def wait_until(self, pid: int, ready: Callable[[], bool], what: str) -> None:
        """Block program ``pid`` until ``ready()`` (the other program runs meanwhile)."""
        other = 1 - pid
        while not ready():
            if self.done[other]:
                raise LaunchError(
                    f"[lnc-deadlock] program {pid} waits for {what}, but program {other} finished without it"
                )
            mark = self.events
            self.waiting[pid] = what
            self._pass(pid)
            self._wait_turn(pid)
            self.waiting[pid] = None
            if not ready() and self.events == mark and self.waiting[other] is not None:
                raise LaunchError(
                    f"[lnc-deadlock] program {pid} waits for {what} while program {other} waits for "
                    f"{self.waiting[other]}"
                )

    # the two cross-core instructions -------------------------------------------------------------------
    def barrier(self, pid: int) -> None:
        self.barriers[pid] += 1
        self.events += 1
        k = self.barriers[pid]
        self.wait_until(pid, lambda: self.barriers[1 - pid] >= k, f"core_barrier #{k} of program {1 - pid}")

    def send(self, pid: int, to: int, pipe: int, data: Any) -> None:
        self.mail.setdefault((pid, to, pipe), deque()).append(data)
        self.events += 1

    def recv(self, pid: int, frm: int, pipe: int) -> Any:
        box = self.mail.setdefault((frm, pid, pipe), deque())
        self.wait_until(pid, lambda: bool(box), f"sendrecv data from program {frm} on pipe {pipe}")
        return box.popleft()

    # running ---------------------------------------------------------------------------------------------
    def _program(self, pid: int, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        try:
            self._wait_turn(pid)
            self.launch.start_program(pid)
            self.launch.scheduler = self
            self.results[pid] = fn(*args, **kwargs)
            self.launch.end_program()
        except _Abort:
            return
        except BaseException as e:  # noqa: BLE001 - handed to the launching thread
            with self.cv:
                if self.error is None:
                    self.error = e
                self.cv.notify_all()
            return
        self._save(pid)
        with self.cv:
            self.done[pid] = True
            self.events += 1
            self.turn = 1 - pid if not self.done[1 - pid] else pid
            self.cv.notify_all()

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> list[Any]:
        """Run every program of the launch; re-raises the first program error in the calling thread."""
        # epochs of the two programs must differ (storages are charged to their program's liveness)
        for pid in range(self.n):
            self.state[pid] = {}
        threads = [
            threading.Thread(target=self._program, args=(pid, fn, args, kwargs), name=f"nki-program-{pid}")
            for pid in range(self.n)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.launch.scheduler = None
        if self.error is not None:
            raise self.error
        return self.results
