"""Signals and the CLI's critical sections (nki_ardiff/cli_run.py): a SIGINT/SIGTERM delivered while a
chunk is written (to ANY thread of the process: the OS picks one that does not block it) takes effect
only when the section ends, so a chunk is in the video and the report whole or in neither."""

from __future__ import annotations

import os
import signal
import sys
import threading

import pytest

from nki_ardiff.cli_run import Interrupted, _signals_deferred, _signals_raise

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


class _Killer:
    """A thread started BEFORE the section (so it does not inherit a mask set inside it, like torch's and
    the video writer's threads) that sends ``sig`` to the process when told to."""

    def __init__(self, sig: signal.Signals) -> None:
        self.go, self.sent = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, args=(sig,), daemon=True)
        self.thread.start()

    def _run(self, sig: signal.Signals) -> None:
        self.go.wait(10)
        os.kill(os.getpid(), sig)
        self.sent.set()

    def fire(self) -> None:
        self.go.set()
        self.sent.wait(10)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_inside_a_critical_section_waits_for_its_end(sig: signal.Signals) -> None:
    done: list[int] = []
    killer = _Killer(sig)
    with pytest.raises(Interrupted) as info, _signals_raise() as got, _signals_deferred():
        killer.fire()
        for i in range(100_000):  # many bytecode boundaries where a handler could run
            done.append(i)
    assert len(done) == 100_000  # the section ran to its end
    assert info.value.signum == sig and got.signum == sig


def test_the_final_write_out_records_but_does_not_raise() -> None:
    killer = _Killer(signal.SIGTERM)
    with _signals_raise() as got, _signals_deferred(raise_pending=False):
        killer.fire()
        for _ in range(100_000):
            pass
    assert got.signum == signal.SIGTERM


def test_outside_a_section_the_signal_raises_at_once() -> None:
    killer = _Killer(signal.SIGINT)
    with pytest.raises(Interrupted), _signals_raise():
        killer.fire()
        for _ in range(10_000_000):
            pass
        pytest.fail("the signal did not interrupt the loop")
