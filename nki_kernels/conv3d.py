"""Causal 3-D convolution (kernel ``(kt, kh, kw)``, each 1 or 3, stride 1) as a blocked implicit GEMM
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

Design (per output-channel tile ``co <= 128``; weights ``[C_in, taps x C_out]`` resident in SBUF):

* Output rows are taken in **bands** of ``R`` rows; a band of frame ``t`` needs input rows ``r0 - kh//2 ..
  r0 + R - 1 + kh//2`` of frames ``t .. t + kt - 1`` for each input-channel tile: one DMA each into a
  zero-bordered SBUF tile ``[ci, R + kh - 1, W + kw - 1]`` (two rotating sets).
* Each PSUM bank ``[co, rows x seg <= 512]`` (``rows`` output rows x a ``seg``-column segment) accumulates
  ``kt*kh*kw x ceil(C_in / 128)`` matmuls: stationary ``w[tap][ci, co]``, moving the band viewed at the
  tap's offset (a 2-D access pattern ``[rows, seg]`` with row stride ``W + kw - 1``: the shifted window
  *is* the im2col column, nothing is copied).
* Evictions add the bias on ScalarE (``activation`` with a per-partition bias: channels are on
  partitions) or VectorE (``tensor_scalar``), alternately, to SBUF, then one store DMA per bank.

Limits: ``C_in, C_out >= 1`` (any; tiled by 128); ``H, W >= 1``; ``T >= 1``; the resident weights
``ceil(C_in/128) x kt*kh*kw x C_out x itemsize`` bytes per partition must fit :data:`W_BYTES_MAX`; one band
tile of one output row ``kh x (W + kw - 1) x itemsize`` must fit its share of :data:`BAND_BYTES`.
LNC1 only (no program split).
"""

from __future__ import annotations

import math
from typing import Any

from nki_kernels._nki import nisa, nki, nl
from nki_kernels.hw_limits import GEMM_MOVING_FMAX, PMAX, PSUM_BANK_FMAX

W_BYTES_MAX = 96 * 1024
"""SBUF bytes per partition for the resident weights."""

BAND_BYTES = 72 * 1024
"""SBUF bytes per partition for all input band tiles ``[ci, R + kh - 1, W + kw - 1]`` (``2 x kt x
ceil(C_in / 128)`` of them rotate), so one tile gets ``BAND_BYTES / (2 kt ceil(C_in / 128))``."""

KERNEL_SIZES = (1, 3)
"""Kernel extents the kernel takes per axis (time, height, width)."""


