"""Measured: a prompt switch followed on the served page, and the time to first frame (``python -m
perf.serve_switch [--save] [--seeds 0,1,2]``; docs/serve.md).

``rolling-forcing serve`` runs as a process (the demo preset, its default); a headless Chromium (Debian's
``chromium``) loads the page over the DevTools protocol, presses *start*, switches the prompt with the
page's own controls and copies every frame the page draws: the page's ``rf-frame`` event gives the frame
index and block from the frame's header, and ``getImageData`` the canvas pixels just drawn. So the
frames measured are the frames the server sent, as the page shows them (JPEG by default).

The project's detector (:mod:`perf.quality.detect`: ``read_backgrounds``, ``detect``) reads each frame;
:func:`switch_on_screen` counts, from the first chunk generated under the new prompt (the block the
session's prompt schedule names: chunk 1), the chunk in which the new prompt is on screen in ``hold``
(4) consecutive frames, three ways: its background; its background and every colour it names (any shape
kind); its background and every ``(colour, kind)`` object (metric (a)'s frame rule,
:func:`perf.quality.metrics.presence_mask`). Targets: background and colours within 2 chunks,
shapes within 4. The page also measures, in the browser, the time from *start* to the first frame drawn,
and from each switch click to the first frame of the new prompt's block and to each criterion.

Without ``--save`` it prints only; ``--save`` appends rows (``serve_switch`` per switch, ``serve_first_frame``
per session) to ``perf/results/serve_switch.jsonl``.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from perf.quality.detect import detect, read_backgrounds
from perf.quality.metrics import presence_mask, prompt_background, prompt_objects
from rolling_forcing.prompts import SWITCH_MODES
from rolling_forcing.video import VideoSpec

ROOT = Path(__file__).resolve().parents[1]
WAIT_S = 60.0
START_S = 120.0  # model build + calibration on a busy 2-core machine
CHUNK_FRAMES = 12
TARGETS = {"background": 2, "colours": 2, "shapes": 4}
"""Chunks after the switch within which each criterion must be on screen (the serving targets)."""

START_PROMPT = "a red circle and a blue square bouncing on a gray background"  # the page's first prompt
SWITCHES = (
    ("a yellow triangle bouncing on a navy background", "continue"),  # one object
    ("a green square and a white triangle bouncing on a black background", "recache"),  # two, re-cached
    ("a white circle bouncing on a gray background", "continue"),  # one
    ("a purple circle and a green triangle bouncing on a black background", "continue"),  # two
)
"""The bench's switches, in order within one session (prompt, the mode ``--switch listed`` uses)."""


# ---- the measurement ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SwitchOnScreen:
    """Chunks from the switch (1 = the first chunk generated under the new prompt) until the new prompt's
    background, background + colours, and background + shapes are on screen in ``hold`` consecutive
    frames (None: not within the ``chunks_seen`` chunks observed); ``frames`` observed from the switch;
    ``done_frames``: index into the observed frames where each criterion's run completed."""

    background: int | None
    colours: int | None
    shapes: int | None
    chunks_seen: int
    frames: int
    done_frames: dict[str, int | None]

    def met(self) -> dict[str, bool]:
        """Each criterion against :data:`TARGETS`."""
        return {k: (v := getattr(self, k)) is not None and v <= TARGETS[k] for k in TARGETS}


def _run_end(mask: np.ndarray, hold: int) -> int | None:
    run = 0
    for i, ok in enumerate(mask):
        run = run + 1 if ok else 0
        if run == hold:
            return i
    return None


