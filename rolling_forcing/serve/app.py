"""The FastAPI application of ``rolling-forcing serve`` (factory :func:`create_app`; nothing is built at
import: the model is built and its chunk cost measured when the app starts, in its lifespan).

HTTP API (JSON; errors are ``{"detail": "..."}`` naming the rule):

* ``GET /``: the single page (live canvas, prompt box, start/stop, readout).
* ``GET /api/config``: the served model (preset, weights, text, decoder, prompt rule, first prompt),
  deadline, fps, frame size, limits.
* ``POST /api/sessions`` ``{"prompt": str, "seed": int}`` -> 201 ``{"id", "ws", "stats"}``; 503 when
  admission refuses (the reason), 429 over the admission rate, 422 for a bad prompt (the rule; for the
  demo preset its roles, :func:`rolling_forcing.prompts.check_scene_prompt`).
* ``GET /api/sessions/{id}``: the session's live readout.
* ``POST /api/sessions/{id}/prompt`` ``{"prompt": str, "recache": bool, "restart": bool}`` -> 202; 422 for
  both, 429 over the rate. Neither: the stream continues under the new prompt; ``recache``: its KV cache
  is re-encoded under it; ``restart``: the stream restarts under it (``RollingForcingPipeline.set_prompt``).
* ``DELETE /api/sessions/{id}``: close it; returns its JSON report (also ``GET /api/reports/{id}``).
* ``WS /api/sessions/{id}/ws``: one viewer; the server sends each frame in its playback slot as a binary
  message (8-byte header: frame index and block, big-endian uint32; then the JPEG/PNG bytes) and a JSON
  text message ``{"type": "stats", ...}`` a few times a second; ``{"type": "closed", "reason"}`` last.
  Closing the socket closes the session (its stream and KV cache are freed at once); a viewer that goes
  away is a normal event: one INFO line on the ``rolling_forcing.serve`` logger, no traceback.
* ``GET /metrics``: Prometheus text format.

The client never names a file: requests carry a prompt string, a seed and a flag only. A loopback server
answers only Host headers naming this machine, and a browser's Origin must be the server itself
(:mod:`rolling_forcing.serve.guard`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import struct
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from rolling_forcing.serve.config import ServeConfig
from rolling_forcing.serve.engine import Engine, ModelParts
from rolling_forcing.serve.guard import GuardMiddleware
from rolling_forcing.serve.manager import SessionManager
from rolling_forcing.serve.metrics import CONTENT_TYPE
from rolling_forcing.serve.page import page_html
from rolling_forcing.serve.session import RuleError, Session, check_prompt, json_safe

FRAME_HEADER = struct.Struct(">II")  # frame index, block
STATS_PERIOD_S = 0.25
LOG = logging.getLogger("rolling_forcing.serve")


class NewSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str
    seed: int = Field(default=0, ge=0, le=2**31 - 1)


class PromptSwitch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str
    recache: bool = False
    restart: bool = False


def _error(exc: RuleError) -> JSONResponse:
    headers = {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, int(exc.retry_after_s + 0.999)))
    return JSONResponse({"detail": str(exc)}, status_code=exc.status, headers=headers)


def build_engine(cfg: ServeConfig, parts: ModelParts | None = None) -> Engine:
    """Build the engine (over ``parts``, default :func:`~rolling_forcing.serve.engine.default_parts`) and
    measure its chunk cost (the start-up work of the app; blocking)."""
    import torch

    torch.set_num_threads(cfg.threads)
    engine = Engine(cfg, parts)
    engine.calibrate()
    return engine


def create_app(
    cfg: ServeConfig | None = None, *, engine: Engine | None = None, parts: ModelParts | None = None
) -> FastAPI:
    """The server app of ``cfg`` (default :class:`ServeConfig`: the demo preset). ``engine``: reuse a built
    engine (its config must be ``cfg``); otherwise one is built over ``parts`` (default: the preset's
    :func:`~rolling_forcing.serve.engine.default_parts`) and calibrated at start-up."""
    cfg = ServeConfig() if cfg is None else cfg
    if engine is not None and engine.cfg != cfg:
        raise ValueError("engine was built for another ServeConfig than cfg")
    if engine is not None and parts is not None:
        raise ValueError("give at most one of engine and parts")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        import torch

        saved_threads = torch.get_num_threads()  # restored at shutdown (in-process use, tests)
        eng = engine if engine is not None else await asyncio.to_thread(build_engine, cfg, parts)
        mgr = SessionManager(eng)
        mgr.start()
        app.state.manager = mgr
        try:
            yield
        finally:
            await asyncio.to_thread(mgr.stop)
            torch.set_num_threads(saved_threads)

    app = FastAPI(title="rolling-forcing serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(GuardMiddleware, allowed_hosts=cfg.host_names)

    def manager(request: Request | WebSocket) -> SessionManager:
        mgr: SessionManager = request.app.state.manager
        return mgr

    @app.exception_handler(RuleError)
    async def rule_error(request: Request, exc: RuleError) -> JSONResponse:
        return _error(exc)

    @app.get("/", response_class=HTMLResponse)
    async def index() -> str:
        return page_html()

    @app.get("/api/config")
    async def config(request: Request) -> dict[str, Any]:
        eng = manager(request).engine
        h, w = eng.frame_shape
        return {
            "preset": cfg.preset,
            "model": eng.parts.describe(),
            "default_prompt": eng.parts.default_prompt,
            "fps": cfg.fps,
            "deadline_ms": cfg.deadline_s * 1e3,
            "chunk_frames": cfg.chunk_frames,
            "frame_height": h,
            "frame_width": w,
            "image_format": cfg.image_format,
            "buffer_frames": cfg.buffer_frames,
            "max_sessions": cfg.max_sessions,
            "max_prompt_chars": cfg.max_prompt_chars,
            "prompt_interval_s": cfg.prompt_interval_s,
            "calibration_chunk_ms": [c * 1e3 for c in eng.calibration_s],
        }

    @app.post("/api/sessions", status_code=201)
    async def new_session(body: NewSession, request: Request) -> dict[str, Any]:
        mgr = manager(request)
        prompt = check_prompt(body.prompt, cfg.max_prompt_chars, mgr.engine)
        s = await asyncio.to_thread(mgr.admit, prompt, body.seed)
        return {"id": s.id, "ws": f"/api/sessions/{s.id}/ws", "stats": s.stats()}

    @app.get("/api/sessions")
    async def list_sessions(request: Request) -> list[dict[str, Any]]:
        return [s.stats() for s in list(manager(request).sessions.values())]

    @app.get("/api/sessions/{sid}")
    async def session_stats(sid: str, request: Request) -> dict[str, Any]:
        return manager(request).get(sid).stats()

    @app.post("/api/sessions/{sid}/prompt", status_code=202)
    async def switch_prompt(sid: str, body: PromptSwitch, request: Request) -> dict[str, Any]:
        s = manager(request).get(sid)
        prompt = check_prompt(body.prompt, cfg.max_prompt_chars, s.engine)
        sw = await asyncio.to_thread(s.request_prompt, prompt, body.recache, body.restart)
        return {
            "prompt": sw.prompt, "recache": sw.recache, "restart": sw.restart,
            "requested_play_index": sw.requested_play_index,
        }  # fmt: skip

    @app.delete("/api/sessions/{sid}")
    async def close_session(sid: str, request: Request) -> dict[str, Any]:
        return await asyncio.to_thread(manager(request).close, sid, "closed by the viewer")

    @app.get("/api/reports/{sid}")
    async def session_report(sid: str, request: Request) -> dict[str, Any]:
        rep = manager(request).reports.get(sid)
        if rep is None:
            raise RuleError(404, f"no report of session {sid!r} (open, unknown or expired)")
        return rep

    @app.get("/metrics")
    async def metrics(request: Request) -> PlainTextResponse:
        return PlainTextResponse(manager(request).metrics_text(), media_type=CONTENT_TYPE)

    @app.websocket("/api/sessions/{sid}/ws")
    async def viewer(websocket: WebSocket, sid: str) -> None:
        await serve_viewer(websocket, sid, manager(websocket))

    return app


async def serve_viewer(websocket: WebSocket, sid: str, mgr: SessionManager) -> None:
    """One viewer of session ``sid``: frames in their slots and the readout until the session closes or
    the viewer goes away. A viewer going away (a closed tab: the socket ends, even in the middle of a
    send) is a normal event: one INFO line, no traceback; the session is closed and its stream freed."""
    s = mgr.sessions.get(sid)
    await websocket.accept()
    if s is None or s.connected:
        why = "no open session" if s is None else "session already has a viewer"
        await websocket.send_text(json.dumps({"type": "closed", "reason": f"{why} {sid!r}"}))
        await websocket.close(code=1008)
        return
    s.connected = True
    receiver = asyncio.create_task(_receive_until_gone(websocket))
    gone: str | None = None
    try:
        await _send_frames(websocket, s, mgr, receiver)
        if receiver.done() and not s.closed:
            gone = "closed the connection"
    except WebSocketDisconnect as exc:  # the socket ended under a send
        gone = f"went away during a send (code {exc.code})"
    finally:
        receiver.cancel()
        s.connected = False
        s.last_seen = time.monotonic()
        if not s.closed:  # in a thread: this runs even when the handler is being cancelled
            threading.Thread(target=mgr.close_if_open, args=(sid, "viewer disconnected"), daemon=True).start()
    if gone is not None:
        LOG.info("viewer of session %s %s: session closed, its stream freed", sid, gone)


async def _receive_until_gone(websocket: WebSocket) -> None:
    """Read (and ignore) client messages until the client goes away."""
    while True:
        msg = await websocket.receive()
        if msg["type"] == "websocket.disconnect":
            return


async def _send_frames(
    websocket: WebSocket, s: Session, mgr: SessionManager, receiver: asyncio.Task[None]
) -> None:
    """Send each frame in its playback slot and the readout every ``STATS_PERIOD_S`` until the session
    closes or the viewer leaves."""
    next_stats = 0.0
    while not receiver.done():
        now = time.perf_counter()
        for f in s.buffer.poll(now):
            await websocket.send_bytes(FRAME_HEADER.pack(f.index, f.block) + f.data)
        if now >= next_stats or s.closed:
            stats = dict(s.stats(now), type="stats", headroom=json_safe(mgr.headroom()))
            await websocket.send_text(json.dumps(stats))
            next_stats = now + STATS_PERIOD_S
        if s.closed:
            await websocket.send_text(json.dumps({"type": "closed", "reason": s.close_reason}))
            await websocket.close()
            return
        due = s.buffer.next_due()
        delay = 0.02 if due is None else min(max(due - time.perf_counter(), 0.0), 0.05)
        await asyncio.wait({receiver}, timeout=delay)


__all__ = ["FRAME_HEADER", "LOG", "build_engine", "create_app", "serve_viewer"]
