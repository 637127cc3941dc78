"""Modelled trn2 benchmark of the NKI kernels at Wan2.1-1.3B Rolling Forcing shapes.

Every kernel and variant (naive ones included) runs **trace-only** on the NKI emulator (no arithmetic) and
the trace goes through the trn2 cost model (:mod:`nki_kernels.emulator.cost`). All figures are
**modelled**, never measured. Rows are appended to ``perf/results/bench_kernels.jsonl`` and printed.

Run: ``python -m perf.bench_kernels`` (Wan shapes, ~1 min) or ``python -m perf.bench_kernels --quick``.

Cost model v2: each row's ``latency_us`` is the nominal figure; ``extra`` holds ``latency_us_low`` /
``latency_us_high`` (every unmeasured parameter at its optimistic / pessimistic end,
``cost.profile_range``), the model used (``"schedule"`` when the emulator records the event log, else
``"bound"``), the max-engine bound, the serial bound and the critical path's engines.
``--bound-only`` skips the event log (the bound model; faster at Wan shapes).

Attention is traced with ``traced_heads`` heads (one per logical core) at the full Lq, Lk and D; heads are
independent and identical, and H only changes the HBM row stride (not any descriptor size), so the
per-layer figure is ``(latency - fixed) / traced heads per core * H / lnc + fixed`` (stated in the row;
the fixed per-kernel time is paid once per launch).

``ops.rope3d_tables`` (caller-built cos/sin tables, built once per forward) runs the very same
``rope3d_kernel`` on the same table layout as ``ops.rope3d``, so the ``rope3d`` rows are its modelled figures
too (no separate row); what it saves is the host-side per-layer table build and upload, outside the kernel.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from nki_kernels.attention import attention_kernel, attention_segments_kernel
from nki_kernels.emulator import TensorSpec, run
from nki_kernels.emulator.cost import KernelProfile, profile, profile_range
from nki_kernels.kv_cache import kv_cache_slide_kernel, kv_cache_write_kernel
from nki_kernels.rope3d import rope3d_kernel, rope3d_naive_kernel, rope3d_one_kernel
from perf.neuron_measure import (
    KernelCall,
    NeuronUnavailable,
    add_measure_args,
    attach_call,
    check_measure_args,
    run_measure,
)
from perf.runner import BenchRow, append_rows, figures_from_profile, print_table, run_case
from rolling_forcing.config import ModelConfig, PipelineConfig, get_preset

BF16 = 2


@dataclass(frozen=True)
class Shapes:
    """Benchmark shapes of one layer; :meth:`from_config` derives them from the model/pipeline config."""

    tokens_per_frame: int
    heads: int
    head_dim: int
    window_frames: int
    block_frames: int
    cache_blocks: int
    key_frames: int

    @classmethod
    def from_config(cls, model: ModelConfig, pipe: PipelineConfig) -> Shapes:
        """Shapes of ``model`` streamed by ``pipe``: window, block, KV buffer and key budget."""
        return cls(
            tokens_per_frame=model.tokens_per_frame,
            heads=model.num_heads,
            head_dim=model.head_dim,
            window_frames=pipe.window_frames,
            block_frames=pipe.frames_per_block,
            cache_blocks=pipe.buffer_slots,
            key_frames=pipe.key_budget_frames,
        )

    @property
    def lq(self) -> int:
        return self.window_frames * self.tokens_per_frame

    @property
    def lk(self) -> int:
        return self.key_frames * self.tokens_per_frame

    @property
    def block(self) -> int:
        return self.block_frames * self.tokens_per_frame

    @property
    def cache(self) -> int:
        return self.cache_blocks * self.block


WAN = Shapes.from_config(get_preset("wan2.1-1.3b"), PipelineConfig())  # 480x832: 1,560 tokens/frame
QUICK = replace(WAN, tokens_per_frame=96, window_frames=3, key_frames=9)


def _spec(*shape: int, dtype: str = "bfloat16") -> TensorSpec:
    return TensorSpec(shape, dtype)


USE_EVENTS = True  # record the event log for the dependency-aware schedule (main's --bound-only clears it)


def _trace(kernel: Any, args: tuple, lnc: int) -> Any:
    """Trace-only run; with the event log when :data:`USE_EVENTS`."""
    return run(kernel, *args, lnc=lnc, trace_only=True, keep_events=USE_EVENTS)[1]


def _scaled_us(prof: KernelProfile, ns: float, scale: float) -> float:
    """``ns`` of a traced launch scaled to the full launch: the work part x ``scale``, the fixed per-kernel
    time once (one launch processes every head)."""
    return round(((ns - prof.fixed_ns) * scale + prof.fixed_ns) / 1e3, 2)


def _v2(tr: Any, lnc: int, scale: float = 1.0) -> tuple[KernelProfile, dict[str, Any]]:
    """Nominal profile plus the v2 extras: latency at both ends of every unmeasured parameter, model,
    bounds, critical path (work x ``scale``, fixed time once; see :func:`_scaled_us`)."""
    p, lo, hi = _v2_profiles(tr, lnc)
    return p, _v2_extras(p, lo, hi, scale)


def _v2_profiles(tr: Any, lnc: int) -> tuple[KernelProfile, KernelProfile, KernelProfile]:
    """Nominal, low-end and high-end profiles of one trace."""
    p = profile(tr, cores=lnc)
    lo, hi = profile_range(tr, cores=lnc)
    return p, lo, hi


def tensore_figures(
    profs: dict[str, KernelProfile], scale: float, useful_flops: float, lnc: int
) -> dict[str, float]:
    """Both TensorE figures per parameter end (``nominal`` / ``low`` / ``high``), as percentages.

    ``tensore_busy_pct_<end>``: TensorE active time (matmuls and transposes) / makespan, the work part x
    ``scale`` and the fixed per-kernel time once (as the latency). ``useful_flop_pct_<end>``:
    ``useful_flops`` (attention: ``4 * Lq * Lk * H * D`` per layer) / (latency x bf16 peak x ``lnc`` cores).
    """
    out: dict[str, float] = {}
    for end, pr in profs.items():
        lat_ns = (pr.latency_ns - pr.fixed_ns) * scale + pr.fixed_ns
        busy_ns = pr.engine_busy_ns.get("tensor", 0.0) * scale
        out[f"tensore_busy_pct_{end}"] = round(100 * busy_ns / lat_ns, 1)
        out[f"useful_flop_pct_{end}"] = round(
            100 * useful_flops / (lat_ns * 1e-9 * pr.peak_flops_per_core * lnc), 1
        )
    return out


def _v2_extras(p: KernelProfile, lo: KernelProfile, hi: KernelProfile, scale: float) -> dict[str, Any]:
    return {
        "latency_us_low": _scaled_us(lo, lo.latency_ns, scale),
        "latency_us_high": _scaled_us(hi, hi.latency_ns, scale),
        "model": p.model,
        "bound_us": _scaled_us(p, p.bound_ns, scale),
        "serial_us": _scaled_us(p, p.serial_ns, scale),
        "fixed_us": round(p.fixed_ns / 1e3, 2),
        "critical_engines": list(p.critical_engines),
        "notes": list(p.notes),
    }


def _prof(
    kernel: Any, args: tuple, lnc: int, hbm_min: int, extra: dict[str, Any]
) -> Callable[[], dict[str, Any]]:
    def fn() -> dict[str, Any]:
        tr = _trace(kernel, args, lnc)
        p, v2 = _v2(tr, lnc)
        figs = figures_from_profile(p, hbm_bytes_min=hbm_min)
        figs["extra"].update(v2)
        figs["extra"].update(
            {
                "dma_bound_ratio": round(p.latency_ns / p.dma_bound_ns, 3) if p.dma_bound_ns else None,
                "min_descriptor_bytes": min(p.descriptor_histogram) if p.descriptor_histogram else None,
                "engine_busy_us": {k: round(v / 1e3, 2) for k, v in p.engine_busy_ns.items()},
                "cores": lnc,
            }
        )
        figs["extra"].update(extra)
        return figs

    return attach_call(fn, KernelCall(kernel, args, lnc))


def _attention_fn(
    kernel: Any,
    args: tuple,
    lnc: int,
    heads_total: int,
    hbm_min: int,
    extra: dict,
    useful_flops: float,
    heads_per_core: int = 1,
) -> Callable:
    def fn() -> dict[str, Any]:
        tr = _trace(kernel, args, lnc)
        scale = heads_total / lnc / heads_per_core
        p, lo, hi = _v2_profiles(tr, lnc)
        v2 = _v2_extras(p, lo, hi, scale)  # low/high per layer, like latency
        v2.update(tensore_figures({"nominal": p, "low": lo, "high": hi}, scale, useful_flops, lnc))
        # heads_per_core traced heads on each core; the fixed per-kernel time is paid once per launch
        per_head_us = (p.latency_ns - p.fixed_ns) / 1e3 / heads_per_core
        figs = figures_from_profile(p, hbm_bytes_min=hbm_min)
        figs["latency_us"] = per_head_us * heads_total / lnc + p.fixed_ns / 1e3
        figs["extra"].update(v2)
        figs["extra"].update(
            {
                "per_head_us": round(per_head_us, 1),
                "per_layer_us": round(per_head_us * heads_total / lnc + p.fixed_ns / 1e3, 1),
                "latency_is": f"per layer = per_head x {heads_total} heads / {lnc} cores + fixed per kernel",
                "useful_flops_per_layer": useful_flops,
                "engine_busy_us_per_head": {k: round(v / 1e3, 1) for k, v in p.engine_busy_ns.items()},
                "transpose_passes_over_hbm": sum(
                    n for r, n in tr.entries() if r.engine == "dma" and r.direction == "hbm->hbm"
                ),
                "pe_transposes": tr.count(op="nc_transpose"),
                "cores": lnc,
            }
        )
        figs["extra"].update(extra)
        return figs

    layer = f"per layer = per traced head ({heads_per_core} per core) x {heads_total} heads / {lnc} cores"
    return attach_call(fn, KernelCall(kernel, args, lnc, heads_total / (lnc * heads_per_core), layer))


def cases(s: Shapes) -> list[tuple[str, str, dict[str, Any], Callable[[], Any]]]:
    h, d, row = s.heads, s.head_dim, s.heads * s.head_dim
    out: list[tuple[str, str, dict[str, Any], Callable[[], Any]]] = []
    lq = s.lq
    rope_args = (
        _spec(1, lq, h, d),
        _spec(1, lq, h, d),
        _spec(lq, d // 2, dtype="float32"),
        _spec(lq, d // 2, dtype="float32"),
    )
    rope_min = 4 * lq * row * BF16
    # these rows also model ops.rope3d_tables: same rope3d_kernel and table operands (see module docstring)
    cfg = {"B": 1, "L": lq, "H": h, "D": d, "dtype": "bf16"}
    target = {"target": "latency <= 1.25 x dma_bound, q/k descriptors >= 2 KiB"}
    for lnc in (1, 2):
        out.append(
            (
                "rope3d",
                f"sbuf_deinterleave_lnc{lnc}",
                cfg,
                _prof(rope3d_kernel, rope_args, lnc, rope_min, target),
            )
        )
    out.append(
        ("rope3d", "naive_stride2_dma", cfg, _prof(rope3d_naive_kernel, rope_args, 1, rope_min, target))
    )
    # ops.rope3d_tables_one / rope3d_positions_one: keys only (the merged forward's roped copies)
    one = _prof(rope3d_one_kernel, rope_args[1:], 1, rope_min // 2, target)
    out.append(("rope3d", "one_tensor_keys_only_lnc1", cfg, one))

    cache, blk = s.cache, s.block
    kv_args = (_spec(1, cache, h, d), _spec(1, cache, h, d), _spec(1, blk, h, d), _spec(1, blk, h, d))
    kcfg = {"B": 1, "S": cache, "T": blk, "H": h, "D": d, "dtype": "bf16"}
    for lnc in (1, 2):
        out.append(
            (
                "kv_cache_write",
                f"ring_lnc{lnc}",
                kcfg,
                _prof(
                    kv_cache_write_kernel,
                    (*kv_args, _spec(1, 1, dtype="int32")),
                    lnc,
                    2 * 2 * blk * row * BF16,
                    {"target": "<= 100 us per layer"},
                ),  # fmt: skip
            )
        )
        out.append(
            (
                "kv_cache_slide",
                f"contiguous_lnc{lnc}",
                {**kcfg, "sink": blk},
                _prof(
                    kv_cache_slide_kernel,
                    (*kv_args, blk),
                    lnc,
                    2 * 2 * (cache - blk) * row * BF16,
                    {"target": "<= 2000 us per layer (published 1.9 ms)"},
                ),  # fmt: skip
            )
        )

    lk = s.lk
    th = 2
    acfg = {"B": 1, "Lq": lq, "Lk": lk, "H": h, "D": d, "dtype": "bf16", "traced_heads": th}
    amin = th * (lq * 2 + 2 * lk) * d * BF16
    att_args = (_spec(1, lq, th, d), _spec(1, lk, th, d), _spec(1, lk, th, d), 1.0 / d**0.5, False)
    tgt = {"target": "TensorE util >= 70% at the pessimistic end, zero transpose passes over HBM"}
    useful = 4.0 * lq * lk * h * d
    out.append(
        (
            "attention",
            "flash_fused_lnc2",
            acfg,
            _attention_fn(attention_kernel, att_args, 2, h, amin, tgt, useful),
        )
    )
    # the same kernel with 3/5 of the P^T groups on the SBUF->SBUF DMA (the previous default): its price is
    # unmeasured, so the comparison shows what the design would gain or lose at either end of it
    dma_args = (*att_args, (3, 5))
    out.append(
        (
            "attention",
            "dma_transpose_3of5_lnc2",
            {**acfg, "dma_transpose_chunks": [3, 5]},
            _attention_fn(attention_kernel, dma_args, 2, h, amin, tgt, useful),
        )
    )
    # per-core shape of the TP4 x SP2 plan (perf/e2e/): H/4 heads x ceil(Lq/2) queries over all keys, 1 core
    hc, lqc = h // 4, -(-lq // 2)
    pc_args = (_spec(1, lqc, hc, d), _spec(1, lk, hc, d), _spec(1, lk, hc, d), 1.0 / d**0.5, False)
    out.append(
        (
            "attention",
            "per_core_tp4xsp2",
            {**acfg, "Lq": lqc, "H": hc, "traced_heads": hc, "plan": "TP4 x SP2, one core"},
            _attention_fn(
                attention_kernel,
                pc_args,
                1,
                hc,
                hc * (lqc * 2 + 2 * lk) * d * BF16,
                {**tgt, "per_layer_is": "one core's share of a layer (the 8 cores run in parallel)"},
                4.0 * lqc * lk * hc * d,
                heads_per_core=hc,
            ),
        )
    )
    # segments: sink block + working cache + window's own keys, read in place from a cache-sized buffer
    segs = ((0, blk), (2 * blk, lk - lq - blk), (cache - lq, lq))
    seg_args = (
        _spec(1, lq, th, d),
        _spec(1, cache, th, d),
        _spec(1, cache, th, d),
        segs,
        1.0 / d**0.5,
        False,
    )
    out.append(
        (
            "attention_segments",
            "in_place_segments_lnc2",
            {**acfg, "S": cache, "segments": [list(x) for x in segs]},
            _attention_fn(attention_segments_kernel, seg_args, 2, h, amin, tgt, useful),
        )
    )
    out.extend(block_table_cases(s))
    out.extend(cte_harness_cases(s))
    return out


def _dense_fn(kernel: Any, args: tuple, hbm_min: int, useful: float, extra: dict[str, Any]) -> Callable:
    """A dense-layer row (linear / conv): latency at both ends, TensorE busy and useful-FLOP % per end."""

    def fn() -> dict[str, Any]:
        tr = _trace(kernel, args, 1)
        p, lo, hi = _v2_profiles(tr, 1)
        figs = figures_from_profile(p, hbm_bytes_min=hbm_min)
        figs["extra"].update(_v2_extras(p, lo, hi, 1.0))
        figs["extra"].update(tensore_figures({"nominal": p, "low": lo, "high": hi}, 1.0, useful, 1))
        figs["extra"].update({"engine_busy_us": {k: round(v / 1e3, 2) for k, v in p.engine_busy_ns.items()}})
        figs["extra"].update(extra)
        return figs

    return attach_call(fn, KernelCall(kernel, args, 1))


def dense_cases(quick: bool) -> list[tuple[str, str, dict[str, Any], Callable[[], Any]]]:
    """Linear layers (``nki_kernels.linear``) at one core's token share of Wan's merged forward (3,510 of
    28,080 tokens on 8 cores; 256 with ``quick``) and the VAE decoder's main convolutions
    (``nki_kernels.conv3d``) on one core's rows of 480x832 (``ceil(H / 8)``), bf16 with bias."""
    from nki_kernels.conv3d import conv3d_causal_kernel
    from nki_kernels.linear import linear_kernel

    m = 256 if quick else 3510
    lin = [("ffn_up", 1536, 8960), ("ffn_down", 8960, 1536), ("qkv_proj", 1536, 4608), ("o_proj", 1536, 1536)]
    conv = [
        ("384x384_k333_60x104", 384, 384, 1, 60, 104, (3, 3, 3)),
        ("192x192_k333_240x416", 192, 192, 4, 240, 416, (3, 3, 3)),
        ("96x96_k333_480x832", 96, 96, 4, 480, 832, (3, 3, 3)),
        ("384x192_k133_240x416", 384, 192, 4, 240, 416, (1, 3, 3)),
    ]
    if quick:
        lin, conv = lin[:1], [("32x32_k333_16x24", 32, 32, 1, 16, 24, (3, 3, 3))]
    out: list[tuple[str, str, dict[str, Any], Callable[[], Any]]] = []
    for name, k, n in lin:
        args: tuple[Any, ...] = (_spec(m, k), _spec(k, n), _spec(n, dtype="float32"))
        cfg = {"M": m, "K": k, "N": n, "dtype": "bf16", "bias": True}
        extra = {"target": "useful-FLOP % >= 85 (full tiles)", "per_core": f"{m} tokens"}
        hbm = (m * k + k * n + m * n) * BF16 + 4 * n
        out.append(("linear", name, cfg, _dense_fn(linear_kernel, args, hbm, 2.0 * m * k * n, extra)))
    for name, ci, co, t, h, w, ks in conv:
        hc = -(-h // 8) if not quick else h
        taps = ks[0] * ks[1] * ks[2]
        cargs: tuple[Any, ...] = (
            _spec(ci, t + ks[0] - 1, hc, w),
            _spec(taps, ci, co),
            _spec(co, dtype="float32"),
            ks,
        )
        cfg = {"C_in": ci, "C_out": co, "T": t, "H": hc, "W": w, "ksize": list(ks), "dtype": "bf16"}
        extra = {
            "target": "useful-FLOP % >= min(C_in, C_out)^2 / 128^2 share",
            "per_core": f"{hc} of {h} rows",
        }
        hbm = (ci * (t + ks[0] - 1) + co * t) * hc * w * BF16 + taps * ci * co * BF16
        useful = 2.0 * t * hc * w * ci * taps * co
        out.append(("conv3d_causal", name, cfg, _dense_fn(conv3d_causal_kernel, cargs, hbm, useful, extra)))
    return out


def cte_harness_cases(s: Shapes) -> list[tuple[str, str, dict[str, Any], Callable[[], Any]]]:
    """AWS ``attention_cte``'s structure (``perf/attention_cte_harness.py``) at the attention rows' shapes.

    Same traced heads, scaling and figures as the ``attention`` rows (:func:`_attention_fn`): Wan lnc2 with
    two heads traced (one per logical core: attention_cte shards B = heads across the cores), and the per-core
    TP4 x SP2 shape on one core. Its layouts: q ``[H, Lq, D]`` (transposed in the kernel), k ``[H, D, Lk]``
    (D-major: the caller's layout change is NOT in the row), v ``[H, Lk, D]``, out ``[H, Lq, D]``.
    """
    from perf.attention_cte_harness import attention_cte_harness_kernel as kern

    h, d, lk, th = s.heads, s.head_dim, s.lk, 2
    note = {
        "target": "side by side with the attention rows (same shapes, same model)",
        "source": "aws-neuron/nki-library src/nkilib_src/nkilib/core/attention/attention_cte.py @ d2ad3a57",
        "layouts": "q [H, Lq, D], k [H, D, Lk] (caller transposes K), v [H, Lk, D], out [H, Lq, D]",
    }
    out = []
    for var, lq, lnc, hh, hpc in (
        ("wan_lnc2", s.lq, 2, th, 1),
        ("per_core_tp4xsp2", -(-s.lq // 2), 1, h // 4, h // 4),
    ):
        args = (_spec(hh, lq, d), _spec(hh, d, lk), _spec(hh, lk, d), 1.0 / d**0.5)
        heads = h if lnc == 2 else hh
        cfg = {"B": 1, "Lq": lq, "Lk": lk, "H": heads, "D": d, "dtype": "bf16", "traced_heads": hh}
        extra = dict(note)
        if lnc == 1:
            cfg["plan"] = "TP4 x SP2, one core"
            extra["per_layer_is"] = "one core's share of a layer (the 8 cores run in parallel)"
        hbm = hh * (lq * 2 + 2 * lk) * d * BF16
        useful = 4.0 * lq * lk * heads * d
        out.append(
            (
                "attention_cte_harness",
                var,
                cfg,
                _attention_fn(kern, args, lnc, heads, hbm, extra, useful, hpc),
            )
        )
    return out


def block_table_cases(s: Shapes) -> list[tuple[str, str, dict[str, Any], Callable[[], Any]]]:
    """Merged-forward attention (``attention_block_table``): one launch, 2 query groups.

    Queries: update block + window = ``block_frames + window_frames`` frames (3 + 15 = 18 at Wan), groups
    (block, window). Keys per group: ``key_frames / block_frames`` = 7 blocks picked by a runtime table
    ``[2, 7, 2]`` from three sources (KV buffer of ``cache_blocks`` blocks, the forward's own 6 blocks, 2
    roped sink copies). Traced at the full shapes with 2 heads (lnc2); the table values do not change the
    trace. Every entry is loaded by one runtime-offset DMA per source with out-of-bounds skip: the cost model
    charges all three (K/V load traffic x3 vs what moves on hardware), so the bytes are an upper bound.
    """
    from nki_kernels.attention_block_table import attention_block_table_kernel

    h, d, blk, th = s.heads, s.head_dim, s.block, 2
    nb = s.key_frames // s.block_frames
    groups = (blk, s.window_frames * s.tokens_per_frame)
    lq = sum(groups)
    srcs = (s.cache, lq, 2 * blk)
    ks = [_spec(1, n, th, d) for n in srcs]
    vs = [_spec(1, n, th, d) for n in srcs]
    args = (_spec(1, lq, th, d), ks, vs, _spec(2, nb, 2, dtype="int32"), groups, blk, 1.0 / d**0.5, False)
    cfg = {"B": 1, "Lq": lq, "q_groups": list(groups), "NB": nb, "T": blk, "sources_S": list(srcs), "H": h,
           "D": d, "dtype": "bf16", "traced_heads": th}  # fmt: skip
    hbm_min = th * (2 * lq + 2 * 2 * nb * blk) * d * BF16  # q, out, each group's k and v read once
    extra = {"target": "TensorE util >= 70% (as attention); one kernel for every table"}
    useful = 4.0 * sum(groups) * nb * blk * h * d  # every query over its group's nb blocks of keys
    fn = _attention_fn(attention_block_table_kernel, args, 2, h, hbm_min, extra, useful)
    # bound: one source holding every block = traffic when skipped DMAs cost nothing (default P^T share)
    one = (_spec(1, s.cache, th, d),)
    args1 = (args[0], one, one, *args[3:])
    cfg1 = {**cfg, "sources_S": [s.cache], "note": "skip-free bound"}
    fn1 = _attention_fn(attention_block_table_kernel, args1, 2, h, hbm_min, extra, useful)
    return [
        ("attention_block_table", "merged_update_plus_window_lnc2", cfg, fn),
        ("attention_block_table", "one_source_skip_free_bound_lnc2", cfg1, fn1),
    ]


def build_parser() -> argparse.ArgumentParser:
    """The command's arguments (its own function so a test can check the defaults: nothing tracked is
    written without ``--save``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small shapes (seconds) instead of Wan shapes")
    ap.add_argument("--no-save", action="store_true", help="print only (the default; kept for scripts)")
    ap.add_argument("--bound-only", action="store_true", help="no event log: the v2 bound model (faster)")
    ap.add_argument(
        "--ops",
        default="",
        help="comma-separated op names to run (e.g. attention,attention_segments); default: every op",
    )
    add_measure_args(ap)
    ap.add_argument(
        "--save",
        action="store_true",
        help="append the rows to perf/results/bench_kernels[_measured].jsonl (tracked); default: print only",
    )
    return ap


def main(argv: list[str] | None = None) -> list[BenchRow] | int:
    """Run the benchmark; returns the rows, or 2 when ``--measure`` cannot run here (message on stderr)."""
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.save and a.no_save:
        ap.error("--save and --no-save contradict each other")
    check_measure_args(ap, a)
    global USE_EVENTS
    USE_EVENTS = not a.bound_only
    shapes = QUICK if a.quick else WAN
    name = "bench_kernels_quick" if a.quick else "bench_kernels"
    from perf.bench_elementwise import elementwise_cases
    from perf.bench_fp8 import linear_fp8_cases

    todo = cases(shapes) + dense_cases(a.quick) + elementwise_cases(a.quick) + linear_fp8_cases(a.quick)
    if a.ops:
        want = {o.strip() for o in a.ops.split(",") if o.strip()}
        known = {op for op, _, _, _ in todo}
        if not want <= known:
            ap.error(f"--ops: unknown op(s) {sorted(want - known)}; known: {sorted(known)}")
        todo = [c for c in todo if c[0] in want]
    if a.measure:
        try:
            rows = run_measure(todo, workdir=a.workdir)
        except NeuronUnavailable as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        name += "_measured"
    else:
        rows = [run_case(fn, op=op, variant=var, config=cfg, kind="modelled") for op, var, cfg, fn in todo]
    if a.save:
        append_rows(rows, name)
    print_table(rows)
    for r in rows:
        ex = r.extra
        keys = (
            "latency_us_low",
            "latency_us_high",
            "model",
            "dma_bound_ratio",
            "per_head_us",
            "per_layer_us",
            "bottleneck",
            "min_descriptor_bytes",
            "target",
            "hbm_roofline_us",
            "kernel_us",
            "speedup_vs_bf16_low",
            "speedup_vs_bf16_high",
            "gate_passed",
            *(
                f"{f}_{e}"
                for f in ("tensore_busy_pct", "useful_flop_pct")
                for e in ("nominal", "low", "high")
            ),
        )
        print(f"{r.kind} {r.op}/{r.variant}: " + ", ".join(f"{k}={ex[k]}" for k in keys if k in ex))
    return rows


if __name__ == "__main__":
    _code = main()
    raise SystemExit(_code if isinstance(_code, int) else 0)
