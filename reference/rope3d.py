"""Pure-PyTorch reference for Wan2.1's 3D rotary position embedding (RoPE).

This mirrors Wan's ``rope_params`` / ``rope_apply`` (and the causal variant's ``start_frame`` offset):

* ``head_dim`` D (even) holds D/2 complex pairs, interleaved: element ``2j`` is the real part and
  ``2j + 1`` the imaginary part of pair j.
* The pairs are split into three consecutive groups: **time** gets ``D/2 - 2*(D//6)`` pairs, **height**
  and **width** get ``D//6`` pairs each (D=128: 22 / 21 / 21). Each group has its own frequencies
  ``omega_j = base^(-2j / dim_g)`` with ``dim_g = 2 * pairs_g`` and base 10000, computed in float64.
* Tokens are ordered ``(f, h, w)`` row-major (the patch-embedding flatten order). The token at frame f,
  row h, column w gets angles ``t_f * omega^time``, ``h * omega^height``, ``w * omega^width`` where the
  time position is ``t_f = start_frame + f`` or ``frame_positions[f]`` when given (used to re-position a
  leading sink segment).
* The rotation is done in complex128 (``x * polar(1, theta)``) and the result is cast to float32 and then
  to the input dtype (Wan's ``rope_apply`` returns ``.float()`` and attention casts to the activation
  dtype; for fp32 inputs the second cast is a no-op).
* The same angles are used for every head.

Depends on torch only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

ROPE_BASE = 10000.0
"""Frequency base ``theta`` of Wan's ``rope_params``."""

Grid = tuple[int, int, int]


def rope_split(head_dim: int) -> tuple[int, int, int]:
    """Number of complex pairs for (time, height, width) at ``head_dim`` (Wan's split).

    ``head_dim`` must be even. Height and width get ``head_dim // 6`` pairs each, time the rest:
    ``rope_split(128) == (22, 21, 21)``.
    """
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even integer, got {head_dim}")
    c = head_dim // 2
    hw = head_dim // 6
    return c - 2 * hw, hw, hw


def _inv_freq(pairs: int) -> torch.Tensor:
    """``1 / base^(2j / dim)`` for j < pairs, dim = 2 * pairs, float64 (Wan's ``rope_params``)."""
    dim = 2 * pairs
    return 1.0 / torch.pow(ROPE_BASE, torch.arange(0, dim, 2, dtype=torch.float64).div(dim))


def time_positions(
    num_frames: int, start_frame: int = 0, frame_positions: Sequence[int] | torch.Tensor | None = None
) -> torch.Tensor:
    """Time position of each of ``num_frames`` frames, int64 ``[F]``.

    ``frame_positions`` (length F) overrides ``start_frame``; otherwise ``start_frame + arange(F)``.
    """
    if frame_positions is None:
        return torch.arange(num_frames, dtype=torch.int64) + int(start_frame)
    pos = torch.as_tensor(frame_positions, dtype=torch.int64).reshape(-1).cpu()
    if pos.numel() != num_frames:
        raise ValueError(f"frame_positions must have length F={num_frames}, got {pos.numel()}")
    return pos


