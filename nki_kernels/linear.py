"""Linear layer ``out = x @ w (+ bias)`` as one NKI kernel (standalone NKI 0.6 API via
:mod:`nki_kernels._nki`).

Layouts: ``x`` ``[M, K]`` row-major HBM (tokens x in-features: the layout activations have), ``w`` ``[K, N]``
row-major HBM (in-features x out-features: ``nn.Linear.weight.T``, prepared once when the model loads),
``bias`` ``[N]`` or ``None``, ``out`` ``[M, N]`` in x's dtype.  bf16 or fp32 (fp32 runs TensorE at a
quarter of the rate: a correctness path).  Accumulation is fp32 in PSUM; the bias is added in fp32 before
the one rounding to the output dtype.

Tiling (all sizes derived from ``K`` and the dtype by :func:`plan_tiles`, a pure function):

* Tokens are taken in **m-blocks** of ``bm <= 1024`` rows.  The block's ``x`` rows are loaded once (one DMA
  per 128 rows, whole rows: ``K x itemsize`` bytes per descriptor) and transposed once on TensorE
  (``nc_transpose`` per ``128 x 128`` tile into PSUM, evicted to SBUF alternately by VectorE and ScalarE)
  into ``x^T`` ``[K, bm]`` (K on partitions), which stays resident for every output panel of the block:
  the transposes cost ``1 / (N / 128 x 4)`` of the block's matmul time instead of once per panel.
* Output columns go in **panels** of ``nb <= 512`` (one fp32 PSUM bank); a panel's weights ``[K, nb]``
  are loaded once per m-block (double-buffered: panel ``j + 1`` loads while ``j`` computes).
* Per 128-row tile and panel: ``K / 128`` matmuls (stationary ``x^T [128 k, 128 m]``, moving ``w [128 k,
  nb]``) accumulate in one of 4 rotating PSUM banks; the eviction (VectorE ``tensor_tensor`` with the bias
  panel broadcast over partitions, else alternately VectorE / ScalarE copies) overlaps the next tile's
  matmuls; the store is one DMA per tile.
* Software pipeline: the next m-block's rows are fetched while this block's first panel computes, and
  transposed right after it (into the second ``x^T`` set), so TensorE never waits at a block boundary.

LNC: ``kernel[2]`` deals the m-blocks round-robin to the logical cores.

Limits: ``M, N >= 1``; ``1 <= K <= 32768`` (bf16; 16384 fp32) so that one 128-row ``x^T`` set fits the SBUF
budget.  Tails (``M``, ``K``, ``N`` not multiples of 128 / ``nb``) are sliced, not padded.
"""

from __future__ import annotations

import math
from typing import Any

from nki_kernels._nki import nisa, nki, nl
from nki_kernels.hw_limits import GEMM_MOVING_FMAX, PMAX

PANEL_MAX = GEMM_MOVING_FMAX
"""Widest output panel: one PSUM bank of fp32 per partition (TensorE moving free size <= 512)."""

BLOCK_M_MAX = 1024
"""Most tokens per m-block."""

SBUF_BUDGET = 160 * 1024
"""SBUF bytes per partition the kernel's tiles may use (of 192 KiB; the rest is headroom)."""

W_BUDGET = 72 * 1024
"""SBUF bytes per partition for the two weight panels ``[K, nb]`` in flight."""

XS_COLS = 2048
"""Columns of x per staging DMA (``XS_COLS x itemsize`` bytes per partition, two buffers rotate)."""

ACC_BANKS = 4
"""Rotating PSUM accumulators (one bank each)."""


