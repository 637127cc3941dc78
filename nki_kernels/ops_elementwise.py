"""The fused elementwise ops ``adaln_norm_modulate``, ``gate_residual``, ``rms_norm`` and ``gelu_tanh``
(namespace ``nki_ardiff``):
validation and backend dispatch, re-exported by :mod:`nki_kernels.ops` (same backend rules as every op
there: ``backend`` ``"reference"`` / ``"emulator"`` / ``"neuron"`` / ``None`` = ``$NKI_ARDIFF_BACKEND`` read
at call time; bad input raises before dispatch).

Layouts: activations ``[B, L, C]`` (tokens x features, contiguous), modulation rows ``[B, F, C]`` per frame
(Wan's ``e0 [B, F, 6, C]`` sliced; ``F`` divides ``L``: token ``t`` uses row ``t // (L / F)``) or ``[B, C]``
(one row per sample, i.e. ``F = 1``).

Wan's fp32 residual stream (the original Wan2.1 block runs its modulation and residuals under
``autocast(float32)``): ``adaln_norm_modulate(x_fp32, ..., out_dtype=torch.bfloat16)`` gives the bf16 branch
input, ``gate_residual(x_fp32, y_bf16, gate_fp32)`` the fp32 stream."""

from __future__ import annotations

import math
from typing import Any

import torch

from nki_kernels.op_checks import _check_tensor
from nki_kernels.op_dispatch import _op_backend, _run_backend, entry

__all__ = [
    "adaln_norm_modulate",
    "gate_residual",
    "gate_residual_adaln",
    "gelu_tanh",
    "rms_norm",
    "ELEMENTWISE_MAX_C",
    "FUSED_MAX_C",
]


ELEMENTWISE_MAX_C = {torch.bfloat16: 4608, torch.float32: 2560}
"""Largest feature count ``C`` the kernels' SBUF tiles take per dtype
(``nki_kernels.elementwise.max_features``);
a bf16 / fp32 mix (adaLN's ``out_dtype``) takes the fp32 limit. ``gelu_tanh`` has no limit."""


FUSED_MAX_C = 1536
"""Largest ``C`` of ``gate_residual_adaln`` (``nki_kernels.elementwise_fused.fused_max_features``)."""


def _rows3(m: torch.Tensor) -> torch.Tensor:
    return m.unsqueeze(1) if m.dim() == 2 else m


