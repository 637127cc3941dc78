"""Causal 3-D convolution (kernel ``(kt, kh, kw)``, each 1 or 3, stride 1) as a packed implicit GEMM
(standalone NKI 0.6 API).

The convolutions of Wan's video VAE (``WanCausalConv3d``; the 2-D convs of its upsamplers are ``kt = 1``):
zero padding of ``kh // 2`` / ``kw // 2`` in height and width, *causal* in time: output frame ``t`` reads
input frames ``t .. t + kt - 1`` of ``x``, whose first ``kt - 1`` frames are the streaming cache (the
previous chunk's last input frames) or zeros.

Math: ``out[co, t, h, w] = bias[co] + sum_{ci, a, b, c} w[(a*kh + b)*kw + c, ci, co] *
x[ci, t + a, h + b - kh//2, w + c - kw//2]``, zero outside the image.

Layouts: ``x`` ``[C_in, T + kt - 1, H, W]`` HBM (channel-major: one batch row of the VAE's ``[B, C, T, H,
W]``), ``w`` ``[kt*kh*kw, C_in, C_out]`` (tap-major; from torch's ``[C_out, C_in, kt, kh, kw]`` by
``w.permute(2, 3, 4, 1, 0).reshape(-1, C_in, C_out)``, once at load), ``bias`` ``[C_out]`` fp32 or ``None``,
``out`` ``[C_out, T, H, W]`` in x's dtype.  bf16 or fp32.  fp32 accumulation in PSUM, bias added in fp32.

Design (the packing is :mod:`nki_kernels.conv3d_plan`'s: ``s`` output rows per row group on the PE columns
with the output channels, ``s`` input row phases x ``at`` time taps x ``C_in`` on the contraction rows):

* **Weights** resident for the whole call (every frame and band): one SBUF tile holding every stationary
  block ``[(o_in, a_in, ci), (u, co)]`` per (time offset, column tap, row-group offset, contraction tile),
  zero where the tap falls outside the kernel; loaded once, by one DMA per (row phase, time tap, channel
  piece, output row ``u``).
* **Bands** of ``j`` row groups: a slot holds, per contraction tile, ``[128, (j + ko - 1) x W]`` (no
  padding columns), row ``jr`` of partition ``(o_in, a_in, ci)`` = input row ``s*(j0 + jr) + o_in - kh//2``
  of frame ``f + a_in`` (zero rows outside the image: memset, then one DMA per channel piece).  With the
  time taps packed two slots alternate and each output frame loads its ``kt`` frames; with them looped
  ``kt + 1`` slots hold consecutive frames and each output frame loads one new frame.
* Each PSUM bank ``[s*C_out tile, rows x seg <= 512]`` accumulates, for every time offset, column tap and
  non-zero block ``(k, g)``, one matmul: stationary the block, moving the band tile ``g`` seen ``k`` row
  groups down and ``c - kw//2`` columns over (output columns whose shifted input lies outside the image
  are left out of that matmul; the centre tap goes first and covers the bank).
* Evictions add the bias on ScalarE (``activation`` with a per-partition bias) or VectorE
  (``tensor_scalar``), alternately, into an output staging tile ``[s*C_out tile, j x W]``; then one store
  DMA per (output row ``u``, channel piece) of the column tile.

Limits: ``C_in, C_out >= 1`` (any); ``H, W >= 1``; ``T >= 1``; the plan must fit (``plan_conv`` raises:
the weights of the plainest packing over :data:`W_BYTES_MAX`, or a one-row band over :data:`SBUF_BYTES`).
LNC1 only (no program split).
"""

from __future__ import annotations

import math
from typing import Any

from nki_kernels._nki import nisa, nki, nl
from nki_kernels.conv3d_plan import KERNEL_SIZES, SBUF_BYTES, W_BYTES_MAX, ConvPlan, forced_plan, plan_conv
from nki_kernels.hw_limits import PMAX, PSUM_BANK_FMAX


def _pieces(width: int, blocks: int) -> list[tuple[int, int, int, int, int]]:
    """``(block, i0, n, tile, p0)``: ``blocks`` consecutive runs of ``width`` rows cut at 128-row tile edges
    (run ``block``'s rows ``i0 .. i0 + n`` sit at partitions ``p0 ..`` of tile ``tile``)."""
    out = []
    for blk in range(blocks):
        i0 = 0
        while i0 < width:
            tile, p0 = divmod(blk * width + i0, PMAX)
            n = min(width - i0, PMAX - p0)
            out.append((blk, i0, n, tile, p0))
            i0 += n
    return out


