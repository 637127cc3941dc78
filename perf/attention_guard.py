"""How often the static softmax offset's guard trips on a real stream, and what the static offset does to
the decoded video (both *measured* on the emulator; docs/kernels/attention.md, "Static softmax offset").

The demo model's (or tiny preset's) stream runs on the emulator backend (every attention call through the
project's kernels, default ``static=True``) and on the reference backend; the script counts the kernels'
static passes and their running-max recomputes (one per (b, h) or block-table query group whose guard
tripped) by wrapping ``nki_kernels.attention._flash_rows`` for the run, and reports the decoded video's
PSNR against the reference backend (the same pair as ``perf.bench_quality``'s ``emulator_vs_reference``).

At the demo model's own grid (16 tokens per frame, at most 336 keys per pass) every pass has ONE key chunk,
so the static offset is the exact row max and the guard cannot trip: ``--latent N`` runs the same trained
DiT on an ``N x N`` latent grid (off its training distribution, but with its trained q/k norm weights), so a
pass has several chunks. The reference-backend run also records, for every self-attention call of the
two-pass stream, the guard's own quantity per query row, ``log l = logsumexp(scale S) - m0`` with ``m0`` the
row max over the kernel's first key chunk (512 keys in fp32, 1,024 in bf16): the guard trips when it
exceeds ``ln 1e30 = 69.08``; the largest value seen is the stream's headroom. With 2-byte dtypes the
offset is one per 128-query tile, and a row trips the guard when its ``log l`` against the tile's maximum
falls below ``ln 1e-18 = -41.4``: the smallest value seen is recorded too (``--dtype bfloat16`` runs the
kernels on that path). ``--running`` forces the running max in the attention and segments kernels
(two-pass streams), the baseline for the PSNR.

Run: ``python -m perf.attention_guard [--model demo|tiny] [--blocks 5] [--merged]`` (a few minutes on one
thread); ``--save`` appends the row (a :class:`perf.runner.BenchRow`) to
``perf/results/attention_guard.jsonl``.
"""

from __future__ import annotations

import argparse
import math
import time
from collections import Counter
from dataclasses import replace
from typing import Any

import torch

from perf.runner import BenchRow, append_rows

ROWS_NAME = "attention_guard"
"""``perf/results/attention_guard.jsonl``: one :class:`~perf.runner.BenchRow` per run."""
PROMPT = "a red circle and a blue square bouncing on a gray background"


def _db(v: float) -> float | str:
    return "identical" if v == float("inf") else round(v, 2)


