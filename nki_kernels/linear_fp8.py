"""FP8 linear layer ``out = (q(x) @ w_q) * x_scale * w_scale (+ bias)`` as one NKI kernel (standalone NKI
0.6 API via :mod:`nki_kernels._nki`): e4m3 double-row matmuls on TensorE, per-token activation scales
computed in the kernel, per-output-channel weight scales prepared offline
(:func:`reference.linear.quantize_weight_fp8`).

Layouts: ``x`` ``[M, K]`` row-major HBM, bf16 or fp32 (tokens x in-features); ``w_q`` ``[K, N]`` row-major
HBM, ``float8_e4m3`` (NeuronCore-v3's e4m3, max finite 240: the values of
``quantize_weight_fp8(weight_t)``); ``w_scale`` ``[N]`` fp32; ``bias`` ``[N]`` fp32 or ``None``; ``out``
``[M, N]`` in x's dtype.

Numerics (reproduced exactly by :func:`reference.linear.linear_fp8`, up to the fp32 accumulation order):

* per token ``m``: ``amax = max_k |x[m, k]|`` (fp32), ``a = max(amax, AMAX_FLOOR)``, ``x_scale = a / 240``
  and ``inv = 240 / a`` (fp32 divisions), ``q[m, k] = e4m3(x[m, k] * inv)`` (fp32 product, round to
  nearest even; ``|x * inv| <= 240`` so nothing saturates);
* ``acc = q @ w_q`` in fp32 (fp8 x fp8 products are exact in fp32; PSUM accumulates in fp32);
* ``out = round((acc * x_scale[m]) * w_scale[n] + bias[n])`` (fp32 products and sum, one rounding).

Tiling (sizes from :func:`plan_tiles_fp8`, a pure function):

* Tokens in **m-blocks** of ``bm <= 1024`` rows; the block's ``q^T`` ``[K, bm]`` (fp8, K on partitions)
  stays resident for every output panel.  Per 128-token tile: the rows ``[128, K]`` are loaded (DMAs of
  <= 2048 columns), ScalarE computes ``|x|`` with a max-reduce into ``amax`` (one pass), VectorE the two
  ``[128, 1]`` scales, ScalarE the quantising cast (``activation(copy, scale=inv)`` -> fp8), TensorE
  transposes the fp8 tile in 128 x 128 pieces into one PSUM tile per 8 k-tiles (fp8, 1 KiB/partition),
  evicted in one copy per group (alternately VectorE / ScalarE).
* The next m-block's tiles go through that pipeline (load -> quantise -> transpose, each stage one step
  behind the previous) spread over this block's matmul work, into the second ``q^T`` set, so TensorE
  does not wait at block boundaries (one set when two do not fit: the next block is prepared after the
  last panel).
* Output **panels** of ``nb <= 512`` columns: the panel's fp8 weights ``[K, nb]`` (one DMA for all full
  k-tiles) and its ``w_scale`` / ``bias`` rows broadcast over partitions (stride-0 DMAs) load one work item
  ahead.  Per 128-token tile: ``K / 256`` double-row matmuls (stationary ``q^T [128, 2, 128]``, moving
  ``w [128, 2, nb]``: rows ``k0 + p`` and ``k0 + 128 + p`` of a 256-row k-pair on partition ``p``), then
  a plain fp8 matmul for an odd full k-tile and one for the partial tail, accumulating in one of 4
  rotating fp32 PSUM banks.  Eviction: VectorE ``scalar_tensor_tensor`` ``(acc * x_scale) * w_scale``
  (PSUM -> SBUF fp32), GpSimd ``tensor_tensor`` ``+ bias`` (-> x's dtype), one store DMA.

LNC: ``kernel[2]`` deals the m-blocks round-robin to the logical cores.

Limits: ``M, N >= 1``; ``K`` such that one 128-token ``q^T`` set fits next to the weight panels and the
row buffers (``plan_tiles_fp8`` raises; ``K <= 18,432`` bf16).  Tails in every dimension are sliced.
"""

