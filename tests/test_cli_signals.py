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


# ---------------------------------------------------------------- a signal that surfaces as an OSError
# A library between the signal and the run can wrap it: imageio's ffmpeg pipe turns any Exception raised
# inside its write (our handler's Interrupted is one) into an OSError, chaining the original as the
# cause or the context; a library that handles SIGINT itself leaves a KeyboardInterrupt in the chain.
# Either way the user stopped the run: the frames so far must be kept, not deleted as after a failure.

STOP_AT_CHUNK = 2  # chunks 0 and 1 (9 + 12 video frames) are written before the stop


def _wrapped_stop(monkeypatch: pytest.MonkeyPatch, sig: signal.Signals, how: str) -> None:
    """Make the tiny run's decoder, at chunk STOP_AT_CHUNK (outside the critical sections), stop with an
    OSError. ``how``: ``cause`` / ``context`` / ``no-chain``: ``sig`` is sent for real (os.kill), our
    handler raises and the OSError chains that as its cause, its context or not at all; ``keyboard-*`` /
    ``interrupted-cause``: no signal reaches our handler, the OSError wraps a KeyboardInterrupt (SIGINT)
    or an :class:`Interrupted` raised by other code."""
    import errno

    import torch

    from rolling_forcing.decode import PreviewDecoder

    real = PreviewDecoder.decode
    calls: list[int] = []

    def decode(self: PreviewDecoder, latents: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) != STOP_AT_CHUNK + 1:
            return real(self, latents)
        if how in ("keyboard-cause", "interrupted-cause"):  # our handler sees no signal: only the chain
            stop = KeyboardInterrupt() if how == "keyboard-cause" else Interrupted(sig)
            raise OSError(errno.EINTR, "write interrupted") from stop
        if how == "keyboard-context":
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt:
                raise OSError(errno.EPIPE, "broken pipe")  # noqa: B904
        stopped = False
        try:
            os.kill(os.getpid(), sig)
            for _ in range(10_000_000):  # the handler raises at the next bytecode boundary
                pass
        except Interrupted as exc:
            if how == "cause":
                raise OSError(errno.EINTR, "write interrupted") from exc
            if how == "context":  # raised while handling it: the Interrupted is the implicit __context__
                raise OSError(errno.EPIPE, "broken pipe")  # noqa: B904
            stopped = True
        if stopped:  # raised afterwards, no chain at all: only the handler's record tells
            raise OSError(errno.EPIPE, "broken pipe")
        raise AssertionError("the signal did not interrupt the decoder")

    monkeypatch.setattr(PreviewDecoder, "decode", decode)


@pytest.mark.parametrize(
    ("sig", "how"),
    [
        (signal.SIGINT, "cause"),
        (signal.SIGTERM, "context"),
        (signal.SIGTERM, "no-chain"),
        (signal.SIGINT, "keyboard-cause"),
        (signal.SIGINT, "keyboard-context"),
        (signal.SIGTERM, "interrupted-cause"),
    ],
)
def test_a_signal_wrapped_in_an_oserror_keeps_the_partial_video(
    tmp_path, monkeypatch: pytest.MonkeyPatch, sig: signal.Signals, how: str
) -> None:
    import json
    from pathlib import Path

    from nki_ardiff.cli_options import GenerateOptions
    from nki_ardiff.cli_run import run_generate
    from rolling_forcing.video import VideoSpec, read_video

    _wrapped_stop(monkeypatch, sig, how)
    out, rep = Path(tmp_path / "demo.mp4"), Path(tmp_path / "demo.json")
    opts = GenerateOptions(
        out=out, preset="tiny", blocks=5, report_json=rep, warmup=False, quiet=True, progress=False
    )
    with pytest.raises(Interrupted) as info:
        run_generate(opts)
    assert info.value.signum == sig and info.value.exit_code == 128 + sig
    partial = tmp_path / "demo.partial.mp4"
    assert f"interrupted by {sig.name}: the 21 frames written so far are in {partial}" in str(info.value)
    frames = VideoSpec().video_frames(STOP_AT_CHUNK, 3)  # 9 + 12 = 21, independent of the run
    assert frames == 21
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.json", "demo.partial.mp4"]
    data = json.loads(rep.read_text())
    assert data["interrupted"] is True and data["signal"] == sig.name and data["error"] is None
    assert data["partial_video"] == str(partial)
    assert data["summary"]["chunks"] == STOP_AT_CHUNK and data["summary"]["video_frames"] == frames
    assert read_video(partial).shape == (frames, 64, 64, 3)  # playable, every chunk the report lists
