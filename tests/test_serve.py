"""``rolling-forcing serve`` through its HTTP/WebSocket API (starlette TestClient, in-process; the tiny
preset, and the demo preset where the served model matters: frames, prompt rules, the model the page
names).

The page itself runs in a real browser in tests/test_serve_browser.py; here its static content is checked,
and everything the page does goes through the same API the tests drive. Frames are PNG in these tests so
they can be compared exactly with the public stream API run offline.
"""

from __future__ import annotations

import gc
import io
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from rolling_forcing.config import PipelineConfig, get_preset
from rolling_forcing.decode import PreviewDecoder, to_uint8_frames
from rolling_forcing.model import CausalWanModel
from rolling_forcing.pipeline import RollingForcingPipeline
from rolling_forcing.prompts import switch_options
from rolling_forcing.serve.app import FRAME_HEADER, create_app
from rolling_forcing.serve.config import ServeConfig
from rolling_forcing.stream import NoiseSource
from rolling_forcing.text import SeededTextEncoder
from rolling_forcing.video import VideoSpec
from tests.pipeline_helpers import one_thread as one_thread

TEST_CFG = ServeConfig(
    preset="tiny", image_format="png", session_interval_s=0.0, prompt_interval_s=0.3, calibration_chunks=2,
    fps=32.0, headroom=0.0, max_session_s=60.0, connect_timeout_s=30.0,
)  # fmt: skip
WS = "ws://127.0.0.1:8000"  # the test client's WebSocket base (its default host is not loopback)
WAIT_S = 60.0  # bound of every receive loop (the server sends a readout every 0.25 s)


@contextmanager
def serve(cfg: ServeConfig = TEST_CFG) -> Iterator[TestClient]:
    with TestClient(create_app(cfg), base_url=WS.replace("ws://", "http://")) as client:
        yield client


def receive(ws: Any, frames: dict[int, tuple[int, np.ndarray]], until: Any) -> dict[str, Any]:
    """Collect frames (index -> (block, uint8 [H, W, 3])) until ``until(frames, stats)``; the last stats."""
    stats: dict[str, Any] = {}
    t_end = time.monotonic() + WAIT_S
    while not until(frames, stats):
        assert time.monotonic() < t_end, f"no progress within {WAIT_S} s: {stats}"
        msg = ws.receive()
        if msg.get("bytes") is not None:
            index, block = FRAME_HEADER.unpack(msg["bytes"][:8])
            frames[index] = (block, np.asarray(Image.open(io.BytesIO(msg["bytes"][8:])).convert("RGB")))
        elif msg.get("text") is not None:
            import json

            stats = json.loads(msg["text"])
        else:
            raise AssertionError(f"unexpected message {msg}")
    return stats


def max_block(frames: dict[int, tuple[int, np.ndarray]]) -> int:
    return max((b for b, _ in frames.values()), default=-1)


def offline_frames(
    cfg: ServeConfig,
    seed: int,
    prompts: list[tuple[int, str, str]],
    blocks: int,
    weights: Path | None = None,
) -> dict[int, tuple[int, np.ndarray]]:
    """The stream the server should send, from the public stream API: ``prompts`` = (first block, prompt,
    switch mode of ``SWITCH_MODES``) in order, the first at block 0. Returns frame index -> (block, uint8
    frame). The tiny preset: ``init_random(weights_seed)``, seeded embeddings, the preview decoder; the demo
    preset: ``load_demo(weights)``'s DiT, text encoder and decoder (default: the shipped weights)."""
    pc = PipelineConfig(positions="relative")
    if cfg.preset == "demo":
        from rolling_forcing.demo import load_demo

        demo = load_demo(weights)
        mcfg, model, dec = demo.model_cfg, demo.model, demo.decoder

        def encode(p: str) -> torch.Tensor:
            return demo.text_encoder.encode([p])
    else:
        mcfg = get_preset("tiny")
        model = CausalWanModel(mcfg).init_random(cfg.weights_seed).eval()
        dec = PreviewDecoder(mcfg.out_channels, seed=cfg.weights_seed)
        enc = SeededTextEncoder(mcfg.text_len, mcfg.text_dim)

        def encode(p: str) -> torch.Tensor:
            return enc.encode([p])

    num_blocks = VideoSpec().blocks_for_seconds(cfg.max_session_s, pc.frames_per_block)
    gen = torch.Generator().manual_seed(seed)
    noise = NoiseSource(
        1, mcfg.latent_frame_shape(), 3, num_blocks, torch.float32, generator=gen, upfront=False
    )
    pipe = RollingForcingPipeline(model, mcfg, pc)
    switches = {b: (p, r) for b, p, r in prompts[1:]}
    out: dict[int, tuple[int, np.ndarray]] = {}
    with torch.inference_mode():
        for chunk in pipe.stream(encode(prompts[0][1]), num_blocks, noise=noise):
            for f in to_uint8_frames(dec.decode(chunk.latents.float())):
                out[len(out)] = (chunk.block, f)
            if chunk.block + 1 >= blocks:
                break
            if chunk.block + 1 in switches:
                p, mode = switches[chunk.block + 1]
                pipe.set_prompt(encode(p), **switch_options(mode))
    return out


