"""Where the demo stream loses its objects: the clean context or the denoising chain (*measured*).

For each prompt the procedural generator renders the prompt's one video
(``rolling_forcing.procedural.prompt_layout``: what the demo DiT is trained to stream), the demo
autoencoder encodes it, and the DiT runs every window of a ``--blocks``-block Rolling Forcing stream
(relative positions, ``rolling_forcing.demo.train_attention.training_forward``) three ways:

* ``teacher``: the clean context is the true latents and every window block is noised from its *true*
  latent at its level (the inputs stages 1-2 train on);
* ``chain``: the clean context is the true latents, but each block's input is the chain the stream runs:
  pure noise at level 0, then the model's own x0 of the previous level re-noised with fresh noise
  (:func:`rolling_forcing.demo.train_stage3.chain_rollout`);
* ``stream``: the chain with the model's own outputs as the clean context: the stream itself
  (``chain_rollout(own_context=True)`` equals ``RollingForcingPipeline``, ``tests/test_demo_stage3.py``).

Per way: metric (a) presence (``perf.quality``: every prompt object with the right colour and kind and the
prompt's background) on the decoded final-level outputs, and the x0 mean squared error against the true
latents per level (normalised latents; level 0 = the newest block, pure-noise input). ``--roundtrip`` is
the true latents decoded (what the autoencoder alone allows).

Run: ``python -m perf.demo_chain [--weights DIR] [--blocks 14] [--seed 0]`` (~10 s of CPU per prompt on
the demo model); ``--save`` appends the rows (:class:`perf.runner.BenchRow`) to
``perf/results/demo_chain.jsonl``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from perf.runner import BenchRow, append_rows, print_table
from rolling_forcing.procedural import PROMPT_SIZES, PROMPT_SPEED, format_sizes

ROWS_NAME = "demo_chain"
WAYS = ("teacher", "chain", "stream")
DEFAULT_PROMPTS = (
    "a red circle and a blue square bouncing on a gray background",
    "a yellow triangle bouncing on a navy background",
    "a green square and a white triangle bouncing on a black background",
)


def _truth_latents(
    ae: Any,
    prompt: str,
    latent_frames: int,
    seed: int,
    prompt_speed: float | None = None,
    prompt_sizes: dict[str, float] | None = None,
) -> torch.Tensor:
    from perf.quality.streams import scene_for_prompt
    from rolling_forcing.procedural import prompt_layout, render

    scene = prompt_layout(scene_for_prompt(prompt, np.random.default_rng(seed)), prompt_speed, prompt_sizes)
    video = render(scene, 0, 1 + 4 * (latent_frames - 1))
    x = torch.from_numpy(video).permute(0, 3, 1, 2).float()[None] / 127.5 - 1.0
    with torch.no_grad():
        return ae.encode(x)


def measure_prompt(
    demo: Any,
    ae: Any,
    prompt: str,
    blocks: int,
    seed: int,
    prompt_speed: float | None = None,
    prompt_sizes: dict[str, float] | None = None,
) -> list[dict[str, Any]]:
    """Rows (dicts) of :data:`WAYS` plus the round trip for one prompt (module docstring); the reference
    video moves at ``prompt_speed`` px/frame and has the shape sizes ``prompt_sizes`` (``None``: the prompt
    layout's defaults, the shipped weights')."""
    from perf.quality.detect import detect, read_backgrounds
    from perf.quality.metrics import presence, prompt_background, prompt_objects
    from rolling_forcing.config import PipelineConfig
    from rolling_forcing.decode import to_uint8_frames
    from rolling_forcing.demo.train_stage3 import chain_rollout

    pc = PipelineConfig(positions="relative")
    fpb, last = pc.frames_per_block, len(pc.timesteps) - 1
    truth = _truth_latents(ae, prompt, blocks * fpb, seed, prompt_speed, prompt_sizes)
    model = demo.model.float().eval()
    with torch.no_grad():
        text_kv = model.text_kv(demo.text_encoder(demo.text_encoder.tokenize([prompt])))

    def score(latents: torch.Tensor) -> float:
        with torch.no_grad():
            frames = to_uint8_frames(ae.decode(latents))
        p = presence(
            detect(frames), prompt_objects(prompt), read_backgrounds(frames), prompt_background(prompt)
        )
        return float(p if p is not None else 0.0)

    rows = [{"prompt": prompt, "way": "roundtrip", "presence": score(truth), "x0_mse": {}}]
    for way in WAYS:
        gen = torch.Generator().manual_seed(seed)

        def draw(block: int, level: int, shape: tuple[int, ...], g: torch.Generator = gen) -> torch.Tensor:
            return torch.randn(shape, generator=g)

        if way == "teacher":
            windows = _teacher_windows(model, text_kv, truth, pc, blocks, gen)
        else:
            windows, _ = chain_rollout(model, text_kv, truth, pc, blocks, draw, own_context=way == "stream")
        errs: dict[int, list[float]] = {}
        final = torch.zeros_like(truth)
        for win in windows:
            lay = win.layout
            for i, level in enumerate(lay.levels):
                blk = slice((lay.start + i) * fpb, (lay.start + i + 1) * fpb)
                x0 = win.x0[:, i * fpb : (i + 1) * fpb]
                errs.setdefault(level, []).append(float((x0 - truth[:, blk]).pow(2).mean()))
                if level == last:
                    final[:, blk] = x0
        mse = {str(k): round(float(np.mean(v)), 4) for k, v in sorted(errs.items())}
        rows.append({"prompt": prompt, "way": way, "presence": score(final), "x0_mse": mse})
    return rows


@torch.no_grad()
def _teacher_windows(
    model: Any, text_kv: Any, truth: torch.Tensor, pc: Any, blocks: int, gen: torch.Generator
) -> list[Any]:
    """Every window with true context and each block noised from its true latent (stage 1's inputs), with
    the model's x0 of its blocks."""
    from rolling_forcing import schedule
    from rolling_forcing.demo.train_attention import training_forward, training_layout
    from rolling_forcing.demo.train_stage3 import ChainWindow, window_x0
    from rolling_forcing.model import add_noise

    fpb, table = pc.frames_per_block, pc.scheduler_table()
    out = []
    for w in range(schedule.num_windows(pc, blocks)):
        lay = training_layout(pc, blocks, w)
        x = truth[:, : (lay.end + 1) * fpb].clone()
        t = torch.zeros(1, (lay.end + 1) * fpb)
        for i, level in enumerate(lay.levels):
            blk = slice((lay.start + i) * fpb, (lay.start + i + 1) * fpb)
            eps = torch.randn(x[:, blk].shape, generator=gen)
            x[:, blk] = add_noise(truth[:, blk], eps, pc.timesteps[level], table)
            t[:, blk] = pc.timesteps[level]
        x0 = window_x0(lay, x, training_forward(model, lay, pc, x, t, text_kv), pc)
        out.append(ChainWindow(lay, x, t, x0))
    return out


def run(
    weights: str | None,
    prompts: Sequence[str],
    blocks: int,
    seed: int,
    prompt_speed: float | None = None,
    prompt_sizes: str | None = None,
) -> list[BenchRow]:
    """One :class:`BenchRow` per (prompt, way) (``kind="measured"``); ``prompt_speed`` and ``prompt_sizes``
    (``"circle=8,square=9,triangle=9"``): the speed and sizes the weights were trained at (``train-demo
    --prompt-speed``, ``--prompt-sizes``), so the reference video is the one they learned. Given neither,
    they are read from the weights' training log (:func:`perf.quality.streams.trained_layout`; the shipped
    weights: the defaults); a directory whose log does not record them is refused (``ValueError`` naming
    both flags) rather than measured against a guessed video."""
    from rolling_forcing.demo import load_demo
    from rolling_forcing.demo.autoencoder import load_autoencoder

    if blocks < 6:
        raise ValueError(f"--blocks must be >= 6 (a full window after the warm-up), got {blocks}")
    if prompt_speed is not None:
        from rolling_forcing.procedural import check_speed

        check_speed(prompt_speed, "--prompt-speed")
    sizes = None
    if prompt_sizes is not None:
        from rolling_forcing.procedural import parse_sizes

        sizes = parse_sizes(prompt_sizes, "--prompt-sizes")
    if prompt_speed is None and sizes is None and weights is not None:
        from perf.quality.streams import trained_layout

        layout = trained_layout(weights)
        if layout is None:
            raise ValueError(
                f"--weights {weights}: its train_log.json does not record the prompt layout its DiT learned "
                "(no prompt_speed), so the reference video is unknown: pass --prompt-speed and "
                "--prompt-sizes (train-demo's settings for it)"
            )
        prompt_speed = None if layout.speed == PROMPT_SPEED else layout.speed
        sizes = None if dict(layout.sizes) == dict(PROMPT_SIZES) else dict(layout.sizes)
    demo = load_demo(weights, with_decoder=False)
    ae = load_autoencoder(None if weights is None else f"{weights}/autoencoder.safetensors")
    rows = []
    for prompt in prompts:
        for r in measure_prompt(demo, ae, prompt, blocks, seed, prompt_speed, sizes):
            rows.append(
                BenchRow(
                    op="demo_chain",
                    variant=r["way"],
                    config={
                        "prompt": prompt,
                        "blocks": blocks,
                        "seed": seed,
                        "weights": weights or "shipped",
                        **({} if prompt_speed is None else {"prompt_speed": prompt_speed}),
                        **({} if sizes is None else {"prompt_sizes": sizes}),
                    },
                    kind="measured",
                    extra={"presence": round(r["presence"], 4), "x0_mse_per_level": r["x0_mse"]},
                )
            )
    return rows


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m perf.demo_chain", description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", default=None, help="a demo weights directory (default: the shipped weights)")
    ap.add_argument("--blocks", type=int, default=14, help="stream length in blocks (>= 6)")
    ap.add_argument("--seed", type=int, default=0, help="noise seed")
    ap.add_argument(
        "--prompt-speed",
        type=float,
        default=None,
        help=f"the reference videos' speed, px/frame at 64x64: the weights' training speed (default: read "
        f"from --weights' train_log.json; {PROMPT_SPEED} for the shipped weights)",
    )
    ap.add_argument(
        "--prompt-sizes",
        default=None,
        help="the reference videos' shape sizes, px at 64x64 (e.g. circle=8,square=7,triangle=9): the "
        "weights' training sizes (default: read from --weights' train_log.json; "
        + format_sizes(PROMPT_SIZES)
        + " for the shipped weights)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument(
        "--prompt", action="append", default=None, help="a prompt (repeatable; default: the 3 bench prompts)"
    )
    ap.add_argument("--save", action="store_true", help=f"append the rows to perf/results/{ROWS_NAME}.jsonl")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = run(
        args.weights,
        tuple(args.prompt or DEFAULT_PROMPTS),
        args.blocks,
        args.seed,
        args.prompt_speed,
        args.prompt_sizes,
    )
    print_table(rows)
    for r in rows:
        print(
            f"{r.variant:9s} {r.config['prompt'][:40]:40s} (a) {r.extra['presence']:.3f}  x0 MSE by level "
            f"{r.extra['x0_mse_per_level']}"
        )
    if args.save:
        print("wrote", append_rows(rows, ROWS_NAME))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
