"""Reference fused elementwise passes of the Wan DiT block in plain PyTorch (the op sets of
:func:`nki_kernels.ops.adaln_norm_modulate`, :func:`nki_kernels.ops.gate_residual`,
:func:`nki_kernels.ops.rms_norm` and :func:`nki_kernels.ops.gelu_tanh`; same parameter names).

Modulation rows are per frame, as Wan's ``e0 [B, F, 6, C]`` gives them: with ``x [B, L, C]`` and a
modulation tensor ``[B, F, C]`` (``F`` divides ``L``), token ``t`` uses row ``t // (L / F)``. ``F = 1`` (or a
``[B, C]`` tensor) is a per-sample modulation, ``F = L`` a per-token one.
"""

from __future__ import annotations

import torch

__all__ = ["adaln_norm_modulate", "gate_residual", "gate_residual_adaln", "gelu_tanh", "rms_norm"]


def _acc(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _per_token(m: torch.Tensor, length: int, acc: torch.dtype) -> torch.Tensor:
    """``[B, F, C]`` (or ``[B, C]``: ``F = 1``) -> ``[B, L, C]``: each frame row over its ``L / F`` tokens."""
    m = m.unsqueeze(1) if m.dim() == 2 else m
    return m.to(acc).repeat_interleave(length // m.shape[1], dim=1)


def adaln_norm_modulate(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float = 1e-6,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``LayerNorm(x; eps, no affine) * (1 + scale) + shift`` over the last dim, per frame.

    Args:
        x: ``[B, L, C]``, any float dtype.
        shift, scale: ``[B, F, C]`` with ``F`` dividing ``L`` (Wan's per-frame modulation rows), or
            ``[B, C]`` (one row per sample).
        eps: LayerNorm epsilon (Wan: 1e-6).
        out_dtype: the result's dtype (``None``: ``x.dtype``); Wan's fp32 residual stream gives its bf16
            branch input with ``out_dtype=torch.bfloat16``.

    Returns:
        ``[B, L, C]`` in ``out_dtype``; statistics and arithmetic in fp32 (float64 when ``x`` is float64: a
        baseline), one rounding at the end (population variance, as ``nn.LayerNorm``).
    """
    acc = _acc(x)
    xf = x.to(acc)
    mean = xf.mean(dim=-1, keepdim=True)
    var = (xf - mean).pow(2).mean(dim=-1, keepdim=True)
    xn = (xf - mean) * torch.rsqrt(var + eps)
    length = x.shape[1]
    out = xn * (1 + _per_token(scale, length, acc)) + _per_token(shift, length, acc)
    return out.to(x.dtype if out_dtype is None else out_dtype)


def gate_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x + gate * y`` (Wan's gated residual), per frame.

    Args:
        x: ``[B, L, C]`` residual stream, any float dtype (Wan: fp32).
        y: ``[B, L, C]`` branch output (attention or FFN; Wan: bf16 under an fp32 ``x``).
        gate: ``[B, F, C]`` with ``F`` dividing ``L``, or ``[B, C]``.

    Returns:
        ``[B, L, C]`` in ``x.dtype``, computed in fp32 (float64 for float64 ``x``), one rounding.
    """
    acc = _acc(x)
    return (x.to(acc) + _per_token(gate, x.shape[1], acc) * y.to(acc)).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim (Wan's RMSNorm of q / k).

    Args:
        x: ``[B, L, C]``, any float dtype.
        weight: ``[C]``.
        eps: epsilon (Wan: 1e-6).

    Returns:
        ``[B, L, C]`` in ``x.dtype``, computed in fp32 (float64 for float64 ``x``), one rounding (Wan's
        module rounds to x's dtype before the weight multiply).
    """
    acc = _acc(x)
    xf = x.to(acc)
    return (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.to(acc)).to(x.dtype)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """``0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))`` elementwise (Wan's FFN activation,
    ``nn.GELU(approximate="tanh")``).

    Args:
        x: any shape, any float dtype.

    Returns:
        x's shape and dtype, computed in fp32 (float64 for float64 ``x``), one rounding.
    """
    acc = _acc(x)
    return torch.nn.functional.gelu(x.to(acc), approximate="tanh").to(x.dtype)


def gate_residual_adaln(
    x: torch.Tensor,
    y: torch.Tensor,
    gate: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float = 1e-6,
    out_dtype: torch.dtype | None = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x_new = x + gate * y`` and the next norm's branch input ``adaln_norm_modulate(x_new, shift, scale,
    eps, out_dtype)`` (Wan's residual update followed by ``norm3`` / ``norm2`` / the next block's ``norm1``).

    Args:
        x: ``[B, L, C]`` residual stream (Wan: fp32).
        y: ``[B, L, C]`` branch output (Wan: bf16).
        gate, shift, scale: ``[B, F, C]`` (``F`` divides ``L``) or ``[B, C]``.
        eps: LayerNorm epsilon.
        out_dtype: the branch input's dtype (``None``: x's).

    Returns:
        ``(x_new in x.dtype, branch in out_dtype)``: :func:`gate_residual` then :func:`adaln_norm_modulate`
        on the rounded ``x_new``.
    """
    x_new = gate_residual(x, y, gate)
    return x_new, adaln_norm_modulate(x_new, shift, scale, eps, out_dtype)