def _log_l(q: torch.Tensor, keys: torch.Tensor, scale: float, chunk: int) -> tuple[float, float, int]:
    """The guard's quantity ``log l`` over the rows of one call: its largest value against each row's own
    first-chunk maximum (the per-row offset), its smallest against the maximum over the row's 128-query
    tile (the per-tile offset of 2-byte dtypes), and the number of key chunks of the call."""
    high, low = float("-inf"), float("inf")
    for h in range(q.shape[2]):
        s = scale * torch.einsum("bqd,bkd->bqk", q[:, :, h].double(), keys[:, :, h].double())
        lse, first = torch.logsumexp(s, -1), s[..., :chunk].amax(-1)  # [B, Lq]
        high = max(high, float((lse - first).max()))
        for t0 in range(0, q.shape[1], 128):
            tile = first[:, t0 : t0 + 128].amax(-1, keepdim=True)
            low = min(low, float((lse[:, t0 : t0 + 128] - tile).min()))
    return high, low, -(-keys.shape[1] // chunk)


def measure(
    model: str = "demo",
    blocks: int = 5,
    merged: bool = False,
    seed: int = 0,
    latent: int | None = None,
    dtype: str = "float32",
    running: bool = False,
) -> BenchRow:
    """Stream ``blocks`` blocks on the emulator and reference backends; the measured row: guard counts
    (``running_max_passes`` = guard trips with the static offset), the guard quantity (reference run,
    two-pass only) and PSNR in ``extra``."""
    import nki_kernels.attention as att
    import reference.attention as ref_att
    from perf.quality.compare import psnr
    from perf.quality.streams import StreamSpec, load_model, run_stream

    sm = load_model(model, seed=seed)
    if latent is not None:  # the same weights on a bigger latent grid
        cfg = replace(sm.model_cfg, latent_height=latent, latent_width=latent)
        from rolling_forcing.decode import PreviewDecoder

        # the trained decoder has a fixed grid: the video compared is the preview decoder's
        sm = replace(sm, model_cfg=cfg, make_decoder=lambda: PreviewDecoder(cfg.in_channels))
        sm.model.cfg = cfg
    spec = StreamSpec(PROMPT, blocks, seed=seed, merged=merged, dtype=dtype)
    counts: Counter = Counter()
    inner = att._flash_rows

    def counting(*args: Any, **kw: Any) -> Any:
        counts["static_pass" if kw.get("static") else "running_max_pass"] += 1
        return inner(*args, **kw)

    guarded: Any = att._guarded_rows

    def forced_running(*args: Any) -> Any:  # the same kernels with the running max (the baseline)
        return guarded(*args[:-1], False)

    att._flash_rows = counting  # measurement instrumentation for this run only
    if running:
        att._guarded_rows = forced_running
    try:
        t0 = time.perf_counter()
        emu = run_stream(sm, replace(spec, backend="emulator"))
        wall = time.perf_counter() - t0
    finally:
        att._flash_rows, att._guarded_rows = inner, guarded
    stats = {"log_l_max": float("-inf"), "log_l_min_tile": float("inf"), "calls": 0, "max_chunks": 0}
    ref_segments, ref_plain = ref_att.attention_segments, ref_att.attention

    def watch(q: torch.Tensor, keys: torch.Tensor, kw: dict[str, Any]) -> None:
        chunk = 512 if q.dtype == torch.float32 else 1024
        scale = kw.get("scale") or q.shape[-1] ** -0.5
        high, low, nchunks = _log_l(q, keys, scale, chunk)
        stats["log_l_max"] = max(stats["log_l_max"], high)
        stats["log_l_min_tile"] = min(stats["log_l_min_tile"], low)
        stats["calls"] += 1
        stats["max_chunks"] = max(stats["max_chunks"], nchunks)

    def segments(q: torch.Tensor, kv_k: torch.Tensor, kv_v: torch.Tensor, segs: Any, **kw: Any) -> Any:
        watch(q, torch.cat([kv_k[:, a : a + n] for a, n in segs], dim=1), kw)
        return ref_segments(q, kv_k, kv_v, segs, **kw)

    def plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> Any:
        watch(q, k, kw)
        return ref_plain(q, k, v, **kw)

    # measurement instrumentation for this run only (the ops import these at call time)
    setattr(ref_att, "attention_segments", segments)  # noqa: B010
    setattr(ref_att, "attention", plain)  # noqa: B010
    try:
        ref = run_stream(sm, replace(spec, backend="reference"))
    finally:
        setattr(ref_att, "attention_segments", ref_segments)  # noqa: B010
        setattr(ref_att, "attention", ref_plain)  # noqa: B010
    config = {
        "model": sm.name,
        "blocks": blocks,
        "merged": merged,
        "latent": f"{sm.model_cfg.latent_height}x{sm.model_cfg.latent_width}",
        "dtype": dtype,
    }
    extra = {
        "static_passes": counts["static_pass"],
        "running_max_passes": counts["running_max_pass"],
        "psnr_db_vs_reference": _db(psnr(emu.frames, ref.frames)),
        "guard_log_l_max": round(stats["log_l_max"], 2) if stats["calls"] else None,
        "guard_log_l_limit": round(math.log(att.GUARD_L_MAX), 2),
        "tile_log_l_min": round(stats["log_l_min_tile"], 2) if stats["calls"] else None,
        "tile_log_l_limit": round(math.log(att.GUARD_L_MIN), 2),
        "attention_calls_watched": stats["calls"],
        "max_key_chunks_per_call": stats["max_chunks"],
        "frames": int(emu.frames.shape[0]),
        "emulator_wall_s": round(wall, 1),
    }
    variant = "running_max" if running else "static_offset"
    return BenchRow(ROWS_NAME, variant, config, "measured", extra=extra)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", choices=("demo", "tiny"), default="demo")
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--merged", action="store_true", help="merged forward (block-table kernel)")
    ap.add_argument(
        "--latent", type=int, default=None, help="run on an N x N latent grid (several key chunks)"
    )
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument(
        "--running",
        action="store_true",
        help="force the running max in the attention / segments kernels (the baseline; two-pass streams)",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--save", action="store_true", help=f"append the row to perf/results/{ROWS_NAME}.jsonl")
    a = ap.parse_args(argv)
    if a.blocks < 5:
        raise SystemExit(f"--blocks must be >= 5 (the rolling window), got {a.blocks}")
    torch.set_num_threads(a.threads)
    row = measure(a.model, a.blocks, a.merged, latent=a.latent, dtype=a.dtype, running=a.running)
    print(row.to_json())
    if a.save:
        print(f"row appended to {append_rows([row], ROWS_NAME)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
