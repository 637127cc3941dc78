"""Measured CPU wall time per chunk: merged forward vs two-pass stream (``python -m perf.bench_pipeline``).

For each model configuration the same stream (same weights, prompt, noise) runs in both modes,
alternating ``--reps`` times. Figures (all *measured*, CPU wall clock / counts):

* ``latency_us``: median time between consecutive chunks over the **steady-state** chunks (blocks
  1 .. num_blocks - window_blocks: each is exactly one full window of work; chunk 0 carries the warm-up,
  the last ones the tail windows);
* ``stream_s_per_chunk``: whole-stream time / num_blocks (warm-up and tail included; the merged mode pads
  those windows to the full shape);
* forwards per steady chunk and per stream, and distinct forward input signatures per stream
  (:class:`rolling_forcing.pipeline.ForwardStats`).

Rows go to ``perf/results/pipeline.jsonl`` and are printed as a table, followed by the measured ratio
two-pass / merged per configuration (both eager). ``--compile`` adds a third mode, ``merged_compiled``: the
merged forward under ``torch.compile(fullgraph=True)`` (inductor; compiled in the untimed warm-up stream),
reported as a separate ratio two-pass (eager) / merged_compiled. The two-pass stream is not compiled: its
warm-up and tail windows change shapes and its key sets are Python data, so it would recompile per window.
Configurations: ``tiny``, ``mid`` (Wan2.1-1.3B widths, 2 layers,
8x8 latent = 16 tokens/frame) and ``mid`` with a 4x4 latent (4 tokens/frame), to show how the gain
depends on the tokens per pass.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace
from typing import Any

import torch

from perf.runner import BenchRow, append_rows, print_table
from rolling_forcing.config import ModelConfig, PipelineConfig, get_preset
from rolling_forcing.model import CausalWanModel
from rolling_forcing.pipeline import RollingForcingPipeline

MODES = ("two_pass", "merged")
COMPILED = "merged_compiled"


def configurations(names: list[str]) -> list[ModelConfig]:
    """Named presets; ``mid-4x4`` is ``mid`` with a 4x4 latent (4 tokens per frame)."""
    out = []
    for name in names:
        if name == "mid-4x4":
            mid = get_preset("mid")
            out.append(replace(mid, name="mid-4x4", latent_height=4, latent_width=4))
        else:
            out.append(get_preset(name))
    return out


def _one_stream(
    pipe: RollingForcingPipeline, text: torch.Tensor, num_blocks: int, seed: int
) -> tuple[list[float], float]:
    """Seconds between consecutive chunks (first: from the call) and the whole stream's seconds."""
    gaps = []
    t_start = t0 = time.perf_counter()
    for _ in pipe.stream(text, num_blocks, generator=torch.Generator().manual_seed(seed)):
        t1 = time.perf_counter()
        gaps.append(t1 - t0)
        t0 = t1
    return gaps, time.perf_counter() - t_start


