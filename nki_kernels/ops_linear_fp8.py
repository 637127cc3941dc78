"""The FP8 linear op ``linear_fp8`` (namespace ``nki_ardiff``) and the offline weight quantiser it takes its
weights from, re-exported by :mod:`nki_kernels.ops` (same backend rules as every op there; bad input raises
before dispatch).  Off by default in the model: see ``docs/kernels/linear_fp8.md`` for its error gate."""

from __future__ import annotations

import torch

from nki_kernels.op_checks import _check_linear_bias, _check_tensor
from nki_kernels.op_dispatch import _op_backend, _run_backend
from reference.linear import E4M3_MAX, quantize_weight_fp8

__all__ = ["LINEAR_FP8_MAX_K", "linear_fp8", "quantize_weight_fp8"]

LINEAR_FP8_MAX_K = {torch.bfloat16: 32128, torch.float32: 22912}
"""Largest in-feature count per activation dtype (``nki_kernels.linear_fp8.max_k``: one 128-token ``q^T``
set next to two 128-column fp8 weight panels and a row buffer)."""

_E4M3_240_BITS = 0x77
"""``float8_e4m3fn`` bit pattern (sign cleared) of 240: larger magnitudes have no NeuronCore-v3 e4m3 value."""


@torch.library.custom_op("nki_ardiff::linear_fp8", mutates_args=())
def _linear_fp8_op(
    x: torch.Tensor, weight_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, backend: str
) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    if _run_backend(backend) == "reference":
        from reference.linear import linear_fp8 as ref_linear_fp8

        out = ref_linear_fp8(x2, weight_q, w_scale, bias)
    else:
        from nki_kernels.op_dispatch import entry

        out = entry("linear_fp8")(x2, weight_q, w_scale, bias)
    return out.reshape(*x.shape[:-1], weight_q.shape[1]).contiguous()


@_linear_fp8_op.register_fake
def _(x, weight_q, w_scale, bias, backend):
    return x.new_empty((*x.shape[:-1], weight_q.shape[1]))


def linear_fp8(
    x: torch.Tensor,
    weight_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """FP8 (e4m3) linear layer as one kernel call: ``((q(x) @ weight_q) * x_scale) * w_scale + bias``.

    ``x`` is quantised per token inside the kernel (``x_scale = max(|x_row|) / 240``); the weights come
    quantised per output channel from :func:`quantize_weight_fp8` (once, when the model loads).  The
    matmuls run as TensorE FP8 double-row matmuls with fp32 accumulation; both scales and the bias are
    applied in fp32 at the PSUM eviction, one rounding to ``x.dtype``
    (:func:`reference.linear.linear_fp8` gives the exact semantics).

    Args:
        x: ``[..., K]`` (any leading dims, tokens), bf16 or fp32, contiguous, at least one token.
        weight_q: ``[K, N]`` ``torch.float8_e4m3fn`` with ``|values| <= 240`` (the e4m3 values of
            NeuronCore-v3's ``float8_e4m3``), contiguous: ``quantize_weight_fp8(weight_t)[0]``.
        w_scale: ``[N]`` ``torch.float32``, finite and positive: ``quantize_weight_fp8(weight_t)[1]``.
        bias: ``[N]`` (``x``'s dtype or fp32; added in fp32) or ``None``.
        backend: see :mod:`nki_kernels.ops`.

    Returns:
        ``[..., N]`` in ``x.dtype``.

    Limits: ``1 <= K <= 32,128`` (bf16) / ``22,912`` (fp32) (:data:`LINEAR_FP8_MAX_K`), ``N >= 1``.
    """
    _check_tensor("x", x, None, "[..., K]")
    if x.dim() < 1 or x.numel() == 0:
        raise ValueError(f"x must be [..., K] with at least one token, got shape {tuple(x.shape)}")
    if not isinstance(weight_q, torch.Tensor):
        raise TypeError(f"weight_q must be a torch.Tensor, got {type(weight_q).__name__}")
    if weight_q.dtype != torch.float8_e4m3fn:
        raise TypeError(
            f"weight_q must be torch.float8_e4m3fn (quantize_weight_fp8's output), got {weight_q.dtype}"
        )
    if weight_q.dim() != 2 or not weight_q.is_contiguous():
        raise ValueError(f"weight_q must be a contiguous [K, N] tensor, got shape {tuple(weight_q.shape)}")
    k, n = weight_q.shape
    if x.shape[-1] != k:
        raise ValueError(
            f"x in-features (x.shape[-1]={x.shape[-1]}) must match weight_q rows (weight_q.shape[0]={k}); "
            "weight_q is quantize_weight_fp8(nn.Linear.weight.T) ([K, N])"
        )
    if not 1 <= k <= LINEAR_FP8_MAX_K[x.dtype] or n < 1:
        raise ValueError(
            f"weight_q shape {tuple(weight_q.shape)}: need 1 <= K <= {LINEAR_FP8_MAX_K[x.dtype]} for "
            f"{x.dtype} activations and N >= 1"
        )
    if ((weight_q.view(torch.uint8) & 0x7F) > _E4M3_240_BITS).any():
        raise ValueError(
            f"weight_q holds values beyond +-{E4M3_MAX:g} (or NaN), which NeuronCore-v3's float8_e4m3 cannot "
            "represent; quantise with quantize_weight_fp8"
        )
    if not isinstance(w_scale, torch.Tensor):
        raise TypeError(f"w_scale must be a torch.Tensor, got {type(w_scale).__name__}")
    if w_scale.dtype != torch.float32:
        raise TypeError(f"w_scale must be torch.float32 (one scale per output channel), got {w_scale.dtype}")
    if tuple(w_scale.shape) != (n,):
        raise ValueError(
            f"w_scale must be [N] with N={n} (weight_q.shape[1]), got shape {tuple(w_scale.shape)}"
        )
    if not bool(torch.isfinite(w_scale).all()) or not bool((w_scale > 0).all()):
        raise ValueError("w_scale must be finite and > 0 (quantize_weight_fp8 gives max|w| / 240 per column)")
    for name, t in (("weight_q", weight_q), ("w_scale", w_scale)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    if bias is not None:
        _check_linear_bias(bias, n, x, "weight_q")
    return _linear_fp8_op(x, weight_q, w_scale, bias, _op_backend(backend))
