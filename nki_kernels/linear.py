"""Linear layer ``out = x @ w (+ bias)`` as one NKI kernel (standalone NKI 0.6 API via
:mod:`nki_kernels._nki`).

Layouts: ``x`` ``[M, K]`` row-major HBM (tokens x in-features: the layout activations have), ``w`` ``[K, N]``
row-major HBM (in-features x out-features: ``nn.Linear.weight.T``, prepared once when the model loads),
``bias`` ``[N]`` or ``None``, ``out`` ``[M, N]`` in x's dtype.  bf16 or fp32 (fp32 runs TensorE at a
quarter of the rate: a correctness path).  Accumulation is fp32 in PSUM; the bias is added in fp32 before
the one rounding to the output dtype.

Tiling (all sizes derived from ``K`` and the dtype by :func:`plan_tiles`, a pure function):

* Tokens are taken in **m-blocks** of ``bm <= 1024`` rows (``bm / 128`` row tiles).  Each row tile's ``x``
  rows are loaded once, in **groups** of ``<= XS_COLS`` columns (one staging DMA each, ``XS_BUFS``
  rotating buffers, the next five in flight), and transposed once on TensorE: ``nc_transpose`` per
  ``128 x 128`` tile into a PSUM tile of one bank (8 bf16 / 4 fp32 k-tiles), evicted to SBUF by ONE copy
  (alternately VectorE and ScalarE) into ``x^T`` (K on partitions; row tile ``r``, k-tile ``j`` at columns
  ``(r * kt + j) * 128``), which stays resident for every output panel of the block.
* Output columns go in **panels** of ``nb <= 512`` (one fp32 PSUM bank); a panel's weights ``[K, nb]``
  are loaded once per m-block, double-buffered, in DMAs of ``W_CHUNK`` k-tiles: the next panel's chunks
  are issued one per row tile of this panel, so no staging fetch waits in the DMA pool behind a whole panel.
* Work items (block, panel, row tile): ``K / 128`` matmuls (stationary ``x^T [128 k, 128 m]``, moving
  ``w [128 k, nb]``) accumulate in one of 4 rotating PSUM banks; the eviction (VectorE ``tensor_tensor``
  with the bias panel broadcast over partitions, else alternately VectorE / ScalarE copies) overlaps the
  next item's matmuls; the store is one DMA per item.
* Transpose pacing: a group may be transposed once the ``x^T`` set's previous reader of its row tile
  (the last panel of the block ``sets`` blocks earlier) has been issued, and must be before its row
  tile's first matmul.  A block's groups are spread evenly over that window, so TensorE interleaves a
  few transposes between items instead of a burst at a block boundary (one ``x^T`` set: the next
  block's row tile ``r`` is transposed while this block's last panel computes rows ``r + 1 ...``).

LNC: ``kernel[2]`` deals the m-blocks round-robin to the logical cores.

Limits: ``M, N >= 1``; ``1 <= K <= 18432`` (bf16; 9216 fp32) so that two 128-column weight panels fit
:data:`W_BUDGET`.  Tails (``M``, ``K``, ``N`` not multiples of 128 / ``nb``) are sliced, not padded.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

from nki_kernels._nki import nisa, nki, nl
from nki_kernels.hw_limits import GEMM_MOVING_FMAX, PMAX

PANEL_MAX = GEMM_MOVING_FMAX
"""Widest output panel: one PSUM bank of fp32 per partition (TensorE moving free size <= 512)."""

BLOCK_M_MAX = 1024
"""Most tokens per m-block."""

SBUF_BUDGET = 192 * 1024
"""SBUF bytes per partition the kernel's tiles may use (of the 212,728 B the emulator allows on trn2,
``nki_kernels/emulator/hw.py``; the rest is headroom)."""

W_BUDGET = 72 * 1024
"""SBUF bytes per partition for the two weight panels ``[K, nb]`` in flight."""

XS_COLS = 2048
"""Columns of x per staging DMA (``XS_COLS x itemsize`` bytes per partition, two buffers rotate)."""

ACC_BANKS = 4
"""Rotating PSUM accumulators (one bank each)."""

XS_BUFS = 6
"""Rotating x staging buffers ``[128, XS_COLS]`` (the next five groups' rows in flight)."""

TP_BYTES = 2048
"""Bytes per partition of one transpose PSUM tile (one bank: 8 bf16 / 4 fp32 ``128 x 128`` transposes)."""

TP_BUFS = 3
"""Rotating transpose PSUM tiles (with :data:`ACC_BANKS`, 7 of the 8 banks)."""

LOOKAHEAD = 0
"""Work items ahead whose x^T row tiles must already be transposed (0: just before their first matmul,
which waits only for the eviction of its own k-tiles)."""

W_CHUNK = 16
"""k-tiles per weight DMA (a panel's load is spread over the previous panel's row tiles)."""


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
    small = XS_BUFS * XS_COLS * itemsize + 3 * PANEL_MAX * itemsize + 2 * PANEL_MAX * 4
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
    tpw = TP_BYTES // isz  # transposed columns per PSUM tile (one bank)

    xs = [nl.ndarray((PMAX, xcols), dtype=dt, buffer=nl.sbuf) for _ in range(XS_BUFS)]
    xT = [nl.ndarray((PMAX, kt * bm), dtype=dt, buffer=nl.sbuf) for _ in range(sets)]
    wb = [nl.ndarray((PMAX, kt * nb), dtype=dt, buffer=nl.sbuf) for _ in range(2)]
    bb = (
        [nl.ndarray((PMAX, nb), dtype=nl.float32, buffer=nl.sbuf) for _ in range(2)]
        if bias is not None
        else []
    )
    ob = [nl.ndarray((PMAX, nb), dtype=dt, buffer=nl.sbuf) for _ in range(3)]
    acc = [nl.ndarray((PMAX, nb), dtype=nl.float32, buffer=nl.psum) for _ in range(ACC_BANKS)]
    tps = [nl.ndarray((PMAX, tpw), dtype=dt, buffer=nl.psum) for _ in range(TP_BUFS)]
    count = {"tp": 0, "acc": 0, "ob": 0, "ev": 0, "panel": 0}

    def evict_copy(dst: Any, src: Any) -> None:
        # PSUM -> SBUF copies alternate between VectorE and ScalarE (both read PSUM at ~1 element/cycle)
        if count["ev"] % 2 == 0:
            nisa.tensor_copy(dst=dst, src=src, engine=nisa.vector_engine)
        else:
            nisa.activation(dst, nl.copy, src)
        count["ev"] += 1

    # the work items (block, panel, row tile) in program order and the x^T groups (one staging DMA of
    # <= XS_COLS columns of one row tile each) with the item before which each must be transposed
    # (``due``: the tile's first matmul) and the item after which it may be (``free``: the x^T set's
    # previous reader of that row tile has been issued)
    items = [
        (bi, pj, r0)
        for bi, (_, rows) in enumerate(mine)
        for pj in range(len(panels))
        for r0 in range(0, rows, PMAX)
    ]
    index = {it: i for i, it in enumerate(items)}
    last_p = len(panels) - 1
    groups = []
    for bi, (_, rows) in enumerate(mine):
        for r0 in range(0, rows, PMAX):
            prev = bi - sets
            free = index[(prev, last_p, r0)] + 1 if prev >= 0 else 0
            for c0 in range(0, K, xcols):
                groups.append((bi, r0, c0, min(xcols, K - c0), free, index[(bi, 0, r0)]))
    # each group's slot: the item before which it is transposed.  A block's groups are spread evenly over
    # the window from its first group's ``free`` to its last group's ``due`` (less LOOKAHEAD), then kept
    # within their own [free, due - LOOKAHEAD] and in order: TensorE never meets a burst of transposes
    # whose staging DMAs were issued just before.
    slot: list[int] = []
    for bi in range(len(mine)):
        mg = [g for g in groups if g[0] == bi]
        lo, hi = mg[0][4], max(mg[0][4], mg[-1][5] - LOOKAHEAD)
        for k, g in enumerate(mg):
            t = lo + (hi - lo) * k // len(mg)
            t = min(max(t, g[4]), max(g[4], g[5] - LOOKAHEAD))
            slot.append(max(t, slot[-1]) if slot else t)
    quota = [sum(1 for t in slot if t <= i) for i in range(len(items))]
    staged: list[Any] = []

    def fetch(gi: int) -> None:
        bi, r0, c0, cc = groups[gi][:4]
        m0, rows = mine[bi]
        rr = min(PMAX, rows - r0)
        buf = xs[gi % XS_BUFS]
        nisa.dma_copy(dst=buf[:rr, :cc], src=x[m0 + r0 : m0 + r0 + rr, c0 : c0 + cc])
        staged.append(buf)

    def transpose(gi: int) -> None:
        # the group's k-tiles into PSUM tiles of ``tpw`` columns, each evicted by one copy into x^T
        bi, r0, c0, cc = groups[gi][:4]
        rows = mine[bi][1]
        rr = min(PMAX, rows - r0)
        buf, s, r = staged[gi], bi % sets, r0 // PMAX
        for t0 in range(0, cc, tpw):
            tc = min(tpw, cc - t0)
            tp = tps[count["tp"] % TP_BUFS]
            count["tp"] += 1
            for u in range(0, tc, PMAX):
                kk = min(PMAX, tc - u)
                nisa.nc_transpose(dst=tp[:kk, u : u + rr], data=buf[:rr, t0 + u : t0 + u + kk])
            col = (r * kt + (c0 + t0) // PMAX) * PMAX
            nfull = tc // PMAX
            if rr == PMAX and nfull:
                evict_copy(xT[s][:, col : col + nfull * PMAX], tp[:, : nfull * PMAX])
            else:
                nfull = 0
            for u in range(nfull * PMAX, tc, PMAX):
                kk = min(PMAX, tc - u)
                evict_copy(xT[s][:kk, col + u : col + u + rr], tp[:kk, u : u + rr])
        if gi + XS_BUFS < len(groups):
            fetch(gi + XS_BUFS)  # into the buffer this group's transposes have just read

    wchunks = [(j0, min(j0 + W_CHUNK, kt)) for j0 in range(0, kt, W_CHUNK)]

    def panel_loads(n0: int, nn: int) -> tuple[Any, Any, list[Any]]:
        """The next weight/bias buffers and the panel's loads (closures, issued by the caller): the bias
        panel, then one DMA per chunk of <= W_CHUNK k-tiles."""
        ws = wb[count["panel"] % 2]
        bs: Any = bb[count["panel"] % 2] if bb else None
        count["panel"] += 1

        def load_bias() -> None:
            # the bias panel on every partition: a partition-stride-0 read of bias[n0:n0+nn]
            nisa.dma_copy(dst=bs[:, :nn], src=bias.ap(pattern=[[0, PMAX], [1, nn]], offset=n0))

        def load_chunk(j0: int, j1: int) -> None:
            jf = min(j1, kfull) - j0  # full k-tiles of the chunk
            if jf > 0:
                # partition p of tile j <- w[j*128 + p, n0:n0+nn], every full tile of the chunk in one DMA
                src = w.ap(pattern=[[N, PMAX], [PMAX * N, jf], [1, nn]], offset=j0 * PMAX * N + n0)
                dst = ws.ap(pattern=[[kt * nb, PMAX], [nb, jf], [1, nn]], offset=j0 * nb)
                nisa.dma_copy(dst=dst, src=src)
            if j1 > kfull and ktail:
                nisa.dma_copy(
                    dst=ws[:ktail, kfull * nb : kfull * nb + nn], src=w[kfull * PMAX : K, n0 : n0 + nn]
                )

        loads: list[Callable[[], None]] = [load_bias] if bs is not None else []
        loads += [partial(load_chunk, j0, j1) for j0, j1 in wchunks]
        return ws, bs, loads

    def tile(bi: int, r0: int, n0: int, nn: int, ws: Any, bs: Any) -> None:
        m0, rows = mine[bi]
        rr = min(PMAX, rows - r0)
        col = (r0 // PMAX) * kt * PMAX
        s = bi % sets
        a = acc[count["acc"] % ACC_BANKS]
        count["acc"] += 1
        for j in range(kt):
            kk = min(PMAX, K - j * PMAX)
            nisa.nc_matmul(
                dst=a[:rr, :nn],
                stationary=xT[s][:kk, col + j * PMAX : col + j * PMAX + rr],
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

    # a panel's weights are loaded one panel ahead in program order (a DMA queue is FIFO: loads issued
    # behind this panel's stores would wait for their evictions)
    # start-up: the first group's rows, the first panel's weights, then the other staging buffers (the
    # first matmuls need the panel)
    fetch(0)
    ws, bs, first = panel_loads(*panels[0])
    for ld in first:
        ld()
    for gi in range(1, min(XS_BUFS, len(groups))):
        fetch(gi)
    work = [(bi, pj) for bi in range(len(mine)) for pj in range(len(panels))]
    tdone = 0
    for wi, (bi, pj) in enumerate(work):
        # the next panel's loads spread over this panel's row tiles (one chunk before each, the rest
        # before the last): the DMA pool never holds a whole panel ahead of a staging fetch
        nws, nbs, pending = panel_loads(*panels[work[wi + 1][1]]) if wi + 1 < len(work) else (ws, bs, [])
        rows = list(range(0, mine[bi][1], PMAX))
        for ri, r0 in enumerate(rows):
            while tdone < quota[index[(bi, pj, r0)]]:
                transpose(tdone)
                tdone += 1
            take = (
                len(pending) if ri == len(rows) - 1 else min(len(pending), 1 + (ri == 0 and bs is not None))
            )
            for ld in pending[:take]:
                ld()
            del pending[:take]
            tile(bi, r0, *panels[pj], ws, bs)
        ws, bs = nws, nbs
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
