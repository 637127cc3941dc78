"""Measurements behind docs/serve.md (CPU wall clock, *measured*; one torch thread).

``python -m rolling_forcing.serve.bench batching``: the per-chunk time of two streams batched into one
forward (``B=2``) against two ``B=1`` streams interleaved chunk by chunk (tiny preset).

``python -m rolling_forcing.serve.bench sessions --sessions 1,2,4,8 --seconds 10 [--preset demo]``: N
sessions of the preset (``demo``, the served default, or ``tiny``; each with its preset's first prompt) on the
server's scheduler (no HTTP; a viewer thread polls every buffer at its slots) for the given time each:
chunk cost p50/p99, frames sent and dropped, late chunks, and what admission would have said.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any


def _stream_times(model: Any, batch: int, chunks: int, seed: int = 0) -> list[float]:
    import torch

    from rolling_forcing.config import PipelineConfig, get_preset
    from rolling_forcing.pipeline import RollingForcingPipeline
    from rolling_forcing.stream import NoiseSource

    cfg, pc = get_preset("tiny"), PipelineConfig(positions="relative")
    pipe = RollingForcingPipeline(model, cfg, pc)
    emb = torch.randn(batch, cfg.text_len, cfg.text_dim, generator=torch.Generator().manual_seed(seed))
    noise = NoiseSource(
        batch, cfg.latent_frame_shape(), pc.frames_per_block, 10**6, pc.torch_dtype,
        generator=torch.Generator().manual_seed(seed), upfront=False,
    )  # fmt: skip
    out, it = [], pipe.stream(emb, 10**6, noise=noise)
    with torch.inference_mode():
        next(it)  # the first chunk carries the window warm-up
        for _ in range(chunks):
            t0 = time.perf_counter()
            next(it)
            out.append(time.perf_counter() - t0)
    it.close()
    return out


def bench_batching(chunks: int = 20, repeats: int = 3) -> dict[str, Any]:
    """Median per-chunk seconds: one ``B=2`` stream vs two ``B=1`` streams (sum of both per chunk)."""
    import torch

    from rolling_forcing.config import get_preset
    from rolling_forcing.model import CausalWanModel

    torch.set_num_threads(1)
    model = CausalWanModel(get_preset("tiny")).init_random(0).eval()
    b1, b2 = [], []
    for _ in range(repeats):  # alternate, so drifting machine load hits both alike
        b1.append(statistics.median(_stream_times(model, 1, chunks)))
        b2.append(statistics.median(_stream_times(model, 2, chunks)))
    one, two = statistics.median(b1), statistics.median(b2)
    return {
        "kind": "measured",
        "clock": "CPU wall clock, 1 torch thread, tiny preset",
        "b1_chunk_s": one,
        "interleaved_two_streams_s": 2 * one,
        "batched_two_streams_s": two,
        "batched_saving": 1.0 - two / (2 * one),
    }


def bench_sessions(counts: Sequence[int], seconds: float, preset: str = "demo") -> list[dict[str, Any]]:
    """Run each count of sessions of ``preset`` (``demo`` or ``tiny``) for ``seconds`` on one scheduler;
    measured figures per count."""
    import torch

    from rolling_forcing.report import percentile
    from rolling_forcing.serve.config import ServeConfig
    from rolling_forcing.serve.engine import Engine
    from rolling_forcing.serve.manager import SessionManager, admission_refusal
    from rolling_forcing.serve.playout import start_threshold
    from rolling_forcing.serve.session import Session

    cfg = ServeConfig(
        preset=preset, max_sessions=max(counts), session_interval_s=0.0, connect_timeout_s=3600.0
    )
    torch.set_num_threads(cfg.threads)
    rows = []
    for n in counts:
        engine = Engine(replace(cfg))
        engine.calibrate()
        mgr = SessionManager(engine)
        # past admission on purpose (to see what it protects against): sessions are added by hand
        start = start_threshold(n * engine.chunk_cost_s(), cfg.fps, cfg.buffer_frames)
        prompt = engine.parts.default_prompt
        sessions = [Session(f"s{i}", engine, prompt, i, start) for i in range(n)]
        for s in sessions:
            s.connected = True
            mgr.sessions[s.id] = s
        stop = threading.Event()

        def viewer(sessions: list[Any] = sessions, stop: threading.Event = stop) -> None:
            while not stop.is_set():
                now = time.perf_counter()
                for s in sessions:
                    s.buffer.poll(now)
                time.sleep(0.005)

        v = threading.Thread(target=viewer, daemon=True)
        mgr.start()
        v.start()
        time.sleep(seconds)
        stop.set()
        v.join()
        steady = [r for s in sessions for r in s.rows if r.block > 0]
        costs = [r.generate_s + r.decode_s + r.write_s for r in steady]
        calib = engine.calibration_s
        sent = sum(s.buffer.sent for s in sessions)
        dropped = sum(s.buffer.dropped for s in sessions)
        late = sum(s.buffer.late_chunks for s in sessions)
        p99 = percentile(costs, 99)
        mgr.stop()
        rows.append({
            "kind": "measured",
            "preset": preset,
            "sessions": n,
            "calibration_p50_ms": percentile(calib, 50) * 1e3,
            "seconds": seconds,
            "chunks": len(costs) + n,
            "chunk_cost_p50_ms": percentile(costs, 50) * 1e3,
            "chunk_cost_p99_ms": p99 * 1e3,
            "generate_p50_ms": percentile([r.generate_s for r in steady], 50) * 1e3,
            "decode_p50_ms": percentile([r.decode_s for r in steady], 50) * 1e3,
            "encode_p50_ms": percentile([r.write_s for r in steady], 50) * 1e3,
            "bytes_per_frame": sum(len(f.data) for s in sessions for f in s.buffer._frames)
            / max(1, sum(len(s.buffer) for s in sessions)),
            "frames_sent": sent,
            "sent_fps_per_session": sent / n / seconds,
            "frames_dropped": dropped,
            "late_chunks": late,
            "admission_at_this_load": admission_refusal(
                [p99] * (n - 1), p99, cfg.deadline_s, cfg.headroom, cfg.max_sessions
            ) or "admit",
        })  # fmt: skip
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rolling_forcing.serve.bench", description=__doc__)
    sub = ap.add_subparsers(dest="what", required=True)
    b = sub.add_parser("batching", help="batched vs interleaved streams")
    b.add_argument("--chunks", type=int, default=20)
    b.add_argument("--repeats", type=int, default=3)
    s = sub.add_parser("sessions", help="N concurrent sessions on one scheduler")
    s.add_argument("--sessions", default="1,2,4,8", help="comma-separated session counts")
    s.add_argument("--seconds", type=float, default=10.0)
    s.add_argument("--preset", choices=["demo", "tiny"], default="demo")
    args = ap.parse_args(argv)
    if args.what == "batching":
        print(json.dumps(bench_batching(args.chunks, args.repeats), indent=2))
    else:
        counts = [int(x) for x in args.sessions.split(",")]
        if any(c < 1 for c in counts):
            ap.error(f"--sessions: counts must be >= 1, got {args.sessions}")
        for row in bench_sessions(counts, args.seconds, args.preset):
            print(json.dumps(row))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
