"""Bench rows of the FP8 linear (``python -m perf.bench_kernels --ops linear_fp8``): the kernel
``nki_kernels.linear_fp8`` at one core's token share of Wan's merged forward (3,510 tokens; 256 with
``--quick``), **modelled** at both ends of every unmeasured parameter, next to the bf16 linear kernel at
the same shape (same model), with the **measured** error gate of :mod:`perf.fp8_gate` for the Wan-block
linears of that shape.

``useful_flop_pct_*`` of these rows is relative to the FP8 double-row peak (2 x the bf16 peak: 157 TF
per core), so 100 % means TensorE at its FP8 rate for the whole latency.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from perf.bench_kernels import BF16, _dense_fn, _spec, _trace
from perf.fp8_gate import GateConfig, gate
from perf.neuron_measure import KernelCall, attach_call

__all__ = ["WAN_LINEARS", "bf16_linear_us", "linear_fp8_cases"]

WAN_LINEARS: tuple[tuple[str, int, int, tuple[str, ...]], ...] = (
    ("ffn_up", 1536, 8960, ("ffn_up",)),
    ("ffn_down", 8960, 1536, ("ffn_down",)),
    ("qkv_proj", 1536, 4608, ("self_q", "self_k", "self_v")),
    ("o_proj", 1536, 1536, ("self_o", "cross_q", "cross_o")),
)
"""``(row, K, N, gate linears of that shape)``: the bench rows of the bf16 linear (``dense_cases``)."""


def bf16_linear_us(m: int, k: int, n: int) -> tuple[float, float]:
    """Modelled latency (µs, optimistic and pessimistic end) of the bf16 linear kernel at ``[m, k] @ [k, n]``
    with bias (one core)."""
    from nki_kernels.emulator.cost import profile_range
    from nki_kernels.linear import linear_kernel

    tr = _trace(linear_kernel, (_spec(m, k), _spec(k, n), _spec(n, dtype="float32")), 1)
    lo, hi = profile_range(tr, cores=1)
    return round(lo.latency_ns / 1e3, 1), round(hi.latency_ns / 1e3, 1)


def _fp8_fn(m: int, k: int, n: int, names: tuple[str, ...], gcfg: GateConfig) -> Callable[[], Any]:
    from nki_kernels.linear_fp8 import linear_fp8_kernel

    args = (
        _spec(m, k),
        _spec(k, n, dtype="float8_e4m3"),
        _spec(n, dtype="float32"),
        _spec(n, dtype="float32"),
    )
    hbm = m * k * BF16 + k * n + m * n * BF16 + 8 * n
    extra = {"target": "latency well below the bf16 linear's at both ends", "per_core": f"{m} tokens"}
    inner = _dense_fn(linear_fp8_kernel, args, hbm, float(m * k * n), extra)  # 2mkn / 2: of the fp8 peak

    def fn() -> dict[str, Any]:
        figs = inner()
        ex = figs["extra"]
        lo16, hi16 = bf16_linear_us(m, k, n)
        rows = [r for r in gate(gcfg) if r.name in names]
        ex.update(
            {
                "bf16_linear_us_low": lo16,
                "bf16_linear_us_high": hi16,
                "speedup_vs_bf16_low": round(lo16 / ex["latency_us_low"], 2),
                "speedup_vs_bf16_high": round(hi16 / ex["latency_us_high"], 2),
                "gate": {
                    r.name: {
                        "err_bf16": float(f"{r.err_bf16:.3g}"),
                        "err_fp8": float(f"{r.err_fp8:.3g}"),
                        "bound": float(f"{r.bound:.3g}"),
                        "pass": r.passed,
                    }
                    for r in rows
                },
                "gate_passed": all(r.passed for r in rows),
                "gate_rule": f"err_fp8 <= {gcfg.factor:g} x err_bf16 + {gcfg.floor:.4g} (measured, "
                f"{gcfg.tokens} tokens, perf/fp8_gate.py)",
                "gate_psnr": _video_gate(),
            }
        )
        return figs

    return attach_call(fn, KernelCall(linear_fp8_kernel, args, 1))


def _video_gate() -> str:
    """The decoded-video half of the gate, from the newest ``python -m perf.fp8_psnr --save`` rows."""
    from perf.fp8_psnr import latest_gates

    g = latest_gates().get("fp8_linears")
    if g is None:
        return "not run: python -m perf.fp8_psnr --save (decoded-video PSNR >= 35 dB on the demo model)"
    verdict = "pass" if g["passed"] else "FAIL"
    return (
        f"{verdict}: {g['psnr_db_min']:.1f}-{g['psnr_db_max']:.1f} dB against the bf16 stream (>= "
        f"{g['threshold_db']:g}), demo model, {g['prompts']} prompts x 30 s (measured, perf/fp8_psnr.py)"
    )


def linear_fp8_cases(quick: bool) -> list[tuple[str, str, dict[str, Any], Callable[[], Any]]]:
    """The ``linear_fp8`` rows: every Wan linear shape (ffn_up only with ``quick``)."""
    m = 256 if quick else 3510
    gcfg = GateConfig(tokens=128, text_tokens=64) if quick else GateConfig()
    todo = WAN_LINEARS[:1] if quick else WAN_LINEARS
    out = []
    for name, k, n, names in todo:
        cfg = {"M": m, "K": k, "N": n, "dtype": "fp8 e4m3 (x bf16, out bf16)", "bias": True}
        out.append(("linear_fp8", name, cfg, _fp8_fn(m, k, n, names, gcfg)))
    return out
