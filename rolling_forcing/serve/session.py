"""One viewer's session: its stream, RNG seed, prompt schedule, playout buffer (with the playback clock)
and its measured chunk timings, reported as JSON on close (the ``generate --report-json`` layout plus a
``serve`` section).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from rolling_forcing.report import ChunkTiming, LatencyReport
from rolling_forcing.serve.engine import ChunkOut, CostTracker, Engine, LiveStream
from rolling_forcing.serve.playout import Frame, PlayoutBuffer, first_frame_of_block


def json_safe(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by None (strict JSON: browsers reject NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


class RuleError(ValueError):
    """A request broke a rule; ``status`` is the HTTP status to answer with (4xx / 503)."""

    def __init__(self, status: int, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


def check_prompt(prompt: object, max_chars: int, engine: Engine | None = None) -> str:
    """The stripped prompt, or :class:`RuleError` 422 naming the rule: a non-empty string of at most
    ``max_chars`` characters that ``engine``'s model can draw (:meth:`Engine.check_prompt`, e.g. the demo
    preset's roles: ``prompt: demo preset: <rule and the words allowed in that role>``)."""
    if not isinstance(prompt, str):
        raise RuleError(422, f"prompt must be a string, got {type(prompt).__name__}")
    p = prompt.strip()
    if not p:
        raise RuleError(422, "prompt must not be empty")
    if len(p) > max_chars:
        raise RuleError(422, f"prompt must be at most {max_chars} characters, got {len(p)}")
    if engine is not None:
        try:
            engine.check_prompt(p)
        except ValueError as exc:
            raise RuleError(422, f"prompt: {engine.cfg.preset} preset: {exc}") from None
    return p


@dataclass
class Switch:
    """A prompt switch: when it was asked (seconds since the session start, the play index and the
    frames produced then) and the block from which the stream runs under it (None until applied: the
    next chunk after the request, whose first frame is ``produced_index``); ``recache`` / ``restart``:
    how the stream takes it (``RollingForcingPipeline.set_prompt``; neither: it continues)."""

    prompt: str
    recache: bool
    requested_s: float
    requested_play_index: int
    produced_index: int
    applied_block: int | None = None
    restart: bool = False

    def to_dict(self, frames_per_block: int, temporal_stride: int) -> dict[str, Any]:
        d = asdict(self)
        if self.applied_block is not None:
            first = first_frame_of_block(self.applied_block, frames_per_block, temporal_stride)
            d["first_frame_index"] = first
            d["frames_to_screen"] = first - self.requested_play_index
        return d


