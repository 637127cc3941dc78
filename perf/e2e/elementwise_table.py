"""``python -m perf.e2e.elementwise_table [float32|bfloat16]``: the DiT block's elementwise work on one
core of Wan2.1-1.3B at 480x832 (3,510 tokens: the merged forward on 8 cores), as separate passes and as the
fused kernels the chunk model charges (:mod:`perf.e2e.elementwise`), both ends of cost model v2, per call
and per forward of 30 layers (*modelled*; the fixed per-kernel time is not included: the chunk model
charges it per kernel call)."""

from __future__ import annotations

import math

from perf.e2e.elementwise import PAIRS, RESIDUALS, elementwise_plan, separate_pass

__all__ = ["layer_table"]


def layer_table(residual: str = "float32", tokens: int = 3510) -> list[str]:
    """Markdown rows: every item of :func:`~perf.e2e.elementwise.elementwise_plan` (with the residual +
    norm pairs for an fp32 residual stream, without for bf16) on one core's ``tokens``: the separate
    passes it stands for, its fused kernel time at both ends (µs per call), its calls per forward and
    kernel calls per call; a last row sums per forward (ms). *Modelled*."""
    from perf.e2e.components import contended_s
    from perf.e2e.kernels import TracedKernels
    from perf.e2e.params import E2EParams
    from rolling_forcing.config import get_preset

    m, p = get_preset("wan2.1-1.3b"), E2EParams()
    k, tpf = TracedKernels(p), math.prod(m.grid_hw)
    rows = [
        "| component | separate passes, µs | fused, µs (optimistic - pessimistic) | calls per forward | "
        "kernel calls per call | busiest engines (µs) |",
        "|---|---|---|---|---|---|",
    ]
    sep_t = lo_t = hi_t = 0.0
    launches_t = 0
    for name, calls, _ in elementwise_plan(m.num_layers, pairs=residual == "float32"):
        c, launches = k.elementwise(name, tokens, m.dim, m.ffn_dim, tpf, residual)
        sep = 0.0
        for part in PAIRS.get(name, (name,)):
            elems, rb, wb, ops, eng = separate_pass(part, tokens, m.dim, m.ffn_dim, residual)
            hz = p.vector_hz if eng == "vector" else p.scalar_hz
            sep += max(elems * (rb + wb) / p.hbm_Bps_per_core, elems * ops / (p.lanes * hz))
        lo, hi = contended_s(c, p.at("optimistic")), contended_s(c, p.at("pessimistic"))
        busy = sorted(c.engine_busy_s.items(), key=lambda kv: -kv[1])[:3]
        eng_s = ", ".join(f"{e} {v * 1e6:.0f}" for e, v in busy)
        rows.append(
            f"| {name} | {sep * 1e6:.1f} | {lo * 1e6:.1f} - {hi * 1e6:.1f} | {calls} | {launches} | {eng_s} |"
        )
        sep_t, lo_t, hi_t = sep_t + sep * calls, lo_t + lo * calls, hi_t + hi * calls
        launches_t += launches * calls
    rows.append(
        f"| **per forward, ms** | separate: **{sep_t * 1e3:.2f}** ({9 * m.num_layers} calls) | "
        f"**{lo_t * 1e3:.2f} - {hi_t * 1e3:.2f}** ({launches_t} calls) | | | |"
    )
    return rows


if __name__ == "__main__":
    import sys

    for res in sys.argv[1:] or RESIDUALS:
        print(
            f"\nresidual stream {res} (modelled, one core of 8, 3,510 tokens, without fixed per-call time):"
        )
        print("\n".join(layer_table(res)))