def rope_angles(
    grid: Sequence[int],
    head_dim: int,
    start_frame: int = 0,
    frame_positions: Sequence[int] | torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotation angle of every (token, pair), float64 ``[L, D//2]`` with L = F*Hp*Wp in (f, h, w) order."""
    f, hp, wp = (int(x) for x in grid)
    pt, ph, pw = rope_split(head_dim)
    t_pos = time_positions(f, start_frame, frame_positions).to(torch.float64)
    ang_t = torch.outer(t_pos, _inv_freq(pt))  # [F, pt]
    ang_h = torch.outer(torch.arange(hp, dtype=torch.float64), _inv_freq(ph))  # [Hp, ph]
    ang_w = torch.outer(torch.arange(wp, dtype=torch.float64), _inv_freq(pw))  # [Wp, pw]
    ang = torch.cat(
        [
            ang_t[:, None, None, :].expand(f, hp, wp, pt),
            ang_h[None, :, None, :].expand(f, hp, wp, ph),
            ang_w[None, None, :, :].expand(f, hp, wp, pw),
        ],
        dim=-1,
    )
    return ang.reshape(f * hp * wp, pt + ph + pw)


def rope_tables(
    grid: Sequence[int],
    head_dim: int,
    start_frame: int = 0,
    frame_positions: Sequence[int] | torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Precomputed ``(cos, sin)`` tables, each ``[L, D//2]`` in ``dtype``; row l = token l in (f, h, w) order.

    Column j is pair j (time pairs first, then height, then width). Angles are computed in float64 and
    only the cos/sin values are rounded to ``dtype``. Kernels take these tables as inputs, as production
    RoPE kernels do (the table is shared by all heads and by q and k), so the device never evaluates
    transcendental functions of positions.

    The values are the real and imaginary parts of ``torch.polar(1, angle)``, the very factors
    :func:`rope3d` multiplies by, so ``rope3d_tables(q, k, *rope_tables(..., dtype=torch.float64))`` is
    bitwise equal to ``rope3d(q, k, ...)`` (``torch.sin`` alone can differ from polar's imaginary part by
    one float64 ulp).
    """
    ang = rope_angles(grid, head_dim, start_frame, frame_positions)
    freqs = torch.polar(torch.ones_like(ang), ang)
    return freqs.real.to(dtype).contiguous(), freqs.imag.to(dtype).contiguous()


def _apply(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    b, seq, h, d = x.shape
    xc = torch.view_as_complex(x.to(torch.float64).reshape(b, seq, h, d // 2, 2).contiguous())
    out = torch.view_as_real(xc * freqs[None, :, None, :]).reshape(b, seq, h, d)
    return out.to(torch.float32).to(x.dtype)


def rope3d(
    q: torch.Tensor,
    k: torch.Tensor,
    grid: Sequence[int],
    start_frame: int = 0,
    frame_positions: Sequence[int] | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply Wan's 3D RoPE to q and k (reference; returns new tensors).

    Args:
        q, k: ``[B, L, H, D]`` (bf16 or fp32; any dtype works here), L = F*Hp*Wp, D even.
        grid: ``(F, Hp, Wp)`` latent frames, patch rows, patch columns.
        start_frame: time position of frame 0 (time position of frame f is ``start_frame + f``).
        frame_positions: optional length-F integer positions overriding ``start_frame``.

    Returns:
        ``(q_rot, k_rot)`` with the input shapes and dtypes, computed in complex128.
    """
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be [B, L, H, D], got q {tuple(q.shape)} and k {tuple(k.shape)}")
    ang = rope_angles(grid, q.shape[-1], start_frame, frame_positions)
    if ang.shape[0] != q.shape[1] or ang.shape[0] != k.shape[1]:
        raise ValueError(f"grid {tuple(grid)} gives L={ang.shape[0]}, q has {q.shape[1]}, k has {k.shape[1]}")
    freqs = torch.polar(torch.ones_like(ang), ang).to(q.device)
    return _apply(q, freqs), _apply(k, freqs)


def rope3d_tables(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply RoPE to q and k with precomputed tables (reference; returns new tensors).

    Args:
        q, k: ``[B, L, H, D]`` (bf16 or fp32), D even.
        cos, sin: ``[L, D//2]`` float32 or float64, as :func:`rope_tables` builds them (row l = token l).

    Returns:
        ``(q_rot, k_rot)`` with the input shapes and dtypes: the complex128 product ``x * (cos + i sin)``
        rounded to float32 and then to the input dtype, exactly as :func:`rope3d`. With float64 tables
        from :func:`rope_tables` the result is bitwise that of :func:`rope3d` for the same positions; with
        float32 tables (what the kernels consume) the factors carry the tables' fp32 rounding.
    """
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be [B, L, H, D], got q {tuple(q.shape)} and k {tuple(k.shape)}")
    want = (q.shape[1], q.shape[3] // 2)
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != want:
            raise ValueError(
                f"{name} must be [L, D//2] = {want} for q {tuple(q.shape)}, got {tuple(t.shape)}"
            )
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"k has L={k.shape[1]} but q and the tables have L={q.shape[1]}")
    freqs = torch.complex(cos.to(torch.float64), sin.to(torch.float64)).to(q.device)
    return _apply(q, freqs), _apply(k, freqs)


def rope3d_tables_one(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE to one tensor with precomputed tables (reference; returns a new tensor).

    The single-tensor form of :func:`rope3d_tables` for callers that need only one of q and k (e.g. the
    keys of a roped cache copy): the result is bitwise :func:`rope3d_tables`'s ``k_rot`` for ``k = x``.

    Args:
        x: ``[B, L, H, D]`` (bf16 or fp32), D even.
        cos, sin: ``[L, D//2]`` float32 or float64, as :func:`rope_tables` builds them (row l = token l).

    Returns:
        ``x_rot`` with x's shape and dtype: the complex128 product ``x * (cos + i sin)`` rounded to float32
        and then to x's dtype.
    """
    if x.dim() != 4:
        raise ValueError(f"x must be [B, L, H, D], got {tuple(x.shape)}")
    want = (x.shape[1], x.shape[3] // 2)
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != want:
            raise ValueError(
                f"{name} must be [L, D//2] = {want} for x {tuple(x.shape)}, got {tuple(t.shape)}"
            )
    freqs = torch.complex(cos.to(torch.float64), sin.to(torch.float64)).to(x.device)
    return _apply(x, freqs)


__all__ = [
    "ROPE_BASE",
    "rope3d",
    "rope3d_tables",
    "rope3d_tables_one",
    "rope_angles",
    "rope_split",
    "rope_tables",
    "time_positions",
]
