"""Reference causal 3-D convolution (Wan VAE's ``WanCausalConv3d`` with a streaming cache), plain PyTorch;
the op set of :func:`nki_kernels.ops.conv3d_causal` (same parameter names)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["conv3d_causal"]


def conv3d_causal(
    x: torch.Tensor,
    weight_taps: torch.Tensor,
    bias: torch.Tensor | None,
    ksize: tuple[int, int, int],
    cache: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal convolution over time, zero-padded ``(kh // 2, kw // 2)`` in space, stride 1.

    Args:
        x: ``[B, C_in, T, H, W]``.
        weight_taps: ``[kt * kh * kw, C_in, C_out]`` (tap ``(a * kh + b) * kw + c`` = torch weight
            ``[:, :, a, b, c].T``).
        bias: ``[C_out]`` or ``None``.
        ksize: ``(kt, kh, kw)``.
        cache: ``[B, C_in, kt - 1, H, W]``, the previous input's last ``kt - 1`` frames, or ``None`` (zeros:
            the first chunk of a stream).

    Returns:
        ``(out [B, C_out, T, H, W] in x.dtype, new cache [B, C_in, kt - 1, H, W]``: the last ``kt - 1``
        frames of ``cat(cache, x)``).  fp32 arithmetic (float64 for a float64 ``x``).
    """
    kt, kh, kw = ksize
    b, cin, t, h, w = x.shape
    if cache is None:
        cache = x.new_zeros((b, cin, kt - 1, h, w))
    full = torch.cat([cache, x], dim=2)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    wt = weight_taps.to(acc).reshape(kt, kh, kw, cin, -1).permute(4, 3, 0, 1, 2)
    out = F.conv3d(full.to(acc), wt, None if bias is None else bias.to(acc), padding=(0, kh // 2, kw // 2))
    return out.to(x.dtype), full[:, :, full.shape[2] - (kt - 1) :].contiguous()
