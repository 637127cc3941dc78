"""Wan2.1 3D RoPE as NKI kernels (standalone NKI 0.6 API, imported through :mod:`nki_kernels._nki`).

Math (per token l, head h, pair j; interleaved pairs, element ``2j`` real, ``2j+1`` imaginary)::

    out[2j]   = x[2j] * cos(theta[l, j]) - x[2j+1] * sin(theta[l, j])
    out[2j+1] = x[2j] * sin(theta[l, j]) + x[2j+1] * cos(theta[l, j])

``theta`` is Wan's angle table (time / height / width pairs, base 10000, see :mod:`reference.rope3d`); the
kernels take ``cos`` and ``sin`` tables ``[L, D//2]`` fp32 computed on the host in float64
(:func:`reference.rope3d.rope_tables`), shared by q, k and all heads.

Layouts and design (:func:`rope3d_kernel`):

* q, k ``[B, L, H, D]`` (the projection output viewed per head), bf16 or fp32, row-major in HBM.
* **Tokens on partitions.** A super-tile is ``128 x m`` tokens: partition ``p`` holds the ``m`` consecutive
  tokens ``t0 + p*m ... t0 + p*m + m - 1``, i.e. one contiguous run of ``m * H * D`` elements (``m * 3 KiB``
  for Wan's H=12, D=128 in bf16). One DMA reads the super-tile of q (or k), one writes it back: every
  descriptor is a whole multiple of a token's ``H*D`` row. The tables' rows for the same tokens are read
  once per super-tile (``m * D/2 * 4`` bytes per partition) and reused for q, k and every head (a stride-0
  broadcast view over the head axis).
* **De-interleave in SBUF**, never in the DMA: ``x[..., 0::2]`` and ``x[..., 1::2]`` are stride-2 free-dim
  views of the loaded tile, and the results are written through the same views of the output tile.
* Engine split (products and sums in fp32, one rounding to the output dtype): GpSimdE forms
  ``e*cos``, ``o*sin`` and ``e*sin`` over the whole super-tile; ScalarE copies ``e*cos`` into PSUM and the
  cos table into PSUM; VectorE forms ``o*cos`` (PSUM table operand) and the two sums, each with one PSUM
  operand, writing bf16/fp32 straight into the output tile's even/odd views.
* The tail (fewer than 128 tokens left) uses ``m = 1`` with fewer partitions.
* LNC: ``rope3d_kernel[2]`` splits the super-tiles between the two logical cores (``nl.program_id(0)``).

:func:`rope3d_naive_kernel` is the deliberately bad variant (benchmark only): it de-interleaves in the
DMA (stride-2 element gathers straight from HBM: one descriptor per element) and stores the same way.

:func:`rope3d_emulated` (builds the tables per call from the grid and positions) and
:func:`rope3d_tables_emulated` (takes caller-built tables, e.g. once per forward for all layers) are the
torch-facing entries that :mod:`nki_kernels.ops` calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from nki_kernels._nki import nisa, nki, nl
from nki_kernels.hw_limits import PMAX, PSUM_BANK_FMAX

MAX_TOKENS_PER_PARTITION = 8
"""Tokens per partition ``m`` of a full super-tile (Wan: 8 x 3 KiB = 24 KiB runs; table runs 2 KiB)."""


def _super_tiles(length: int, max_m: int) -> list[tuple[int, int, int]]:
    """Split ``length`` tokens into ``(t0, rows, m)`` super-tiles: rows partitions x m tokens each.

    Full super-tiles use ``m = max_m``; the remainder uses the largest ``m`` that still fills 128
    partitions, and the last < 128 tokens use ``m = 1``.
    """
    out = []
    t0 = 0
    while t0 < length:
        rem = length - t0
        m = min(max_m, rem // PMAX)
        if m >= 1:
            out.append((t0, PMAX, m))
            t0 += PMAX * m
        else:
            out.append((t0, rem, 1))
            t0 += rem
    return out


def _rope_tile(
    x_sb: Any, o_sb: Any, cos_sb: Any, sin_sb: Any, cos_ps: Any, rows: int, m: int, H: int, half: int
) -> None:
    """Rotate one loaded super-tile ``x_sb[:rows, :m]`` ([P, m, H, D]) into ``o_sb`` (same layout)."""
    f32 = nl.float32
    xe = x_sb[:rows, :m, :, 0::2]
    xo = x_sb[:rows, :m, :, 1::2]
    oe = o_sb[:rows, :m, :, 0::2]
    oo = o_sb[:rows, :m, :, 1::2]
    cb = cos_sb[:rows, :m].expand_dim(2).broadcast(2, H)
    sb = sin_sb[:rows, :m].expand_dim(2).broadcast(2, H)
    # GpSimdE: three of the four products over the whole super-tile (fp32).
    ec = nl.ndarray((PMAX, m, H, half), dtype=f32, buffer=nl.sbuf)
    os_ = nl.ndarray((PMAX, m, H, half), dtype=f32, buffer=nl.sbuf)
    es = nl.ndarray((PMAX, m, H, half), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_tensor(ec[:rows], xe, cb, nl.multiply, engine=nisa.gpsimd_engine)
    nisa.tensor_tensor(os_[:rows], xo, sb, nl.multiply, engine=nisa.gpsimd_engine)
    nisa.tensor_tensor(es[:rows], xe, sb, nl.multiply, engine=nisa.gpsimd_engine)
    # Per PSUM-bank chunk: ScalarE moves e*cos to PSUM; VectorE does o*cos and the two sums, each with
    # one PSUM operand, writing straight into the output's even/odd views.
    hc = max(1, min(H, PSUM_BANK_FMAX // half))
    ec_ps = nl.ndarray((PMAX, hc, half), dtype=f32, buffer=nl.psum)
    oc_ps = nl.ndarray((PMAX, hc, half), dtype=f32, buffer=nl.psum)
    for j in range(m):
        for h0 in range(0, H, hc):
            hn = min(hc, H - h0)
            cps = cos_ps[:rows, j : j + 1].broadcast(1, hn)
            nisa.activation(ec_ps[:rows, :hn], nl.copy, ec[:rows, j, h0 : h0 + hn])
            nisa.tensor_tensor(
                oc_ps[:rows, :hn], xo[:, j, h0 : h0 + hn], cps, nl.multiply, engine=nisa.vector_engine
            )
            nisa.tensor_tensor(
                oe[:, j, h0 : h0 + hn],
                ec_ps[:rows, :hn],
                os_[:rows, j, h0 : h0 + hn],
                nl.subtract,
                engine=nisa.vector_engine,
            )
            nisa.tensor_tensor(
                oo[:, j, h0 : h0 + hn],
                oc_ps[:rows, :hn],
                es[:rows, j, h0 : h0 + hn],
                nl.add,
                engine=nisa.vector_engine,
            )


@nki.jit
def rope3d_kernel(q, k, cos, sin):
    """Rotate q and k ``[B, L, H, D]`` with tables ``cos``/``sin`` ``[L, D//2]`` fp32, returning
    ``(q_out, k_out)``.

    One launch covers q, k, every batch and every head. Each HBM byte of q and k is read once and written
    once with descriptors of ``m * H * D`` elements (whole token rows). LNC-aware: super-tiles are dealt
    round-robin to ``nl.num_programs()`` logical cores.
    """
    B, L, H, D = q.shape
    half = D // 2
    q_out = nl.ndarray(q.shape, dtype=q.dtype, buffer=nl.shared_hbm)
    k_out = nl.ndarray(k.shape, dtype=k.dtype, buffer=nl.shared_hbm)
    pid = nl.program_id(0)
    nprog = nl.num_programs()
    tiles = _super_tiles(L, MAX_TOKENS_PER_PARTITION)
    m_max = max(m for _, _, m in tiles)
    cos_sb = nl.ndarray((PMAX, m_max, half), dtype=nl.float32, buffer=nl.sbuf)
    sin_sb = nl.ndarray((PMAX, m_max, half), dtype=nl.float32, buffer=nl.sbuf)
    cos_ps = nl.ndarray((PMAX, m_max, half), dtype=nl.float32, buffer=nl.psum)
    x_sb = nl.ndarray((PMAX, m_max, H, D), dtype=q.dtype, buffer=nl.sbuf)
    o_sb = nl.ndarray((PMAX, m_max, H, D), dtype=q.dtype, buffer=nl.sbuf)
    for i, (t0, rows, m) in enumerate(tiles):
        if i % nprog != pid:
            continue
        n_tok = rows * m
        # Tables for these tokens: one contiguous run of m*half fp32 per partition.
        nisa.dma_copy(dst=cos_sb[:rows, :m], src=cos[t0 : t0 + n_tok].reshape((rows, m, half)))
        nisa.dma_copy(dst=sin_sb[:rows, :m], src=sin[t0 : t0 + n_tok].reshape((rows, m, half)))
        nisa.activation(cos_ps[:rows, :m], nl.copy, cos_sb[:rows, :m])
        for b in range(B):
            for src, dst in ((q, q_out), (k, k_out)):
                nisa.dma_copy(dst=x_sb[:rows, :m], src=src[b, t0 : t0 + n_tok].reshape((rows, m, H, D)))
                _rope_tile(x_sb, o_sb, cos_sb, sin_sb, cos_ps, rows, m, H, half)
                nisa.dma_copy(dst=dst[b, t0 : t0 + n_tok].reshape((rows, m, H, D)), src=o_sb[:rows, :m])
    return q_out, k_out


@nki.jit
def rope3d_naive_kernel(q, k, cos, sin):
    """Benchmark-only naive RoPE: de-interleaves with stride-2 element gathers in the DMA.

    Per 128-token tile and per (b, tensor): the even and odd elements are fetched from HBM with stride-2
    access patterns (one 2-byte descriptor per element for bf16) into separate SBUF tiles, rotated on
    VectorE, and scattered back the same way. Same results as :func:`rope3d_kernel`, far more descriptors.
    """
    B, L, H, D = q.shape
    half = D // 2
    f32 = nl.float32
    q_out = nl.ndarray(q.shape, dtype=q.dtype, buffer=nl.shared_hbm)
    k_out = nl.ndarray(k.shape, dtype=k.dtype, buffer=nl.shared_hbm)
    cos_sb = nl.ndarray((PMAX, half), dtype=f32, buffer=nl.sbuf)
    sin_sb = nl.ndarray((PMAX, half), dtype=f32, buffer=nl.sbuf)
    e_sb = nl.ndarray((PMAX, H, half), dtype=q.dtype, buffer=nl.sbuf)
    o_sb = nl.ndarray((PMAX, H, half), dtype=q.dtype, buffer=nl.sbuf)
    t1 = nl.ndarray((PMAX, H, half), dtype=f32, buffer=nl.sbuf)
    t2 = nl.ndarray((PMAX, H, half), dtype=f32, buffer=nl.sbuf)
    re = nl.ndarray((PMAX, H, half), dtype=q.dtype, buffer=nl.sbuf)
    ro = nl.ndarray((PMAX, H, half), dtype=q.dtype, buffer=nl.sbuf)
    for t0 in range(0, L, PMAX):
        rows = min(PMAX, L - t0)
        nisa.dma_copy(dst=cos_sb[:rows], src=cos[t0 : t0 + rows])
        nisa.dma_copy(dst=sin_sb[:rows], src=sin[t0 : t0 + rows])
        cb = cos_sb[:rows].expand_dim(1).broadcast(1, H)
        sb = sin_sb[:rows].expand_dim(1).broadcast(1, H)
        for b in range(B):
            for src, dst in ((q, q_out), (k, k_out)):
                nisa.dma_copy(dst=e_sb[:rows], src=src[b, t0 : t0 + rows, :, 0::2])
                nisa.dma_copy(dst=o_sb[:rows], src=src[b, t0 : t0 + rows, :, 1::2])
                nisa.tensor_tensor(t1[:rows], e_sb[:rows], cb, nl.multiply)
                nisa.tensor_tensor(t2[:rows], o_sb[:rows], sb, nl.multiply)
                nisa.tensor_tensor(re[:rows], t1[:rows], t2[:rows], nl.subtract)
                nisa.tensor_tensor(t1[:rows], e_sb[:rows], sb, nl.multiply)
                nisa.tensor_tensor(t2[:rows], o_sb[:rows], cb, nl.multiply)
                nisa.tensor_tensor(ro[:rows], t1[:rows], t2[:rows], nl.add)
                nisa.dma_copy(dst=dst[b, t0 : t0 + rows, :, 0::2], src=re[:rows])
                nisa.dma_copy(dst=dst[b, t0 : t0 + rows, :, 1::2], src=ro[:rows])
    return q_out, k_out


# --------------------------------------------------------------------------------------------------
# torch-facing entry


def rope_tables_np(
    grid: Sequence[int], head_dim: int, start_frame: int = 0, frame_positions: Sequence[int] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Host-side ``(cos, sin)`` tables ``[L, D//2]`` fp32 (angles in float64), as the kernels consume them."""
    import torch

    from reference.rope3d import rope_tables

    cos, sin = rope_tables(grid, head_dim, start_frame, frame_positions, dtype=torch.float64)
    return cos.to(torch.float32).numpy(), sin.to(torch.float32).numpy()


def rope3d_emulated(
    q: Any,
    k: Any,
    grid: Sequence[int],
    start_frame: int = 0,
    frame_positions: Sequence[int] | None = None,
    lnc: int = 1,
) -> tuple[Any, Any]:
    """Wan 3D RoPE of ``q`` and ``k`` through :func:`rope3d_kernel` (emulator on CPU tensors).

    Args:
        q, k: torch ``[B, L, H, D]`` bf16 or fp32, same shape and dtype, D even, L = F*Hp*Wp.
        grid: ``(F, Hp, Wp)``.
        start_frame: time position of frame 0; ignored when ``frame_positions`` (length F) is given.
        lnc: logical cores of the launch (1 or 2).

    Returns:
        ``(q_rot, k_rot)`` new torch tensors with q's shape and dtype.
    """
    import torch

    from nki_kernels._nki import launch

    if q.shape != k.shape or q.dim() != 4:
        raise ValueError(
            f"q and k must both be [B, L, H, D] of equal shape, got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if q.dtype != k.dtype or q.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"q and k must share dtype bfloat16 or float32, got {q.dtype} and {k.dtype}")
    d = q.shape[3]
    if d % 2:
        raise ValueError(f"q/k head_dim D={d} must be even")
    f, hp, wp = (int(g) for g in grid)
    if f * hp * wp != q.shape[1]:
        raise ValueError(f"grid {tuple(grid)} gives {f * hp * wp} tokens but q has L={q.shape[1]}")
    cos, sin = rope_tables_np(grid, d, start_frame, frame_positions)
    (qo, ko), _ = launch(rope3d_kernel, q.contiguous(), k.contiguous(), cos, sin, lnc=lnc)
    return _to_torch(qo, q.dtype), _to_torch(ko, q.dtype)


def rope3d_tables_emulated(q: Any, k: Any, cos: Any, sin: Any, lnc: int = 1) -> tuple[Any, Any]:
    """RoPE of ``q`` and ``k`` through :func:`rope3d_kernel` with caller-built tables (no per-call angles).

    Args:
        q, k: torch ``[B, L, H, D]`` bf16 or fp32, same shape and dtype, D even.
        cos, sin: torch ``[L, D//2]`` float32 (the kernel's operand dtype) or float64 (rounded to float32
            here, the rounding :func:`rope_tables_np` applies), e.g. from :func:`reference.rope3d.rope_tables`
            built once per forward and shared by every layer.
        lnc: logical cores of the launch (1 or 2).

    Returns:
        ``(q_rot, k_rot)`` new torch tensors with q's shape and dtype. For tables of the same positions the
        result equals :func:`rope3d_emulated`'s bit for bit (same kernel, same fp32 tables).
    """
    import torch

    from nki_kernels._nki import launch

    if q.shape != k.shape or q.dim() != 4:
        raise ValueError(
            f"q and k must both be [B, L, H, D] of equal shape, got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if q.dtype != k.dtype or q.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"q and k must share dtype bfloat16 or float32, got {q.dtype} and {k.dtype}")
    if q.shape[3] % 2:
        raise ValueError(f"q/k head_dim D={q.shape[3]} must be even")
    want = (q.shape[1], q.shape[3] // 2)
    tabs = []
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != want:
            raise ValueError(f"{name} must be [L, D//2] = {want}, got {tuple(t.shape)}")
        if t.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{name} must be float32 or float64, got {t.dtype}")
        tabs.append(t.detach().to("cpu", torch.float32).contiguous().numpy())
    (qo, ko), _ = launch(rope3d_kernel, q.contiguous(), k.contiguous(), tabs[0], tabs[1], lnc=lnc)
    return _to_torch(qo, q.dtype), _to_torch(ko, q.dtype)


def _to_torch(x: Any, dtype: Any) -> Any:
    import torch

    if isinstance(x, torch.Tensor):
        return x.to(dtype)
    arr = np.asarray(x)
    if arr.dtype.name == "bfloat16":
        return torch.from_numpy(arr.view(np.uint16).astype(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(arr)).to(dtype)


__all__ = [
    "rope3d_emulated",
    "rope3d_kernel",
    "rope3d_tables_emulated",
    "rope3d_naive_kernel",
    "rope_tables_np",
]