def plan_conv(
    c_in: int, c_out: int, h: int, w: int, itemsize: int, ksize: tuple[int, int, int] = (3, 3, 3)
) -> tuple[int, int, int]:
    """``(R, rows, seg)``: output rows per band, output rows per PSUM bank and columns per segment.

    ``seg = ceil(W / ceil(W / 512))`` (equal segments of at most 512 columns); ``rows = 512 // seg`` rows
    per bank (at most ``R``); ``R``: the most rows (at most ``H``, a multiple of ``rows`` when possible)
    whose band tile ``(R + kh - 1) x (W + kw - 1) x itemsize`` fits its share of :data:`BAND_BYTES`.
    Raises ``ValueError`` when the weights or a one-row band do not fit.
    """
    for name, v in (("c_in", c_in), ("c_out", c_out), ("h", h), ("w", w), ("itemsize", itemsize)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"plan_conv: {name} must be a positive int, got {v!r}")
    if len(ksize) != 3 or any(k not in KERNEL_SIZES for k in ksize):
        raise ValueError(
            f"conv3d: ksize must be 3 extents (time, height, width) each in {KERNEL_SIZES}, got {ksize}"
        )
    kt, kh, kw = ksize
    wbytes = math.ceil(c_in / PMAX) * kt * kh * kw * c_out * itemsize
    if wbytes > W_BYTES_MAX:
        raise ValueError(
            f"conv3d: weights of C_in={c_in} x C_out={c_out} need {wbytes} B per partition resident, "
            f"more than {W_BYTES_MAX}; split C_out"
        )
    seg = math.ceil(w / math.ceil(w / GEMM_MOVING_FMAX))
    per_tile = BAND_BYTES // (2 * kt * math.ceil(c_in / PMAX))
    fit = per_tile // ((w + kw - 1) * itemsize) - (kh - 1)
    if fit < 1:
        raise ValueError(
            f"conv3d: W={w} is too wide: {kh} input rows of {w + kw - 1} elements do not fit a band tile of "
            f"{per_tile} B per partition (C_in={c_in}, kt={kt})"
        )
    rows = max(1, min(PSUM_BANK_FMAX // seg, h, fit))
    r = min(h, fit)
    if r >= rows:
        r = r // rows * rows
    return r, rows, seg


@nki.jit
def conv3d_causal_kernel(x, w, bias, ksize=(3, 3, 3)):
    """``out[C_out, T, H, W]``; see the module docstring (``ksize`` a compile-time tuple)."""
    C_in, F, H, W = x.shape
    C_out = w.shape[2]
    KT, KH, KW = (int(k) for k in ksize)
    TAPS = KT * KH * KW
    T = F - (KT - 1)
    dt = x.dtype
    isz = 4 if dt == nl.float32 else 2
    R, rows, seg = plan_conv(C_in, C_out, H, W, isz, (KT, KH, KW))
    out = nl.ndarray((C_out, T, H, W), dtype=dt, buffer=nl.shared_hbm)
    cits = [(c0, min(PMAX, C_in - c0)) for c0 in range(0, C_in, PMAX)]
    cots = [(c0, min(PMAX, C_out - c0)) for c0 in range(0, C_out, PMAX)]
    segs = [(s0, min(seg, W - s0)) for s0 in range(0, W, seg)]
    bands = [(r0, min(R, H - r0)) for r0 in range(0, H, R)]
    Wp = W + KW - 1
    PH, PW = (KH - 1) // 2, (KW - 1) // 2
    BR = R + KH - 1  # band rows

    # resident weights: partition ci, free (tap, co) -- one DMA per ci tile
    wsb = []
    for c0, cc in cits:
        t = nl.ndarray((PMAX, TAPS * C_out), dtype=dt, buffer=nl.sbuf)
        src = w.ap(pattern=[[C_out, cc], [C_in * C_out, TAPS], [1, C_out]], offset=c0 * C_out)
        nisa.dma_copy(dst=t.ap(pattern=[[TAPS * C_out, cc], [C_out, TAPS], [1, C_out]], offset=0), src=src)
        wsb.append(t)
    bsb = None
    if bias is not None:
        bsb = nl.ndarray((PMAX, len(cots)), dtype=nl.float32, buffer=nl.sbuf)
        for j, (o0, oc) in enumerate(cots):
            nisa.dma_copy(dst=bsb[:oc, j : j + 1], src=bias.ap(pattern=[[1, oc], [1, 1]], offset=o0))

    nbuf = KT * len(cits) * 2  # a band's KT frames x ci tiles, double-buffered
    xb = [nl.ndarray((PMAX, BR * Wp), dtype=dt, buffer=nl.sbuf) for _ in range(nbuf)]
    if PW:
        for t in xb:  # zero borders (the padding columns are never written by a load)
            nisa.memset(t, value=0.0)
    acc = [nl.ndarray((PMAX, PSUM_BANK_FMAX), dtype=nl.float32, buffer=nl.psum) for _ in range(4)]
    ob = [nl.ndarray((PMAX, PSUM_BANK_FMAX), dtype=dt, buffer=nl.sbuf) for _ in range(3)]
    count = {"band": 0, "acc": 0, "ob": 0, "ev": 0}

    def load_band(t: int, r0: int, rr: int) -> list[list[Any]]:
        """Band tiles [frame a][ci tile] of input rows r0-PH .. r0+rr-1+PH (zero outside the image)."""
        base = (count["band"] % 2) * KT * len(cits)
        count["band"] += 1
        lo, hi = max(0, r0 - PH), min(H, r0 + rr + PH)  # input rows that exist
        tiles: list[list[Any]] = []
        for a in range(KT):
            row = []
            for i, (c0, cc) in enumerate(cits):
                tb = xb[base + a * len(cits) + i]
                first = lo - (r0 - PH)  # band row of input row lo (PH at the top edge)
                if first > 0:
                    nisa.memset(tb[:cc, 0 : first * Wp], value=0.0)
                last = first + (hi - lo)
                if last < rr + KH - 1:
                    nisa.memset(tb[:cc, last * Wp : (rr + KH - 1) * Wp], value=0.0)
                dst = tb.ap(pattern=[[BR * Wp, cc], [Wp, hi - lo], [1, W]], offset=first * Wp + PW)
                src = x.ap(
                    pattern=[[F * H * W, cc], [W, hi - lo], [1, W]], offset=((c0 * F + t + a) * H + lo) * W
                )
                nisa.dma_copy(dst=dst, src=src)
                row.append(tb)
            tiles.append(row)
        return tiles

    for o_j, (o0, oc) in enumerate(cots):
        for t in range(T):
            for r0, rr in bands:
                band = load_band(t, r0, rr)
                for q0 in range(0, rr, rows):
                    qr = min(rows, rr - q0)
                    for s0, ss in segs:
                        a_t = acc[count["acc"] % 4]
                        count["acc"] += 1
                        n = qr * ss
                        first = True
                        for a in range(KT):
                            for b in range(KH):
                                for c in range(KW):
                                    tap = (a * KH + b) * KW + c
                                    for i, (_, cc) in enumerate(cits):
                                        mv = band[a][i].ap(
                                            pattern=[[BR * Wp, cc], [Wp, qr], [1, ss]],
                                            offset=(q0 + b) * Wp + s0 + c,
                                        )
                                        nisa.nc_matmul(
                                            dst=a_t[:oc, :n],
                                            stationary=wsb[i][:cc, tap * C_out + o0 : tap * C_out + o0 + oc],
                                            moving=mv,
                                            accumulate=not first,
                                        )
                                        first = False
                        o = ob[count["ob"] % 3]
                        count["ob"] += 1
                        ev = count["ev"] % 2
                        count["ev"] += 1
                        if bsb is not None and ev == 0:
                            nisa.activation(o[:oc, :n], nl.copy, a_t[:oc, :n], bias=bsb[:oc, o_j : o_j + 1])
                        elif bsb is not None:
                            nisa.tensor_scalar(
                                o[:oc, :n],
                                a_t[:oc, :n],
                                nl.add,
                                bsb[:oc, o_j : o_j + 1],
                                engine=nisa.vector_engine,
                            )
                        elif ev == 0:
                            nisa.activation(o[:oc, :n], nl.copy, a_t[:oc, :n])
                        else:
                            nisa.tensor_copy(dst=o[:oc, :n], src=a_t[:oc, :n], engine=nisa.vector_engine)
                        dst = out.ap(
                            pattern=[[T * H * W, oc], [W, qr], [1, ss]],
                            offset=((o0 * T + t) * H + r0 + q0) * W + s0,
                        )
                        nisa.dma_copy(dst=dst, src=o[:oc, :n])
    return out


def conv3d_causal_emulated(
    x: Any, w: Any, bias: Any = None, ksize: tuple[int, int, int] = (3, 3, 3), lnc: int = 1
) -> Any:
    """Causal 3-D convolution through :func:`conv3d_causal_kernel` on the emulator.

    Args:
        x: torch ``[C_in, T + kt - 1, H, W]`` (``kt - 1`` context frames first), bf16 or fp32, contiguous.
        w: torch ``[kt * kh * kw, C_in, C_out]``, same dtype.
        ksize: ``(kt, kh, kw)``, each 1 or 3 (Wan's VAE: (3, 3, 3) convs, (1, 1, 1) shortcuts, (3, 1, 1)
            temporal upsampling convs, (1, 3, 3) spatial ones).
        bias: torch ``[C_out]`` (added in fp32) or ``None``.
        lnc: logical cores (1 only: the kernel has no LNC split yet).

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
    res, _ = launch(conv3d_causal_kernel, _to_numpy(x), _to_numpy(w), b, tuple(ksize), lnc=lnc)
    return _to_torch(res, x.dtype)


__all__ = ["conv3d_causal_kernel", "conv3d_causal_emulated", "plan_conv"]