DEMO_A = "a red circle and a blue square bouncing on a gray background"
DEMO_B = "a yellow triangle bouncing on a navy background"


@pytest.mark.parametrize(
    ("preset", "mode"),
    [
        ("tiny", "continue"),
        ("tiny", "recache"),
        ("tiny", "restart"),
        ("demo", "continue"),
        ("demo", "restart"),
    ],
)
def test_prompt_switch_reaches_the_stream_frame_exact(preset: str, mode: str) -> None:
    """The frames on the socket equal the public stream API's, with the switch (each mode of
    ``SWITCH_MODES``) before the block the session report names; the switch shows within the buffer
    depth; without it the frames differ. The demo preset: the shipped DiT, text encoder and a decoder of
    the session's own."""
    recache, restart = mode == "recache", mode == "restart"
    seed, a, b = 5, "a red fox in the snow", "a blue whale in deep water"
    cfg = TEST_CFG
    if preset == "demo":
        a, b, cfg = DEMO_A, DEMO_B, ServeConfig(**{**TEST_CFG.__dict__, "preset": "demo"})
    with serve(cfg) as client:
        r = client.post("/api/sessions", json={"prompt": a, "seed": seed})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        frames: dict[int, tuple[int, np.ndarray]] = {}
        with client.websocket_connect(WS + r.json()["ws"]) as ws:
            receive(ws, frames, lambda f, s: max_block(f) >= 1)
            if restart:  # both at once is refused with the rule, before the rate limit counts it
                r = client.post(
                    f"/api/sessions/{sid}/prompt", json={"prompt": b, "recache": True, "restart": True}
                )
                assert r.status_code == 422 and "a restart drops the KV cache" in r.json()["detail"], r.text
            r = client.post(
                f"/api/sessions/{sid}/prompt", json={"prompt": b, "recache": recache, "restart": restart}
            )
            assert r.status_code == 202, r.text
            assert (r.json()["recache"], r.json()["restart"]) == (recache, restart)

            def switched(f: dict[int, Any], s: dict[str, Any]) -> bool:
                sched = s.get("prompt_schedule", [])
                return (
                    len(sched) == 2
                    and sched[1]["block"] is not None
                    and max_block(f) >= sched[1]["block"] + 1
                )

            receive(ws, frames, switched)
        r = client.delete(f"/api/sessions/{sid}")
        assert r.status_code == 200, r.text
        rep = r.json()
    sched = rep["serve"]["prompt_schedule"]
    assert [(s["prompt"], s["recache"], s["restart"]) for s in sched] == [
        (a, False, False), (b, recache, restart)
    ]  # fmt: skip
    at = sched[1]["applied_block"]
    # the switch acts on the first chunk produced after it was asked, and shows within the buffer depth
    assert sched[1]["first_frame_index"] == sched[1]["produced_index"]
    assert 0 <= sched[1]["frames_to_screen"] <= TEST_CFG.buffer_frames
    assert rep["meta"]["preset"] == preset
    assert rep["meta"]["guidance"] == get_preset(preset).guidance_scale  # the report names the guidance
    last = max_block(frames)
    want = offline_frames(cfg, seed, [(0, a, "continue"), (at, b, mode)], last + 1)
    plain = offline_frames(cfg, seed, [(0, a, "continue")], last + 1)
    assert frames, "no frames received"
    for index, (block, img) in frames.items():
        assert want[index][0] == block
        np.testing.assert_array_equal(img, want[index][1], err_msg=f"frame {index} (block {block})")
    after = [i for i, (blk, _) in frames.items() if blk >= at]
    assert after and any(not np.array_equal(frames[i][1], plain[i][1]) for i in after)
    assert rep["serve"]["frames_sent"] >= len(frames)


