"""Reference linear layers in plain PyTorch (the op sets of :func:`nki_kernels.ops.linear` and
:func:`nki_kernels.ops.linear_fp8`; same parameter names): ``out = x @ weight_t (+ bias)`` and its FP8
form with per-token activation and per-output-channel weight scales."""

from __future__ import annotations

import torch

__all__ = [
    "AMAX_FLOOR",
    "E4M3_MAX",
    "linear",
    "linear_fp8",
    "quantize_activation_fp8",
    "quantize_weight_fp8",
]

E4M3_MAX = 240.0
"""Largest finite value of NeuronCore-v3's ``float8_e4m3`` (the type of TensorE's double-row matmuls).
Its values in ``[-240, 240]`` are exactly torch's ``float8_e4m3fn`` values there (same exponent bias and
mantissa width; only the encodings above 240 differ), so ``float8_e4m3fn`` tensors carry them here."""

AMAX_FLOOR = 2.0**-96
"""Smallest absmax a scale is computed from (an all-zero row or column quantises to zeros)."""


def linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight_t + bias`` with fp32 accumulation, one rounding to ``x.dtype`` at the end.

    Args:
        x: ``[..., K]`` (tokens along the leading dims), any float dtype.
        weight_t: ``[K, N]``: ``nn.Linear.weight.T`` (in-features x out-features).
        bias: ``[N]`` or ``None``; added in fp32 (float64 when ``x`` is float64) before the rounding.

    Returns:
        ``[..., N]`` in ``x.dtype``.  Computed in float64 when ``x`` is float64 (a baseline), else fp32.
    """
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = x.to(acc) @ weight_t.to(acc)
    if bias is not None:
        out = out + bias.to(acc)
    return out.to(x.dtype)


def _scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, inverse)`` from an fp32 absmax: ``a = max(amax, AMAX_FLOOR)``, ``a / 240`` and ``240 / a``
    (two correctly rounded fp32 divisions, as the kernel's VectorE computes them)."""
    a = torch.clamp_min(amax.to(torch.float32), AMAX_FLOOR)
    # a tensor numerator: torch evaluates ``scalar / tensor`` as ``reciprocal(tensor) * scalar`` (2 roundings)
    return a / E4M3_MAX, torch.full_like(a, E4M3_MAX) / a


def quantize_weight_fp8(weight_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a linear weight to e4m3 with one scale per output channel (once, offline, when the model
    loads).

    Args:
        weight_t: ``[K, N]`` (``nn.Linear.weight.T``), any float dtype.

    Returns:
        ``(weight_q, w_scale)``: ``weight_q`` ``[K, N]`` ``torch.float8_e4m3fn`` (contiguous) with values in
        ``[-240, 240]`` (e4m3 values: what NeuronCore-v3's ``float8_e4m3`` holds), ``w_scale`` ``[N]`` fp32,
        such that ``weight_q.float() * w_scale ~ weight_t``.  Per column ``n``: ``a = max(max_k |w[k, n]|,
        AMAX_FLOOR)``, ``w_scale = a / 240``, ``weight_q = e4m3(w * (240 / a))`` (fp32 product, round to
        nearest even).
    """
    if not isinstance(weight_t, torch.Tensor) or weight_t.dim() != 2 or not weight_t.is_floating_point():
        got = (
            f"{tuple(weight_t.shape)} {weight_t.dtype}"
            if isinstance(weight_t, torch.Tensor)
            else type(weight_t).__name__
        )
        raise ValueError(f"weight_t must be a floating-point [K, N] tensor, got {got}")
    w = weight_t.to(torch.float32)
    scale, inv = _scales(w.abs().amax(dim=0))
    q = (w * inv).to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def quantize_activation_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token e4m3 quantisation of activations as :func:`nki_kernels.linear_fp8.linear_fp8_kernel` does
    it on chip: per row ``a = max(max_k |x[..., k]|, AMAX_FLOOR)`` (fp32), ``x_scale = a / 240``,
    ``x_q = e4m3(x * (240 / a))`` (fp32 product, round to nearest even).

    Args:
        x: ``[..., K]``, any float dtype.

    Returns:
        ``(x_q [..., K] float8_e4m3fn, x_scale [...] fp32)``.
    """
    xf = x.to(torch.float32)
    scale, inv = _scales(xf.abs().amax(dim=-1))
    return (xf * inv.unsqueeze(-1)).to(torch.float8_e4m3fn), scale


def linear_fp8(
    x: torch.Tensor, weight_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """FP8 linear: ``((q(x) @ weight_q) * x_scale) * w_scale + bias``, one rounding to ``x.dtype``.

    Args:
        x: ``[..., K]`` (tokens along the leading dims), bf16 or fp32; quantised per token by
            :func:`quantize_activation_fp8`.
        weight_q: ``[K, N]`` ``float8_e4m3fn`` with values in ``[-240, 240]`` (from
            :func:`quantize_weight_fp8`).
        w_scale: ``[N]`` per-output-channel scales (fp32).
        bias: ``[N]`` or ``None``; added in fp32.

    Returns:
        ``[..., N]`` in ``x.dtype``: the fp8 x fp8 products are exact in fp32; they are accumulated in fp32
        (torch's order, which the kernel's PSUM order differs from), then scaled by ``x_scale`` and by
        ``w_scale`` and the bias added, each an fp32 operation.
    """
    xq, xs = quantize_activation_fp8(x)
    acc = xq.to(torch.float32) @ weight_q.to(torch.float32)
    out = (acc * xs.unsqueeze(-1)) * w_scale.to(torch.float32)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype)
