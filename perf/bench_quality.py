"""Measured: the video quality of the streaming pipeline and the numerics gate (``python -m
perf.bench_quality [--quick] [--save] [--model tiny|demo]``; docs/quality.md).

Sections (every figure *measured*: detections on CPU-decoded frames, CPU wall clock):

1. ``detector``: the shape detector against the procedural generator's ground truth, clean and degraded
   (blur + noise) renders: accuracy (right colour and kind within 2 px).
2. ``stream``: per prompt, (a) presence and (b) chunk-boundary continuity of the model's decoded stream,
   next to the same metrics on the generator's own frames (``ground_truth``: the ideal stream, random
   sizes and motion) and, for a model with an autoencoder, on the video it is trained to draw (its prompt
   layout) through that autoencoder (``decoder_roundtrip``: the best (a) its decoder allows), and
   (e) the longest run of frames in which an object vanished (no detection of its colour).
3. ``drift``: (c) presence in the last 30 s of a 3-minute stream (relative positions, per-block noise)
   and whether the objects still move (``--quick``: 5 s of a 24-block stream).
4. ``switch``: (d) frames from a ``set_prompt`` switch until the new prompt's objects are detected, in
   each mode of ``SWITCH_MODES`` (the stream continues, continues with its KV cache re-cached, restarts);
   from the first prompt (two objects) and, in the full run, from the second (one object: the new prompt
   adds an object the context does not show).
5. ``compare``: merged vs two-pass, sharded (2 ranks, gloo) vs unsharded, emulator vs reference backend,
   bf16 vs fp32: decoded-video PSNR and (a), (b) of both streams.

Prints every metric against its target (met / MISSED), writes one JSONL row per measurement (house row
format, perf/runner.py) to ``perf/results/quality.jsonl`` and a PNG contact sheet of the first prompt's
stream to ``perf/results/quality_sheet.png``. ``--quick`` (< 1 min on the tiny model) writes the untracked
``quality_quick.jsonl`` / ``quality_quick_sheet.png`` instead. Without ``--save`` no row is written and the
sheet goes under ``build/perf/`` (untracked); ``make bench-quality UPDATE=1`` passes ``--save``.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from perf.quality.compare import COMPARISONS, evaluate, run_pair
from perf.quality.detect import degrade, detect, read_backgrounds, score_against_truth
from perf.quality.metrics import check, drift, prompt_background, prompt_objects, switch_latency
from perf.quality.sheet import contact_sheet, write_png
from perf.quality.streams import (
    DEFAULT_MODEL,
    MODELS,
    StreamModel,
    StreamSpec,
    load_model,
    run_stream,
    truth_stream,
)
from perf.runner import RESULTS_DIR, BenchRow, append_rows, print_table, run_case
from rolling_forcing.config import check_guidance
from rolling_forcing.procedural import render, sample_scene
from rolling_forcing.prompts import SWITCH_MODES

PROMPTS = (
    "a red circle and a blue square bouncing on a gray background",
    "a yellow triangle bouncing on a navy background",
    "a green square and a white triangle bouncing on a black background",
)
DETECTOR_OP = "quality_detector"
SWITCH_TO = "a purple circle and a green triangle bouncing on a black background"
FPS = 16.0


@dataclass(frozen=True)
class Plan:
    """Sizes of one bench run: prompts streamed for (a)/(b), their length (blocks), the drift stream's
    length and tail, the switch stream's length and switch block, detector scenes x frames, and the
    prompts the switch streams start from (each switches to :data:`SWITCH_TO`)."""

    prompts: tuple[str, ...]
    blocks: int
    drift_blocks: int
    drift_tail_s: float
    switch_blocks: int
    switch_block: int
    detector_scenes: int
    detector_frames: int
    switch_from: tuple[str, ...]


# 241 blocks = 2,889 frames = 3.0 min at 16 fps; switches from two objects and from one object to two
FULL = Plan(PROMPTS, 40, 241, 30.0, 20, 8, 40, 48, PROMPTS[:2])
QUICK = Plan(PROMPTS[:1], 10, 24, 5.0, 10, 5, 8, 24, PROMPTS[:1])


def _fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return "inf" if math.isinf(v) else f"{v:.3g}"
    return str(v)


def _json_float(v: float | None) -> float | None:
    """None for a value JSON cannot hold (inf / NaN)."""
    return None if v is None or not math.isfinite(v) else float(v)


def detector_rows(plan: Plan) -> list[BenchRow]:
    # seeds from 1000: held out from the scenes the detector's thresholds were chosen on (seeds 0-59)
    scenes = [sample_scene(np.random.default_rng(1000 + i)) for i in range(plan.detector_scenes)]
    cases: dict[str, Callable[[np.ndarray, int], np.ndarray]] = {
        "clean": lambda f, i: f,
        "blur1_noise10": lambda f, i: degrade(f, sigma=1.0, noise=10.0, seed=i),
        "blur1.5_noise16": lambda f, i: degrade(f, sigma=1.5, noise=16.0, seed=i),
    }
    rows = []
    for name, fn in cases.items():

        def case(fn: Callable[[np.ndarray, int], np.ndarray] = fn) -> dict[str, Any]:
            dets = [detect(fn(render(s, 0, plan.detector_frames), i)) for i, s in enumerate(scenes)]
            sc = score_against_truth(scenes, dets, 0)
            return {
                "accuracy": sc.accuracy,
                "color_accuracy": sc.color_accuracy,
                "mean_error_px": sc.mean_error,
                "shape_frames": sc.shapes,
                "spurious": sc.spurious,
            }

        cfg = {
            "scenes": plan.detector_scenes,
            "frames": plan.detector_frames,
            "seeds": f"1000..{999 + plan.detector_scenes}",
        }
        rows.append(run_case(case, op=DETECTOR_OP, variant=name, config=cfg, kind="measured"))
    return rows


def _stream_row(
    op: str, variant: str, config: Mapping[str, Any], fn: Callable[[], dict[str, Any]]
) -> BenchRow:
    return run_case(fn, op=op, variant=variant, config=dict(config), kind="measured")


def stream_rows(sm: StreamModel, plan: Plan, seed: int) -> tuple[list[BenchRow], np.ndarray | None]:
    rows: list[BenchRow] = []
    sheet_frames: list[np.ndarray] = []
    for n, prompt in enumerate(plan.prompts):
        spec = StreamSpec(prompt, plan.blocks, seed=seed + n)
        whos = ["ground_truth", *(["decoder_roundtrip"] if sm.roundtrip is not None else []), sm.name]
        for who in whos:

            def case(who: str = who, spec: StreamSpec = spec) -> dict[str, Any]:
                if who == sm.name:
                    res = run_stream(sm, spec)
                elif who == "decoder_roundtrip" and sm.roundtrip is not None:
                    # the video the model is trained to draw (its prompt layout), through its autoencoder
                    if sm.layout is None:
                        raise ValueError(
                            "decoder_roundtrip: the weights' training layout is unknown (their "
                            "train_log.json has no prompt_speed), so the video they draw is too"
                        )
                    res = truth_stream(spec, seed=spec.seed, layout=sm.layout)
                    res = replace(res, frames=sm.roundtrip(res.frames))
                else:
                    res = truth_stream(spec, seed=spec.seed)
                if who == sm.name and not sheet_frames:
                    sheet_frames.append(res.frames)
                m = evaluate(res, spec.prompt)
                return {
                    **m,
                    "presence_met": check("presence", m["presence"]).met,
                    "continuity_met": check("continuity_ratio", m["continuity_ratio"]).met,
                    "vanish_met": check("vanish_frames", m["vanish_frames"]).met,
                    "frames": int(res.frames.shape[0]),
                    "wall_s": res.wall_s,
                }

            cfg = {"prompt": prompt, "blocks": plan.blocks, "seed": spec.seed}
            rows.append(_stream_row("quality_stream", who, cfg, case))
    return rows, (sheet_frames[0] if sheet_frames else None)


def drift_rows(sm: StreamModel, plan: Plan, seed: int) -> list[BenchRow]:
    prompt = plan.prompts[0]
    spec = StreamSpec(prompt, plan.drift_blocks, seed=seed, positions="relative", upfront=False)
    rows = []
    for who in ("ground_truth", sm.name):

        def case(who: str = who) -> dict[str, Any]:
            res = truth_stream(spec, seed=seed) if who == "ground_truth" else run_stream(sm, spec)
            d = drift(
                detect(res.frames), prompt_objects(prompt), FPS, tail_seconds=plan.drift_tail_s,
                backgrounds=read_backgrounds(res.frames), background=prompt_background(prompt),
            )  # fmt: skip
            return {
                "tail_presence": d.tail_presence,
                "tail_frames": d.tail_frames,
                "speeds_px_per_frame": [_json_float(s) for s in d.speeds],
                "moving": d.moving,
                "tail_presence_met": check("tail_presence", d.tail_presence).met,
                "frames": int(res.frames.shape[0]),
                "wall_s": res.wall_s,
            }

        cfg = {
            "prompt": prompt,
            "blocks": plan.drift_blocks,
            "positions": "relative",
            "tail_s": plan.drift_tail_s,
        }
        rows.append(_stream_row("quality_drift", who, cfg, case))
    return rows


def switch_rows(sm: StreamModel, plan: Plan, seed: int) -> list[BenchRow]:
    rows = []
    for src, mode in itertools.product(plan.switch_from, SWITCH_MODES):
        spec = StreamSpec(src, plan.switch_blocks, seed=seed, switch=(SWITCH_TO, plan.switch_block, mode))
        for who in ("ground_truth", sm.name):
            if who == "ground_truth" and mode != "continue":
                continue  # the ideal stream has no cache and no restart

            def case(who: str = who, spec: StreamSpec = spec) -> dict[str, Any]:
                res = truth_stream(spec, seed=spec.seed) if who == "ground_truth" else run_stream(sm, spec)
                assert res.switch_frame is not None
                lat = switch_latency(
                    detect(res.frames), prompt_objects(SWITCH_TO), res.switch_frame,
                    backgrounds=read_backgrounds(res.frames), background=prompt_background(SWITCH_TO),
                )  # fmt: skip
                return {
                    "switch_frames": lat,
                    "switch_frame": res.switch_frame,
                    "switch_met": check("switch_frames", lat).met,
                    "wall_s": res.wall_s,
                }

            cfg = {
                "from": src,
                "to": SWITCH_TO,
                "blocks": plan.switch_blocks,
                "switch_block": plan.switch_block,
                "recache": mode == "recache",
                "switch": mode,
            }
            rows.append(_stream_row("quality_switch", who, cfg, case))
    return rows


def compare_rows(sm: StreamModel, plan: Plan, seed: int) -> list[BenchRow]:
    prompt = plan.prompts[0]
    rows = []
    for pair in COMPARISONS:

        def case(pair: Any = pair) -> dict[str, Any]:
            c = run_pair(sm, pair, StreamSpec(prompt, plan.blocks, seed=seed))
            return {
                "psnr_db": _json_float(c.psnr_db),
                "identical": math.isinf(c.psnr_db),
                "base": {k: _json_float(v) for k, v in c.base.items()},
                "variant": {k: _json_float(v) for k, v in c.variant.items()},
                "frames": c.frames,
                "base_wall_s": c.base_wall_s,
                "variant_wall_s": c.variant_wall_s,
            }

        cfg = {
            "prompt": prompt,
            "blocks": pair.num_blocks or plan.blocks,
            "base": pair.base,
            "variant": pair.variant,
        }
        rows.append(_stream_row("quality_compare", pair.name, cfg, case))
    return rows


def _moving(extra: Mapping[str, Any]) -> str:
    """``yes`` / ``no`` and each object's speed (a stream row's ``moving``, ``tail_speeds_px_per_frame``)."""
    v = ", ".join(_fmt(s) for s in extra["tail_speeds_px_per_frame"])
    return f"{'yes' if extra['moving'] else 'no'} ({v} px/frame)"


def summary(rows: list[BenchRow]) -> list[str]:
    """One line per metric with its target (met / MISSED), per row."""
    out = []
    for r in rows:
        e = r.extra
        if r.status == "error":
            out.append(f"{r.op} {r.variant}: ERROR {r.message}")
        elif r.op == DETECTOR_OP:
            out.append(
                f"detector {r.variant}: accuracy {_fmt(e['accuracy'])}, colour only "
                f"{_fmt(e['color_accuracy'])}, centroid error {_fmt(e['mean_error_px'])} px "
                f"over {e['shape_frames']} shape-frames"
            )
        elif r.op == "quality_stream":
            out.append(
                f"stream {r.variant} [{r.config['prompt']}]: "
                f"(a) {check('presence', e['presence']).describe()}; "
                f"(b) {check('continuity_ratio', e['continuity_ratio']).describe()} "
                f"(boundary {_fmt(e['boundary_px'])} px, within {_fmt(e['within_px'])} px; ratio at "
                f"latent-frame boundaries {_fmt(e.get('latent_boundary_ratio'))}); "
                f"(e) {check('vanish_frames', e.get('vanish_frames')).describe()}; "
                f"moving over the last 10 s: {_moving(e)}"
            )
        elif r.op == "quality_drift":
            out.append(
                f"drift {r.variant} ({r.config['blocks']} blocks, last {r.config['tail_s']:g} s): "
                f"(c) {check('tail_presence', e['tail_presence']).describe()}; moving: {e['moving']} "
                f"(median speeds {', '.join(_fmt(v) for v in e['speeds_px_per_frame'])} px/frame)"
            )
        elif r.op == "quality_switch":
            mode = r.config.get("switch", "recache" if r.config["recache"] else "continue")
            rc = {"continue": "continuing", "recache": "with re-cache", "restart": "restarting"}[mode]
            n_from = len(prompt_objects(r.config["from"]))
            out.append(
                f"switch {r.variant} from {n_from} object(s) {rc}: "
                f"(d) {check('switch_frames', e['switch_frames']).describe()}"
            )
        elif r.op == "quality_compare":
            b, v = e["base"], e["variant"]
            db = "identical" if e["identical"] else _fmt(e["psnr_db"])
            out.append(
                f"compare {r.variant}: PSNR {db} dB; "
                f"presence {_fmt(b['presence'])} -> {_fmt(v['presence'])}; continuity "
                f"{_fmt(b['continuity_ratio'])} -> {_fmt(v['continuity_ratio'])}"
            )
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command's arguments (its own function so a test can check the defaults: nothing tracked is
    written without ``--save``)."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="short streams, one prompt (< 1 min on the tiny model)"
    )
    ap.add_argument(
        "--no-save",
        action="store_true",
        help="no JSONL row, sheet under build/perf/ (the default; kept for scripts)",
    )
    ap.add_argument("--model", choices=MODELS, default=DEFAULT_MODEL)
    ap.add_argument(
        "--weights",
        default=None,
        help="demo model: a weights directory (train-demo --out) instead of the shipped one",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument(
        "--guidance",
        type=float,
        default=None,
        help="classifier-free guidance scale of every stream, >= 1, the model's guidance interval kept "
        "(default: the model's; demo 3, tiny 1)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--blocks", type=int, default=None, help="blocks per stream of (a)/(b) (>= 5; default 40, quick 10)"
    )
    ap.add_argument(
        "--skip", nargs="*", default=[], choices=["detector", "stream", "drift", "switch", "compare"]
    )
    ap.add_argument(
        "--save",
        action="store_true",
        help="append the rows to perf/results/quality[_quick].jsonl and write the contact sheet there "
        "(tracked); default: the sheet under build/perf, no rows",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.save and args.no_save:
        ap.error("--save and --no-save contradict each other")
    saved = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(saved)


def _run(args: argparse.Namespace) -> int:
    plan = QUICK if args.quick else FULL
    if args.blocks is not None:
        if args.blocks < 5:
            raise SystemExit(f"--blocks must be >= 5 (the rolling window), got {args.blocks}")
        plan = replace(plan, blocks=args.blocks)
    sm = load_model(args.model, seed=args.seed, weights=args.weights)
    if args.guidance is not None:
        sm = replace(sm, model_cfg=replace(sm.model_cfg, guidance_scale=check_guidance(args.guidance)))
    guidance = sm.model_cfg.guidance_scale
    print(
        f"quality bench: model {sm.name} ({sm.description}), guidance {guidance:g}; "
        f"{'quick' if args.quick else 'full'} run",
        flush=True,
    )
    rows: list[BenchRow] = []
    box: dict[str, np.ndarray | None] = {"sheet": None}

    def streams() -> list[BenchRow]:
        srows, box["sheet"] = stream_rows(sm, plan, args.seed)
        return srows

    sections: dict[str, Callable[[], list[BenchRow]]] = {
        "detector": lambda: detector_rows(plan),
        "stream": streams,
        "drift": lambda: drift_rows(sm, plan, args.seed),
        "switch": lambda: switch_rows(sm, plan, args.seed),
        "compare": lambda: compare_rows(sm, plan, args.seed),
    }
    for name, section in sections.items():
        if name in args.skip:
            continue
        t0 = time.perf_counter()
        new = section()
        rows += new
        print(f"[{name}: {time.perf_counter() - t0:.0f} s wall clock]", *summary(new), sep="\n  ", flush=True)
    sheet = box["sheet"]
    # every row but the detector's streams the model
    streamed = {"guidance": guidance, "guidance_sigma_min": sm.model_cfg.guidance_sigma_min}
    rows = [
        replace(r, config={"model": sm.name, **({} if r.op == DETECTOR_OP else streamed), **r.config})
        for r in rows
    ]
    print_table(rows)
    print("\n".join(summary(rows)))
    stem = "quality_quick" if args.quick else "quality"
    out_dir = RESULTS_DIR if args.save else Path("build/perf")
    if sheet is not None:
        png = write_png(out_dir / f"{stem}_sheet.png", contact_sheet(sheet, fps=FPS))
        print(f"contact sheet: {png}")
    if args.save:
        print(f"rows appended to {append_rows(rows, stem)}")
    return 1 if any(r.status == "error" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