def test_session_lifecycle_two_sessions_and_report() -> None:
    with serve() as client:
        page = client.get("/")
        assert page.status_code == 200 and "<canvas" in page.text and "new WebSocket" in page.text
        assert "/api/sessions" in page.text and 'id="mode"' in page.text
        assert "http://" not in page.text and "https://" not in page.text  # no external resources
        ids, got = [], []
        for prompt in ("a cat", "a dog"):
            r = client.post("/api/sessions", json={"prompt": prompt, "seed": 1})
            assert r.status_code == 201, r.text
            ids.append(r.json()["id"])
        assert len(client.get("/api/sessions").json()) == 2
        for sid in ids:
            frames: dict[int, tuple[int, np.ndarray]] = {}
            with client.websocket_connect(f"{WS}/api/sessions/{sid}/ws") as ws:
                stats = receive(ws, frames, lambda f, s: len(f) >= 12 and "buffer_depth" in s)
                assert stats["id"] == sid and stats["buffer_depth"] == TEST_CFG.buffer_frames
                assert list(frames) == sorted(frames)  # arrival order is frame order (gaps: dropped frames)
                assert next(iter(frames.values()))[1].shape == (64, 64, 3)
            got.append(frames)
        # same seed, different prompts: different pictures
        common = sorted(set(got[0]) & set(got[1]))
        assert common and any(not np.array_equal(got[0][i][1], got[1][i][1]) for i in common)
        for sid in ids:  # the viewer left: both sessions closed, reports kept
            rep = _wait_report(client, sid)
            assert rep["serve"]["close_reason"] == "viewer disconnected"
            assert rep["summary"]["chunks"] >= 2 and rep["meta"]["session"] == sid
            assert rep["summary"]["kind"] == "measured" and rep["serve"]["frames_produced"] >= 12
        assert client.get(f"/api/sessions/{ids[0]}").status_code == 404


def _wait_report(client: TestClient, sid: str, within_s: float = 5.0) -> dict[str, Any]:
    t_end = time.monotonic() + within_s
    while time.monotonic() < t_end:
        r = client.get(f"/api/reports/{sid}")
        if r.status_code == 200:
            return r.json()  # type: ignore[no-any-return]
        time.sleep(0.05)
    raise AssertionError(f"session {sid} not closed within {within_s} s")


def test_disconnect_frees_the_session_and_its_cache_within_seconds() -> None:
    with serve() as client:
        mgr = client.app.state.manager  # type: ignore[attr-defined]
        sid = client.post("/api/sessions", json={"prompt": "a cat"}).json()["id"]
        with client.websocket_connect(f"{WS}/api/sessions/{sid}/ws") as ws:
            receive(ws, {}, lambda f, s: len(f) >= 1)
            cache = weakref.ref(mgr.sessions[sid].stream.pipe.state.cache)
            assert cache() is not None
        t0 = time.monotonic()
        rep = _wait_report(client, sid, within_s=3.0)
        assert sid not in mgr.sessions and rep["serve"]["close_reason"] == "viewer disconnected"
        gc.collect()
        assert cache() is None, "the KV cache of a closed session is still referenced"
        assert time.monotonic() - t0 < 3.0


def test_session_without_a_viewer_is_reaped() -> None:
    cfg = ServeConfig(**{**TEST_CFG.__dict__, "connect_timeout_s": 0.5})
    with serve(cfg) as client:
        sid = client.post("/api/sessions", json={"prompt": "a cat"}).json()["id"]
        rep = _wait_report(client, sid, within_s=4.0)
        assert rep["serve"]["close_reason"].startswith("viewer absent")