def plan_tiles(m: int, k: int, n: int, itemsize: int) -> tuple[int, int, int]:
    """``(bm, nb, sets)`` for ``[m, k] @ [k, n]`` with ``itemsize``-byte inputs (a pure function).

    ``nb``: the widest panel (512, 256 or 128, at most ``n``) whose two weight buffers ``2 x ceil(k / 128)
    x nb x itemsize`` fit :data:`W_BUDGET`.  What is left of :data:`SBUF_BUDGET` after the weights, the x
    staging buffers and the output/bias tiles holds the resident ``x^T`` sets (``ceil(k / 128) x bm x
    itemsize`` each): two sets (the next m-block transposed while this one computes) when that still allows
    ``bm >= 512`` (or all of ``m``), else one set with the largest ``bm``; ``bm`` a multiple of 128, at most
    1024 and at most ``m`` rounded up to 128.  Raises ``ValueError`` when ``k`` is too large for 128-wide
    panels and 128-token blocks.
    """
    for name, v in (("m", m), ("k", k), ("n", n), ("itemsize", itemsize)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"plan_tiles: {name} must be a positive int, got {v!r}")
    kt = math.ceil(k / PMAX)
    nb = next((w for w in (PANEL_MAX, 256, PMAX) if 2 * kt * w * itemsize <= W_BUDGET), 0)
    cap = min(BLOCK_M_MAX, math.ceil(m / PMAX) * PMAX)
    small = 2 * XS_COLS * itemsize + 3 * PANEL_MAX * itemsize + 2 * PANEL_MAX * 4
    left = SBUF_BUDGET - 2 * kt * nb * itemsize - small
    per_tok = kt * itemsize
    if nb == 0 or left < PMAX * per_tok:
        kmax = (W_BUDGET // (2 * PMAX * itemsize)) * PMAX
        raise ValueError(
            f"linear: K={k} is too large for the kernel's SBUF tiles (at most K={kmax} at {itemsize} B)"
        )
    bm2 = min(cap, left // (2 * per_tok) // PMAX * PMAX)
    if bm2 >= min(cap, 512):
        return bm2, min(nb, n), 2
    return min(cap, left // per_tok // PMAX * PMAX), min(nb, n), 1


@nki.jit
def linear_kernel(x, w, bias):
    """``out[M, N] = x[M, K] @ w[K, N] (+ bias[N])``; see the module docstring for layouts and tiling."""
    M, K = x.shape
    N = w.shape[1]
    dt = x.dtype
    isz = 4 if dt == nl.float32 else 2
    bm, nb, sets = plan_tiles(M, K, N, isz)
    out = nl.ndarray((M, N), dtype=dt, buffer=nl.shared_hbm)
    kt = math.ceil(K / PMAX)
    kfull = K // PMAX  # k-tiles with all 128 rows (one DMA per panel moves them)
    ktail = K - kfull * PMAX
    panels = [(n0, min(nb, N - n0)) for n0 in range(0, N, nb)]
    blocks = [(m0, min(bm, M - m0)) for m0 in range(0, M, bm)]
    mine = blocks[nl.program_id(0) :: nl.num_programs()]
    if not mine:
        return out
    xcols = min(XS_COLS, K)
    chunks = [(c0, min(xcols, K - c0)) for c0 in range(0, K, xcols)]

    xs = [nl.ndarray((PMAX, xcols), dtype=dt, buffer=nl.sbuf) for _ in range(2)]
    xT = [nl.ndarray((PMAX, kt * bm), dtype=dt, buffer=nl.sbuf) for _ in range(sets)]
    wb = [nl.ndarray((PMAX, kt * nb), dtype=dt, buffer=nl.sbuf) for _ in range(2)]
    bb = (
        [nl.ndarray((PMAX, nb), dtype=nl.float32, buffer=nl.sbuf) for _ in range(2)]
        if bias is not None
        else []
    )
    ob = [nl.ndarray((PMAX, nb), dtype=dt, buffer=nl.sbuf) for _ in range(3)]
    acc = [nl.ndarray((PMAX, nb), dtype=nl.float32, buffer=nl.psum) for _ in range(ACC_BANKS)]
    tps = [nl.ndarray((PMAX, PMAX), dtype=dt, buffer=nl.psum) for _ in range(2)]
    count = {"tp": 0, "acc": 0, "ob": 0, "ev": 0, "panel": 0, "xs": 0}

    def evict_copy(dst: Any, src: Any) -> None:
        # PSUM -> SBUF copies alternate between VectorE and ScalarE (both read PSUM at ~1 element/cycle)
        if count["ev"] % 2 == 0:
            nisa.tensor_copy(dst=dst, src=src, engine=nisa.vector_engine)
        else:
            nisa.activation(dst, nl.copy, src)
        count["ev"] += 1

    def stage_list(blk: tuple[int, int]) -> list[tuple[int, int, int, int]]:
        """(row offset in block, rows, first column, columns) of every x staging DMA of ``blk``."""
        _, rows = blk
        out_l = []
        for r0 in range(0, rows, PMAX):
            for c0, cc in chunks:
                out_l.append((r0, min(PMAX, rows - r0), c0, cc))
        return out_l

    def fetch(blk: tuple[int, int], item: tuple[int, int, int, int]) -> Any:
        r0, rr, c0, cc = item
        buf = xs[count["xs"] % 2]
        count["xs"] += 1
        nisa.dma_copy(dst=buf[:rr, :cc], src=x[blk[0] + r0 : blk[0] + r0 + rr, c0 : c0 + cc])
        return buf

    def transpose(blk: tuple[int, int], s: int, first: Any) -> None:
        # x^T of the block into set s; the DMA of staging item i+1 is issued before the transposes of item i
        items = stage_list(blk)
        bufs = [first]
        for i, (r0, rr, c0, cc) in enumerate(items):
            if i + 1 < len(items):
                bufs.append(fetch(blk, items[i + 1]))
            buf = bufs[i]
            for t0 in range(0, cc, PMAX):
                kk = min(PMAX, cc - t0)
                j = (c0 + t0) // PMAX
                tp = tps[count["tp"] % 2]
                count["tp"] += 1
                nisa.nc_transpose(dst=tp[:kk, :rr], data=buf[:rr, t0 : t0 + kk])
                evict_copy(xT[s][:kk, j * bm + r0 : j * bm + r0 + rr], tp[:kk, :rr])

    def load_panel(n0: int, nn: int) -> tuple[Any, Any]:
        ws = wb[count["panel"] % 2]
        bs = bb[count["panel"] % 2] if bb else None
        count["panel"] += 1
        if kfull:
            # every full k-tile of the panel in one DMA: partition p of tile j <- w[j*128 + p, n0:n0+nn]
            src = w.ap(pattern=[[N, PMAX], [PMAX * N, kfull], [1, nn]], offset=n0)
            dst = ws.ap(pattern=[[kt * nb, PMAX], [nb, kfull], [1, nn]], offset=0)
            nisa.dma_copy(dst=dst, src=src)
        if ktail:
            nisa.dma_copy(dst=ws[:ktail, kfull * nb : kfull * nb + nn], src=w[kfull * PMAX : K, n0 : n0 + nn])
        if bs is not None:
            # the bias panel on every partition: a partition-stride-0 read of bias[n0:n0+nn]
            nisa.dma_copy(dst=bs[:, :nn], src=bias.ap(pattern=[[0, PMAX], [1, nn]], offset=n0))
        return ws, bs

    def panel(blk: tuple[int, int], s: int, n0: int, nn: int, ws: Any, bs: Any) -> None:
        m0, rows = blk
        for r0 in range(0, rows, PMAX):
            rr = min(PMAX, rows - r0)
            a = acc[count["acc"] % ACC_BANKS]
            count["acc"] += 1
            for j in range(kt):
                kk = min(PMAX, K - j * PMAX)
                nisa.nc_matmul(
                    dst=a[:rr, :nn],
                    stationary=xT[s][:kk, j * bm + r0 : j * bm + r0 + rr],
                    moving=ws[:kk, j * nb : j * nb + nn],
                    accumulate=(j > 0),
                )
            o = ob[count["ob"] % 3]
            count["ob"] += 1
            if bs is not None:
                nisa.tensor_tensor(o[:rr, :nn], a[:rr, :nn], bs[:rr, :nn], nl.add, engine=nisa.vector_engine)
            else:
                evict_copy(o[:rr, :nn], a[:rr, :nn])
            nisa.dma_copy(dst=out[m0 + r0 : m0 + r0 + rr, n0 : n0 + nn], src=o[:rr, :nn])

    # work items in order: (block index, panel); a panel's weights are loaded one item ahead in program
    # order (a DMA queue is FIFO: loads issued behind this item's stores would wait for its evictions)
    work = [(bi, pj) for bi in range(len(mine)) for pj in range(len(panels))]
    loaded = [load_panel(*panels[work[0][1]])]
    transpose(mine[0], 0, fetch(mine[0], stage_list(mine[0])[0]))
    first = None
    for i, (bi, pj) in enumerate(work):
        blk, s = mine[bi], bi % sets
        nxt = mine[bi + 1] if bi + 1 < len(mine) else None
        last = pj == len(panels) - 1
        if nxt is not None and ((sets == 2 and pj == 0) or (sets == 1 and last)):
            first = fetch(nxt, stage_list(nxt)[0])  # the next block's first rows load during this panel
        if i + 1 < len(work):
            loaded.append(load_panel(*panels[work[i + 1][1]]))
        panel(blk, s, *panels[pj], *loaded[i])
        if nxt is not None and sets == 2 and pj == 0:
            transpose(nxt, 1 - s, first)  # two x^T sets: right after this block's first panel
        if nxt is not None and sets == 1 and last:
            transpose(nxt, 0, first)  # one set: after every panel has read it
    return out


def _to_numpy(t: Any) -> Any:
    import numpy as np
    import torch

    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.detach().contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return np.ascontiguousarray(t.detach().numpy())


def linear_emulated(x: Any, w: Any, bias: Any = None, lnc: int = 1) -> Any:
    """``x @ w (+ bias)`` through :func:`linear_kernel` on the emulator.

    Args:
        x: torch ``[M, K]`` bf16 or fp32, contiguous.
        w: torch ``[K, N]``, same dtype.
        bias: torch ``[N]`` (any float dtype; added in fp32) or ``None``.
        lnc: logical cores (1 or 2).

    Returns:
        torch ``[M, N]`` in x's dtype.
    """
    import torch

    from nki_kernels._nki import launch
    from nki_kernels.rope3d import _to_torch

    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(
            f"linear: x [M, K] and w [K, N] must agree on K, got {tuple(x.shape)}, {tuple(w.shape)}"
        )
    b = None if bias is None else _to_numpy(bias.to(torch.float32))
    res, _ = launch(linear_kernel, _to_numpy(x), _to_numpy(w), b, lnc=lnc)
    return _to_torch(res, x.dtype)


__all__ = ["linear_kernel", "linear_emulated", "plan_tiles"]
