"""``python -m perf.e2e.elementwise_table [float32|bfloat16]``: the DiT block's elementwise components per
layer on one core of Wan2.1-1.3B at 480x832, as separate passes and as the fused kernels the chunk model
charges (:mod:`perf.e2e.elementwise`), both ends of cost model v2 (*modelled*)."""

from __future__ import annotations

import math

from perf.e2e.elementwise import FUSED, RESIDUALS, separate_pass

__all__ = ["layer_table"]


def layer_table(residual: str = "float32", tokens: int = 3510) -> list[str]:
    """Markdown rows: every component's separate pass vs its fused kernel calls on one core's ``tokens``
    of Wan2.1-1.3B at 480x832 (per layer, µs without the fixed per-kernel time, both ends; *modelled*)."""
    from perf.e2e.components import contended_s
    from perf.e2e.kernels import TracedKernels
    from perf.e2e.params import E2EParams
    from rolling_forcing.config import get_preset

    m, p = get_preset("wan2.1-1.3b"), E2EParams()
    k, tpf = TracedKernels(p), math.prod(get_preset("wan2.1-1.3b").grid_hw)
    rows = ["| component | separate pass | fused (optimistic - pessimistic) | calls | busiest engines (µs) |"]
    rows.append("|---|---|---|---|---|")
    tot = [0.0, 0.0, 0.0, 0]
    for name in FUSED:
        c, calls = k.elementwise(name, tokens, m.dim, m.ffn_dim, tpf, residual)
        elems, rb, wb, ops, eng = separate_pass(name, tokens, m.dim, m.ffn_dim, residual)
        hz = p.vector_hz if eng == "vector" else p.scalar_hz
        sep = max(elems * (rb + wb) / p.hbm_Bps_per_core, elems * ops / (p.lanes * hz))
        lo, hi = contended_s(c, p.at("optimistic")), contended_s(c, p.at("pessimistic"))
        busy = sorted(c.engine_busy_s.items(), key=lambda kv: -kv[1])[:3]
        eng_s = ", ".join(f"{e} {v * 1e6:.0f}" for e, v in busy)
        rows.append(f"| {name} | {sep * 1e6:.1f} | {lo * 1e6:.1f} - {hi * 1e6:.1f} | {calls} | {eng_s} |")
        tot = [tot[0] + sep, tot[1] + lo, tot[2] + hi, tot[3] + calls]
    rows.append(
        f"| **sum per layer** | **{tot[0] * 1e6:.1f}** | **{tot[1] * 1e6:.1f} - {tot[2] * 1e6:.1f}** | "
        f"**{tot[3]}** | |"
    )
    return rows


if __name__ == "__main__":
    import sys

    for res in sys.argv[1:] or RESIDUALS:
        print(f"\nresidual stream {res} (modelled, one core, per layer, µs):")
        print("\n".join(layer_table(res)))
