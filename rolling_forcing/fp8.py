"""FP8 options, both OFF by default: FP8 linear layers for the DiT and the FP8 KV cache.

FP8 linears (nothing in the pipeline calls this).

:func:`use_fp8_linears` swaps the ``nn.Linear`` layers of the transformer blocks for :class:`Fp8Linear`:
weights quantised once to e4m3 per output channel (``ops.quantize_weight_fp8``), activations quantised
per token inside ``ops.linear_fp8`` (the FP8 double-row kernel on the kernel backends).  Its error gate
(``docs/kernels/linear_fp8.md``) does not pass per linear at the stated floor, nor does the decoded-video
half (PSNR >= 35 dB against the bf16 stream on the trained demo model, ``python -m perf.fp8_psnr``:
27.4-33.8 dB measured).

FP8 KV cache (``kv_dtype=KV_FP8`` on the pipeline / ``RollingKVCache``): K and V quantised to e4m3 per
token and head when written, dequantised where attention reads them.  On the CPU path the cache holds the
dequantised values (:func:`kv_fp8_roundtrip` at every write: the numbers attention sees are exactly an FP8
cache's); the HBM model prices the real layout (:func:`kv_fp8_bytes_per_element`).
"""

from __future__ import annotations

import torch
from torch import nn

from nki_kernels import ops

__all__ = [
    "FP8_MIN_FEATURES",
    "KV_FP8",
    "KV_SCALE_BYTES",
    "Fp8Linear",
    "kv_fp8_bytes_per_element",
    "kv_fp8_roundtrip",
    "use_fp8_linears",
]

FP8_MIN_FEATURES = 256
"""Default smallest in- and out-feature count converted (the perf model's ``perf.e2e.fp8.FP8_MIN_DIM``)."""


class Fp8Linear(nn.Module):
    """``nn.Linear`` replacement computing ``ops.linear_fp8`` (inference only).

    Buffers: ``weight_q`` ``[K, N]`` ``float8_e4m3fn`` (e4m3 values, ``|w| <= 240``), ``w_scale`` ``[N]``
    fp32, ``bias`` ``[N]`` fp32 or absent.  Input ``[..., K]`` bf16 or fp32 (made contiguous), output in
    the input's dtype.
    """

    weight_q: torch.Tensor
    w_scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear, backend: str | None = None) -> None:
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        wq, ws = ops.quantize_weight_fp8(linear.weight.detach().t())
        self.register_buffer("weight_q", wq)
        self.register_buffer("w_scale", ws)
        b = linear.bias
        self.register_buffer("bias", None if b is None else b.detach().to(torch.float32).clone())
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear_fp8(x.contiguous(), self.weight_q, self.w_scale, self.bias, backend=self.backend)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3"


def use_fp8_linears(
    model: nn.Module, *, backend: str | None = None, min_features: int = FP8_MIN_FEATURES
) -> list[str]:
    """Replace, in place, every ``nn.Linear`` inside ``model.blocks`` whose in- and out-features are both
    ``>= min_features`` by an :class:`Fp8Linear` (embeddings, time projection and output head stay as they
    are).  Returns the qualified names replaced.  Raises ``ValueError`` when ``model`` has no ``blocks``
    or ``min_features < 1``."""
    if isinstance(min_features, bool) or not isinstance(min_features, int) or min_features < 1:
        raise ValueError(f"min_features must be a positive int, got {min_features!r}")
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.Module):
        raise ValueError("model must have transformer blocks at model.blocks (a CausalWanModel)")
    done: list[str] = []
    for bname, parent in list(blocks.named_modules()):
        for cname, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and min(child.in_features, child.out_features) >= min_features:
                setattr(parent, cname, Fp8Linear(child, backend))
                done.append(f"blocks.{bname}.{cname}" if bname else f"blocks.{cname}")
    return done


KV_FP8 = "float8_e4m3"
"""``kv_dtype`` value of an FP8 KV cache (:class:`rolling_forcing.cache.RollingKVCache`, the pipeline)."""

KV_SCALE_BYTES = 4
"""Bytes of one per-token-per-head scale of the FP8 KV cache (fp32)."""


def kv_fp8_bytes_per_element(head_dim: int) -> float:
    """HBM bytes per cached K/V element of the FP8 KV cache's layout: one e4m3 byte plus one fp32 scale per
    token and head (``1 + 4 / head_dim``)."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
    return 1 + KV_SCALE_BYTES / head_dim


def kv_fp8_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """What an FP8 KV cache returns for K or V ``[B, T, H, D]``: per token and head ``a = max(max_d |x|,
    2**-96)``, ``q = e4m3(x * (240 / a))`` (NeuronCore-v3 e4m3 values, round to nearest even), read back as
    ``q * (a / 240)`` in ``x.dtype`` (the dequantisation where attention reads it).  fp32 arithmetic."""
    q, scale = ops.quantize_weight_fp8(x.reshape(-1, x.shape[-1]).t())
    return (q.t().to(torch.float32) * scale.unsqueeze(-1)).reshape(x.shape).to(x.dtype)
