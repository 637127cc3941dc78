"""The FP8 gates' second half: the decoded video of a stream with an FP8 option against the bf16
stream of the same model, prompt and noise, PSNR >= 35 dB over a 30 s stream, on the project's trained
demo model (``rolling_forcing.demo``).

:func:`psnr_gate` (FP8 linears) and :func:`kv_cache_gate` (FP8 KV cache) take any model; the command runs
both on the demo model for the quality bench's three prompts, next to the bf16 path's own PSNR against
fp32 (the scale of the bf16 error the FP8 one is compared with), and appends one **measured** row per
(gate, prompt) to ``perf/results/fp8_psnr.jsonl`` (``--save``); :func:`latest_gates` reads the newest
rows back for the reports (``perf/bench_fp8.py``, ``python -m perf.e2e``)::

    python -m perf.fp8_psnr --save        # ~1 min of CPU: 3 prompts x 30 s, fp32 / bf16 / fp8 streams

The demo DiT is 128 wide, under the Wan threshold of :data:`~rolling_forcing.fp8.FP8_MIN_FEATURES`
(256), so the command converts *every* block linear (``min_features=1``): stricter than the Wan option,
where embeddings-sized layers stay bf16 too.
"""

from __future__ import annotations

import argparse
import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from rolling_forcing.fp8 import FP8_MIN_FEATURES, KV_FP8, use_fp8_linears
from rolling_forcing.pipeline import RollingForcingPipeline
from rolling_forcing.stream import NoiseSource
from rolling_forcing.video import VideoSpec

__all__ = [
    "DEMO_PROMPTS",
    "GATES",
    "PSNR_THRESHOLD_DB",
    "PsnrGate",
    "attention_gate",
    "demo_rows",
    "kv_cache_gate",
    "latest_gates",
    "psnr",
    "psnr_gate",
    "stream_video",
]

PSNR_THRESHOLD_DB = 35.0
"""Pass mark of the decoded-video PSNR against the bf16 stream (the project's FP8 gate)."""


@dataclass(frozen=True)
class PsnrGate:
    """Result of :func:`psnr_gate` (**measured**)."""

    psnr_db: float
    frames: int
    blocks: int
    replaced: tuple[str, ...]
    threshold_db: float = PSNR_THRESHOLD_DB

    @property
    def passed(self) -> bool:
        return self.psnr_db >= self.threshold_db


