"""The single static page of ``rolling-forcing serve`` (HTML + inline JS, no external resources).

On load the page reads ``GET /api/config`` and says which model it shows (preset, weights, text encoder,
decoder and, for the demo preset, the prompt rule) and fills the prompt box with the model's first prompt.
It creates a session (``POST /api/sessions``), opens its WebSocket, draws each binary frame message
(8-byte header, then a JPEG/PNG) on a canvas with ``createImageBitmap``, switches the prompt
(``POST /api/sessions/{id}/prompt``: the stream continues, continues with its KV cache re-cached, or
restarts under the new prompt; the model's default, ``switch`` of ``/api/config``, is preselected),
stops (``DELETE``: shows the report summary) and shows the readout the server sends, plus the time from
*start* to the first frame on the canvas (measured in the browser, ``performance.now()``). After drawing
a frame it dispatches a ``rf-frame`` event on ``document`` (``detail``: ``index``, ``block``, ``t_ms``)
for scripts that read the canvas (the browser test).
"""

from __future__ import annotations

_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>rolling-forcing serve</title>
<style>
 body { font-family: system-ui, sans-serif; margin: 1.5em; background: #111; color: #ddd; }
 canvas { width: 384px; height: 384px; image-rendering: pixelated; background: #000; border: 1px solid #444; }
 .row { display: flex; gap: 1.5em; align-items: flex-start; }
 input[type=text] { width: 28em; }
 table { border-collapse: collapse; } td { padding: 0.1em 0.8em 0.1em 0; font-variant-numeric: tabular-nums; }
 #error { color: #f77; min-height: 1.2em; } .muted { color: #888; font-size: 0.85em; }
</style>
</head>
<body>
<h1>rolling-forcing serve</h1>
<div class="row">
 <div>
  <canvas id="video" width="64" height="64"></canvas>
  <p class="muted" id="model">model: loading ...</p>
  <p class="muted" id="rule"></p>
  <p class="muted">Figures are measured (CPU wall clock).</p>
 </div>
 <div>
  <p><label>prompt <input id="prompt" type="text" value=""></label></p>
  <p><label>seed <input id="seed" type="number" value="0" min="0"></label>
     <button id="start" disabled>start</button> <button id="stop" disabled>stop</button></p>
  <p><button id="switch" disabled>switch prompt</button>
     <label>as <select id="mode">
       <option value="continue">continue the stream</option>
       <option value="recache">continue, re-cache the KV cache</option>
       <option value="restart">restart the video</option></select></label></p>
  <p id="error"></p>
  <table id="readout">
   <tr><td>status</td><td id="r-status">idle</td></tr>
   <tr><td>first frame after start</td><td id="r-first">-</td></tr>
   <tr><td>chunk latency (last / p99)</td><td id="r-latency">-</td></tr>
   <tr><td>deadline / headroom</td><td id="r-deadline">-</td></tr>
   <tr><td>buffer (frames held / depth, lead)</td><td id="r-buffer">-</td></tr>
   <tr><td>frames shown / dropped (missed slot)</td><td id="r-frames">-</td></tr>
   <tr><td>late chunks</td><td id="r-late">-</td></tr>
   <tr><td>current frame / block</td><td id="r-frame">-</td></tr>
   <tr><td>prompt in the stream</td><td id="r-prompt">-</td></tr>
  </table>
  <pre id="report" class="muted"></pre>
 </div>
</div>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const ctx = $("video").getContext("2d");
let session = null, ws = null, mime = "image/jpeg", tStart = null, shown = 0;
function setError(msg) { $("error").textContent = msg || ""; }
async function api(method, url, body) {
  const res = await fetch(url, {method, headers: {"content-type": "application/json"},
                                body: body === undefined ? undefined : JSON.stringify(body)});
  const data = await res.json().catch(() => ({}));
  if (!res.ok) {
    const d = data.detail;
    throw new Error(res.status + ": " + (typeof d === "string" ? d : JSON.stringify(d)));
  }
  return data;
}
function fmt(x, digits) {
  return (x === null || x === undefined || Number.isNaN(x)) ? "-" : x.toFixed(digits);
}
function showStats(s) {
  $("r-status").textContent = s.closed ? "closed" : (s.playing ? "playing" : "buffering");
  $("r-latency").textContent = fmt(s.last_chunk_ms, 1) + " ms / " + fmt(s.p99_chunk_ms, 1) + " ms";
  const headroom = s.headroom === null ? null : 100 * s.headroom;
  $("r-deadline").textContent = fmt(s.deadline_ms, 0) + " ms / " + fmt(headroom, 0) + " %";
  $("r-buffer").textContent = s.buffer_frames + " / " + s.buffer_depth + ", " + fmt(s.lead_ms, 0) + " ms";
  $("r-frames").textContent = s.frames_sent + " / " + s.frames_dropped;
  $("r-late").textContent = s.late_chunks;
  $("r-prompt").textContent = s.prompt;
}
async function drawFrame(buf) {
  const view = new DataView(buf);
  const index = view.getUint32(0), block = view.getUint32(4);
  const bmp = await createImageBitmap(new Blob([buf.slice(8)], {type: mime}));
  const c = $("video");
  if (c.width !== bmp.width || c.height !== bmp.height) { c.width = bmp.width; c.height = bmp.height; }
  ctx.drawImage(bmp, 0, 0);
  $("r-frame").textContent = index + " / " + block;
  const t = performance.now() - tStart;
  if (shown++ === 0) $("r-first").textContent = t.toFixed(0) + " ms";
  document.dispatchEvent(new CustomEvent("rf-frame", {detail: {index, block, t_ms: t}}));
}
function idle() {
  $("start").disabled = false; $("stop").disabled = true; $("switch").disabled = true;
  session = null; ws = null;
}
async function loadModel() {
  try {
    const cfg = await api("GET", "/api/config"), m = cfg.model;
    mime = cfg.image_format === "png" ? "image/png" : "image/jpeg";
    $("model").textContent = "model: " + m.preset + " preset; weights: " + m.weights + "; text: " +
      m.text + "; decoder: " + m.decoder + " (" + cfg.frame_width + " x " + cfg.frame_height + " at " +
      cfg.fps + " fps); guidance: " + m.guidance;
    $("rule").textContent = m.prompt_rule ? "prompts: " + m.prompt_rule : "";
    if (!$("prompt").value) $("prompt").value = cfg.default_prompt;
    $("mode").value = m.switch || "continue";
    $("start").disabled = false;
  } catch (e) { setError(e.message); }
}
loadModel();
$("start").onclick = async () => {
  setError(""); $("report").textContent = ""; $("r-first").textContent = "-";
  tStart = performance.now(); shown = 0;
  try {
    session = await api("POST", "/api/sessions", {prompt: $("prompt").value, seed: Number($("seed").value)});
  } catch (e) { setError(e.message); return; }
  $("start").disabled = true; $("stop").disabled = false; $("switch").disabled = false;
  const proto = location.protocol === "https:" ? "wss://" : "ws://";
  ws = new WebSocket(proto + location.host + session.ws);
  ws.binaryType = "arraybuffer";
  ws.onmessage = (ev) => {
    if (typeof ev.data !== "string") { drawFrame(ev.data); return; }
    const msg = JSON.parse(ev.data);
    if (msg.type === "stats") showStats(msg);
    if (msg.type === "closed") { $("r-status").textContent = "closed: " + msg.reason; }
  };
  ws.onclose = () => idle();
};
$("stop").onclick = async () => {
  if (!session) return;
  const id = session.id;
  try {
    const rep = await api("DELETE", "/api/sessions/" + id);
    const s = rep.summary, v = rep.serve;
    $("report").textContent = "session " + id + ": " + s.chunks + " chunks, p50 " +
      fmt(1e3 * s.p50_chunk_latency_s, 1) + " ms, p99 " + fmt(1e3 * s.p99_chunk_latency_s, 1) +
      " ms between chunks; frames sent " + v.frames_sent + ", dropped " + v.frames_dropped +
      "\\nfull JSON report: /api/reports/" + id;
  } catch (e) { setError(e.message); }
  if (ws) ws.close();
  idle();
};
$("switch").onclick = async () => {
  if (!session) return;
  setError("");
  try {
    await api("POST", "/api/sessions/" + session.id + "/prompt",
              {prompt: $("prompt").value, recache: $("mode").value === "recache",
               restart: $("mode").value === "restart"});
  } catch (e) { setError(e.message); }
};
</script>
</body>
</html>
"""


def page_html() -> str:
    """The page's HTML (a constant string; it fetches nothing outside this server)."""
    return _PAGE


__all__ = ["page_html"]