from __future__ import annotations

import math
from typing import Any

from nki_kernels._nki import nisa, nki, nl
from nki_kernels.hw_limits import GEMM_MOVING_FMAX, PMAX

PANEL_MAX = GEMM_MOVING_FMAX
"""Widest output panel (one fp32 PSUM bank; TensorE moving free size <= 512)."""

BLOCK_M_MAX = 1024
"""Most tokens per m-block."""

SBUF_BUDGET = 168 * 1024
"""SBUF bytes per partition the kernel's tiles may use (of 192 KiB)."""

W_BUDGET = 72 * 1024
"""Most SBUF bytes per partition for the two fp8 weight panels."""

XS_COLS = 2048
"""Columns of x per load DMA."""

ACC_BANKS = 4
"""Rotating PSUM accumulators (one bank each)."""

TP_GROUP = 8
"""k-tiles transposed into one PSUM tile (``[128, 8, 128]`` fp8 = 1 KiB per partition) and evicted by
one copy."""

E4M3_MAX = 240.0
"""Largest finite ``float8_e4m3`` (NeuronCore-v3's e4m3, the double-row matmul's type)."""

AMAX_FLOOR = 2.0**-96
"""Smallest row absmax used for a scale (an all-zero row quantises to zeros instead of dividing by 0)."""


def _fixed_bytes(k: int, nb: int, xbufs: int, itemsize: int) -> int:
    """SBUF bytes per partition of everything but the ``q^T`` sets (a pure function)."""
    kt = math.ceil(k / PMAX)
    weights = 2 * kt * nb
    rows = xbufs * k * itemsize + 3 * min(
        k, XS_COLS
    )  # row buffers + fp8 |x| scratch and two quantised chunks
    tiles = 3 * nb * 4 + 3 * nb * itemsize + 2 * 2 * nb * 4  # fp32 eviction, output, w_scale/bias panels
    return weights + rows + tiles + 256  # + the [128, 1] scale tiles