def test_admission_refuses_with_503_and_the_reason() -> None:
    cfg = ServeConfig(**{**TEST_CFG.__dict__, "max_sessions": 1})
    with serve(cfg) as client:
        assert client.post("/api/sessions", json={"prompt": "a"}).status_code == 201
        r = client.post("/api/sessions", json={"prompt": "b"})
        assert r.status_code == 503 and "max_sessions=1" in r.json()["detail"]
    # a 12 ms deadline (1000 fps) is below the measured cost of one tiny chunk: refused on cost
    cfg = ServeConfig(**{**TEST_CFG.__dict__, "fps": 1000.0})
    with serve(cfg) as client:
        r = client.post("/api/sessions", json={"prompt": "a"})
        assert r.status_code == 503, r.text
        detail = r.json()["detail"]
        assert "measured per-chunk cost of 1 session(s)" in detail and "> budget 12.0 ms" in detail
        fams = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
        refused = {s.labels["reason"]: s.value for s in fams["rf_serve_sessions_refused"].samples}
        assert refused == {"cost": 1.0}


def test_limits_name_the_rule() -> None:
    cfg = ServeConfig(**{**TEST_CFG.__dict__, "session_interval_s": 30.0, "prompt_interval_s": 30.0})
    with serve(cfg) as client:
        long = "x" * (cfg.max_prompt_chars + 1)
        r = client.post("/api/sessions", json={"prompt": long})
        assert r.status_code == 422 and r.json()["detail"] == (
            f"prompt must be at most {cfg.max_prompt_chars} characters, got {cfg.max_prompt_chars + 1}"
        )
        assert client.post("/api/sessions", json={"prompt": "  "}).status_code == 422
        # no file paths (or anything else) from the client: unknown fields are refused
        r = client.post("/api/sessions", json={"prompt": "a", "checkpoint": "/etc/passwd"})
        assert r.status_code == 422 and "checkpoint" in r.text
        assert client.post("/api/sessions", json={"prompt": "a", "seed": -1}).status_code == 422
        sid = client.post("/api/sessions", json={"prompt": "a"}).json()["id"]
        r = client.post("/api/sessions", json={"prompt": "b"})
        assert r.status_code == 429 and "one per 30 s" in r.json()["detail"] and "Retry-After" in r.headers
        assert client.post(f"/api/sessions/{sid}/prompt", json={"prompt": "c"}).status_code == 202
        r = client.post(f"/api/sessions/{sid}/prompt", json={"prompt": "d"})
        assert r.status_code == 429 and "one per 30 s per session" in r.json()["detail"]
        r = client.post(f"/api/sessions/{sid}/prompt", json={"prompt": long})
        assert r.status_code == 422 and "at most" in r.json()["detail"]
        assert client.post("/api/sessions/nope/prompt", json={"prompt": "c"}).status_code == 404


def test_metrics_follow_the_sessions() -> None:
    with serve() as client:
        sid = client.post("/api/sessions", json={"prompt": "a cat"}).json()["id"]
        with client.websocket_connect(f"{WS}/api/sessions/{sid}/ws") as ws:
            receive(ws, {}, lambda f, s: len(f) >= 12)
            text = client.get("/metrics").text
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        assert fams["rf_serve_chunk_seconds"].type == "histogram"
        hist = {(s.name, s.labels.get("le")): s.value for s in fams["rf_serve_chunk_seconds"].samples}
        chunks = fams["rf_serve_chunks"].samples[0].value
        assert chunks >= 2 and hist[("rf_serve_chunk_seconds_count", None)] == chunks
        assert hist[("rf_serve_chunk_seconds_bucket", "+Inf")] == chunks
        assert fams["rf_serve_sessions"].samples[0].value == 1
        depth = fams["rf_serve_buffer_frames"].samples
        assert [s.labels["session"] for s in depth] == [sid] and 0 <= depth[0].value <= TEST_CFG.buffer_frames
        assert fams["rf_serve_deadline_seconds"].samples[0].value == pytest.approx(TEST_CFG.deadline_s)
        assert fams["rf_serve_deadline_misses"].type == "counter"
        assert fams["rf_serve_frames_sent"].samples[0].value >= 12
        _wait_report(client, sid)
        fams = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
        assert fams["rf_serve_sessions"].samples[0].value == 0
        closed = {s.labels["reason"]: s.value for s in fams["rf_serve_sessions_closed"].samples}
        assert closed == {"viewer disconnected": 1.0}


