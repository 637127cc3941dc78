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
  tokens ``t0 + p*m ... t0 + p*m + m - 1``, i.e. one contiguous run of ``m * H * D`` elements (``m`` up to
  16, fewer when H*D is large: :func:`_plan` fits the tiles in :data:`SBUF_BUDGET_BYTES`). One DMA reads
  the super-tile of q (or k), one writes it back: every descriptor is a whole multiple of a token's
  ``H*D`` row. The tables' rows for the same tokens are read once per super-tile (``m * D/2 * 4`` bytes per
  partition) and reused for q, k, every batch and every head (a stride-0 broadcast view over heads).
* **De-interleave in SBUF**, never in the DMA: ``x[..., 0::2]`` and ``x[..., 1::2]`` are stride-2 free-dim
  views of the loaded tile; the results are written back through the same views (in place).
* **One compute engine.** GpSimdE forms the four fp32 products and the two sums (one rounding to the
  output dtype) in instructions of up to :data:`CHUNK_PAIRS` pairs per partition. VectorE and GpSimdE
  share the SBUF port (the cost model's ``vector_gpsimd_contention``, 1.0-2.0): at the pessimistic end
  any work split between them costs the sum of their times, and VectorE's fp32 ``tensor_tensor``
  (2 cycles per element at 0.96 GHz, or 1 plus 141 per instruction with a PSUM operand) is slower per
  element than GpSimdE's (1 at 1.2 GHz). ScalarE cannot multiply two tensors, so it has nothing to do.
* **Pipelined.** q/k tiles rotate through a ring of :data:`X_RING` buffers and the tables through a ring
  of :data:`TABLE_RING`: the load of the next tile and the store of the previous one overlap the rotation.
* The tail (fewer than 128 tokens left) uses ``m = 1`` with fewer partitions.
* LNC: ``rope3d_kernel[2]`` splits the super-tiles between the two logical cores (``nl.program_id(0)``).

:func:`rope3d_one_kernel` rotates a single tensor (the keys of a roped cache copy): the same pass over
one input, half the traffic and half the work of :func:`rope3d_kernel`.

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
from nki_kernels.hw_limits import PMAX

MAX_TOKENS_PER_PARTITION = 16
"""Upper bound on the tokens per partition ``m`` of a super-tile (H=3, D=128 bf16: 16 x 768 B = 12 KiB)."""

SBUF_BUDGET_BYTES = 144 * 1024
"""SBUF bytes per partition the kernel may use (of 192 KiB): the x ring, the table rings, the temporaries."""

X_RING = 3
"""Super-tile buffers of q/k in flight: one loading, one being rotated, one storing."""

TABLE_RING = 2
"""cos/sin buffers: the next super-tile's tables load while the current one is rotated."""

RAMP_PAIRS = 1536
"""Pairs per partition of the smallest super-tile of the ramp (GpSimdE's 150-cycle start: < 10 %)."""

CHUNK_PAIRS = 4096
"""Pairs per partition of one compute instruction (at most): GpSimdE's 150-cycle start is < 4 % of it."""


def _plan(h: int, d: int, itemsize: int) -> tuple[int, int]:
    """``(m, ct)``: tokens per partition of a super-tile and of a compute chunk (``ct`` divides ``m``).

    ``m`` is the largest value <= :data:`MAX_TOKENS_PER_PARTITION` whose x ring, table rings and four fp32
    temporaries of ``ct`` tokens fit :data:`SBUF_BUDGET_BYTES`; ``ct = min(m, CHUNK_PAIRS // (h * d/2))``
    (at least 1; the last chunk of a super-tile may be shorter).
    """
    half = d // 2
    for m in range(MAX_TOKENS_PER_PARTITION, 0, -1):
        ct = max(1, min(m, CHUNK_PAIRS // (h * half)))
        need = X_RING * m * h * d * itemsize + TABLE_RING * 2 * m * half * 4 + 4 * ct * h * half * 4
        if need <= SBUF_BUDGET_BYTES or m == 1:
            return m, ct
    raise AssertionError("unreachable")


def _ramp_start(h: int, d: int, max_m: int) -> int:
    """Smallest power of two ``m`` with >= :data:`RAMP_PAIRS` pairs per partition (at most ``max_m``)."""
    m = 1
    while m < max_m and m * h * (d // 2) < RAMP_PAIRS:
        m *= 2
    return m


def _super_tiles(length: int, max_m: int, min_m: int = 1) -> list[tuple[int, int, int]]:
    """Split ``length`` tokens into ``(t0, rows, m)`` super-tiles: rows partitions x m tokens each.

    The ``length // 128`` full rows of 128 tokens are cut into super-tiles of ``m`` rows: a ramp
    ``min_m, 2*min_m, ...`` (below ``max_m``) first, so that the first rotation waits only for a small
    load, then ``max_m`` rows (and one smaller remainder), then the ramp reversed, so that the last store
    after the last rotation is small. The last < 128 tokens form one super-tile of ``m = 1`` with fewer
    partitions.
    """
    units = length // PMAX
    ramp: list[int] = []
    m = min_m
    while m < max_m and 2 * (sum(ramp) + m) <= units:
        ramp.append(m)
        m *= 2
    full, rem = divmod(units - 2 * sum(ramp), max_m)
    ms = ramp + [max_m] * full + ([rem] if rem else []) + ramp[::-1]
    out = []
    t0 = 0
    for m in ms:
        out.append((t0, PMAX, m))
        t0 += PMAX * m
    if t0 < length:
        out.append((t0, length - t0, 1))
    return out


def _rotate(x_sb: Any, tmp: Sequence[Any], c_sb: Any, s_sb: Any, rows: int, j0: int, n: int, H: int) -> None:
    """Rotate tokens ``j0 : j0 + n`` of the loaded super-tile ``x_sb`` ([P, m, H, D]) in place.

    All on GpSimdE in fp32 (``e*cos``, ``o*sin``, ``e*sin``, ``o*cos``, then ``e*cos - o*sin`` and
    ``o*cos + e*sin`` rounded once into the even / odd views); the tables are broadcast over heads.
    """
    g = nisa.gpsimd_engine
    xe = x_sb[:rows, j0 : j0 + n, :, 0::2]
    xo = x_sb[:rows, j0 : j0 + n, :, 1::2]
    cb = c_sb[:rows, j0 : j0 + n].expand_dim(2).broadcast(2, H)
    sb = s_sb[:rows, j0 : j0 + n].expand_dim(2).broadcast(2, H)
    ec, os_, es, oc = (t[:rows, :n] for t in tmp)
    nisa.tensor_tensor(ec, xe, cb, nl.multiply, engine=g)
    nisa.tensor_tensor(os_, xo, sb, nl.multiply, engine=g)
    nisa.tensor_tensor(es, xe, sb, nl.multiply, engine=g)
    nisa.tensor_tensor(oc, xo, cb, nl.multiply, engine=g)
    nisa.tensor_tensor(xe, ec, os_, nl.subtract, engine=g)
    nisa.tensor_tensor(xo, oc, es, nl.add, engine=g)


def _rope_pass(srcs: Sequence[Any], dsts: Sequence[Any], cos: Any, sin: Any) -> None:
    """Rotate every ``srcs[i]`` ``[B, L, H, D]`` into ``dsts[i]`` (HBM) with tables ``[L, D//2]``.

    Super-tiles of ``128 x m`` tokens (partition p holds m consecutive tokens: one contiguous HBM run)
    are dealt round-robin to the logical cores; per super-tile the tables load once (a ring of
    :data:`TABLE_RING`) and each (batch, tensor) tile goes load -> rotate in place -> store through a ring
    of :data:`X_RING` buffers, so the DMA of one tile overlaps the rotation of the next.
    """
    B, L, H, D = srcs[0].shape
    half = D // 2
    pid = nl.program_id(0)
    nprog = nl.num_programs()
    m_max, ct = _plan(H, D, 2 if srcs[0].dtype == nl.bfloat16 else 4)
    tiles = _super_tiles(L, m_max, _ramp_start(H, D, m_max))
    m_max = max(m for _, _, m in tiles)
    dt = srcs[0].dtype
    x_ring = [nl.ndarray((PMAX, m_max, H, D), dtype=dt, buffer=nl.sbuf) for _ in range(X_RING)]
    c_ring = [nl.ndarray((PMAX, m_max, half), dtype=nl.float32, buffer=nl.sbuf) for _ in range(TABLE_RING)]
    s_ring = [nl.ndarray((PMAX, m_max, half), dtype=nl.float32, buffer=nl.sbuf) for _ in range(TABLE_RING)]
    tmp = [nl.ndarray((PMAX, ct, H, half), dtype=nl.float32, buffer=nl.sbuf) for _ in range(4)]
    turn = 0
    mine = 0
    for i, (t0, rows, m) in enumerate(tiles):
        if i % nprog != pid:
            continue
        n_tok = rows * m
        c_sb, s_sb = c_ring[mine % TABLE_RING], s_ring[mine % TABLE_RING]
        mine += 1
        # Tables for these tokens: one contiguous run of m*half fp32 per partition.
        nisa.dma_copy(dst=c_sb[:rows, :m], src=cos[t0 : t0 + n_tok].reshape((rows, m, half)))
        nisa.dma_copy(dst=s_sb[:rows, :m], src=sin[t0 : t0 + n_tok].reshape((rows, m, half)))
        for b in range(B):
            for src, dst in zip(srcs, dsts):
                x_sb = x_ring[turn % X_RING]
                turn += 1
                nisa.dma_copy(dst=x_sb[:rows, :m], src=src[b, t0 : t0 + n_tok].reshape((rows, m, H, D)))
                for j0 in range(0, m, ct):
                    _rotate(x_sb, tmp, c_sb, s_sb, rows, j0, min(ct, m - j0), H)
                nisa.dma_copy(dst=dst[b, t0 : t0 + n_tok].reshape((rows, m, H, D)), src=x_sb[:rows, :m])


@nki.jit
def rope3d_kernel(q, k, cos, sin):
    """Rotate q and k ``[B, L, H, D]`` with tables ``cos``/``sin`` ``[L, D//2]`` fp32, returning
    ``(q_out, k_out)``.

    One launch covers q, k, every batch and every head. Each HBM byte of q and k is read once and written
    once with descriptors of ``m * H * D`` elements (whole token rows); the tables are read once. LNC-aware:
    super-tiles are dealt round-robin to ``nl.num_programs()`` logical cores.
    """
    q_out = nl.ndarray(q.shape, dtype=q.dtype, buffer=nl.shared_hbm)
    k_out = nl.ndarray(k.shape, dtype=k.dtype, buffer=nl.shared_hbm)
    _rope_pass((q, k), (q_out, k_out), cos, sin)
    return q_out, k_out


@nki.jit
def rope3d_one_kernel(x, cos, sin):
    """Rotate one tensor ``x`` ``[B, L, H, D]`` (e.g. keys only) with tables ``[L, D//2]`` fp32; returns
    ``x_out``. Same tiling, arithmetic and results as :func:`rope3d_kernel`'s k output, half its traffic."""
    x_out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    _rope_pass((x,), (x_out,), cos, sin)
    return x_out


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
    tabs = _host_tables(cos, sin, want)
    (qo, ko), _ = launch(rope3d_kernel, q.contiguous(), k.contiguous(), tabs[0], tabs[1], lnc=lnc)
    return _to_torch(qo, q.dtype), _to_torch(ko, q.dtype)


def rope3d_one_emulated(
    x: Any,
    grid: Sequence[int],
    frame_positions: Sequence[int] | None = None,
    start_frame: int = 0,
    lnc: int = 1,
) -> Any:
    """RoPE of ONE tensor ``x`` ``[B, L, H, D]`` through :func:`rope3d_one_kernel`, tables built per call
    from ``grid`` ``(F, Hp, Wp)`` and the time positions (``frame_positions``, length F, else
    ``start_frame + f``), as :func:`rope3d_emulated` builds them: bit for bit its k output for k = x."""
    f, hp, wp = (int(g) for g in grid)
    if x.dim() != 4 or f * hp * wp != x.shape[1]:
        raise ValueError(
            f"x must be [B, L, H, D] with L = F*Hp*Wp of grid {tuple(grid)}, got {tuple(x.shape)}"
        )
    if x.shape[3] % 2:
        raise ValueError(f"x head_dim D={x.shape[3]} must be even")
    import torch

    cos, sin = rope_tables_np(grid, x.shape[3], start_frame, frame_positions)
    return rope3d_one_tables_emulated(x, torch.from_numpy(cos), torch.from_numpy(sin), lnc=lnc)


def rope3d_one_tables_emulated(x: Any, cos: Any, sin: Any, lnc: int = 1) -> Any:
    """RoPE of ONE tensor ``x`` through :func:`rope3d_one_kernel` with caller-built tables.

    Args:
        x: torch ``[B, L, H, D]`` bf16 or fp32, D even (e.g. the keys of a roped cache copy).
        cos, sin: torch ``[L, D//2]`` float32 or float64 (float64 rounded to float32 here, as
            :func:`rope3d_tables_emulated` does).
        lnc: logical cores of the launch (1 or 2).

    Returns:
        a new torch tensor with x's shape and dtype, bit for bit the k output of
        :func:`rope3d_tables_emulated` for k = x (same tiling and arithmetic), at half its traffic.
    """
    import torch

    from nki_kernels._nki import launch

    if x.dim() != 4:
        raise ValueError(f"x must be [B, L, H, D], got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"x must be bfloat16 or float32, got {x.dtype}")
    if x.shape[3] % 2:
        raise ValueError(f"x head_dim D={x.shape[3]} must be even")
    want = (x.shape[1], x.shape[3] // 2)
    tabs = _host_tables(cos, sin, want)
    xo, _ = launch(rope3d_one_kernel, x.contiguous(), tabs[0], tabs[1], lnc=lnc)
    return _to_torch(xo, x.dtype)


def _host_tables(cos: Any, sin: Any, want: tuple[int, int]) -> list[Any]:
    """``cos``, ``sin`` checked as ``[L, D//2]`` (``want``) float32/float64 torch tensors, returned as
    contiguous float32 numpy arrays (the kernels' table inputs)."""
    import torch

    tabs = []
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != want:
            raise ValueError(f"{name} must be [L, D//2] = {want}, got {tuple(t.shape)}")
        if t.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{name} must be float32 or float64, got {t.dtype}")
        tabs.append(t.detach().to("cpu", torch.float32).contiguous().numpy())
    return tabs


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
    "rope3d_one_emulated",
    "rope3d_one_kernel",
    "rope3d_one_tables_emulated",
    "rope3d_tables_emulated",
    "rope3d_naive_kernel",
    "rope_tables_np",
]