def plan_tiles_fp8(m: int, k: int, n: int, itemsize: int) -> tuple[int, int, int, int]:
    """``(bm, nb, sets, xbufs)`` for ``[m, k] @ [k, n]`` with ``itemsize``-byte activations (pure function).

    Tried in order, the first that fits :data:`SBUF_BUDGET` with two ``q^T`` sets of ``bm >= 384`` tokens
    (or all of ``m``): panel width ``nb`` 512, 256, 128 (two fp8 panels within :data:`W_BUDGET`) x two or
    one row buffers ``xbufs``.  ``nb = 512`` comes first even at the price of ``bm``: an fp8 panel row is
    ``nb`` bytes, and the weight DMAs' descriptors shrink with it (256 B ones are modelled at a sixth of
    the 512 B throughput).  Otherwise one set with the largest ``bm`` (``nb`` 512 first).  ``bm`` is a
    multiple of 128, at most 1024 and at most ``m`` rounded up to 128; ``nb`` at most ``n``.  Raises
    ``ValueError`` when not even one 128-token set fits.
    """
    for name, v in (("m", m), ("k", k), ("n", n), ("itemsize", itemsize)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"plan_tiles_fp8: {name} must be a positive int, got {v!r}")
    kt = math.ceil(k / PMAX)
    cap = min(BLOCK_M_MAX, math.ceil(m / PMAX) * PMAX)
    per_tok = kt + 1  # q^T bytes per token and partition (+ its fp32 scale, rounded up)
    options = [(nb, xb) for nb in (PANEL_MAX, 256, PMAX) if 2 * kt * nb <= W_BUDGET for xb in (2, 1)]
    for nb, xb in options:
        left = SBUF_BUDGET - _fixed_bytes(k, nb, xb, itemsize)
        bm2 = min(cap, max(left, 0) // (2 * per_tok) // PMAX * PMAX)
        if bm2 >= min(cap, 384):
            return bm2, min(nb, n), 2, xb
    for nb, xb in options:
        left = SBUF_BUDGET - _fixed_bytes(k, nb, xb, itemsize)
        bm1 = min(cap, max(left, 0) // per_tok // PMAX * PMAX)
        if bm1 >= PMAX:
            return bm1, min(nb, n), 1, xb
    raise ValueError(
        f"linear_fp8: K={k} is too large for the kernel's SBUF tiles at {itemsize} B activations"
    )


def max_k(itemsize: int) -> int:
    """Largest ``K`` (a multiple of 128) :func:`plan_tiles_fp8` accepts for ``itemsize``-byte activations."""
    lo, hi = PMAX, 64 * 1024
    while lo < hi:
        mid = (lo + hi + PMAX) // 2 // PMAX * PMAX
        try:
            plan_tiles_fp8(PMAX, mid, PMAX, itemsize)
            lo = mid
        except ValueError:
            hi = mid - PMAX
    return lo


@nki.jit
def linear_fp8_kernel(x, w_q, w_scale, bias):
    """``out[M, N]``: FP8 linear of ``x[M, K]`` with ``w_q[K, N]`` (e4m3) and ``w_scale[N]`` (+ ``bias[N]``);
    see the module docstring for the numerics, layouts and tiling."""
    M, K = x.shape
    N = w_q.shape[1]
    dt = x.dtype
    isz = 4 if dt == nl.float32 else 2
    f8 = w_q.dtype
    bm, nb, sets, xb = plan_tiles_fp8(M, K, N, isz)
    out = nl.ndarray((M, N), dtype=dt, buffer=nl.shared_hbm)
    kt = math.ceil(K / PMAX)
    kfull = K // PMAX
    ktail = K - kfull * PMAX
    panels = [(n0, min(nb, N - n0)) for n0 in range(0, N, nb)]
    blocks = [(m0, min(bm, M - m0)) for m0 in range(0, M, bm)]
    mine = blocks[nl.program_id(0) :: nl.num_programs()]
    if not mine:
        return out
    rt = math.ceil(bm / PMAX)

    xs = [nl.ndarray((PMAX, K), dtype=dt, buffer=nl.sbuf) for _ in range(xb)]
    xcols = min(XS_COLS, K)
    scr = nl.ndarray((PMAX, xcols), dtype=f8, buffer=nl.sbuf)
    xq = [nl.ndarray((PMAX, xcols), dtype=f8, buffer=nl.sbuf) for _ in range(2)]
    amax = [nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf) for _ in range(2)]
    inv = [nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf) for _ in range(2)]
    xT = [nl.ndarray((PMAX, kt, bm), dtype=f8, buffer=nl.sbuf) for _ in range(sets)]
    sx = [nl.ndarray((PMAX, rt), dtype=nl.float32, buffer=nl.sbuf) for _ in range(sets)]
    wb = [nl.ndarray((PMAX, kt, nb), dtype=f8, buffer=nl.sbuf) for _ in range(2)]
    wsb = [nl.ndarray((PMAX, nb), dtype=nl.float32, buffer=nl.sbuf) for _ in range(2)]
    bb = (
        [nl.ndarray((PMAX, nb), dtype=nl.float32, buffer=nl.sbuf) for _ in range(2)]
        if bias is not None
        else []
    )
    tb = [nl.ndarray((PMAX, nb), dtype=nl.float32, buffer=nl.sbuf) for _ in range(3)]
    ob = [nl.ndarray((PMAX, nb), dtype=dt, buffer=nl.sbuf) for _ in range(3)]
    acc = [nl.ndarray((PMAX, nb), dtype=nl.float32, buffer=nl.psum) for _ in range(ACC_BANKS)]
    tps = [nl.ndarray((PMAX, TP_GROUP, PMAX), dtype=f8, buffer=nl.psum) for _ in range(2)]
    count = {"tp": 0, "acc": 0, "ob": 0, "ev": 0, "panel": 0, "xq": 0}

    # ---- activation pipeline: task g = (block index, row tile); stages load -> quant -> transpose
    tasks: list[tuple[int, int]] = []
    for bi, (_, rows) in enumerate(mine):
        tasks.extend((bi, t) for t in range(math.ceil(rows / PMAX)))
    pipe = {"ld": 0, "q": 0, "tp": 0}

    def rows_of(g: int) -> tuple[int, int, int]:
        bi, t = tasks[g]
        m0, rows = mine[bi]
        return m0 + t * PMAX, min(PMAX, rows - t * PMAX), t

    def load(g: int) -> None:
        r0, rr, _ = rows_of(g)
        buf = xs[g % xb]
        for c0 in range(0, K, XS_COLS):
            cc = min(XS_COLS, K - c0)
            nisa.dma_copy(dst=buf[:rr, c0 : c0 + cc], src=x[r0 : r0 + rr, c0 : c0 + cc])

    def quant(g: int) -> None:
        _, rr, t = rows_of(g)
        src, am, iv = xs[g % xb], amax[g % 2], inv[g % 2]
        # |x| (to a scratch tile) with its running max over the row's chunks into amax (ScalarE registers)
        for c0 in range(0, K, XS_COLS):
            cc = min(XS_COLS, K - c0)
            cmd = nisa.reduce_cmd.reset_reduce if c0 == 0 else nisa.reduce_cmd.reduce
            nisa.activation(
                scr[:rr, :cc], nl.abs, src[:rr, c0 : c0 + cc], reduce_op=nl.maximum, reduce_res=am[:rr, :],
                reduce_cmd=cmd,
            )  # fmt: skip
        s = sx[tasks[g][0] % sets]
        nisa.tensor_scalar(
            dst=s[:rr, t : t + 1], data=am[:rr, :], op0=nl.maximum, operand0=AMAX_FLOOR,
            op1=nl.divide, operand1=E4M3_MAX, engine=nisa.vector_engine,
        )  # fmt: skip
        nisa.tensor_scalar(
            dst=iv[:rr, :], data=am[:rr, :], op0=nl.maximum, operand0=AMAX_FLOOR,
            op1=nl.divide, operand1=E4M3_MAX, reverse1=True, engine=nisa.vector_engine,
        )  # fmt: skip

    def evict(dst: Any, src: Any) -> None:
        if count["ev"] % 2 == 0:
            nisa.tensor_copy(dst=dst, src=src, engine=nisa.vector_engine)
        else:
            nisa.activation(dst, nl.copy, src)
        count["ev"] += 1

    def transpose(g: int) -> None:
        """Quantise task g's rows chunk by chunk (ScalarE cast to fp8) and transpose them into q^T."""
        _, rr, t = rows_of(g)
        src, iv, dstT = xs[g % xb], inv[g % 2], xT[tasks[g][0] % sets]
        c0 = t * PMAX
        for k0 in range(0, K, XS_COLS):
            kc = min(XS_COLS, K - k0)
            q = xq[count["xq"] % 2]
            count["xq"] += 1
            nisa.activation(q[:rr, :kc], nl.copy, src[:rr, k0 : k0 + kc], scale=iv[:rr, :])
            jf = k0 // PMAX + kc // PMAX  # full k-tiles of the chunk end here
            groups = [(j0, min(TP_GROUP, jf - j0), PMAX) for j0 in range(k0 // PMAX, jf, TP_GROUP)]
            if kc % PMAX:
                groups.append((jf, 1, kc % PMAX))
            for j0, gn, kk in groups:
                tp = tps[count["tp"] % 2]
                count["tp"] += 1
                for i in range(gn):
                    a0 = (j0 + i) * PMAX - k0
                    nisa.nc_transpose(dst=tp[:kk, i, :rr], data=q[:rr, a0 : a0 + kk])
                evict(dstT[:kk, j0 : j0 + gn, c0 : c0 + rr], tp[:kk, :gn, :rr])

    def step(limit: int) -> bool:
        """One pipeline step over tasks < limit: quantise, load ahead, transpose (one step behind the quant
        while loads can still go ahead).  Row buffer ld % xb was last read by transpose(ld - xb)."""
        did = False
        if pipe["q"] < pipe["ld"]:
            quant(pipe["q"])
            pipe["q"] += 1
            did = True
        while pipe["ld"] < limit and pipe["ld"] - pipe["tp"] < xb:
            load(pipe["ld"])
            pipe["ld"] += 1
            did = True
        if pipe["tp"] < pipe["q"] and (pipe["tp"] < pipe["q"] - 1 or pipe["q"] == pipe["ld"]):
            transpose(pipe["tp"])
            pipe["tp"] += 1
            did = True
        return did

    def flush(limit: int) -> None:
        while pipe["tp"] < limit:
            if not step(limit):
                raise RuntimeError(f"linear_fp8: activation pipeline stalled at {pipe} (limit {limit})")

    def load_panel(n0: int, nn: int) -> tuple[Any, Any, Any]:
        i = count["panel"] % 2
        count["panel"] += 1
        ws = wb[i]
        if kfull:
            src = w_q.ap(pattern=[[N, PMAX], [PMAX * N, kfull], [1, nn]], offset=n0)
            dst = ws.ap(pattern=[[kt * nb, PMAX], [nb, kfull], [1, nn]], offset=0)
            nisa.dma_copy(dst=dst, src=src)
        if ktail:
            nisa.dma_copy(dst=ws[:ktail, kfull : kfull + 1, :nn], src=w_q[kfull * PMAX : K, n0 : n0 + nn])
        nisa.dma_copy(dst=wsb[i][:, :nn], src=w_scale.ap(pattern=[[0, PMAX], [1, nn]], offset=n0))
        bs = None
        if bb:
            bs = bb[i]
            nisa.dma_copy(dst=bs[:, :nn], src=bias.ap(pattern=[[0, PMAX], [1, nn]], offset=n0))
        return ws, wsb[i], bs

    def tile(bi: int, t: int, n0: int, nn: int, ws: Any, wss: Any, bs: Any) -> None:
        m0, rows = mine[bi]
        s = bi % sets
        c0 = t * PMAX
        rr = min(PMAX, rows - c0)
        a = acc[count["acc"] % ACC_BANKS]
        count["acc"] += 1
        mms: list[tuple[Any, Any, bool]] = []
        for jp in range(kfull // 2):
            j = 2 * jp
            mms.append((xT[s][:, j : j + 2, c0 : c0 + rr], ws[:, j : j + 2, :nn], True))
        if kfull % 2:
            j = kfull - 1
            mms.append((xT[s][:, j : j + 1, c0 : c0 + rr], ws[:, j : j + 1, :nn], False))
        if ktail:
            mms.append(
                (xT[s][:ktail, kfull : kfull + 1, c0 : c0 + rr], ws[:ktail, kfull : kfull + 1, :nn], False)
            )
        for i, (st, mv, dr) in enumerate(mms):
            mode = nisa.matmul_perf_mode.double_row if dr else nisa.matmul_perf_mode.none
            nisa.nc_matmul(dst=a[:rr, :nn], stationary=st, moving=mv, accumulate=(i > 0), perf_mode=mode)
        o = ob[count["ob"] % 3]
        tt = tb[count["ob"] % 3]
        count["ob"] += 1
        tgt = tt if bs is not None else o
        nisa.scalar_tensor_tensor(
            dst=tgt[:rr, :nn], data=a[:rr, :nn], op0=nl.multiply, operand0=sx[s][:rr, t : t + 1],
            op1=nl.multiply, operand1=wss[:rr, :nn],
        )  # fmt: skip
        if bs is not None:
            nisa.tensor_tensor(o[:rr, :nn], tt[:rr, :nn], bs[:rr, :nn], nl.add, engine=nisa.gpsimd_engine)
        nisa.dma_copy(dst=out[m0 + c0 : m0 + c0 + rr, n0 : n0 + nn], src=o[:rr, :nn])

    # block b's tiles are tasks[start[b] : start[b + 1]]
    start = [0]
    for _, rows in mine:
        start.append(start[-1] + math.ceil(rows / PMAX))
    npan = len(panels)
    loaded = {0: load_panel(*panels[0])}
    flush(start[1])
    for bi in range(len(mine)):
        flush(start[bi + 1])  # this block's q^T is complete (a no-op when prepared during the last block)
        nt = start[bi + 1] - start[bi]
        nxt = start[bi + 2] if sets == 2 and bi + 2 < len(start) else start[bi + 1]
        ops = 3 * (nxt - start[bi + 1])  # pipeline stage operations of the next block
        for pj in range(npan):
            pi = bi * npan + pj
            if pi + 1 < len(mine) * npan:
                # the next panel's weights one panel ahead (DMA queues are FIFO: before this panel's stores)
                loaded[pi + 1] = load_panel(*panels[(pi + 1) % npan])
            for t in range(nt):
                tile(bi, t, *panels[pj], *loaded[pi])
                # the next block's pipeline, spread evenly over this block's tiles
                due = ops * (pj * nt + t + 1) // (npan * nt)
                while sum(pipe.values()) - 3 * start[bi + 1] < due and step(nxt):
                    pass
            del loaded[pi]
    return out


def _to_numpy(t: Any, fp8: bool = False) -> Any:
    import ml_dtypes
    import numpy as np
    import torch

    if fp8:
        return t.detach().to(torch.float32).contiguous().numpy().astype(ml_dtypes.float8_e4m3)
    if t.dtype == torch.bfloat16:
        return t.detach().contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return np.ascontiguousarray(t.detach().numpy())


def linear_fp8_emulated(x: Any, weight_q: Any, w_scale: Any, bias: Any = None, lnc: int = 1) -> Any:
    """The FP8 linear through :func:`linear_fp8_kernel` on the emulator.

    Args:
        x: torch ``[M, K]`` bf16 or fp32, contiguous.
        weight_q: torch ``[K, N]`` ``float8_e4m3fn`` holding e4m3 values (``|w| <= 240``: the output of
            :func:`reference.linear.quantize_weight_fp8`), passed to the kernel as ``float8_e4m3``.
        w_scale: torch ``[N]`` fp32 per-output-channel scales.
        bias: torch ``[N]`` (added in fp32) or ``None``.
        lnc: logical cores (1 or 2).

    Returns:
        torch ``[M, N]`` in x's dtype.
    """
    import torch

    from nki_kernels._nki import launch
    from nki_kernels.rope3d import _to_torch

    if x.dim() != 2 or weight_q.dim() != 2 or x.shape[1] != weight_q.shape[0]:
        raise ValueError(
            f"linear_fp8: x [M, K] and weight_q [K, N] must agree on K, got {tuple(x.shape)}, "
            f"{tuple(weight_q.shape)}"
        )
    b = None if bias is None else _to_numpy(bias.to(torch.float32))
    ws = _to_numpy(w_scale.to(torch.float32))
    res, _ = launch(linear_fp8_kernel, _to_numpy(x), _to_numpy(weight_q, fp8=True), ws, b, lnc=lnc)
    return _to_torch(res, x.dtype)


__all__ = [
    "AMAX_FLOOR",
    "E4M3_MAX",
    "linear_fp8_emulated",
    "linear_fp8_kernel",
    "max_k",
    "plan_tiles_fp8",
]
