"""Sessions of the server: admission control, the scheduler thread that interleaves their chunks, the
reaper of abandoned sessions, and the Prometheus metrics.

Scheduling: every session's chunks run on ONE worker thread, interleaved earliest-deadline-first (the
session whose buffer runs dry first gets the next chunk). Batching two streams into one forward saves
about 4 % on CPU for the tiny preset (measured: ``python -m rolling_forcing.serve.bench``, docs/serve.md),
too little to tie the sessions' block clocks and prompt switches together, so streams are interleaved.
With one worker the per-chunk costs of all sessions add up within one deadline, which is the admission
rule (:func:`admission_refusal`).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rolling_forcing.serve import metrics as prom
from rolling_forcing.serve.engine import Engine
from rolling_forcing.serve.playout import start_threshold
from rolling_forcing.serve.session import RuleError, Session


def admission_refusal(
    session_costs_s: Sequence[float], new_cost_s: float, deadline_s: float, headroom: float, max_sessions: int
) -> str | None:
    """Why a new session is refused, or None to admit it.

    Rule: with one worker, all sessions' per-chunk costs (measured p99, seconds) plus the new one's must
    fit in ``deadline_s * (1 - headroom)``; and at most ``max_sessions`` sessions run.
    """
    n = len(session_costs_s) + 1
    if n > max_sessions:
        return f"max_sessions={max_sessions} sessions already run"
    total = sum(session_costs_s) + new_cost_s
    budget = deadline_s * (1.0 - headroom)
    if total > budget:
        return (
            f"measured per-chunk cost of {n} session(s) would be {total * 1e3:.1f} ms > budget "
            f"{budget * 1e3:.1f} ms (deadline {deadline_s * 1e3:.1f} ms with headroom {headroom:.0%})"
        )
    return None


class SessionManager:
    """Admits, schedules, reaps and closes sessions over one :class:`Engine` (see the module docstring).

    Call :meth:`start` to run the scheduler thread and :meth:`stop` to end it (closing every session).
    """

    def __init__(self, engine: Engine, *, keep_reports: int = 32) -> None:
        self.engine = engine
        self.cfg = engine.cfg
        self.sessions: dict[str, Session] = {}
        self.reports: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._keep_reports = keep_reports
        self._lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_admit = -float("inf")
        self.chunk_hist = prom.Histogram()
        self.counts: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self.closed_by: Counter[str] = Counter()
        self.error: str | None = None

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the scheduler is already running")
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="rf-serve-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        for sid in list(self.sessions):
            self.close(sid, "server shutdown")

    # ---- sessions -----------------------------------------------------------------------------
    def admit(self, prompt: str, seed: int) -> Session:
        """A new session, or :class:`RuleError` 503 (admission: the reason) / 429 (admission rate)."""
        cfg = self.cfg
        with self._lock:
            now = time.monotonic()
            wait = self._last_admit + cfg.session_interval_s - now
            if wait > 0:
                self.refused["rate"] += 1
                raise RuleError(
                    429,
                    f"new sessions are limited to one per {cfg.session_interval_s:g} s; "
                    f"retry in {wait:.2f} s",
                    retry_after_s=wait,
                )
            costs = [s.cost_s() for s in self.sessions.values()]
            new_cost = self.engine.chunk_cost_s()
            reason = admission_refusal(costs, new_cost, cfg.deadline_s, cfg.headroom, cfg.max_sessions)
            if reason is not None:
                self.refused["capacity" if "max_sessions" in reason else "cost"] += 1
                raise RuleError(503, f"session refused: {reason}")
            # buffer enough frames to play through the p99 wait for a chunk: every session's cost
            wait_s = sum(costs) + new_cost
            start = start_threshold(wait_s, cfg.fps, cfg.buffer_frames)
            sid = secrets.token_urlsafe(9)
            sess = Session(sid, self.engine, prompt, seed, start)
            self.sessions[sid] = sess
            self._last_admit = now
            self.counts["admitted"] += 1
        self._wake.set()
        return sess

    def get(self, sid: str) -> Session:
        """The open session ``sid`` or :class:`RuleError` 404."""
        s = self.sessions.get(sid)
        if s is None:
            raise RuleError(404, f"no open session {sid!r}")
        return s

    def close(self, sid: str, reason: str) -> dict[str, Any]:
        """Close session ``sid`` (freeing its stream), keep and return its JSON report. Closes are
        serialised, so a second close of the same session (viewer gone + stop button) gets the report."""
        with self._close_lock:
            with self._lock:
                s = self.sessions.pop(sid, None)
            if s is None:
                if sid in self.reports:
                    return self.reports[sid]
                raise RuleError(404, f"no open session {sid!r}")
            s.release(reason)
            rep = s.report()
            if self.cfg.report_dir is not None:
                path = Path(self.cfg.report_dir) / f"session-{sid}.json"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(rep, indent=2, allow_nan=True) + "\n")
            with self._lock:
                self.closed_by[reason.split(":")[0]] += 1
                self.counts["frames_sent"] += s.buffer.sent
                self.counts["frames_dropped"] += s.buffer.dropped
                self.counts["late_chunks"] += s.buffer.late_chunks
                self.reports[sid] = rep
                while len(self.reports) > self._keep_reports:
                    self.reports.popitem(last=False)
            return rep

    def close_if_open(self, sid: str, reason: str) -> None:
        """:meth:`close` unless the session is already closed (for the viewer's clean-up path)."""
        with contextlib.suppress(RuleError):
            self.close(sid, reason)

    def headroom(self) -> float:
        """Share of the chunk deadline left after every open session's measured p99 chunk cost."""
        costs = [s.cost_s() for s in list(self.sessions.values())]
        return 1.0 - sum(costs) / self.cfg.deadline_s

    # ---- the worker ---------------------------------------------------------------------------
    def _pick(self, now: float) -> Session | None:
        """Earliest deadline first: sessions with a viewer before those without, then the least video
        buffered ahead of the playback clock."""
        ready = [s for s in list(self.sessions.values()) if s.wants_chunk()]
        return min(ready, key=lambda s: (not s.connected, s.buffer.lead_s(now)), default=None)

    def _reap(self) -> None:
        limit = self.cfg.connect_timeout_s
        now = time.monotonic()
        for s in list(self.sessions.values()):
            if not s.connected and now - s.last_seen > limit:
                self.close(s.id, f"viewer absent: no connection for {limit:g} s")

    def _run(self) -> None:
        import torch

        torch.set_num_threads(self.cfg.threads)
        while not self._stop.is_set():
            try:
                self._reap()
            except Exception as exc:  # e.g. a report that cannot be written: keep serving the others
                self.error = f"reaper: {type(exc).__name__}: {exc}"
            s = self._pick(time.perf_counter())
            if s is None:
                self._wake.wait(timeout=0.01)
                self._wake.clear()
                continue
            try:
                out = s.step()
            except Exception as exc:  # a failing stream closes its session, never the server
                self.error = f"{type(exc).__name__}: {exc}"
                self.close(s.id, f"error: {self.error}")
                continue
            if out is not None:
                if out.block > 0:
                    self.engine.costs.add(out.cost_s)
                with self._lock:  # the histogram and the chunk counter move together
                    self.chunk_hist.observe(out.cost_s)
                    self.counts["chunks"] += 1

    # ---- metrics ------------------------------------------------------------------------------
    def metrics_text(self) -> str:
        """``/metrics`` in the Prometheus text format (all figures measured)."""
        live = list(self.sessions.values())
        with self._lock:
            sent = self.counts["frames_sent"] + sum(s.buffer.sent for s in live)
            dropped = self.counts["frames_dropped"] + sum(s.buffer.dropped for s in live)
            late = self.counts["late_chunks"] + sum(s.buffer.late_chunks for s in live)
            refused = [({"reason": r}, float(n)) for r, n in sorted(self.refused.items())]
            closed = [({"reason": r}, float(n)) for r, n in sorted(self.closed_by.items())]
            chunks, admitted = self.counts["chunks"], self.counts["admitted"]
            hist = self.chunk_hist.copy()
        p99 = self.engine.costs.p99()
        return prom.render(
            histograms={
                "rf_serve_chunk_seconds": (
                    "measured wall-clock cost of one chunk (generate + decode + image encode)",
                    hist,
                )
            },
            counters={
                "rf_serve_chunks_total": ("chunks produced", [({}, chunks)]),
                "rf_serve_deadline_misses_total": (
                    "chunks whose first frame was produced after its playback slot",
                    [({}, late)],
                ),
                "rf_serve_frames_sent_total": ("frames sent to viewers in their slot", [({}, sent)]),
                "rf_serve_frames_dropped_total": (
                    "frames that missed their slot (counted, not sent)",
                    [({}, dropped)],
                ),
                "rf_serve_sessions_admitted_total": ("sessions admitted", [({}, admitted)]),
                "rf_serve_sessions_refused_total": ("sessions refused, by rule", refused),
                "rf_serve_sessions_closed_total": ("sessions closed, by reason", closed),
            },
            gauges={
                "rf_serve_sessions": ("open sessions", [({}, len(live))]),
                "rf_serve_buffer_frames": (
                    "frames held in a session's playout buffer",
                    [({"session": s.id}, len(s.buffer)) for s in live],
                ),
                "rf_serve_deadline_seconds": ("real-time budget of one chunk", [({}, self.cfg.deadline_s)]),
                "rf_serve_chunk_cost_p99_seconds": (
                    "measured p99 chunk cost over recent chunks (admission input)",
                    [({}, p99 if p99 == p99 else 0.0)],
                ),
            },
        )


__all__ = ["SessionManager", "admission_refusal"]