@torch.library.custom_op("nki_ardiff::adaln_norm_modulate", mutates_args=())
def _adaln_op(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    out_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    if _run_backend(backend) == "reference":
        from reference.elementwise import adaln_norm_modulate as ref

        return ref(x, shift, scale, eps, out_dtype).contiguous()
    od = None if out_dtype == x.dtype else out_dtype  # x's dtype: the kernel's default (unchanged) stream
    return entry("adaln_norm_modulate")(x, _rows3(shift), _rows3(scale), eps, out_dtype=od).contiguous()


@_adaln_op.register_fake
def _(x, shift, scale, eps, out_dtype, backend):
    return x.new_empty(x.shape, dtype=out_dtype)


@torch.library.custom_op("nki_ardiff::gate_residual_adaln", mutates_args=())
def _gate_adaln_op(
    x: torch.Tensor,
    y: torch.Tensor,
    gate: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    out_dtype: torch.dtype,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    if _run_backend(backend) == "reference":
        from reference.elementwise import gate_residual_adaln as ref

        xo, br = ref(x, y, gate, shift, scale, eps, out_dtype)
        return xo.contiguous(), br.contiguous()
    f = max(m.shape[1] if m.dim() == 3 else 1 for m in (gate, shift, scale))
    rows = [_rows3(m).expand(-1, f, -1).contiguous() for m in (gate, shift, scale)]  # one frame count
    xo, br = entry("gate_residual_adaln")(x, y, *rows, eps, out_dtype=out_dtype)
    return xo.contiguous(), br.contiguous()


@_gate_adaln_op.register_fake
def _(x, y, gate, shift, scale, eps, out_dtype, backend):
    return x.new_empty(x.shape), x.new_empty(x.shape, dtype=out_dtype)


@torch.library.custom_op("nki_ardiff::gelu_tanh", mutates_args=())
def _gelu_op(x: torch.Tensor, backend: str) -> torch.Tensor:
    if _run_backend(backend) == "reference":
        from reference.elementwise import gelu_tanh as ref

        return ref(x).contiguous()
    return entry("gelu_tanh")(x).contiguous()


@_gelu_op.register_fake
def _(x, backend):
    return x.new_empty(x.shape)


@torch.library.custom_op("nki_ardiff::gate_residual", mutates_args=())
def _gate_op(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, backend: str) -> torch.Tensor:
    if _run_backend(backend) == "reference":
        from reference.elementwise import gate_residual as ref

        return ref(x, y, gate).contiguous()
    return entry("gate_residual")(x, y, _rows3(gate)).contiguous()


@_gate_op.register_fake
def _(x, y, gate, backend):
    return x.new_empty(x.shape)


@torch.library.custom_op("nki_ardiff::rms_norm", mutates_args=())
def _rms_op(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str) -> torch.Tensor:
    if _run_backend(backend) == "reference":
        from reference.elementwise import rms_norm as ref

        return ref(x, weight, eps).contiguous()
    return entry("rms_norm")(x, weight, eps).contiguous()


@_rms_op.register_fake
def _(x, weight, eps, backend):
    return x.new_empty(x.shape)


def _check_eps(eps: Any) -> None:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be finite and > 0, got {eps}")


def _check(name: str, t: Any, ranks: tuple[int, ...], layout: str) -> None:
    """:func:`~nki_kernels.op_checks._check_tensor` with this family's rank message (``must be <layout>``)."""
    if isinstance(t, torch.Tensor) and t.dim() not in ranks:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
    _check_tensor(name, t, None, layout)


def _check_x(x: Any, limit: bool = True, out_dtype: torch.dtype | None = None) -> None:
    _check("x", x, (3,), "[B, L, C]")
    if x.numel() == 0:
        raise ValueError(f"x must be [B, L, C] with every size >= 1, got shape {tuple(x.shape)}")
    c = x.shape[2]
    top = ELEMENTWISE_MAX_C[x.dtype if out_dtype in (None, x.dtype) else torch.float32]
    if limit and c > top:
        mix = "" if out_dtype in (None, x.dtype) else f" with out_dtype {out_dtype}"
        raise ValueError(f"x has C={c} features; the kernels take at most C={top} for {x.dtype}{mix}")


def _check_rows(name: str, m: Any, x: torch.Tensor) -> None:
    """A modulation tensor ``[B, F, C]`` (F divides L) or ``[B, C]``, x's dtype or fp32, on x's device."""
    _check(name, m, (2, 3), "[B, F, C] or [B, C]")
    b, length, c = x.shape
    f = m.shape[1] if m.dim() == 3 else 1
    if m.shape[0] != b or m.shape[-1] != c:
        raise ValueError(
            f"{name} must be [B={b}, F, C={c}] or [B={b}, C={c}] (x is {tuple(x.shape)}), "
            f"got {tuple(m.shape)}"
        )
    if f < 1 or length % f:
        raise ValueError(
            f"{name} has F={f} frames: F must divide x's L={length} tokens (token t uses row t // (L / F))"
        )
    if m.dtype not in (x.dtype, torch.float32):
        raise TypeError(f"{name} dtype {m.dtype} must be x's dtype {x.dtype} or torch.float32")
    if m.device != x.device:
        raise ValueError(f"{name} is on {m.device} but x is on {x.device}")


def adaln_norm_modulate(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float = 1e-6,
    out_dtype: torch.dtype | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """``LayerNorm(x; eps, no affine) * (1 + scale) + shift`` in one pass (Wan's ``norm1`` / ``norm2`` and
    their adaLN modulation; :mod:`nki_kernels.elementwise`).

    Args:
        x: ``[B, L, C]`` bf16 or fp32, contiguous.
        shift, scale: ``[B, F, C]`` (``F`` divides ``L``; per-frame rows) or ``[B, C]``, x's dtype or fp32,
            both of the same shape and dtype.
        eps: LayerNorm epsilon, finite and > 0 (Wan: 1e-6).
        out_dtype: ``torch.bfloat16`` or ``torch.float32``; ``None`` = x's dtype. An fp32 ``x`` with
            ``torch.bfloat16`` is Wan's fp32 residual stream giving the bf16 branch input.
        backend: see :mod:`nki_kernels.ops`.

    Returns:
        ``[B, L, C]`` in ``out_dtype``: fp32 statistics (population variance) and arithmetic. Same dtype in
        and out: the kernels round ``1 + scale`` and ``shift`` to x's dtype first (and, in bf16, the
        product before adding ``shift``). Mixed dtypes: modulation and arithmetic in fp32, one rounding.

    Limits: ``C <= 4608`` (bf16) / ``2560`` (fp32 or mixed) (:data:`ELEMENTWISE_MAX_C`).
    """
    if out_dtype is not None and out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"out_dtype must be None, torch.bfloat16 or torch.float32, got {out_dtype!r}")
    _check_x(x, out_dtype=out_dtype)
    _check_rows("shift", shift, x)
    _check_rows("scale", scale, x)
    if tuple(scale.shape) != tuple(shift.shape) or scale.dtype != shift.dtype:
        raise ValueError(
            f"scale {tuple(scale.shape)} {scale.dtype} must have shift's shape and dtype "
            f"{tuple(shift.shape)} {shift.dtype} (one modulation row per frame for both)"
        )
    _check_eps(eps)
    od = x.dtype if out_dtype is None else out_dtype
    return _adaln_op(x, shift, scale, float(eps), od, _op_backend(backend))


def gate_residual(
    x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, *, backend: str | None = None
) -> torch.Tensor:
    """``x + gate * y`` in one pass (Wan's gated residuals after self-attention and the FFN;
    :mod:`nki_kernels.elementwise`).

    Args:
        x: ``[B, L, C]`` residual stream, bf16 or fp32, contiguous.
        y: ``[B, L, C]`` branch output, contiguous: x's dtype, or bf16 with an fp32 ``x`` (Wan's fp32
            residual stream plus a bf16 branch).
        gate: ``[B, F, C]`` (``F`` divides ``L``) or ``[B, C]``, x's dtype or fp32.
        backend: see :mod:`nki_kernels.ops`.

    Returns:
        ``[B, L, C]`` in ``x.dtype`` (fp32 arithmetic, one rounding; the kernels round ``gate`` to x's
        dtype first: with an fp32 ``x``, ``x + fp32(gate * y)`` exactly as Wan's fp32 autocast).

    Limits: ``C <= 4608`` (bf16) / ``2560`` (fp32) (:data:`ELEMENTWISE_MAX_C`).
    """
    _check_x(x)
    _check("y", y, (3,), "[B, L, C]")
    if tuple(y.shape) != tuple(x.shape):
        raise ValueError(f"y shape {tuple(y.shape)} must equal x shape {tuple(x.shape)}")
    if y.dtype != x.dtype and not (x.dtype == torch.float32 and y.dtype == torch.bfloat16):
        raise TypeError(f"y dtype {y.dtype} must match x dtype {x.dtype} (or be bfloat16 with a float32 x)")
    if y.device != x.device:
        raise ValueError(f"y is on {y.device} but x is on {x.device}")
    _check_rows("gate", gate, x)
    return _gate_op(x, y, gate, _op_backend(backend))


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, backend: str | None = None
) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the feature dim in one pass (Wan's RMSNorm of q / k
    over all heads' features; :mod:`nki_kernels.elementwise`).

    Args:
        x: ``[B, L, C]`` bf16 or fp32, contiguous.
        weight: ``[C]``, x's dtype or fp32, contiguous.
        eps: finite and > 0 (Wan: 1e-6).
        backend: see :mod:`nki_kernels.ops`.

    Returns:
        ``[B, L, C]`` in ``x.dtype``: fp32 statistics and arithmetic, one rounding (the kernels round
        ``weight`` to x's dtype first).

    Limits: ``C <= 4608`` (bf16) / ``2560`` (fp32) (:data:`ELEMENTWISE_MAX_C`).
    """
    _check_x(x)
    _check("weight", weight, (1,), "[C]")
    if weight.shape[0] != x.shape[2]:
        raise ValueError(
            f"weight must be [C={x.shape[2]}] (x is {tuple(x.shape)}), got {tuple(weight.shape)}"
        )
    if weight.dtype not in (x.dtype, torch.float32):
        raise TypeError(f"weight dtype {weight.dtype} must be x's dtype {x.dtype} or torch.float32")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but x is on {x.device}")
    _check_eps(eps)
    return _rms_op(x, weight, float(eps), _op_backend(backend))


def gelu_tanh(x: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """``0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))`` elementwise in one pass (Wan's FFN activation
    ``nn.GELU(approximate="tanh")``; :func:`nki_kernels.elementwise.gelu_tanh_kernel`).

    Args:
        x: ``[B, L, C]`` bf16 or fp32, contiguous, every size >= 1 (any ``C``: the kernel tiles columns).
        backend: see :mod:`nki_kernels.ops`.

    Returns:
        ``[B, L, C]`` in ``x.dtype``, fp32 arithmetic, one rounding.
    """
    _check_x(x, limit=False)
    return _gelu_op(x, _op_backend(backend))


def gate_residual_adaln(
    x: torch.Tensor,
    y: torch.Tensor,
    gate: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float = 1e-6,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x_new = x + gate * y`` and ``adaln_norm_modulate(x_new, shift, scale, eps, out_dtype)`` in one
    pass (Wan's fp32 residual update followed by the next norm: ``norm3`` with ``shift = bias``, ``scale =
    weight - 1``, ``norm2``, the next block's ``norm1``; :mod:`nki_kernels.elementwise_fused`). Equal to
    :func:`gate_residual` then :func:`adaln_norm_modulate` (bitwise on the emulator), without reading
    ``x_new`` back.

    Args:
        x: ``[B, L, C]`` fp32 residual stream, contiguous.
        y: ``[B, L, C]`` bf16 branch output, contiguous.
        gate, shift, scale: ``[B, F, C]`` (``F`` divides ``L``) or ``[B, C]``, fp32, each its own frame
            count (rows are repeated to the largest).
        eps: LayerNorm epsilon, finite and > 0.
        out_dtype: the branch input's dtype, ``torch.bfloat16`` (default) or ``torch.float32``.
        backend: see :mod:`nki_kernels.ops`.

    Returns:
        ``(x_new fp32, branch in out_dtype)``, each ``[B, L, C]``.

    Limits: ``C <= 1536`` (:data:`FUSED_MAX_C`; Wan2.1-1.3B's width).
    """
    _check_x(x, limit=False)
    if x.dtype != torch.float32:
        raise TypeError(f"x dtype {x.dtype} must be torch.float32 (the fp32 residual stream)")
    if x.shape[2] > FUSED_MAX_C:
        raise ValueError(f"x has C={x.shape[2]} features; gate_residual_adaln takes at most C={FUSED_MAX_C}")
    _check("y", y, (3,), "[B, L, C]")
    if tuple(y.shape) != tuple(x.shape):
        raise ValueError(f"y shape {tuple(y.shape)} must equal x shape {tuple(x.shape)}")
    if y.dtype != torch.bfloat16:
        raise TypeError(f"y dtype {y.dtype} must be torch.bfloat16 (the branch output)")
    if y.device != x.device:
        raise ValueError(f"y is on {y.device} but x is on {x.device}")
    for name, m in (("gate", gate), ("shift", shift), ("scale", scale)):
        _check_rows(name, m, x)
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype!r}")
    _check_eps(eps)
    fs = {m.shape[1] if m.dim() == 3 else 1 for m in (gate, shift, scale)}
    if any(max(fs) % f for f in fs):
        raise ValueError(f"gate, shift and scale frame counts {sorted(fs)} must each divide the largest")
    return _gate_adaln_op(x, y, gate, shift, scale, float(eps), out_dtype, _op_backend(backend))