def test_loopback_server_refuses_foreign_hosts_and_cross_site_origins() -> None:
    with serve() as client:
        r = client.get("/api/config", headers={"host": "rebound.example:8000"})
        assert r.status_code == 403 and "Host header 'rebound.example:8000'" in r.json()["detail"]
        r = client.post("/api/sessions", json={"prompt": "a"}, headers={"origin": "http://evil.example"})
        assert r.status_code == 403 and "cross-site requests are refused" in r.json()["detail"]
        assert client.get("/api/sessions").json() == []  # nothing was created
        ok = client.post("/api/sessions", json={"prompt": "a"}, headers={"origin": "http://127.0.0.1:8000"})
        assert ok.status_code == 201
        from starlette.websockets import WebSocketDisconnect

        foreign = {"origin": "http://evil.example"}
        with (
            pytest.raises(WebSocketDisconnect) as e,
            client.websocket_connect(WS + ok.json()["ws"], headers=foreign),
        ):
            pass
        assert e.value.code == 1008


def test_buffer_start_threshold_covers_the_measured_wait_of_every_session() -> None:
    """Without the worker running, costs stay put: the second session's threshold is the p99 wait for a
    chunk when two sessions share the worker, in frames."""
    from rolling_forcing.serve.engine import Engine
    from rolling_forcing.serve.manager import SessionManager
    from rolling_forcing.serve.playout import start_threshold

    engine = Engine(TEST_CFG)
    engine.calibrate()
    cost = engine.chunk_cost_s()
    mgr = SessionManager(engine)
    a, b = mgr.admit("a", 0), mgr.admit("b", 1)
    assert a.stream is not None and b.stream is not None
    assert a.stream.pipe is not b.stream.pipe and a.stream.pipe.model is b.stream.pipe.model  # shared weights
    assert a.buffer.start_frames == start_threshold(cost, TEST_CFG.fps, TEST_CFG.buffer_frames)
    assert b.buffer.start_frames == start_threshold(2 * cost, TEST_CFG.fps, TEST_CFG.buffer_frames)
    # enough frames to play through the wait (unless that is more than the buffer holds)
    assert b.buffer.start_frames >= min(TEST_CFG.buffer_frames, 2 * cost * TEST_CFG.fps)
    mgr.stop()


def test_viewer_gone_under_a_send_is_one_info_line_and_frees_the_session(caplog) -> None:
    """A tab closed while a frame is being sent: the server's send fails (uvicorn raises an OSError,
    starlette turns it into WebSocketDisconnect 1006) before the receive side has seen the disconnect.
    The handler logs one INFO line (no traceback, no error) and the session is closed and freed."""
    import asyncio
    import logging

    from starlette.websockets import WebSocket

    from rolling_forcing.serve.app import serve_viewer
    from rolling_forcing.serve.engine import Engine
    from rolling_forcing.serve.manager import SessionManager

    engine = Engine(TEST_CFG)
    engine.calibrate()
    mgr = SessionManager(engine)
    mgr.start()
    try:
        s = mgr.admit("a cat", 0)
        sent: list[str] = []

        async def receive() -> dict[str, Any]:
            if not sent:
                return {"type": "websocket.connect"}
            await asyncio.Event().wait()  # the disconnect never reaches the receive side
            raise AssertionError("unreachable")

        async def send(message: dict[str, Any]) -> None:
            sent.append(message["type"])
            if message["type"] == "websocket.send" and message.get("bytes") is not None:
                raise OSError("connection reset by peer")  # what uvicorn raises (ClientDisconnected)

        scope = {"type": "websocket", "path": f"/api/sessions/{s.id}/ws", "headers": [], "query_string": b""}
        with caplog.at_level(logging.DEBUG):
            asyncio.run(asyncio.wait_for(serve_viewer(WebSocket(scope, receive, send), s.id, mgr), WAIT_S))
        assert "websocket.send" in sent  # it did fail under a frame send
        rep = _wait_report_mgr(mgr, s.id)
        assert rep["serve"]["close_reason"] == "viewer disconnected" and s.stream is None
        ours = [r for r in caplog.records if r.name.startswith("rolling_forcing.serve")]
        line = (
            f"viewer of session {s.id} went away during a send (code 1006): session closed, its stream freed"
        )
        assert [(r.levelno, r.getMessage()) for r in ours] == [(logging.INFO, line)]
        assert all(r.exc_info is None and r.levelno < logging.WARNING for r in caplog.records)
    finally:
        mgr.stop()