def bench_config(
    mcfg: ModelConfig, pcfg: PipelineConfig, num_blocks: int, reps: int, compiled: bool = False
) -> list[BenchRow]:
    model = CausalWanModel(mcfg).init_random(0).eval().to(pcfg.torch_dtype)
    text = torch.randn(1, mcfg.text_len, mcfg.text_dim, generator=torch.Generator().manual_seed(1))
    text = text.to(pcfg.torch_dtype)
    modes = (*MODES, COMPILED) if compiled else MODES
    pipes = {
        m: RollingForcingPipeline(model, mcfg, pcfg, merged=m != "two_pass", compile=m == COMPILED or None)
        for m in modes
    }
    steady = slice(1, num_blocks - pcfg.window_blocks + 1)  # chunks yielded after one full window each
    samples: dict[str, list[float]] = {m: [] for m in modes}
    streams: dict[str, list[float]] = {m: [] for m in modes}
    compile_s = 0.0
    for m in modes:  # untimed warm-up stream per mode (allocator, first-touch of weights, compilation)
        compile_s = _one_stream(pipes[m], text, pcfg.window_blocks, 0)[1] if m == COMPILED else compile_s
        if m != COMPILED:
            _one_stream(pipes[m], text, pcfg.window_blocks, 0)
    for _ in range(reps):
        for m in modes:  # alternate the modes so background load hits all alike
            gaps, total = _one_stream(pipes[m], text, num_blocks, 7)
            samples[m] += gaps[steady]
            streams[m].append(total)
    config: dict[str, Any] = {
        "preset": mcfg.name,
        "layers": mcfg.num_layers,
        "dim": mcfg.dim,
        "latent": [mcfg.latent_height, mcfg.latent_width],
        "tokens_per_frame": mcfg.tokens_per_frame,
        "num_blocks": num_blocks,
        "dtype": pcfg.dtype,
        "backend": "reference",
        "threads": torch.get_num_threads(),
        "loadavg_1m_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    rows = []
    for m in modes:
        st = pipes[m].stats
        nw = st.total
        steady_fwd = 2 if m == "two_pass" else 1
        rows.append(
            BenchRow(
                op="pipeline_chunk",
                variant=m,
                config=config,
                kind="measured",
                latency_us=statistics.median(samples[m]) * 1e6,
                extra={
                    "steady_samples": len(samples[m]),
                    "steady_p90_us": sorted(samples[m])[int(0.9 * (len(samples[m]) - 1))] * 1e6,
                    "stream_s_per_chunk": statistics.median(streams[m]) / num_blocks,
                    "forwards_per_steady_chunk": steady_fwd,
                    "forwards_per_stream": nw,
                    "forwards_per_chunk_stream": nw / num_blocks,
                    "signatures_per_stream": len(st.signatures),
                    **({"compile_warmup_stream_s": compile_s} if m == COMPILED else {}),
                },
            )
        )
    two = rows[0]
    for one in rows[1:]:
        assert two.latency_us is not None and one.latency_us is not None
        rows.append(
            BenchRow(
                op="pipeline_chunk_ratio",
                variant=f"two_pass/{one.variant}",
                config=config,
                kind="measured",
                extra={
                    "steady_ratio": two.latency_us / one.latency_us,
                    "stream_ratio": two.extra["stream_s_per_chunk"] / one.extra["stream_s_per_chunk"],
                },
            )
        )
    return rows


def build_parser() -> argparse.ArgumentParser:
    """The command's arguments (its own function so a test can check the defaults: nothing tracked is
    written without ``--save``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=["tiny", "mid", "mid-4x4"])
    ap.add_argument("--blocks", type=int, default=10, help="blocks per stream (>= window_blocks + 2)")
    ap.add_argument("--reps", type=int, default=2, help="streams per mode (alternating)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (pinned)")
    ap.add_argument("--no-write", action="store_true", help="print only (the default; kept for scripts)")
    ap.add_argument(
        "--compile", action="store_true", help="also time the merged forward compiled with inductor"
    )
    ap.add_argument(
        "--save",
        action="store_true",
        help="append the rows to perf/results/pipeline.jsonl (tracked); default: print only",
    )
    return ap


def main(argv: list[str] | None = None) -> list[BenchRow]:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.save and args.no_write:
        ap.error("--save and --no-write contradict each other")
    pcfg = PipelineConfig()
    if args.blocks < pcfg.window_blocks + 2:
        raise SystemExit(f"--blocks must be >= {pcfg.window_blocks + 2} to have steady-state chunks")
    torch.set_num_threads(args.threads)
    rows: list[BenchRow] = []
    with torch.inference_mode():
        for mcfg in configurations(args.configs):
            rows += bench_config(mcfg, pcfg, args.blocks, args.reps, compiled=args.compile)
    if args.save:
        append_rows(rows, "pipeline")
    print_table(rows)
    for r in rows:
        if r.op == "pipeline_chunk_ratio":
            print(
                f"measured ratio {r.variant.replace('_', '-')} per steady chunk, {r.config['preset']} "
                f"({r.config['tokens_per_frame']} tokens/frame): {r.extra['steady_ratio']:.2f}x "
                f"(whole stream: {r.extra['stream_ratio']:.2f}x)"
            )
    return rows


if __name__ == "__main__":
    main()
