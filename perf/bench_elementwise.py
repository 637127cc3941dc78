"""Benchmark cases of the fused elementwise kernels (``nki_kernels.elementwise``) for
``python -m perf.bench_kernels`` (rows ``adaln_norm_modulate``, ``gate_residual``, ``rms_norm``,
``gelu_tanh``, ``gate_residual_adaln``): modelled by cost model v2 over
emulator traces, as the other kernel rows."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from perf.bench_kernels import BF16, _prof, _spec

__all__ = ["elementwise_cases"]


def elementwise_cases(quick: bool) -> list[tuple[str, str, dict[str, Any], Callable[[], Any]]]:
    """Fused elementwise passes (``nki_kernels.elementwise``) at one core's token share of Wan's merged
    forward (3,510 of 28,080 tokens x 1,536 features; 256 tokens with ``quick``), modulation rows of 2
    frames (1,755 tokens each: a core's share starts and ends mid-frame, so 2 equal frames stand in for its
    2.25): bf16 rows, Wan's fp32 residual stream (``*_fp32res``: adaLN fp32 x -> bf16, gate fp32 x + bf16
    y -> fp32; ``gate_residual_adaln``: both in one kernel) and GELU-tanh over the FFN width (8,960).
    ``hbm_roofline_us``: the bytes the pass must move at one core's HBM share (2.9 TB/s / 8)."""
    from nki_kernels import elementwise as ew
    from nki_kernels.elementwise_fused import gate_residual_adaln_kernel

    n, c, g, f = (256, 1536, 2, 8960) if quick else (3510, 1536, 2, 8960)
    act, a32, rows = _spec(n, c), _spec(n, c, dtype="float32"), _spec(g, c, dtype="float32")
    w, rb = _spec(1, c, dtype="float32"), 2 * g * c * 4
    out = []
    for name, var, kernel, args, hbm in (
        ("adaln_norm_modulate", "bf16", ew.adaln_norm_modulate_kernel, (act, rows, rows, 1e-6),
         4 * n * c + rb),
        ("gate_residual", "bf16", ew.gate_residual_kernel, (act, act, rows), 6 * n * c + rb // 2),
        ("rms_norm", "bf16", ew.rms_norm_kernel, (act, w, 1e-6), 2 * n * c * BF16 + c * 4),
        ("adaln_norm_modulate", "fp32res", ew.adaln_norm_modulate_kernel, (a32, rows, rows, 1e-6, "bfloat16"),
         6 * n * c + rb),
        ("gate_residual", "fp32res", ew.gate_residual_kernel, (a32, act, rows), 10 * n * c + rb // 2),
        ("gelu_tanh", "bf16", ew.gelu_tanh_kernel, (_spec(n, f),), 2 * n * f * BF16),
        ("gate_residual_adaln", "fp32res", gate_residual_adaln_kernel, (a32, act, rows, rows, rows, 1e-6),
         12 * n * c + 3 * rb // 2),
    ):  # fmt: skip
        extra = {
            "target": "latency -> hbm_roofline_us (one pass over HBM)",
            "per_core": f"{n} tokens",
            "hbm_roofline_us": round(hbm / (2.9e12 / 8) * 1e6, 1),
        }
        cols = f if name == "gelu_tanh" else c
        cfg = {"N": n, "C": cols, "frames": 0 if name == "gelu_tanh" else g, "dtype": var}
        out.append((name, f"wan_{n}x{cols}_{var}", cfg, _prof(kernel, args, 1, hbm, extra)))
    return out
