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

``--model wan-layer`` (:func:`measure_wan_layer`, no emulator): ONE Wan2.1-1.3B self-attention layer (dim
1,536, 12 heads of 128; q/k projections and q/k RMSNorm of ``rolling_forcing.model.Attention`` with Wan's
init: xavier-uniform weights, zero biases, norm weights 1, or a real checkpoint's layer with
``--checkpoint``) on LayerNorm-ed i.i.d. Gaussian tokens at the merged forward's real key count (21 frames
x 1,560 = 32,760 keys, 3D RoPE at frame positions 0..20; the update group = the queries of frames 3-5,
4,680, the denoise group = frames 6-20, 23,400; ``--tiles`` 128-query tiles sampled per group and head).
The q/k norm weights are multiplied by each ``--qk-gain`` (1 = as initialised / as trained; larger =
sharper attention: the scores scale by gain^2), and the guard's own quantities are computed in float64
per head and group, as the kernel forms them for ``--dtype`` (fp32: one offset per row, its first 512-key
chunk's max, upper bound only; bf16: one offset per 128-query tile, the tile's largest score over the
first 1,024 keys, both bounds); a head trips if any sampled row of any of its groups does. One row per
gain; the trip onset (the first gain of the sweep with a tripping head) is in every row.
"""

from __future__ import annotations

import argparse
import math
import time
from collections import Counter
from dataclasses import replace
from datetime import datetime, timezone
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


# ------------------------------------------------------------------------------------- one Wan layer
WAN_PRESET = "wan2.1-1.3b"
WAN_FRAMES = 21
"""Latent frames of the merged forward's key budget: 21 x 1,560 = 32,760 keys."""
WAN_GROUPS = (("update", 3, 6), ("denoise", 6, 21))
"""Query groups as frame ranges ``[first, end)`` of the 21 frames: 3 update frames (4,680 queries) and 15
denoise frames (23,400); both attend to all 21 frames here."""
WAN_GAINS = (1.0, 1.5, 2.0, 2.5, 3.0, 3.25, 3.5, 3.75, 4.0, 4.5, 5.0, 6.0, 8.0)
"""Default ``--qk-gain`` sweep (the guard's quantities grow about as gain^2: finer where trips begin)."""
TILE = 128


def tile_guard_stats(s: torch.Tensor, chunk: int, per_tile: bool) -> tuple[float, float, float]:
    """The guard's quantities over one query tile of scaled scores ``s`` ``[rows <= 128, Lk]`` (float64):
    ``(row_max, tile_max, tile_min)`` with ``log l = logsumexp(s_row)`` minus an offset: ``row_max`` =
    its largest value against each row's own first-``chunk`` maximum (the per-row offset, as
    :func:`_log_l`); ``tile_max`` / ``tile_min`` = its largest / smallest value against the tile's
    largest first-chunk score (the per-tile offset of 2-byte dtypes; ``per_tile=False``: ``nan``)."""
    if s.dim() != 2 or not 1 <= s.shape[0] <= TILE or chunk < 1:
        raise ValueError(
            f"tile_guard_stats: s must be [1..{TILE}, Lk] and chunk >= 1, got {tuple(s.shape)}, {chunk}"
        )
    lse, first = torch.logsumexp(s, -1), s[:, :chunk].amax(-1)
    row_max = float((lse - first).max())
    if not per_tile:
        return row_max, float("nan"), float("nan")
    d = lse - first.max()
    return row_max, float(d.max()), float(d.min())


def trips(stats: tuple[float, float, float], dtype: str) -> bool:
    """Whether a tile with ``stats`` (:func:`tile_guard_stats`) trips the kernel's guard at ``dtype``:
    fp32 (one offset per row, upper bound only): ``row_max > ln GUARD_L_MAX``; bf16 (one offset per
    tile): ``tile_max > ln GUARD_L_MAX`` or ``tile_min < ln GUARD_L_MIN``."""
    from nki_kernels.attention import GUARD_L_MAX, GUARD_L_MIN

    hi, lo = math.log(GUARD_L_MAX), math.log(GUARD_L_MIN)
    if dtype == "float32":
        return stats[0] > hi
    return stats[1] > hi or stats[2] < lo


