"""The page in a real headless Chromium (Debian's ``chromium`` package), driven over the DevTools
protocol with the ``websockets`` client: it starts a session, sees frames advance on the canvas, types a
new prompt and switches, sees the switch reach the stream, stops and shows the report; a screenshot of
the page is written (``RF_SERVE_SCREENSHOT=path.png`` keeps it, e.g. ``docs/serve_page.png``).

Skipped, with the reason, where no Chromium is installed (``apt-get install chromium``).
"""

from __future__ import annotations

import base64
import json
import os
import queue
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.sync.client import ClientConnection, connect

from tests.serve_helpers import running_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium on this machine (Debian: apt-get install chromium)"
)
WAIT_S = 60.0


class DevTools:
    """Minimal DevTools-protocol client over one page session (flattened target attach)."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.next_id = 0
        self.session: str | None = None

    def send(self, method: str, params: dict[str, Any] | None = None, *, page: bool = True) -> dict[str, Any]:
        self.next_id += 1
        msg: dict[str, Any] = {"id": self.next_id, "method": method, "params": params or {}}
        if page and self.session is not None:
            msg["sessionId"] = self.session
        self.ws.send(json.dumps(msg))
        while True:  # skip events until the answer
            reply = json.loads(self.ws.recv(timeout=WAIT_S))
            if reply.get("id") == self.next_id:
                assert "error" not in reply, reply
                return reply["result"]  # type: ignore[no-any-return]

    def open(self, url: str) -> None:
        target = self.send("Target.createTarget", {"url": url}, page=False)["targetId"]
        att = self.send("Target.attachToTarget", {"targetId": target, "flatten": True}, page=False)
        self.session = att["sessionId"]

    def js(self, expr: str) -> Any:
        res = self.send("Runtime.evaluate", {"expression": expr, "returnByValue": True, "awaitPromise": True})
        assert "exceptionDetails" not in res, res
        return res["result"].get("value")

    def wait_for(self, expr: str, what: str) -> Any:
        t_end = time.monotonic() + WAIT_S
        while time.monotonic() < t_end:
            value = self.js(expr)
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"the page did not show {what} within {WAIT_S} s")


def el(id_: str) -> str:
    return f"document.getElementById({json.dumps(id_)})"


# the frame index and block of the frame on the canvas, from the readout "index / block"
FRAME = f"Number(({el('r-frame')}.textContent || '-1 / -1').split(' / ')[0])"
BLOCK = f"Number(({el('r-frame')}.textContent || '-1 / -1').split(' / ')[1])"
# width, height and number of distinct colours of the canvas
CANVAS = (
    f"(() => {{ const c = {el('video')};"
    " const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
    " const s = new Set();"
    " for (let i = 0; i < d.length; i += 4) s.add((d[i] << 16) + (d[i + 1] << 8) + d[i + 2]);"
    " return [c.width, c.height, s.size]; })()"
)


def devtools_url(browser: subprocess.Popen[str]) -> str:
    """The browser's DevTools WebSocket URL from its stderr (read in a thread: bounded by ``WAIT_S``)."""
    found: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert browser.stderr is not None
        for line in browser.stderr:  # keep draining it, so the browser never blocks on a full pipe
            m = re.search(r"DevTools listening on (ws://\S+)", line)
            if m:
                found.put(m.group(1))

    threading.Thread(target=read, daemon=True).start()
    try:
        return found.get(timeout=WAIT_S)
    except queue.Empty:
        raise AssertionError(f"Chromium printed no DevTools URL within {WAIT_S} s") from None


def test_page_streams_and_switches_prompt_in_headless_chromium(tmp_path: Path) -> None:
    assert CHROMIUM is not None
    flags = ["--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--remote-debugging-port=0"]
    flags += [f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1100,760"]
    with running_server() as url:
        browser = subprocess.Popen([CHROMIUM, *flags, "about:blank"], stderr=subprocess.PIPE, text=True)
        try:
            with connect(devtools_url(browser), open_timeout=30, max_size=2**26) as ws:
                _drive_page(DevTools(ws), url, tmp_path)
        finally:
            browser.terminate()
            browser.wait(timeout=30)


def _drive_page(dt: DevTools, url: str, tmp_path: Path) -> None:
    dt.open(url)
    dt.wait_for(f"document.readyState === 'complete' && !!{el('start')}", "the page")
    dt.js(f"{el('start')}.click()")
    dt.wait_for(f"{el('r-status')}.textContent === 'playing'", "playback")
    first = dt.js(FRAME)
    dt.wait_for(f"{FRAME} > {first + 12}", "frames advancing")
    width, height, colours = dt.js(CANVAS)
    assert (width, height) == (64, 64) and colours > 4  # a decoded frame, not a blank canvas
    new_prompt = "a violet jellyfish drifting"
    dt.js(f"{el('prompt')}.value = {json.dumps(new_prompt)}; {el('recache')}.checked = true")
    dt.js(f"{el('switch')}.click()")
    dt.wait_for(f"{el('r-prompt')}.textContent === {json.dumps(new_prompt)}", "the new prompt in the stream")
    sid = dt.js("(async () => (await (await fetch('/api/sessions')).json())[0].id)()")
    sched = httpx.get(f"{url}api/sessions/{sid}").json()["prompt_schedule"]
    assert sched[-1]["prompt"] == new_prompt and sched[-1]["block"] is not None
    dt.wait_for(f"{BLOCK} >= {sched[-1]['block']}", "frames made under the new prompt on the canvas")
    shot = base64.b64decode(dt.send("Page.captureScreenshot", {"format": "png"})["data"])
    assert shot[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "page.png").write_bytes(shot)
    if os.environ.get("RF_SERVE_SCREENSHOT"):
        Path(os.environ["RF_SERVE_SCREENSHOT"]).write_bytes(shot)
    dt.js(f"{el('stop')}.click()")
    report = dt.wait_for(f"{el('report')}.textContent", "the session report")
    assert f"session {sid}:" in report and "frames sent" in report
    rep = httpx.get(f"{url}api/reports/{sid}").json()
    assert rep["serve"]["close_reason"] == "closed by the viewer"
    assert rep["serve"]["prompt_schedule"][-1]["prompt"] == new_prompt
