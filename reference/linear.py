"""Reference linear layer: ``out = x @ weight_t (+ bias)`` in plain PyTorch (the op set of
:func:`nki_kernels.ops.linear`; same parameter names)."""

from __future__ import annotations

import torch

__all__ = ["linear"]


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