def _parse_layers(text: str, checkpoint: str | None) -> tuple[int, ...]:
    """``--layer``: an index, a comma list or ``all`` (the preset's layers); only with ``--checkpoint``
    may it name other layers than 0 (Wan's init draws every layer alike)."""
    from rolling_forcing.config import get_preset

    n = get_preset(WAN_PRESET).num_layers
    if text == "all":
        layers = tuple(range(n))
    else:
        try:
            layers = tuple(int(x) for x in text.split(","))
        except ValueError:
            raise ValueError(f"--layer must be an int, a comma list of ints or 'all', got {text!r}") from None
    if any(not 0 <= i < n for i in layers):
        raise ValueError(f"--layer indices must be in [0, {n}), got {text!r}")
    if checkpoint is None and layers != (0,):
        raise ValueError("--layer needs --checkpoint (Wan's init draws every layer alike)")
    return layers


def _wan_attention(seed: int, checkpoint: str | None, layer: int) -> Any:
    """``rolling_forcing.model.Attention`` of Wan2.1-1.3B: Wan's init (seeded) or layer ``layer``'s
    self-attention q/k weights and norms from ``checkpoint``."""
    from rolling_forcing.config import get_preset
    from rolling_forcing.model import Attention

    cfg = get_preset(WAN_PRESET)
    attn = Attention(cfg.dim, cfg.eps)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if checkpoint is None:  # Wan's init: xavier-uniform linear weights, zero biases, norm weights 1
            for lin in (attn.q, attn.k):
                torch.nn.init.xavier_uniform_(lin.weight, generator=g)
                lin.bias.zero_()
            return attn
        from rolling_forcing.checkpoint import load_wan_state_dict

        state, _ = load_wan_state_dict(checkpoint)
        pre = f"blocks.{layer}.self_attn."
        for name in ("q.weight", "q.bias", "k.weight", "k.bias", "norm_q.weight", "norm_k.weight"):
            key, dst = pre + name, attn.get_parameter(name)
            if key not in state:
                raise ValueError(f"--checkpoint {checkpoint}: no tensor {key!r}")
            if tuple(state[key].shape) != tuple(dst.shape):
                raise ValueError(
                    f"--checkpoint {checkpoint}: {key} is {tuple(state[key].shape)}, Wan2.1-1.3B needs "
                    f"{tuple(dst.shape)}"
                )
            dst.copy_(state[key].float())
    return attn


def wan_tokens(seed: int, frames: int) -> torch.Tensor:
    """The layer's input: ``frames x 1,560`` tokens ``[L, 1536]`` fp32, i.i.d. standard normal through
    Wan's parameter-free LayerNorm (``norm1``; the adaLN modulation taken as 0), seeded by ``seed + 1``."""
    from rolling_forcing.config import get_preset

    cfg = get_preset(WAN_PRESET)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(frames * cfg.tokens_per_frame, cfg.dim, generator=g)
    return torch.nn.functional.layer_norm(x, (cfg.dim,), eps=cfg.eps)


