"""The DiT block's elementwise work as the project's fused kernels (``nki_kernels/elementwise.py``), priced
by cost model v2 over trace-only emulator runs (*modelled*).

Wan's block, with the original Wan2.1's precision (modulation and residuals under ``autocast(float32)``:
the residual stream ``x`` is fp32, every branch (linear / attention output) bf16), one core's
``tokens`` x ``dim`` share; each component of the chunk model's list maps to kernel calls:

==================  ===============================================================  =====
component           kernel call(s) on one core                                       calls
==================  ===============================================================  =====
adaln_norm1_mod     ``adaln_norm_modulate`` fp32 x -> bf16, per-frame rows              1
rmsnorm_qk          ``rms_norm`` bf16 on q, then on k                                   2
gate_residual_sa    ``gate_residual`` fp32 x + fp32 gate x bf16 y -> fp32, per frame    1
norm3_affine        ``adaln_norm_modulate`` fp32 x -> bf16, one row (bias, weight - 1)  1
rmsnorm_cross_q     ``rms_norm`` bf16                                                   1
residual_cross      ``gate_residual`` fp32 + bf16 with a ones gate row                  1
adaln_norm2_mod     as adaln_norm1_mod                                                  1
gelu_tanh           ``gelu_tanh`` bf16 over ``tokens`` x ``ffn_dim``                    1
gate_residual_ffn   as gate_residual_sa                                                 1
==================  ===============================================================  =====

**Residual + norm pairs** (:data:`PAIRS`, fp32 residual stream only): where a residual update feeds the
next norm, one ``gate_residual_adaln`` call (``nki_kernels/elementwise_fused.py``: 12 instead of 16 bytes
per element, one call instead of two) replaces both components: ``gate_residual_sa+norm3_affine`` and
``residual_cross+adaln_norm2_mod`` in every layer, ``gate_residual_ffn+adaln_norm1_mod`` (the FFN residual
with the NEXT layer's ``norm1``) in all but the last; the first layer's ``adaln_norm1_mod`` and the last
layer's ``gate_residual_ffn`` stay single calls once per forward (:func:`elementwise_plan`).

Frames: a core's contiguous share of ``tokens`` can touch ``frames_touched(tokens, tokens_per_frame)``
frames (it starts anywhere in a frame); the per-frame kernels are traced with that many equal frames over
``tokens`` rounded up to a multiple of it (each frame costs one modulation-row broadcast, and frame ends cut
partial tiles), the worst alignment.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FUSED",
    "PAIRS",
    "RESIDUALS",
    "FusedCall",
    "compulsory_bytes",
    "elementwise_plan",
    "frames_touched",
    "fused_calls",
    "separate_pass",
    "trace_args",
]


@dataclass(frozen=True)
class FusedCall:
    """One fused kernel call: ``kernel`` (name in ``nki_kernels.elementwise``), the per-core shape
    ``(tokens, features)``, ``frames`` modulation rows (0 = none), ``x_dtype`` / ``y_dtype`` / ``out_dtype``
    (``"bfloat16"`` / ``"float32"``; ``""`` = no such operand / x's dtype)."""

    kernel: str
    tokens: int
    features: int
    frames: int = 0
    x_dtype: str = "bfloat16"
    y_dtype: str = ""
    out_dtype: str = ""


FUSED = (
    "adaln_norm1_mod",
    "rmsnorm_qk",
    "gate_residual_sa",
    "norm3_affine",
    "rmsnorm_cross_q",
    "residual_cross",
    "adaln_norm2_mod",
    "gelu_tanh",
    "gate_residual_ffn",
)
"""The chunk model's elementwise components, in block order (all of them are fused kernel calls)."""


PAIRS = {
    "gate_residual_sa+norm3_affine": ("gate_residual_sa", "norm3_affine"),
    "residual_cross+adaln_norm2_mod": ("residual_cross", "adaln_norm2_mod"),
    "gate_residual_ffn+adaln_norm1_mod": ("gate_residual_ffn", "adaln_norm1_mod"),
}
"""Fused residual + next-norm components -> the two components each replaces (the last pair's norm is the
next layer's ``norm1``)."""


def elementwise_plan(num_layers: int, pairs: bool) -> list[tuple[str, int, bool]]:
    """``(component, calls per forward, per_layer)`` of the elementwise work of ``num_layers`` blocks (a
    pure function): the 9 components of :data:`FUSED` once per layer, or with ``pairs`` the residual + norm
    pairs of :data:`PAIRS` (``L``, ``L`` and ``L - 1`` calls), the unpaired components once per layer and
    the first ``adaln_norm1_mod`` and the last ``gate_residual_ffn`` once per forward."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"elementwise_plan: num_layers must be an int >= 1, got {num_layers!r}")
    L = num_layers
    if not pairs:
        return [(name, L, True) for name in FUSED]
    plan = [(name, L, True) for name in ("rmsnorm_qk", "rmsnorm_cross_q", "gelu_tanh")]
    plan += [("gate_residual_sa+norm3_affine", L, True), ("residual_cross+adaln_norm2_mod", L, True)]
    if L > 1:
        plan.append(("gate_residual_ffn+adaln_norm1_mod", L - 1, True))
    return plan + [("adaln_norm1_mod", 1, False), ("gate_residual_ffn", 1, False)]


def compulsory_bytes(name: str, tokens: int, dim: int, ffn_dim: int, residual: str = "float32") -> int:
    """HBM bytes one call of component ``name`` must move on one core (every input read once, every output
    written once): :func:`separate_pass`'s, and for a pair the sum of its two parts less the residual's
    re-read (``tokens x dim x`` the residual's itemsize)."""
    if name in PAIRS:
        a, b = PAIRS[name]
        r = _check_residual(residual)
        return (
            compulsory_bytes(a, tokens, dim, ffn_dim, residual)
            + compulsory_bytes(b, tokens, dim, ffn_dim, residual)
            - tokens * dim * r
        )
    elems, rb, wb, _, _ = separate_pass(name, tokens, dim, ffn_dim, residual)
    return elems * (rb + wb)


RESIDUALS = ("float32", "bfloat16")
"""Residual-stream dtypes: ``"float32"`` (the original Wan2.1 block, modulation and residuals under
``autocast(float32)``; the chunk model's default) or ``"bfloat16"`` (the causal repos' block, which
``rolling_forcing/model.py`` follows: everything in the activation dtype)."""


def _check_residual(residual: str) -> int:
    if residual not in RESIDUALS:
        raise ValueError(f"residual must be one of {RESIDUALS}, got {residual!r}")
    return 4 if residual == "float32" else 2


def separate_pass(
    name: str, tokens: int, dim: int, ffn_dim: int, residual: str = "float32"
) -> tuple[int, int, int, int, str]:
    """``(elements, read B, write B, ALU ops per element, engine)`` of component ``name`` as one separate
    pass over HBM (the unfused accounting: residual stream in ``residual``, bf16 branches; a provider
    without fused kernels is charged ``max(HBM bytes / per-core HBM share, elements x ops / (128 lanes x
    clock))``). The bytes are also every fused call's compulsory traffic (the roofline's byte side)."""
    r = _check_residual(residual)
    n, d, f = tokens, dim, ffn_dim
    table = {  # elements, read B, write B, ALU ops per element, engine
        "adaln_norm1_mod": (n * d, r, 2, 4, "vector"),
        "rmsnorm_qk": (2 * n * d, 2, 2, 3, "vector"),
        "gate_residual_sa": (n * d, r + 2, r, 2, "vector"),
        "norm3_affine": (n * d, r, 2, 4, "vector"),
        "rmsnorm_cross_q": (n * d, 2, 2, 3, "vector"),
        "residual_cross": (n * d, r + 2, r, 1, "vector"),
        "adaln_norm2_mod": (n * d, r, 2, 4, "vector"),
        "gelu_tanh": (n * f, 2, 2, 1, "scalar"),
        "gate_residual_ffn": (n * d, r + 2, r, 2, "vector"),
    }
    if name not in table:
        raise ValueError(f"separate_pass: name must be one of {FUSED}, got {name!r}")
    return table[name]


def frames_touched(tokens: int, tokens_per_frame: int) -> int:
    """Most frames a contiguous run of ``tokens`` tokens can touch with ``tokens_per_frame`` tokens per
    frame (a pure function): ``ceil((tokens - 1) / tpf) + 1``, at most ``tokens``."""
    if min(tokens, tokens_per_frame) < 1:
        raise ValueError(
            f"frames_touched: need tokens >= 1 and tokens_per_frame >= 1, got {tokens}, {tokens_per_frame}"
        )
    return min(tokens, math.ceil((tokens - 1) / tokens_per_frame) + 1)


def fused_calls(
    name: str, tokens: int, dim: int, ffn_dim: int, tokens_per_frame: int, residual: str = "float32"
) -> list[FusedCall]:
    """The kernel calls of component ``name`` (one of :data:`FUSED`) on a core's ``tokens`` (module
    docstring table) with the residual stream in ``residual`` (``"bfloat16"``: the same kernels with x,
    y and out all bf16). Raises ``ValueError`` for any other name or residual dtype."""
    _check_residual(residual)
    bf = "bfloat16"
    r, o, y = residual, ("" if residual == bf else bf), ("" if residual == bf else bf)
    g = frames_touched(tokens, tokens_per_frame)
    adaln = FusedCall("adaln_norm_modulate", tokens, dim, g, r, "", o)
    gate = FusedCall("gate_residual", tokens, dim, g, r, y)
    rms = FusedCall("rms_norm", tokens, dim)
    table: dict[str, list[FusedCall]] = {
        "adaln_norm1_mod": [adaln],
        "rmsnorm_qk": [rms, rms],
        "gate_residual_sa": [gate],
        "norm3_affine": [FusedCall("adaln_norm_modulate", tokens, dim, 1, r, "", o)],
        "rmsnorm_cross_q": [rms],
        "residual_cross": [FusedCall("gate_residual", tokens, dim, 1, r, y)],
        "adaln_norm2_mod": [adaln],
        "gelu_tanh": [FusedCall("gelu_tanh", tokens, ffn_dim)],
        "gate_residual_ffn": [gate],
    }
    if residual == "float32":
        pair = FusedCall("gate_residual_adaln", tokens, dim, g, r, bf, bf)
        table.update({p: [pair] for p in PAIRS})
    if name not in table:
        known = FUSED + (tuple(PAIRS) if residual == "float32" else ())
        raise ValueError(f"fused_calls: name must be one of {known} (residual {residual}), got {name!r}")
    return table[name]


def trace_args(call: FusedCall, spec: Callable[..., Any]) -> tuple[Any, tuple[Any, ...]]:
    """``(kernel, args)`` of a trace-only emulator run of ``call`` (``spec(shape, dtype)`` builds the
    emulator's tensor specs): ``tokens`` rounded up to a multiple of ``frames``."""
    from nki_kernels import elementwise as ew

    c = call.features
    n = math.ceil(call.tokens / max(call.frames, 1)) * max(call.frames, 1)
    x = spec((n, c), call.x_dtype)
    if call.kernel == "adaln_norm_modulate":
        rows = spec((call.frames, c), "float32")
        return ew.adaln_norm_modulate_kernel, (x, rows, rows, 1e-6, call.out_dtype or None)
    if call.kernel == "gate_residual":
        return ew.gate_residual_kernel, (
            x,
            spec((n, c), call.y_dtype or call.x_dtype),
            spec((call.frames, c), "float32"),
        )
    if call.kernel == "rms_norm":
        return ew.rms_norm_kernel, (x, spec((1, c), "float32"), 1e-6)
    if call.kernel == "gelu_tanh":
        return ew.gelu_tanh_kernel, (x,)
    if call.kernel == "gate_residual_adaln":
        from nki_kernels.elementwise_fused import gate_residual_adaln_kernel

        rows = spec((call.frames, c), "float32")
        y = spec((n, c), call.y_dtype)
        return gate_residual_adaln_kernel, (x, y, rows, rows, rows, 1e-6, call.out_dtype or "bfloat16")
    raise ValueError(f"trace_args: unknown kernel {call.kernel!r}")
