"""Measured: a long relative-position stream on the tiny preset keeps flat memory (``python -m
perf.bench_long_stream``).

Streams ``--frames`` latent frames (default 3,000: three times past the original's 1,024-position RoPE
table) with ``positions="relative"`` and noise drawn per block (``NoiseSource(upfront=False)``), so
nothing grows with the stream length. Every ``--every`` chunks it records the process's resident set size
(RSS, ``/proc/self/statm``; the current value, not the peak) and the median chunk latency since the last
sample. All figures are *measured* (CPU wall clock, RSS). One row per sample goes to
``perf/results/long_stream.jsonl``; the table ends with the RSS growth from the first to the last sample.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from perf.runner import BenchRow, append_rows, print_table
from rolling_forcing.config import PipelineConfig, get_preset
from rolling_forcing.model import CausalWanModel
from rolling_forcing.pipeline import NoiseSource, RollingForcingPipeline


def rss_bytes() -> int:
    """Current resident set size of this process (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def run(frames: int, every: int, preset: str = "tiny", seed: int = 0) -> list[BenchRow]:
    cfg = get_preset(preset)
    pipe_cfg = PipelineConfig()
    if frames % pipe_cfg.frames_per_block:
        raise ValueError(f"frames must be a multiple of {pipe_cfg.frames_per_block}, got {frames}")
    num_blocks = frames // pipe_cfg.frames_per_block
    model = CausalWanModel(cfg).init_random(seed).eval()
    pipe = RollingForcingPipeline(model, cfg, pipe_cfg, positions="relative")
    g = torch.Generator().manual_seed(seed)
    text = torch.randn(1, cfg.text_len, cfg.text_dim, generator=g)
    noise = NoiseSource(
        1, cfg.latent_frame_shape(), pipe_cfg.frames_per_block, num_blocks, torch.float32,
        generator=g, upfront=False,
    )  # fmt: skip
    rows: list[BenchRow] = []
    gaps: list[float] = []
    t_prev = time.perf_counter()
    with torch.inference_mode():
        for n, chunk in enumerate(pipe.stream(text, num_blocks, noise=noise), start=1):
            now = time.perf_counter()
            gaps.append(now - t_prev)
            t_prev = now
            if not torch.isfinite(chunk.latents).all():
                raise RuntimeError(f"non-finite latents in chunk {chunk.block}")
            if n % every == 0 or n == num_blocks:
                rows.append(
                    BenchRow(
                        op="stream",
                        variant="relative_positions",
                        config={"preset": preset, "latent_frames_so_far": n * pipe_cfg.frames_per_block,
                                "threads": torch.get_num_threads()},
                        kind="measured",
                        latency_us=statistics.median(gaps) * 1e6,
                        memory_bytes=rss_bytes(),
                    )
                )  # fmt: skip
                gaps = []
    return rows


def build_parser() -> argparse.ArgumentParser:
    """The command's arguments (its own function so a test can check the defaults: nothing tracked is
    written without ``--save``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=3000, help="latent frames to stream (multiple of 3)")
    ap.add_argument("--every", type=int, default=100, help="chunks between RSS samples")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-save", action="store_true", help="print only (the default; kept for scripts)")
    ap.add_argument(
        "--save",
        action="store_true",
        help="append the rows to perf/results/long_stream.jsonl (tracked); default: print only",
    )
    return ap


def main(argv: list[str] | None = None) -> None:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.save and args.no_save:
        ap.error("--save and --no-save contradict each other")
    torch.set_num_threads(args.threads)
    rows = run(args.frames, args.every, args.preset)
    if args.save:
        append_rows(rows, "long_stream")
    print_table(rows)
    first, last = rows[0].memory_bytes or 0, rows[-1].memory_bytes or 0
    print(
        f"measured RSS growth from chunk {args.every} to the end: {(last - first) / 2**20:+.1f} MiB "
        f"({first / 2**20:.1f} -> {last / 2**20:.1f} MiB) over {args.frames} latent frames"
    )


if __name__ == "__main__":
    main()