def wan_layer_stats(
    gains: tuple[float, ...],
    dtype: str = "bfloat16",
    tiles: int = 16,
    seed: int = 0,
    *,
    frames: int = WAN_FRAMES,
    groups: tuple[tuple[str, int, int], ...] = WAN_GROUPS,
    checkpoint: str | None = None,
    layer: int = 0,
) -> dict[float, dict[str, list[tuple[float, float, float]]]]:
    """Per gain, per ``"head/group"`` (e.g. ``"3/update"``): the :func:`tile_guard_stats` of every sampled
    tile, for one Wan2.1-1.3B self-attention layer (module docstring) over ``frames`` x 1,560 keys.
    The scores are computed once per tile at gain 1 (fp32 matmul, then float64) and scaled by gain^2."""
    from reference.rope3d import rope3d_tables, rope_tables
    from rolling_forcing.config import get_preset

    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    if not gains or any(not (isinstance(x, (int, float)) and x > 0 and math.isfinite(x)) for x in gains):
        raise ValueError(f"--qk-gain values must be finite and > 0, got {gains}")
    if tiles < 1:
        raise ValueError(f"--tiles must be >= 1, got {tiles}")
    cfg = get_preset(WAN_PRESET)
    hp, wp = cfg.grid_hw
    tpf, nh, hd = hp * wp, cfg.num_heads, cfg.head_dim
    attn = _wan_attention(seed, checkpoint, layer)
    g = torch.Generator().manual_seed(seed + 2)  # the tile sampling
    x = wan_tokens(seed, frames)
    cos, sin = rope_tables((frames, hp, wp), hd, dtype=torch.float64)

    def roped(proj: torch.nn.Module, norm: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            y = norm(proj(x[rows])).view(1, len(rows), nh, hd)
        return rope3d_tables(y, y, cos[rows], sin[rows])[0][0]  # [len(rows), H, D]

    k = roped(attn.k, attn.norm_k, torch.arange(frames * tpf))
    chunk = 512 if dtype == "float32" else 1024
    per_tile = dtype != "float32"
    scale = hd**-0.5
    out: dict[float, dict[str, list[tuple[float, float, float]]]] = {gn: {} for gn in gains}
    for name, f0, f1 in groups:
        if not 0 <= f0 < f1 <= frames:
            raise ValueError(f"query group {name!r}: frames [{f0}, {f1}) must lie in [0, {frames})")
        n_tiles = -(-(f1 - f0) * tpf // TILE)
        picks = torch.randperm(n_tiles, generator=g)[: min(tiles, n_tiles)].sort().values
        for t in picks.tolist():
            lo = f0 * tpf + t * TILE
            rows = torch.arange(lo, min(lo + TILE, f1 * tpf))
            q = roped(attn.q, attn.norm_q, rows)
            for h in range(nh):
                s1 = (scale * (q[:, h] @ k[:, h].T)).double()
                for gn in gains:
                    st = tile_guard_stats(gn * gn * s1, chunk, per_tile)
                    out[gn].setdefault(f"{h}/{name}", []).append(st)
    return out


def _round(v: float) -> float | None:
    return None if math.isnan(v) else round(v, 2)


def _wan_extra(per_unit: dict[str, list[tuple[float, float, float]]], dtype: str) -> dict[str, Any]:
    """The measured figures of one gain from its per-``"head/group"`` tile stats."""
    from nki_kernels.attention import GUARD_L_MAX, GUARD_L_MIN

    def head(u: str) -> int:
        return int(u.split("/")[0])

    heads = sorted({head(u) for u in per_unit})
    unit_trip = {u: any(trips(st, dtype) for st in sts) for u, sts in per_unit.items()}
    head_trip = [any(v for u, v in unit_trip.items() if head(u) == h) for h in heads]
    row_max = [max(st[0] for u, sts in per_unit.items() if head(u) == h for st in sts) for h in heads]
    every = [st for sts in per_unit.values() for st in sts]
    return {
        "heads_tripping": sum(head_trip),
        "heads": len(heads),
        "fraction_heads_tripping": sum(head_trip) / len(heads),
        "groups_tripping": sorted(u for u, v in unit_trip.items() if v),
        "guard_log_l_max": _round(max(row_max)),
        "guard_log_l_max_per_head": [_round(v) for v in row_max],
        "guard_log_l_limit": round(math.log(GUARD_L_MAX), 2),
        "tile_log_l_max": _round(max(st[1] for st in every)),
        "tile_log_l_min": _round(min(st[2] for st in every)),
        "tile_log_l_limit": round(math.log(GUARD_L_MIN), 2),
        "tiles_sampled": len(every),
    }


def measure_wan_layer(
    gains: tuple[float, ...] = WAN_GAINS,
    dtype: str = "bfloat16",
    tiles: int = 16,
    seed: int = 0,
    *,
    frames: int = WAN_FRAMES,
    groups: tuple[tuple[str, int, int], ...] = WAN_GROUPS,
    checkpoint: str | None = None,
    layers: tuple[int, ...] = (0,),
) -> list[BenchRow]:
    """One measured row per gain (and layer, with ``checkpoint``): heads tripping, the guard's quantities
    (largest ``log l`` per head against the row offset, the per-tile extremes) and the sweep's trip onset
    (``trip_onset_gain``: the first gain with a tripping head, None if none; ``trip_onset_bracket``: the
    gain before it and it) in ``extra``.  The fraction is over the sampled rows: a head whose unsampled
    rows trip counts as not tripping, so it is a lower bound."""
    from rolling_forcing.config import get_preset

    tpf = get_preset(WAN_PRESET).tokens_per_frame
    gains = tuple(sorted({float(x) for x in gains}))
    run_id = datetime.now(timezone.utc).isoformat(timespec="seconds")  # one per sweep
    rows: list[BenchRow] = []
    for layer in layers:
        t0 = time.perf_counter()
        stats = wan_layer_stats(
            gains, dtype, tiles, seed, frames=frames, groups=groups, checkpoint=checkpoint, layer=layer
        )
        extras = [_wan_extra(stats[gn], dtype) for gn in gains]
        onset = next((gn for gn, e in zip(gains, extras, strict=True) if e["heads_tripping"]), None)
        before = [gn for gn in gains if onset is not None and gn < onset]
        config = {
            "model": "wan-layer",
            "preset": WAN_PRESET,
            "weights": "wan_init" if checkpoint is None else "checkpoint",
            "layer": layer,
            "keys": frames * tpf,
            "queries": {n: (f1 - f0) * tpf for n, f0, f1 in groups},
            "tiles_per_group": tiles,
            "seed": seed,
            "inputs": "layer_norm(iid gaussian tokens)",
            "dtype": dtype,
        }
        wall = round(time.perf_counter() - t0, 1)
        for gn, e in zip(gains, extras, strict=True):
            e.update(trip_onset_gain=onset, trip_onset_bracket=[before[-1] if before else None, onset])
            e.update(wall_s=wall, run_id=run_id)
            rows.append(BenchRow(ROWS_NAME, "wan_layer", {**config, "qk_gain": gn}, "measured", extra=e))
    return rows


def wan_layer_summary(rows: list[BenchRow]) -> list[str]:
    """One line per row: gain, heads tripping, the guard's quantities against their limits."""
    out = []
    for r in rows:
        e = r.extra
        out.append(
            f"layer {r.config['layer']} gain {r.config['qk_gain']:g}: {e['heads_tripping']}/{e['heads']} "
            f"heads trip; log l max {e['guard_log_l_max']} (row offset), per tile [{e['tile_log_l_min']}, "
            f"{e['tile_log_l_max']}] (limits {e['tile_log_l_limit']}, {e['guard_log_l_limit']}); onset "
            f"{e['trip_onset_gain']}"
        )
    return out


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
        "guidance": sm.model_cfg.guidance_scale,
        "guidance_sigma_min": sm.model_cfg.guidance_sigma_min,
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


def build_parser() -> argparse.ArgumentParser:
    """The command's arguments (a test checks the default writes nothing tracked: rows only with
    ``--save``)."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", choices=("demo", "tiny", "wan-layer"), default="demo")
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--merged", action="store_true", help="merged forward (block-table kernel)")
    ap.add_argument(
        "--latent", type=int, default=None, help="run on an N x N latent grid (several key chunks)"
    )
    ap.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="default: float32 for the stream models, bfloat16 (the production path) for wan-layer",
    )
    ap.add_argument(
        "--running",
        action="store_true",
        help="force the running max in the attention / segments kernels (the baseline; two-pass streams)",
    )
    ap.add_argument(
        "--qk-gain",
        type=float,
        nargs="+",
        default=None,
        help=f"wan-layer: q/k norm weight multipliers to sweep (default {' '.join(map(str, WAN_GAINS))})",
    )
    ap.add_argument(
        "--tiles", type=int, default=16, help="wan-layer: 128-query tiles sampled per group and head"
    )
    ap.add_argument(
        "--checkpoint", default=None, help="wan-layer: take the layers' q/k weights from this file"
    )
    ap.add_argument(
        "--layer", default="0", help="wan-layer with --checkpoint: layer index, list 0,5,29 or 'all'"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--save", action="store_true", help=f"append the row to perf/results/{ROWS_NAME}.jsonl")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.model == "wan-layer":
        if a.merged or a.running or a.latent is not None:
            raise SystemExit(
                "--merged, --running and --latent apply to the stream models (demo, tiny), not wan-layer"
            )
        try:
            rows = measure_wan_layer(
                tuple(a.qk_gain) if a.qk_gain else WAN_GAINS,
                a.dtype or "bfloat16",
                a.tiles,
                a.seed,
                checkpoint=a.checkpoint,
                layers=_parse_layers(a.layer, a.checkpoint),
            )
        except ValueError as e:
            raise SystemExit(str(e)) from None
        for row in rows:
            print(row.to_json())
        print("\n".join(wan_layer_summary(rows)))
        if a.save:
            print(f"{len(rows)} rows appended to {append_rows(rows, ROWS_NAME)}")
        return 0
    if a.qk_gain or a.checkpoint:
        raise SystemExit("--qk-gain and --checkpoint apply to --model wan-layer only")
    if a.blocks < 5:
        raise SystemExit(f"--blocks must be >= 5 (the rolling window), got {a.blocks}")
    dtype = a.dtype or "float32"
    row = measure(a.model, a.blocks, a.merged, seed=a.seed, latent=a.latent, dtype=dtype, running=a.running)
    print(row.to_json())
    if a.save:
        print(f"row appended to {append_rows([row], ROWS_NAME)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