def switch_on_screen(
    frames: np.ndarray, blocks: Sequence[int], prompt: str, applied_block: int, *, hold: int = 4
) -> SwitchOnScreen:
    """Measure a switch on the frames shown from it on: uint8 ``frames`` ``[T, H, W, 3]`` with the block of
    each (non-decreasing, all ``>= applied_block``), the new ``prompt`` (a demo prompt naming its objects
    and background) and ``applied_block``, the first block generated under it. ``hold`` >= 1."""
    if hold < 1:
        raise ValueError(f"hold must be >= 1, got {hold}")
    b = np.asarray(blocks, dtype=np.int64)
    if len(b) != len(frames) or (len(b) and (b.min() < applied_block or np.any(np.diff(b) < 0))):
        raise ValueError("blocks must give one non-decreasing block >= applied_block per frame")
    objects, background = prompt_objects(prompt), prompt_background(prompt)
    colours = {c for c, _ in objects}
    dets = detect(frames) if len(frames) else []
    bgs = read_backgrounds(frames) if len(frames) else []
    bg_ok = np.array([g == background for g in bgs], dtype=bool)
    masks = {
        "background": bg_ok,
        "colours": bg_ok & np.array([colours <= {d.color for d in fr} for fr in dets], dtype=bool),
        "shapes": presence_mask(dets, objects, bgs, background) if len(frames) else bg_ok,
    }
    done = {k: _run_end(m, hold) for k, m in masks.items()}
    chunk = {k: None if i is None else int(b[i] - applied_block + 1) for k, i in done.items()}
    seen = int(b.max() - applied_block + 1) if len(b) else 0
    return SwitchOnScreen(chunk["background"], chunk["colours"], chunk["shapes"], seen, len(frames), done)


# ---- the browser ----------------------------------------------------------------------------------