def psnr(a: torch.Tensor, b: torch.Tensor, peak_to_peak: float = 2.0) -> float:
    """PSNR in dB of video ``a`` against ``b`` (same shape, values in a range of ``peak_to_peak``: 2 for
    the decoders' ``[-1, 1]``); ``inf`` when equal."""
    if a.shape != b.shape:
        raise ValueError(f"videos must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    mse = float((a.double() - b.double()).pow(2).mean())
    return math.inf if mse == 0 else 10 * math.log10(peak_to_peak**2 / mse)


@torch.no_grad()
def stream_video(
    model: Any, model_cfg: Any, pipe_cfg: Any, text_embeds: torch.Tensor, decoder: Any, num_blocks: int,
    *, seed: int = 0, backend: str | None = None, kv_dtype: str | None = None, merged: bool | None = None,
    attn_fp8: bool = False,
) -> torch.Tensor:  # fmt: skip
    """The decoded video ``[B, T, 3, H, W]`` (float32, ``[-1, 1]``) of ``num_blocks`` blocks streamed with
    noise drawn per block from ``seed`` (relative positions: any length); ``kv_dtype``, ``merged`` and
    ``attn_fp8`` as :class:`~rolling_forcing.pipeline.RollingForcingPipeline` takes them."""
    pipe = RollingForcingPipeline(
        model, model_cfg, pipe_cfg, backend=backend, positions="relative", kv_dtype=kv_dtype, merged=merged,
        attn_fp8=attn_fp8,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    noise = NoiseSource(
        text_embeds.shape[0], model_cfg.latent_frame_shape(), pipe_cfg.frames_per_block, num_blocks,
        pipe_cfg.torch_dtype, generator=gen, upfront=False,
    )  # fmt: skip
    decoder.reset()
    frames = [decoder.decode(c.latents.float()) for c in pipe.stream(text_embeds, num_blocks, noise=noise)]
    return torch.cat(frames, dim=1)


def psnr_gate(
    model: Any,
    model_cfg: Any,
    pipe_cfg: Any,
    text_embeds: torch.Tensor,
    decoder: Any,
    *,
    seconds: float = 30.0,
    num_blocks: int | None = None,
    seed: int = 0,
    backend: str | None = None,
    min_features: int = FP8_MIN_FEATURES,
    threshold_db: float = PSNR_THRESHOLD_DB,
    reference: torch.Tensor | None = None,
) -> PsnrGate:
    """Stream ``model`` (bf16 linears, as given) and a deep copy with FP8 linears
    (:func:`rolling_forcing.fp8.use_fp8_linears`) on the same prompt and noise, decode both with
    ``decoder`` and return the PSNR of the FP8 video against the bf16 one.

    ``num_blocks``: blocks to stream; ``None`` = the blocks of ``seconds`` of video at the project's
    video spec (``VideoSpec().blocks_for_seconds``).  ``model`` is not modified.  ``reference``: the bf16
    video if the caller already streamed it (:func:`stream_video` with the same blocks, seed, backend).
    """
    blocks = num_blocks or VideoSpec().blocks_for_seconds(seconds, pipe_cfg.frames_per_block)
    ref = reference
    if ref is None:
        ref = stream_video(
            model, model_cfg, pipe_cfg, text_embeds, decoder, blocks, seed=seed, backend=backend
        )
    m8 = copy.deepcopy(model)
    names = use_fp8_linears(m8, backend=backend, min_features=min_features)
    out = stream_video(m8, model_cfg, pipe_cfg, text_embeds, decoder, blocks, seed=seed, backend=backend)
    return PsnrGate(psnr(out, ref), int(ref.shape[1]), blocks, tuple(names), threshold_db)


def kv_cache_gate(
    model: Any,
    model_cfg: Any,
    pipe_cfg: Any,
    text_embeds: torch.Tensor,
    decoder: Any,
    *,
    num_blocks: int,
    seed: int = 0,
    backend: str | None = None,
    merged: bool | None = None,
    threshold_db: float = PSNR_THRESHOLD_DB,
    reference: torch.Tensor | None = None,
) -> PsnrGate:
    """The FP8 KV cache's gate: the decoded video with ``kv_dtype="float8_e4m3"`` against the same stream
    with the cache in ``pipe_cfg.dtype`` (same model, prompt, noise), PSNR >= ``threshold_db``.
    ``reference``: that plain-cache video if the caller already streamed it (:func:`stream_video` with the
    same blocks, seed, backend and ``merged``)."""
    kw: dict[str, Any] = {"seed": seed, "backend": backend, "merged": merged}
    ref = reference
    if ref is None:
        ref = stream_video(model, model_cfg, pipe_cfg, text_embeds, decoder, num_blocks, **kw)
    out = stream_video(model, model_cfg, pipe_cfg, text_embeds, decoder, num_blocks, kv_dtype=KV_FP8, **kw)
    return PsnrGate(psnr(out, ref), int(ref.shape[1]), num_blocks, ("kv_cache",), threshold_db)


def attention_gate(
    model: Any,
    model_cfg: Any,
    pipe_cfg: Any,
    text_embeds: torch.Tensor,
    decoder: Any,
    *,
    num_blocks: int,
    seed: int = 0,
    backend: str | None = None,
    threshold_db: float = PSNR_THRESHOLD_DB,
    reference: torch.Tensor | None = None,
) -> PsnrGate:
    """The FP8 attention option's gate: the decoded video with ``attn_fp8=True`` (the merged forward's
    self-attention with P.V in e4m3, ``reference.attention_fp8`` on the reference backend) against the same
    merged stream in bf16, PSNR >= ``threshold_db``. ``reference``: that bf16 merged video if the caller
    already streamed it (:func:`stream_video` with the same blocks, seed and backend, ``merged`` None or
    True)."""
    kw: dict[str, Any] = {"seed": seed, "backend": backend, "merged": True}
    ref = reference
    if ref is None:
        ref = stream_video(model, model_cfg, pipe_cfg, text_embeds, decoder, num_blocks, **kw)
    out = stream_video(model, model_cfg, pipe_cfg, text_embeds, decoder, num_blocks, attn_fp8=True, **kw)
    return PsnrGate(psnr(out, ref), int(ref.shape[1]), num_blocks, ("self_attention",), threshold_db)


DEMO_PROMPTS = (
    "a red circle and a blue square bouncing on a gray background",
    "a yellow triangle bouncing on a navy background",
    "a green square and a white triangle bouncing on a black background",
)
"""The quality bench's prompts (``perf/bench_quality.PROMPTS``)."""

ROWS_NAME = "fp8_psnr"
GATES = ("fp8_linears", "fp8_kv_cache", "fp8_attention")


def demo_rows(
    *, seconds: float = 30.0, prompts: Sequence[str] = DEMO_PROMPTS, seed: int = 0,
    gates: Sequence[str] = GATES,
) -> list[Any]:  # fmt: skip
    """The FP8 gates (``gates``, a subset of :data:`GATES`) on the demo model (bf16 pipeline, reference
    backend), one **measured** row per (gate, prompt), streams of ``seconds`` (at least one window of
    blocks): ``extra`` holds ``psnr_db``, ``passed``, ``threshold_db``, the bf16 stream's own
    ``bf16_vs_fp32_db``, the converted layers' count and the run's ``run_id`` (UTC start time)."""
    from perf.runner import BenchRow
    from rolling_forcing.config import PipelineConfig
    from rolling_forcing.demo import load_demo

    bad = [g for g in gates if g not in GATES]
    if bad or not gates:
        raise ValueError(f"gates must be a non-empty subset of {GATES}, got {list(gates)}")
    demo = load_demo()
    m32 = demo.model
    m16 = copy.deepcopy(m32).to(torch.bfloat16)
    p32, p16 = PipelineConfig(dtype="float32"), PipelineConfig(dtype="bfloat16")
    blocks = max(VideoSpec().blocks_for_seconds(seconds, p16.frames_per_block), p16.window_blocks)
    run_id = datetime.now(timezone.utc).isoformat(timespec="seconds")
    rows = []
    for prompt in prompts:
        emb = demo.text_encoder.encode(prompt)
        ref32 = stream_video(m32, demo.model_cfg, p32, emb, demo.decoder, blocks, seed=seed)
        ref16 = stream_video(
            m16, demo.model_cfg, p16, emb.to(torch.bfloat16), demo.decoder, blocks, seed=seed
        )
        bf16_db = psnr(ref16, ref32)
        args = (m16, demo.model_cfg, p16, emb.to(torch.bfloat16), demo.decoder)
        for gate_name in gates:
            if gate_name == "fp8_linears":
                g = psnr_gate(*args, num_blocks=blocks, seed=seed, min_features=1, reference=ref16)
            elif gate_name == "fp8_attention":  # ref16 is merged: the reference backend has the block table
                g = attention_gate(*args, num_blocks=blocks, seed=seed, reference=ref16)
            else:
                g = kv_cache_gate(*args, num_blocks=blocks, seed=seed, reference=ref16)
            cfg = {
                "model": "demo",
                "prompt": prompt,
                "blocks": blocks,
                "frames": g.frames,
                "dtype": "bfloat16",
            }
            extra = {
                "psnr_db": round(g.psnr_db, 2),
                "passed": g.passed,
                "threshold_db": g.threshold_db,
                "bf16_vs_fp32_db": round(bf16_db, 2),
                "layers_converted": len(g.replaced),
                "seconds": seconds,
                "run_id": run_id,
            }
            rows.append(BenchRow(gate_name, "demo", cfg, "measured", extra=extra))
    return rows


def latest_gates(path: str | Path | None = None) -> dict[str, dict[str, Any]]:
    """The newest run's rows of ``perf/results/fp8_psnr.jsonl`` per gate: ``{gate: {"psnr_db_min",
    "psnr_db_max", "passed" (every prompt), "threshold_db", "bf16_vs_fp32_db_min", "prompts",
    "command"}}``; ``{}`` when the file does not exist (no run yet)."""
    from perf.runner import read_rows, results_path

    p = Path(path) if path is not None else results_path(ROWS_NAME)
    if not p.exists():
        return {}
    rows = [r for r in read_rows(p) if r.status == "ok" and r.op in GATES]
    out: dict[str, dict[str, Any]] = {}
    for gate_name in GATES:
        mine = [r for r in rows if r.op == gate_name]
        if not mine:
            continue
        last = max(str(r.extra.get("run_id", "")) for r in mine)
        newest = [r for r in mine if str(r.extra.get("run_id", "")) == last]
        db = [float(r.extra["psnr_db"]) for r in newest]
        out[gate_name] = {
            "psnr_db_min": min(db),
            "psnr_db_max": max(db),
            "passed": all(bool(r.extra["passed"]) for r in newest),
            "threshold_db": float(newest[0].extra["threshold_db"]),
            "bf16_vs_fp32_db_min": min(float(r.extra["bf16_vs_fp32_db"]) for r in newest),
            "prompts": len(newest),
            "command": newest[0].command,
        }
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command's arguments (a test checks the default writes nothing tracked: rows only with
    ``--save``)."""
    ap = argparse.ArgumentParser(description="FP8 decoded-video gates on the demo model (measured)")
    ap.add_argument("--seconds", type=float, default=30.0, help="stream length per prompt (default 30)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    ap.add_argument("--save", action="store_true", help="append the rows to perf/results/fp8_psnr.jsonl")
    ap.add_argument(
        "--gates", nargs="+", choices=GATES, default=list(GATES), help="gates to run (default all)"
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.seconds <= 0:
        ap.error(f"--seconds must be > 0, got {args.seconds}")
    torch.set_num_threads(args.threads)
    from perf.runner import append_rows

    rows = demo_rows(seconds=args.seconds, seed=args.seed, gates=args.gates)
    for r in rows:
        e = r.extra
        verdict = "PASS" if e["passed"] else "FAIL"
        print(
            f"{r.op:13s} {r.config['prompt'][:48]:48s} {e['psnr_db']:6.2f} dB vs bf16 "
            f"(>= {e['threshold_db']:g}: {verdict}); bf16 vs fp32 {e['bf16_vs_fp32_db']:.2f} dB; "
            f"{r.config['frames']} frames"
        )
    if args.save:
        append_rows(rows, ROWS_NAME)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
