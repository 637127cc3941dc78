"""The ``linear`` op (namespace ``nki_ardiff``): validation and backend dispatch, re-exported by
:mod:`nki_kernels.ops` (same backend rules as every op there: ``backend`` ``"reference"`` / ``"emulator"`` /
``"neuron"`` / ``None`` = ``$NKI_ARDIFF_BACKEND`` read at call time; bad input raises before dispatch)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["linear", "LINEAR_MAX_K"]

_DTYPES = (torch.bfloat16, torch.float32)

LINEAR_MAX_K = {torch.bfloat16: 18432, torch.float32: 9216}
"""Largest in-feature count the kernel's SBUF tiles take per dtype (``nki_kernels.linear.plan_tiles``)."""


@torch.library.custom_op("nki_ardiff::linear", mutates_args=())
def _linear_op(
    x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None, backend: str
) -> torch.Tensor:
    from nki_kernels.ops import _run_backend

    x2 = x.reshape(-1, x.shape[-1])
    if _run_backend(backend) == "reference":
        from reference.linear import linear as ref_linear

        out = ref_linear(x2, weight_t, bias)
    else:
        from nki_kernels.linear import linear_emulated

        out = linear_emulated(x2, weight_t, bias)
    return out.reshape(*x.shape[:-1], weight_t.shape[1]).contiguous()


@_linear_op.register_fake
def _(x, weight_t, bias, backend):
    return x.new_empty((*x.shape[:-1], weight_t.shape[1]))


def _check(name: str, t: Any, rank: int | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if rank is not None and t.dim() != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {tuple(t.shape)}")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{name} must be torch.bfloat16 or torch.float32, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (the kernel addresses it row-major); call .contiguous()")


def linear(
    x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None, *, backend: str | None = None
) -> torch.Tensor:
    """``x @ weight_t + bias`` as one kernel call (fp32 accumulation, one rounding to ``x.dtype``).

    Args:
        x: ``[..., K]`` (any leading dims, tokens), bf16 or fp32, contiguous, at least one token.
        weight_t: ``[K, N]``, ``nn.Linear.weight.T`` made contiguous once when the model loads (the kernel
            contracts over K on partitions and streams ``N`` in panels), same dtype as ``x``.
        bias: ``[N]`` (``x``'s dtype or fp32; added in fp32) or ``None``.
        backend: see :mod:`nki_kernels.ops`.

    Returns:
        ``[..., N]`` in ``x.dtype``.

    Limits: ``1 <= K <= 18432`` (bf16) / ``9216`` (fp32) (the kernel keeps two ``[K, nb]`` weight panels
    and the block's ``x^T`` in SBUF), ``N >= 1``.
    """
    from nki_kernels.ops import _op_backend

    _check("x", x, None)
    _check("weight_t", weight_t, 2)
    if x.dim() < 1 or x.numel() == 0:
        raise ValueError(f"x must be [..., K] with at least one token, got shape {tuple(x.shape)}")
    k, n = weight_t.shape
    if x.shape[-1] != k:
        raise ValueError(
            f"x in-features (x.shape[-1]={x.shape[-1]}) must match weight_t rows (weight_t.shape[0]={k}); "
            "weight_t is nn.Linear.weight.T ([K, N])"
        )
    if weight_t.dtype != x.dtype:
        raise TypeError(f"weight_t dtype {weight_t.dtype} must match x dtype {x.dtype}")
    if weight_t.device != x.device:
        raise ValueError(f"weight_t is on {weight_t.device} but x is on {x.device}")
    if not 1 <= k <= LINEAR_MAX_K[x.dtype] or n < 1:
        raise ValueError(
            f"weight_t shape {tuple(weight_t.shape)}: need 1 <= K <= {LINEAR_MAX_K[x.dtype]} for {x.dtype} "
            "and N >= 1"
        )
    if bias is not None:
        _check("bias", bias, 1)
        if bias.shape[0] != n:
            raise ValueError(
                f"bias must be [N] with N={n} (weight_t.shape[1]), got shape {tuple(bias.shape)}"
            )
        if bias.dtype not in (x.dtype, torch.float32):
            raise TypeError(f"bias dtype {bias.dtype} must be x's dtype {x.dtype} or torch.float32")
        if bias.device != x.device:
            raise ValueError(f"bias is on {bias.device} but x is on {x.device}")
    return _linear_op(x, weight_t, bias, _op_backend(backend))