def find_chromium() -> str | None:
    """Debian's ``chromium`` (or ``chromium-browser``) on PATH."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


class DevTools:
    """Minimal DevTools-protocol client over one page session (flattened target attach)."""

    def __init__(self, ws: Any) -> None:
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
                if "error" in reply:
                    raise RuntimeError(f"DevTools {method}: {reply['error']}")
                return reply["result"]

    def open(self, url: str) -> str:
        """A new tab on ``url``, attached; returns its target id."""
        target: str = self.send("Target.createTarget", {"url": url}, page=False)["targetId"]
        att = self.send("Target.attachToTarget", {"targetId": target, "flatten": True}, page=False)
        self.session = att["sessionId"]
        return target

    def close(self, target: str) -> None:
        self.session = None
        self.send("Target.closeTarget", {"targetId": target}, page=False)

    def js(self, expr: str) -> Any:
        res = self.send("Runtime.evaluate", {"expression": expr, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in res:
            raise RuntimeError(f"page script failed: {res['exceptionDetails']}")
        return res["result"].get("value")

    def wait_for(self, expr: str, what: str, timeout_s: float = WAIT_S) -> Any:
        t_end = time.monotonic() + timeout_s
        while time.monotonic() < t_end:
            value = self.js(expr)
            if value:
                return value
            time.sleep(0.05)
        raise TimeoutError(f"the page did not show {what} within {timeout_s} s")


def _devtools_url(browser: subprocess.Popen[str]) -> str:
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
        raise TimeoutError(f"Chromium printed no DevTools URL within {WAIT_S} s") from None


@contextmanager
def chromium(profile: Path, exe: str | None = None) -> Iterator[DevTools]:
    """A headless Chromium with its profile in ``profile``, driven over DevTools; ended afterwards."""
    from websockets.sync.client import connect

    exe = exe or find_chromium()
    if exe is None:
        raise FileNotFoundError("no Chromium on this machine (Debian: apt-get install chromium)")
    flags = ["--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--remote-debugging-port=0"]
    flags += [f"--user-data-dir={profile}", "--window-size=1100,760"]
    browser = subprocess.Popen([exe, *flags, "about:blank"], stderr=subprocess.PIPE, text=True)
    try:
        with connect(_devtools_url(browser), open_timeout=30, max_size=2**27) as ws:
            yield DevTools(ws)
    finally:
        browser.terminate()
        browser.wait(timeout=30)


@contextmanager
def running_server(extra_args: Sequence[str] = (), log: list[str] | None = None) -> Iterator[str]:
    """Start ``python -m nki_ardiff serve --port 0 ...``, wait until it answers, yield its base URL
    (``http://127.0.0.1:PORT/``) and end the process afterwards. ``log``: receives the server's output
    lines (stdout and stderr) as they come."""
    import httpx

    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "nki_ardiff", "serve", "--port", "0", *extra_args]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    drainer: threading.Thread | None = None
    try:
        assert proc.stdout is not None
        stdout = proc.stdout
        url = None
        for _ in range(50):  # the URL line comes first, after any import-time warnings
            line = stdout.readline()
            if log is not None:
                log.append(line)
            m = re.search(r"open (http://127\.0\.0\.1:\d+/)", line)
            if m:
                url = m.group(1)
                break
        if not url:
            raise RuntimeError(f"the server printed no URL: {' '.join(cmd)}")

        def drain() -> None:  # keep reading the server's log, so it never blocks on a full pipe
            for line in stdout:
                if log is not None:
                    log.append(line)

        drainer = threading.Thread(target=drain, daemon=True)
        drainer.start()
        t_end = time.monotonic() + START_S
        while True:  # the app answers once the model is built and calibrated
            try:
                if httpx.get(url, timeout=5.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > t_end or proc.poll() is not None:
                raise RuntimeError("the server did not come up")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if drainer is not None:
            drainer.join(timeout=10)  # the log's last lines (EOF once the process is gone)


# ---- one session on the page ----------------------------------------------------------------------


def el(id_: str) -> str:
    return f"document.getElementById({json.dumps(id_)})"


# every frame the page draws: index, block, time since start (ms), the canvas RGB (base64)
_CAPTURE = """(() => { window.__rf = [];
  document.addEventListener('rf-frame', (e) => {
    const c = document.getElementById('video'), n = c.width * c.height;
    const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data, rgb = new Uint8Array(3 * n);
    for (let i = 0; i < n; i++) { rgb[3*i] = d[4*i]; rgb[3*i+1] = d[4*i+1]; rgb[3*i+2] = d[4*i+2]; }
    let s = '';
    for (let i = 0; i < rgb.length; i += 4096) s += String.fromCharCode(...rgb.subarray(i, i + 4096));
    window.__rf.push([e.detail.index, e.detail.block, e.detail.t_ms, c.width, c.height, btoa(s)]);
  }); return true; })()"""
_LAST_BLOCK = "(window.__rf.length ? window.__rf[window.__rf.length - 1][1] : -1)"
_LAST_INDEX = "(window.__rf.length ? window.__rf[window.__rf.length - 1][0] : -1)"


@dataclass(frozen=True)
class SwitchRun:
    """One switch on the page: prompt, mode (``SWITCH_MODES``, as the session report names it), the block
    it applied from, the session report's
    ``frames_to_screen``, the click's time since *start* (ms, browser clock) and the measurement."""

    prompt: str
    mode: str
    applied_block: int
    frames_to_screen: int
    click_ms: float
    on_screen: SwitchOnScreen
    click_to_block_ms: float | None
    click_to_ms: dict[str, float | None]


@dataclass(frozen=True)
class PageRun:
    """One session on the page: ``first_frame_ms`` (start press to the first frame drawn, browser clock;
    the readout's text ``first_frame_text``), the frames drawn (index, block, uint8 RGB), every switch,
    the model line and the session report; ``screenshot``: PNG of the page half way through the second
    chunk of switch ``screenshot_at`` (or None)."""

    first_frame_ms: float
    first_frame_text: str
    indices: list[int]
    blocks: list[int]
    times_ms: list[float]
    frames: np.ndarray
    switches: list[SwitchRun]
    model_line: str
    report: dict[str, Any]
    screenshot: bytes | None


def run_page_session(
    dt: DevTools,
    url: str,
    switches: Sequence[tuple[str, str | None]],
    *,
    seed: int = 0,
    chunks_after: int = 4,
    warm_blocks: int = 2,
    screenshot: bool = False,
    screenshot_at: int = 0,
) -> PageRun:
    """Open the page, start a session (seed ``seed``, the page's first prompt), wait for block
    ``warm_blocks`` on the canvas, then for each switch: type the prompt, choose its mode of
    ``SWITCH_MODES`` in the page's select (None: the mode the page preselected on load, the model's), press
    *switch prompt* and wait for ``chunks_after`` chunks of the new prompt on the canvas; stop, read the
    report and measure every switch on the frames drawn (:func:`switch_on_screen`)."""
    import httpx

    target = dt.open(url)
    try:
        ready = f"(() => {{ const b = {el('start')}; return !!b && !b.disabled; }})()"
        dt.wait_for(ready, "the page with its model line")
        model_line = dt.js(f"{el('model')}.textContent")
        page_mode = dt.js(f"{el('mode')}.value")  # the model's default, preselected by the page
        dt.js(_CAPTURE)
        dt.js(f"{el('seed')}.value = {int(seed)}")
        dt.js(f"{el('start')}.click()")
        dt.wait_for(f"{_LAST_BLOCK} >= {warm_blocks}", f"block {warm_blocks} on the canvas")
        sid = dt.js("session.id")
        clicks, applied = [], []
        shot = None
        for k, (prompt, mode) in enumerate(switches):
            dt.js(f"{el('prompt')}.value = {json.dumps(prompt)}")
            dt.js(f"{el('mode')}.value = {json.dumps(page_mode if mode is None else mode)}")
            t_click = dt.js(
                f"(() => {{ const t = performance.now() - tStart; {el('switch')}.click(); return t; }})()"
            )
            block = None
            t_end = time.monotonic() + WAIT_S
            while block is None:
                if time.monotonic() > t_end:
                    raise TimeoutError(f"switch {k} was not applied within {WAIT_S} s")
                sched = httpx.get(f"{url}api/sessions/{sid}", timeout=10.0).json()["prompt_schedule"]
                if len(sched) == k + 2 and sched[-1]["block"] is not None:
                    block = int(sched[-1]["block"])
                time.sleep(0.05)
            if screenshot and k == screenshot_at:  # half way through the new prompt's second chunk
                mid = VideoSpec().video_frames(block + 1, 3) + CHUNK_FRAMES // 2
                dt.wait_for(f"{_LAST_INDEX} >= {mid}", f"frame {mid} on the canvas")
                shot = base64.b64decode(dt.send("Page.captureScreenshot", {"format": "png"})["data"])
            # the watched chunks drawn whole: the next chunk's first frame (a next switch's buffered
            # frames of this prompt are drawn while it is applied)
            last = block + chunks_after - (0 if k == len(switches) - 1 else 1)
            dt.wait_for(f"{_LAST_BLOCK} >= {last}", f"{chunks_after} chunks of switch {k}")
            clicks.append(float(t_click))
            applied.append(block)
        first_text = dt.js(f"{el('r-first')}.textContent")
        raw = json.loads(dt.js("JSON.stringify(window.__rf)"))
        dt.js(f"{el('stop')}.click()")
        dt.wait_for(f"{el('report')}.textContent", "the session report")
        report = httpx.get(f"{url}api/reports/{sid}", timeout=10.0).json()
    finally:
        dt.close(target)
    raw.sort(key=lambda r: r[0])  # drawn in order of arrival; decoding may finish out of order
    frames = np.stack([np.frombuffer(base64.b64decode(r[5]), np.uint8).reshape(r[4], r[3], 3) for r in raw])
    idx = [int(r[0]) for r in raw]
    blk = [int(r[1]) for r in raw]
    tms = [float(r[2]) for r in raw]
    sched = report["serve"]["prompt_schedule"]
    runs = []
    for k, (prompt, _) in enumerate(switches):
        lo = applied[k]
        hi = applied[k + 1] if k + 1 < len(switches) else lo + chunks_after
        sel = [i for i, b in enumerate(blk) if lo <= b < hi]
        res = switch_on_screen(frames[sel], [blk[i] for i in sel], prompt, lo)
        first = next((tms[i] for i in sel), None)
        to = {key: None if j is None else tms[sel[j]] - clicks[k] for key, j in res.done_frames.items()}
        sw = sched[k + 1]
        mode = "restart" if sw["restart"] else "recache" if sw["recache"] else "continue"
        runs.append(
            SwitchRun(
                prompt, mode, lo, int(sched[k + 1]["frames_to_screen"]), clicks[k], res,
                None if first is None else first - clicks[k], to,
            )
        )  # fmt: skip
    return PageRun(tms[0], first_text, idx, blk, tms, frames, runs, model_line, report, shot)


# ---- the bench ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m perf.serve_switch", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2", help="page seeds, one session each (comma-separated)")
    ap.add_argument("--chunks-after", type=int, default=5, help="chunks watched after each switch")
    ap.add_argument(
        "--switch", default="page", choices=("page", "listed", *SWITCH_MODES),
        help="how every switch is taken: page = the page's default for the model (the demo's: restart), "
        "listed = the bench's own list (continue / recache), or one mode for all (default: page)",
    )  # fmt: skip
    ap.add_argument("--save", action="store_true", help="append rows to perf/results/serve_switch.jsonl")
    return ap


def _fmt(v: float | None, unit: str = "") -> str:
    return "-" if v is None else f"{v:.0f}{unit}"


def main(argv: Sequence[str] | None = None) -> int:
    from perf.runner import BenchRow, append_rows

    args = build_parser().parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        raise SystemExit(f"error: --seeds: comma-separated ints, got {args.seeds!r}") from None
    if args.chunks_after < max(TARGETS.values()):
        raise SystemExit(f"error: --chunks-after: at least {max(TARGETS.values())} (the shapes target)")
    rows: list[BenchRow] = []
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    with tempfile.TemporaryDirectory() as tmp, running_server() as url, chromium(Path(tmp) / "p") as dt:
        for seed in seeds:
            switches = [(p, m if args.switch == "listed" else None if args.switch == "page" else args.switch)
                        for p, m in SWITCHES]  # fmt: skip
            run = run_page_session(dt, url, switches, seed=seed, chunks_after=args.chunks_after)
            meta = run.report["meta"]
            cfg = {
                "preset": meta["preset"],
                "guidance": meta["guidance"],
                "guidance_sigma_min": meta["guidance_sigma_min"],
                "seed": seed,
                "image_format": "jpeg",
            }
            print(f"seed {seed}: first frame {run.first_frame_ms:.0f} ms after start ({run.model_line})")
            rows.append(BenchRow("serve_first_frame", "page", cfg, "measured", extra={
                "first_frame_ms": run.first_frame_ms, "loadavg_1m": load,
            }))  # fmt: skip
            prev = START_PROMPT
            for s in run.switches:
                o = s.on_screen
                print(
                    f"  {prev[:34]!r} -> {s.prompt[:40]!r} {s.mode}: chunks to background "
                    f"{_fmt(o.background)}, colours {_fmt(o.colours)}, shapes {_fmt(o.shapes)} (of "
                    f"{o.chunks_seen} seen; met {o.met()}); click to new block "
                    f"{_fmt(s.click_to_block_ms, ' ms')}, to colours {_fmt(s.click_to_ms['colours'], ' ms')}"
                )
                rows.append(BenchRow("serve_switch", "demo_page", {**cfg, "from": prev, "to": s.prompt,
                    "recache": s.mode == "recache", "switch": s.mode}, "measured", extra={
                    **{f"{k}_chunks": getattr(o, k) for k in TARGETS}, "met": o.met(),
                    "chunks_seen": o.chunks_seen, "applied_block": s.applied_block,
                    "frames_to_screen": s.frames_to_screen, "click_to_block_ms": s.click_to_block_ms,
                    **{f"click_to_{k}_ms": v for k, v in s.click_to_ms.items()}, "loadavg_1m": load,
                }))  # fmt: skip
                prev = s.prompt
    if args.save:
        print(f"rows appended to {append_rows(rows, 'serve_switch')}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