def _wait_report_mgr(mgr: Any, sid: str, within_s: float = 5.0) -> dict[str, Any]:
    t_end = time.monotonic() + within_s
    while time.monotonic() < t_end:
        if sid in mgr.reports:
            return mgr.reports[sid]  # type: ignore[no-any-return]
        time.sleep(0.02)
    raise AssertionError(f"session {sid} not closed within {within_s} s")


def test_demo_preset_names_its_model_and_refuses_prompts_by_role_with_422() -> None:
    """The demo preset (the default) says which model it serves and refuses a prompt it cannot draw with
    the rule (the words allowed in that role), for a new session and for a switch."""
    from rolling_forcing.prompts import check_scene_prompt

    cfg = ServeConfig(**{**TEST_CFG.__dict__, "preset": "demo"})
    assert cfg.preset == ServeConfig().preset
    bad = [
        "a red circle on a white background",  # white is a shape colour only
        "a circle bouncing on a gray background",  # a shape without a colour
        "a red circle and a blue square and a green triangle and a white circle on a gray background",
        "a red fox in the snow",  # not in the vocabulary
    ]
    with serve(cfg) as client:
        conf = client.get("/api/config").json()
        assert conf["model"] == {
            "preset": "demo",
            "weights": "shipped demo weights",
            "text": "demo text encoder (trained with the DiT)",
            "decoder": "demo autoencoder (streaming decoder, trained)",
            "guidance": "3 (classifier-free, where sigma > 0.85)",  # the demo preset's guidance interval
            "prompt_rule": conf["model"]["prompt_rule"],
            "switch": "restart",  # the page's default for the demo model (docs/demo_model.md)
        }
        for word in ("red", "purple", "circle", "triangle", "black", "navy", "1 to 3"):
            assert word in conf["model"]["prompt_rule"]
        assert check_scene_prompt(conf["default_prompt"]).background == "gray"
        for p in bad:
            with pytest.raises(ValueError) as rule:
                check_scene_prompt(p)
            r = client.post("/api/sessions", json={"prompt": p})
            assert r.status_code == 422 and r.json()["detail"] == f"prompt: demo preset: {rule.value}"
        assert client.get("/api/sessions").json() == []  # nothing was admitted
        r = client.post("/api/sessions", json={"prompt": conf["default_prompt"]})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        r = client.post(f"/api/sessions/{sid}/prompt", json={"prompt": bad[0]})
        assert r.status_code == 422 and "white is a shape colour only" in r.json()["detail"]
        r = client.post(f"/api/sessions/{sid}/prompt", json={"prompt": DEMO_B})
        assert r.status_code == 202, r.text
        page = client.get("/").text
        assert 'id="model"' in page and "m.preset" in page and "default_prompt" in page


def test_the_chunk_after_a_restart_is_not_a_steady_cost() -> None:
    """The first chunk of a stream and the first after a restarting switch carry the window warm-up: the
    session's steady cost (what admission and the buffer threshold read) leaves both out, and every other
    chunk in. Without the worker running, the session is stepped by hand; a continuing switch counts."""
    from rolling_forcing.serve.engine import Engine
    from rolling_forcing.serve.manager import SessionManager

    engine = Engine(ServeConfig(**{**TEST_CFG.__dict__, "buffer_frames": 120}))  # room for 8 chunks unplayed
    engine.calibrate()
    mgr = SessionManager(engine)
    s = mgr.admit("a cat", 0)
    counted = []
    for step in range(8):
        if step == 3:
            s.request_prompt("a dog", recache=False, restart=True)
            s._last_switch_s = -float("inf")  # the rate limit is not what this test is about
        if step == 5:
            s.request_prompt("a cow", recache=False)
        n = len(s.costs)
        out = s.step()
        assert out is not None and out.block == step
        counted.append(len(s.costs) - n)
    assert counted == [0, 1, 1, 0, 1, 1, 1, 1]
    assert [(w.prompt, w.restart, w.applied_block) for w in s.switches[1:]] == [
        ("a dog", True, 3),
        ("a cow", False, 5),
    ]
    mgr.stop()
