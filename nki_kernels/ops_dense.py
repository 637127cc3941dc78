"""The dense-layer ops ``linear`` and ``conv3d_causal`` (namespace ``nki_ardiff``): validation and backend
dispatch, re-exported by :mod:`nki_kernels.ops` (same backend rules as every op there: ``backend``
``"reference"`` / ``"emulator"`` /
``"neuron"`` / ``None`` = ``$NKI_ARDIFF_BACKEND`` read at call time; bad input raises before dispatch)."""

from __future__ import annotations

import torch

from nki_kernels.op_checks import _check_linear_bias, _check_tensor
from nki_kernels.op_dispatch import _op_backend, _run_backend

__all__ = ["linear", "LINEAR_MAX_K", "conv3d_causal", "conv_weight_taps"]


LINEAR_MAX_K = {torch.bfloat16: 18432, torch.float32: 9216}
"""Largest in-feature count the kernel's SBUF tiles take per dtype (``nki_kernels.linear.plan_tiles``)."""


@torch.library.custom_op("nki_ardiff::linear", mutates_args=())
def _linear_op(
    x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None, backend: str
) -> torch.Tensor:
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
    _check_tensor("x", x, None, "[..., K]")
    _check_tensor("weight_t", weight_t, 2, "[K, N]")
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
        _check_linear_bias(bias, n, x, "weight_t")
    return _linear_op(x, weight_t, bias, _op_backend(backend))


# --------------------------------------------------------------------------------------------------
# causal 3-D convolution


@torch.library.custom_op("nki_ardiff::conv3d_causal", mutates_args=())
def _conv_op(
    x: torch.Tensor,
    weight_taps: torch.Tensor,
    bias: torch.Tensor | None,
    ksize: list[int],
    cache: torch.Tensor,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    ks = (int(ksize[0]), int(ksize[1]), int(ksize[2]))
    if _run_backend(backend) == "reference":
        from reference.conv3d import conv3d_causal as ref_conv

        out, new = ref_conv(x, weight_taps, bias, ks, cache)
        return out.contiguous(), new.clone()
    from nki_kernels.conv3d import conv3d_causal_emulated

    full = torch.cat([cache, x], dim=2)
    outs = [conv3d_causal_emulated(full[i].contiguous(), weight_taps, bias, ks) for i in range(x.shape[0])]
    new = full[:, :, full.shape[2] - (ks[0] - 1) :].contiguous()
    return torch.stack(outs).contiguous(), new.clone()


@_conv_op.register_fake
def _(x, weight_taps, bias, ksize, cache, backend):
    b, _, t, h, w = x.shape
    return x.new_empty((b, weight_taps.shape[2], t, h, w)), cache.new_empty(cache.shape)


def conv_weight_taps(weight: torch.Tensor) -> torch.Tensor:
    """torch's conv weight ``[C_out, C_in, kt, kh, kw]`` as the kernels' ``[kt * kh * kw, C_in, C_out]``
    (contiguous; do it once when the model loads)."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 5:
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight must be a torch conv3d weight [C_out, C_in, kt, kh, kw], got {got}")
    co, ci = weight.shape[:2]
    return weight.permute(2, 3, 4, 1, 0).reshape(-1, ci, co).contiguous()


def conv3d_causal(
    x: torch.Tensor,
    weight_taps: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ksize: tuple[int, int, int] = (3, 3, 3),
    cache: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal 3-D convolution with a streaming cache (Wan VAE's ``WanCausalConv3d``: stride 1, zero padding
    ``(kh // 2, kw // 2)`` in space, ``kt - 1`` previous frames in time).

    Args:
        x: ``[B, C_in, T, H, W]`` (T >= 1), bf16 or fp32, contiguous.
        weight_taps: ``[kt * kh * kw, C_in, C_out]`` (:func:`conv_weight_taps` of the torch weight), same
            dtype as ``x``; its resident SBUF copy must fit (``nki_kernels.conv3d.plan_conv`` raises).
        bias: ``[C_out]`` (x's dtype or fp32, added in fp32) or ``None``.
        ksize: ``(kt, kh, kw)``, each 1 or 3.
        cache: ``[B, C_in, kt - 1, H, W]`` (the previous call's returned cache) or ``None`` (zeros: the
            first chunk of a stream).
        backend: see :mod:`nki_kernels.ops`.

    Returns:
        ``(out [B, C_out, T, H, W] in x's dtype, new cache [B, C_in, kt - 1, H, W])``.
    """
    _check_tensor("x", x, 5, "[B, C_in, T, H, W]")
    _check_tensor("weight_taps", weight_taps, 3, "[taps, C_in, C_out]")
    ks = tuple(ksize)
    if len(ks) != 3 or any(isinstance(k, bool) or k not in (1, 3) for k in ks):
        raise ValueError(f"ksize must be (kt, kh, kw) with each 1 or 3, got {ksize!r}")
    kt, kh, kw = ks
    b, cin, t, h, w = x.shape
    if min(b, cin, t, h, w) < 1:
        raise ValueError(f"x must be [B, C_in, T, H, W] with every size >= 1, got {tuple(x.shape)}")
    if weight_taps.shape[0] != kt * kh * kw or weight_taps.shape[1] != cin:
        raise ValueError(
            f"weight_taps must be [kt*kh*kw={kt * kh * kw}, C_in={cin}, C_out] for ksize={ks}, got "
            f"{tuple(weight_taps.shape)} (use conv_weight_taps on the torch weight)"
        )
    if weight_taps.dtype != x.dtype:
        raise TypeError(f"weight_taps dtype {weight_taps.dtype} must match x dtype {x.dtype}")
    cout = weight_taps.shape[2]
    if bias is not None:
        _check_tensor("bias", bias, 1, "[C_out]")
        if bias.shape[0] != cout:
            raise ValueError(f"bias must be [C_out] with C_out={cout}, got shape {tuple(bias.shape)}")
        if bias.dtype not in (x.dtype, torch.float32):
            raise TypeError(f"bias dtype {bias.dtype} must be x's dtype {x.dtype} or torch.float32")
    if cache is None:
        cache = x.new_zeros((b, cin, kt - 1, h, w))
    else:
        _check_tensor("cache", cache, 5, "[B, C_in, kt - 1, H, W]")
        if tuple(cache.shape) != (b, cin, kt - 1, h, w):
            raise ValueError(
                f"cache must be [B, C_in, kt-1, H, W] = {(b, cin, kt - 1, h, w)}, got {tuple(cache.shape)}"
            )
        if cache.dtype != x.dtype:
            raise TypeError(f"cache dtype {cache.dtype} must match x dtype {x.dtype}")
    from nki_kernels.conv3d import plan_conv

    plan_conv(cin, cout, h, w, x.element_size(), ks)  # raises early when the kernel cannot take the shape
    return _conv_op(x, weight_taps, bias, list(ks), cache, _op_backend(backend))