class Session:
    """A viewer's session (created by :class:`rolling_forcing.serve.manager.SessionManager`).

    Thread use: the scheduler thread calls :meth:`step`; request handlers call :meth:`request_prompt`,
    :meth:`stats`; :meth:`release` runs under ``lock`` so it never interrupts a step.
    """

    def __init__(self, sid: str, engine: Engine, prompt: str, seed: int, start_frames: int) -> None:
        cfg = engine.cfg
        self.id, self.engine, self.seed = sid, engine, seed
        self.prompt = prompt
        self.start = time.perf_counter()
        self.lock = threading.Lock()
        self.buffer = PlayoutBuffer(cfg.buffer_frames, cfg.fps, start_frames)
        self.costs = CostTracker(cfg.cost_window)
        self.rows: list[ChunkTiming] = []
        self.switches: list[Switch] = [Switch(prompt, False, 0.0, 0, 0, 0)]
        self._pending: Switch | None = None
        self._pending_emb: Any = None
        self._last_switch_s = -float("inf")
        self.connected = False
        self.last_seen = time.monotonic()
        self.closed = False
        self.close_reason: str | None = None
        self.last_cost_s = float("nan")
        self.stream: LiveStream | None = engine.open_stream(prompt, seed)

    # ---- request side -------------------------------------------------------------------------
    def request_prompt(self, prompt: str, recache: bool, restart: bool = False) -> Switch:
        """Queue a prompt switch for the next chunk (``restart``: the stream restarts under the new
        prompt, see ``RollingForcingPipeline.set_prompt``); :class:`RuleError` 422 for ``recache`` with
        ``restart``, 429 inside ``prompt_interval_s`` of the previous switch, 409 once the session is
        closed. Blocks while a chunk of this session is being produced (call it off the event loop)."""
        cfg = self.engine.cfg
        if recache and restart:
            raise RuleError(422, "recache and restart: a restart drops the KV cache; choose one")
        emb = self.engine.encode(prompt)  # before the lock: a chunk may be in flight meanwhile
        now = time.perf_counter() - self.start
        with self.lock:
            if self.closed:
                raise RuleError(409, f"session {self.id} is closed ({self.close_reason})")
            wait = self._last_switch_s + cfg.prompt_interval_s - now
            if wait > 0:
                raise RuleError(
                    429,
                    f"prompt switches are limited to one per {cfg.prompt_interval_s:g} s per session; "
                    f"retry in {wait:.2f} s",
                    retry_after_s=wait,
                )
            self._last_switch_s = now
            # under the lock no chunk is in flight: the next one produced starts at next_index
            sw = Switch(
                prompt, bool(recache), now, self.buffer.sent + self.buffer.dropped, self.buffer.next_index,
                restart=bool(restart),
            )  # fmt: skip
            self._pending, self._pending_emb = sw, emb
            return sw

    # ---- scheduler side -----------------------------------------------------------------------
    def wants_chunk(self) -> bool:
        """True if the stream runs and the buffer has room for a whole chunk."""
        return (
            not self.closed
            and self.stream is not None
            and not self.stream.finished
            and self.buffer.room() >= self.engine.cfg.chunk_frames
        )

    def step(self) -> ChunkOut | None:
        """Apply a pending switch, produce the next chunk into the buffer (under ``lock``)."""
        with self.lock:
            if self.closed or self.stream is None:
                return None
            if self._pending is not None:
                sw, self._pending = self._pending, None
                sw.applied_block = self.stream.set_prompt(self._pending_emb, sw.recache, sw.restart)
                self._pending_emb = None
                self.switches.append(sw)
                self.prompt = sw.prompt
            out = self.stream.next_chunk()
            if out is None:
                return None
            now = time.perf_counter()
            first = self.buffer.next_index
            frames = [Frame(first + i, out.block, img) for i, img in enumerate(out.images)]
            self.buffer.push(frames, now)
            # write_s of the generate report holds the image encoding here
            row = ChunkTiming(
                out.block, now - self.start, len(frames), out.generate_s, out.decode_s, out.encode_s
            )
            self.rows.append(row)
            self.last_cost_s = out.cost_s
            # the first chunk, and the first after a restart, carry the window warm-up: not a steady cost
            last = self.switches[-1]  # the switch in force (the first: the session's own prompt)
            if out.block > 0 and not (last.restart and out.block == last.applied_block):
                self.costs.add(out.cost_s)
            return out

    def cost_s(self) -> float:
        """This session's measured p99 chunk cost (the engine's while it has fewer than 3 of its own)."""
        return self.costs.p99() if len(self.costs) >= 3 else self.engine.chunk_cost_s()

    def release(self, reason: str) -> None:
        """Close: end the stream and drop its state (KV cache freed once unreferenced)."""
        with self.lock:
            if self.closed:
                return
            self.closed, self.close_reason = True, reason
            if self.stream is not None:
                self.stream.close()
                self.stream = None

    # ---- readouts -----------------------------------------------------------------------------
    def stats(self, now: float | None = None) -> dict[str, Any]:
        """Live readout (measured): chunk cost, buffer, clock, counters."""
        now = time.perf_counter() if now is None else now
        cfg = self.engine.cfg
        buf = self.buffer
        return json_safe(
            {
                "id": self.id,
                "prompt": self.prompt,
                "seed": self.seed,
                "blocks": len(self.rows),
                "last_chunk_ms": self.last_cost_s * 1e3,
                "p99_chunk_ms": self.cost_s() * 1e3,
                "deadline_ms": cfg.deadline_s * 1e3,
                "buffer_frames": len(buf),
                "buffer_depth": buf.depth,
                "start_frames": buf.start_frames,
                "lead_ms": buf.lead_s(now) * 1e3,
                "playing": buf.started,
                "frames_sent": buf.sent,
                "frames_dropped": buf.dropped,
                "late_chunks": buf.late_chunks,
                "closed": self.closed,
                "prompt_schedule": [{"prompt": s.prompt, "block": s.applied_block} for s in self.switches],
            }
        )

    def report(self) -> dict[str, Any]:
        """JSON report: ``generate --report-json``'s summary/meta/chunks plus a ``serve`` section."""
        e = self.engine
        meta = {
            "session": self.id,
            "preset": e.cfg.preset,
            "method": "rolling-forcing",
            "positions": e.pipe_cfg.positions,
            "dtype": e.pipe_cfg.dtype,
            "seed": self.seed,
            "weights": e.parts.weights,
            "text": e.parts.text,
            "decoder": e.parts.decoder,
            "guidance": e.parts.model_cfg.guidance_scale,
            "guidance_sigma_min": e.parts.model_cfg.guidance_sigma_min,
            "image_format": e.cfg.image_format,
        }
        rep = LatencyReport(e.cfg.deadline_s, e.cfg.fps, tuple(self.rows), meta).to_json_dict()
        fpb, ts = e.pipe_cfg.frames_per_block, e.spec.temporal_stride
        rep["serve"] = {
            "kind": "measured",
            "close_reason": self.close_reason,
            "buffer_depth": self.buffer.depth,
            "start_frames": self.buffer.start_frames,
            "frames_produced": self.buffer.next_index,
            "frames_sent": self.buffer.sent,
            "frames_dropped": self.buffer.dropped,
            "late_chunks": self.buffer.late_chunks,
            "chunk_cost_p99_s": self.costs.p99(),
            "prompt_schedule": [s.to_dict(fpb, ts) for s in self.switches],
        }
        safe: dict[str, Any] = json_safe(rep)
        return safe


__all__ = ["RuleError", "Session", "Switch", "check_prompt", "json_safe"]
