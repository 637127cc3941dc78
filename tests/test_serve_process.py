"""``rolling-forcing serve`` as a real process: uvicorn on a free loopback port (``--port 0``), driven over
real HTTP and a real WebSocket (the ``websockets`` client); the test ends the process it started. It
serves the demo preset by default (the shipped trained model, named by ``/api/config``); a viewer that
leaves is one INFO line in the server's log, never a traceback."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import httpx
from PIL import Image
from websockets.sync.client import connect

from tests.serve_helpers import running_server


def test_serve_command_streams_over_a_real_socket(tmp_path: Path) -> None:
    log: list[str] = []
    with (
        running_server(["--image-format", "png", "--report-dir", str(tmp_path)], log) as url,
        httpx.Client(base_url=url, timeout=10.0) as http,
    ):
        model = http.get("/api/config").json()["model"]
        assert model["preset"] == "demo" and model["weights"] == "shipped demo weights"
        assert model["decoder"] == "demo autoencoder (streaming decoder, trained)"
        r = http.post("/api/sessions", json={"prompt": "a lighthouse at dusk", "seed": 2})
        assert r.status_code == 422 and "prompt word 'lighthouse' is not in the vocabulary" in r.text
        prompt = "a yellow triangle bouncing on a navy background"
        r = http.post("/api/sessions", json={"prompt": prompt, "seed": 2})
        assert r.status_code == 201, r.text
        sid, ws_path = r.json()["id"], r.json()["ws"]
        frames, stats = [], None
        with connect(url.replace("http://", "ws://").rstrip("/") + ws_path, open_timeout=10) as ws:
            while len(frames) < 3 or stats is None:
                msg = ws.recv(timeout=30)
                if isinstance(msg, bytes):
                    frames.append(Image.open(io.BytesIO(msg[8:])).size)
                else:
                    stats = json.loads(msg)
        assert frames == [(64, 64)] * len(frames) and stats["id"] == sid
        for _ in range(100):  # the disconnect closes the session within seconds
            r = http.get(f"/api/reports/{sid}")
            if r.status_code == 200:
                break
            time.sleep(0.05)
        assert r.status_code == 200 and r.json()["serve"]["close_reason"] == "viewer disconnected"
        saved = json.loads((tmp_path / f"session-{sid}.json").read_text())
        assert saved["meta"]["session"] == sid and saved["summary"]["chunks"] >= 1
        assert saved["meta"]["preset"] == "demo" and saved["meta"]["weights"] == "shipped demo weights"
        metrics = http.get("/metrics")
        assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
    # the viewer left: one INFO line naming the session, no traceback anywhere in the log
    left = [line for line in log if f"viewer of session {sid}" in line]
    assert len(left) == 1 and left[0].startswith("INFO:") and "session closed" in left[0], left
    assert not any("Traceback" in line or "ERROR" in line for line in log), "".join(log)