def _runs(sorted_rows: list[int]) -> list[tuple[int, int]]:
    """Maximal ``[lo, hi)`` runs of consecutive ints."""
    out: list[tuple[int, int]] = []
    for r in sorted_rows:
        if out and out[-1][1] == r:
            out[-1] = (out[-1][0], r + 1)
        else:
            out.append((r, r + 1))
    return out


def _load_weights(w: Any, wsb: Any, p: ConvPlan) -> None:
    """The packed stationary blocks: per ``(a_out, k, g)`` block used by a matmul, a memset where some tap
    falls outside the kernel (VectorE / GpSimd alternately), then one DMA per contraction piece covering
    the ``kw`` column taps and the column blocks ``v`` whose taps lie inside."""
    kt, kh, kw = p.ksize
    c_in, c_out = p.c_in, p.c_out
    wfree = p.a_loops * kw * p.ko * p.k_tiles * p.mp
    used = {kg for blocks in p.blocks for kg in blocks}
    pieces = _pieces(c_in, p.s * p.at)
    n_set = 0
    for a_out in range(p.a_loops):
        for k, g in sorted(used):
            base = p.w_index(a_out, 0, k, g)
            mine = [(blk, ci0, n, p0) for blk, ci0, n, gg, p0 in pieces if gg == g]
            spans = [p.u_range(blk // p.at, k) for blk, _, _, _ in mine]
            if any(hi - lo + 1 < p.s for lo, hi in spans):  # zero entries in this block
                eng = nisa.vector_engine if n_set % 2 == 0 else nisa.gpsimd_engine
                nisa.memset(wsb[:, base : base + kw * p.mp], value=0.0, engine=eng)
                n_set += 1
            for (blk, ci0, n, p0), (lo, hi) in zip(mine, spans):
                if lo > hi:
                    continue
                a = a_out * p.at + blk % p.at
                b0 = p.s * k + blk // p.at - (p.s - 1 - lo)  # tap b of column block lo
                dst = wsb.ap(
                    pattern=[[wfree, n], [p.mp, kw], [c_out, hi - lo + 1], [1, c_out]],
                    offset=p0 * wfree + base + lo * c_out,
                )
                src = w.ap(
                    pattern=[[c_out, n], [c_in * c_out, kw], [kw * c_in * c_out, hi - lo + 1], [1, c_out]],
                    offset=(a * kh + b0) * kw * c_in * c_out + ci0 * c_out,
                )
                nisa.dma_copy(dst=dst, src=src)


@nki.jit
def conv3d_causal_kernel(x, w, bias, ksize=(3, 3, 3), packing=None):
    """``out[C_out, T, H, W]``; see the module docstring (``ksize`` a compile-time tuple; ``packing`` an
    optional compile-time ``(s, at)`` that replaces the planner's choice, for tests and measurements:
    ``ValueError`` when it does not fit)."""
    C_in, F, H, W = x.shape
    C_out = w.shape[2]
    KT, KH, KW = (int(k) for k in ksize)
    T = F - (KT - 1)
    dt = x.dtype
    isz = 4 if dt == nl.float32 else 2
    if packing is None:
        p = plan_conv(C_in, C_out, H, W, isz, (KT, KH, KW), frames=T)
    else:
        p = forced_plan(C_in, C_out, H, W, isz, (KT, KH, KW), packing)
    S, AT, KP, MP, KO, BR, J = p.s, p.at, p.kp, p.mp, p.ko, p.band_rows, p.j
    PH, PW = (KH - 1) // 2, (KW - 1) // 2
    out = nl.ndarray((C_out, T, H, W), dtype=dt, buffer=nl.shared_hbm)
    segs = [(s0, min(p.seg, W - s0)) for s0 in range(0, W, p.seg)]
    bands = [(j0, min(J, p.groups - j0)) for j0 in range(0, p.groups, J)]
    in_pieces = _pieces(C_in, S * AT)  # contraction rows (o_in, a_in) blocks
    out_pieces = _pieces(C_out, S)  # PE columns: column blocks v (output row s - 1 - v)

    wsb = nl.ndarray((PMAX, p.a_loops * KW * KO * p.k_tiles * MP), dtype=dt, buffer=nl.sbuf)
    _load_weights(w, wsb, p)
    bsb = None
    if bias is not None:
        bsb = nl.ndarray((PMAX, p.m_tiles), dtype=nl.float32, buffer=nl.sbuf)
        for _, o0, n, m, p0 in out_pieces:
            nisa.dma_copy(dst=bsb[p0 : p0 + n, m : m + 1], src=bias.ap(pattern=[[1, n], [1, 1]], offset=o0))

    xb = [[nl.ndarray((PMAX, BR * W), dtype=dt, buffer=nl.sbuf) for _ in range(p.k_tiles)]
          for _ in range(p.n_slots)]  # fmt: skip
    acc = [nl.ndarray((PMAX, PSUM_BANK_FMAX), dtype=nl.float32, buffer=nl.psum) for _ in range(4)]
    ob = [nl.ndarray((PMAX, J * W), dtype=dt, buffer=nl.sbuf) for _ in range(3)]
    count = {"slot": 0, "acc": 0, "ob": 0, "ev": 0}

    def load_slot(tiles: list[Any], f: int, j0: int, jn: int) -> None:
        """Rows of row groups ``j0 .. j0 + jn + ko - 2`` of frames ``f .. f + at - 1`` into ``tiles``."""
        nr = jn + KO - 1
        zero: dict[int, set[int]] = {}
        spans = []
        for blk, ci0, n, g, p0 in in_pieces:
            o_in, a_in = divmod(blk, AT)
            rows = [S * (j0 + jr) + o_in - PH for jr in range(nr)]
            ok = [jr for jr in range(nr) if 0 <= rows[jr] < H]
            zero.setdefault(g, set()).update(jr for jr in range(nr) if not 0 <= rows[jr] < H)
            if ok:
                spans.append((g, p0, n, ci0, f + a_in, ok[0], len(ok), rows[ok[0]]))
        for g, jrs in zero.items():  # rows outside the image (a run at the top, one at the bottom)
            for lo, hi in _runs(sorted(jrs)):
                nisa.memset(tiles[g][:, lo * W : hi * W], value=0.0)
        for g, p0, n, ci0, fa, jr0, nv, r0 in spans:
            if S == 1:
                dst = tiles[g].ap(pattern=[[BR * W, n], [1, nv * W]], offset=p0 * BR * W + jr0 * W)
                src = x.ap(pattern=[[F * H * W, n], [1, nv * W]], offset=((ci0 * F + fa) * H + r0) * W)
            else:
                dst = tiles[g].ap(pattern=[[BR * W, n], [W, nv], [1, W]], offset=p0 * BR * W + jr0 * W)
                src = x.ap(
                    pattern=[[F * H * W, n], [S * W, nv], [1, W]], offset=((ci0 * F + fa) * H + r0) * W
                )
            nisa.dma_copy(dst=dst, src=src)

    # steps (band, output frame t): the slots they read ({group: slot}; a group is the frame t with the time
    # taps packed, else one frame) and the groups they load; a step's loads are issued before the previous
    # step computes when their slots are free of it (prefetch), else just before the step
    steps = []
    held: dict[tuple[int, int], int] = {}
    for j0, jn in bands:
        for t in range(T):
            keys = [t] if AT == KT else [t + a for a in range(KT)]
            loads = [q for q in keys if (j0, q) not in held]
            for q in loads:
                held[(j0, q)] = count["slot"] % p.n_slots
                count["slot"] += 1
            steps.append((j0, jn, t, {q: held[(j0, q)] for q in keys}, loads))
    issued: set[tuple[int, int]] = set()

    def issue(i: int, busy: set[int]) -> None:
        j0, jn, _, used, loads = steps[i]
        for q in loads:
            if (i, q) not in issued and used[q] not in busy:
                issued.add((i, q))
                load_slot(xb[used[q]], q, j0, jn)

    taps_c = [PW] + [c for c in range(KW) if c != PW]  # centre column tap first: it covers the bank
    for i, (j0, jn, t, used, _) in enumerate(steps):
        issue(i, set())
        if i + 1 < len(steps):
            issue(i + 1, set(used.values()))
        for m, blocks in enumerate(p.blocks):
            mm = min(PMAX, MP - m * PMAX)
            o = ob[count["ob"] % 3]
            count["ob"] += 1
            for q0 in range(0, jn, p.jb):
                qn = min(p.jb, jn - q0)
                for s0, ss in segs:
                    a_t = acc[count["acc"] % 4]
                    count["acc"] += 1
                    first = True
                    for a_out in range(p.a_loops):
                        band = xb[used[t + a_out]] if AT != KT else xb[used[t]]
                        for c in taps_c:
                            d = c - PW
                            x0, x1 = max(s0, -d), min(s0 + ss, W - d)  # output columns inside
                            if x1 <= x0:
                                continue
                            for k, g in blocks:
                                kk = min(PMAX, KP - g * PMAX)
                                wo = p.w_index(a_out, c, k, g) + m * PMAX
                                nisa.nc_matmul(
                                    dst=a_t.ap(pattern=[[PSUM_BANK_FMAX, mm], [ss, qn], [1, x1 - x0]],
                                               offset=x0 - s0),
                                    stationary=wsb[:kk, wo : wo + mm],
                                    moving=band[g].ap(pattern=[[BR * W, kk], [W, qn], [1, x1 - x0]],
                                                      offset=(q0 + k) * W + x0 + d),
                                    accumulate=not first,
                                )  # fmt: skip
                                first = False
                    src = a_t.ap(pattern=[[PSUM_BANK_FMAX, mm], [ss, qn], [1, ss]], offset=0)
                    dst = o.ap(pattern=[[J * W, mm], [W, qn], [1, ss]], offset=q0 * W + s0)
                    ev = count["ev"] % 2
                    count["ev"] += 1
                    if bsb is not None and ev == 0:
                        nisa.activation(dst, nl.copy, src, bias=bsb[:mm, m : m + 1])
                    elif bsb is not None:
                        nisa.tensor_scalar(dst, src, nl.add, bsb[:mm, m : m + 1], engine=nisa.vector_engine)
                    elif ev == 0:
                        nisa.activation(dst, nl.copy, src)
                    else:
                        nisa.tensor_copy(dst=dst, src=src, engine=nisa.vector_engine)
            for v, o0, n, mt, p0 in out_pieces:
                if mt != m:
                    continue
                u = S - 1 - v  # output row of column block v
                nv = sum(1 for jj in range(jn) if S * (j0 + jj) + u < H)  # rows inside the image
                if nv == 0:
                    continue
                r0 = S * j0 + u
                src = o.ap(pattern=[[J * W, n], [1, nv * W]], offset=p0 * J * W)
                if S == 1:
                    dst = out.ap(pattern=[[T * H * W, n], [1, nv * W]], offset=((o0 * T + t) * H + r0) * W)
                else:
                    dst = out.ap(
                        pattern=[[T * H * W, n], [S * W, nv], [1, W]], offset=((o0 * T + t) * H + r0) * W
                    )
                nisa.dma_copy(dst=dst, src=src)
    return out


def conv3d_causal_emulated(
    x: Any,
    w: Any,
    bias: Any = None,
    ksize: tuple[int, int, int] = (3, 3, 3),
    lnc: int = 1,
    packing: tuple[int, int] | None = None,
) -> Any:
    """Causal 3-D convolution through :func:`conv3d_causal_kernel` on the emulator.

    Args:
        x: torch ``[C_in, T + kt - 1, H, W]`` (``kt - 1`` context frames first), bf16 or fp32, contiguous.
        w: torch ``[kt * kh * kw, C_in, C_out]``, same dtype.
        ksize: ``(kt, kh, kw)``, each 1 or 3 (Wan's VAE: (3, 3, 3) convs, (1, 1, 1) shortcuts, (3, 1, 1)
            temporal upsampling convs, (1, 3, 3) spatial ones).
        bias: torch ``[C_out]`` (added in fp32) or ``None``.
        lnc: logical cores (1 only: the kernel has no LNC split yet).
        packing: ``(s, at)`` instead of the planner's choice (:func:`nki_kernels.conv3d_plan.forced_plan`
            raises ``ValueError`` when it does not fit), or ``None``.

    Returns:
        torch ``[C_out, T, H, W]`` in x's dtype.
    """
    import torch

    from nki_kernels._nki import launch
    from nki_kernels.linear import _to_numpy
    from nki_kernels.rope3d import _to_torch

    taps = math.prod(ksize)
    if (
        x.dim() != 4
        or w.dim() != 3
        or w.shape[0] != taps
        or w.shape[1] != x.shape[0]
        or x.shape[1] < ksize[0]
    ):
        raise ValueError(
            f"conv3d: x [C_in, T+{ksize[0] - 1}, H, W] (T >= 1) and w [{taps}, C_in, C_out] must agree for "
            f"ksize={ksize}, got {tuple(x.shape)}, {tuple(w.shape)}"
        )
    b = None if bias is None else _to_numpy(bias.to(torch.float32))
    args = (_to_numpy(x), _to_numpy(w), b, tuple(ksize)) + (() if packing is None else (tuple(packing),))
    res, _ = launch(conv3d_causal_kernel, *args, lnc=lnc)
    return _to_torch(res, x.dtype)


__all__ = [
    "KERNEL_SIZES",
    "SBUF_BYTES",
    "W_BYTES_MAX",
    "conv3d_causal_kernel",
    "conv3d_causal_emulated",
    "plan_conv",
]
