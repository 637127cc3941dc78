"""Fused elementwise passes of the Wan DiT block as NKI kernels (standalone NKI 0.6 API via
:mod:`nki_kernels._nki`): adaLN modulation with its LayerNorm, the gated residual, and RMSNorm
(:func:`rms_norm_kernel`, described in its docstring).

Math (tokens grouped by frame: token ``t`` of sample ``b`` uses modulation row ``(b, t // tpf)``, where
``tpf = L / F`` tokens per frame; Wan's per-frame modulation ``e0 [B, F, 6, C]``)::

    adaln_norm_modulate:  out = (x - mean) * rsqrt(var + eps) * (1 + scale) + shift   (LayerNorm, no affine)
    gate_residual:        out = x + gate * y
    rms_norm:             out = x * rsqrt(mean(x^2) + eps) * weight                   (one weight row)

Layouts: ``x`` (and ``y``) ``[N, C]`` row-major HBM (``N = B * L`` tokens x ``C`` features), bf16 or fp32;
the modulation rows ``shift`` / ``scale`` / ``gate`` ``[G, C]`` fp32 (``G = B * F`` frames, ``N`` a multiple
of ``G``: frame ``g`` owns tokens ``g * N/G ... (g + 1) * N/G - 1``); ``out`` ``[N, C]`` in x's dtype.

Design (one pass over HBM: every input element read once, every output element written once):

* **Tokens on partitions.** A tile is up to 128 consecutive tokens of one frame, ``C`` features along the
  free dim: one DMA per operand per tile, each descriptor a whole token row (``C x itemsize`` bytes, 3 KiB
  for Wan's C=1536 in bf16). Tiles never straddle a frame, so the tile's modulation is one row.
* **Modulation broadcast on TensorE**, once per frame: the fp32 row is loaded to partition 0 (``C x 4``
  bytes from HBM, not 128 copies), ``1 + scale`` formed there, rounded to x's dtype, and spread over the
  128 partitions by ``ones[1, 128]^T @ row[1, <=512]`` matmuls (K = 1, exact) into PSUM, evicted to SBUF
  by ScalarE. Sets rotate (3 for adaLN, 2 for the gate: one per frame the pipeline can hold), so the next
  frame's broadcast overlaps this frame's last tiles.
* **adaLN**, a 3-stage software pipeline in program order (each engine runs its queue in order, so one
  stage per tile would chain all engines into one loop per tile): stage 0 (tile ``i + 2``) loads x and
  runs VectorE ``bn_stats`` per 512-element chunk and ``bn_aggr`` -> (mean, population var) in fp32
  (per-chunk centred sums: no ``E[x^2] - mean^2`` cancellation); stage 1 (tile ``i + 1``) forms the
  ``[P, 1]`` columns ``rstd = (var + eps)^-0.5`` (ScalarE) and ``-mean * rstd`` (VectorE); stage 2 (tile
  ``i``): ScalarE normalises (``activation(copy, x, scale=rstd, bias=-mean*rstd)``, fp32 out), GpSimdE
  multiplies by ``1 + scale`` writing x's dtype, VectorE adds ``shift`` (both operands in x's dtype: the
  bf16 rate, 4x the fp32 one in the cost model's VectorE table) and the tile is stored.
* **gate_residual**: loads run one tile ahead of the stores; per 512-column chunk VectorE forms
  ``t = gate * y`` into an fp32 PSUM bank and ``out = x + t`` (a PSUM operand keeps the 1 element/cycle
  rate an fp32 SBUF operand would halve).
* **gate_residual**: per 512-column chunk VectorE ``t = gate * y`` into an fp32 PSUM bank and
  ``out = x + t`` (one rounding to x's dtype).
* LNC: ``kernel[2]`` deals frames round-robin to the logical cores.

Precision: statistics and arithmetic in fp32; ``1 + scale``, ``shift`` and ``gate`` are rounded to x's
dtype on chip (Wan's modulation arithmetic runs in the activation dtype too). gate_residual rounds once;
adaLN rounds ``xn * (1 + scale)`` to x's dtype before adding ``shift`` (two roundings in bf16; exact
pass-through in fp32), within the tests' tolerance (tests/test_kernel_elementwise.py).

Limits (:func:`max_features`): ``C <= 4608`` (bf16) / ``2560`` (fp32) for the SBUF tiles; ``N >= 1``,
``G >= 1``, ``N % G == 0``. Short frames (``N / G`` far below 128, e.g. per-token modulation) are correct
but use partial tiles.
"""

from __future__ import annotations

import math
from typing import Any

from nki_kernels._nki import nisa, nki, nl
from nki_kernels.hw_limits import PMAX, PSUM_BANK_FMAX

CHUNK = PSUM_BANK_FMAX
"""Free elements per bn_stats call / per broadcast matmul (one fp32 PSUM bank)."""

ROT = 4
"""Rotating x tiles: tiles ``i .. i + 2`` are in flight (three pipeline stages) while tile ``i - 1``'s
store drains."""

LAG = 1
"""Tiles the loads (and the adaLN statistics) run ahead of the elementwise tail in program order."""

SBUF_BUDGET = 160 * 1024
"""SBUF bytes per partition the kernels' tiles may use (of 192 KiB)."""


def tile_bytes(c: int, itemsize: int, out_itemsize: int | None = None) -> int:
    """SBUF bytes per partition of the adaLN kernel's tiles for ``c`` features (the largest of the
    kernels; a pure function): :data:`ROT` rotating x tiles in x's dtype (the result overwrites its input
    when the output dtype is x's), 2 fp32 temporaries, three sets of two modulation tiles and the row in the
    working dtype (fp32 unless x and out are both 2-byte), the fp32 row, the statistics, the ones row and,
    when ``out_itemsize`` differs from ``itemsize``, 2 rotating output tiles."""
    osz = itemsize if out_itemsize is None else out_itemsize
    wsz = 2 if itemsize == osz == 2 else 4
    stats = ROT * (6 * math.ceil(c / CHUNK) + 4) * 4
    out_tiles = 0 if osz == itemsize else 2 * osz
    return c * (ROT * itemsize + 2 * 4 + 6 * wsz + 4 + wsz + out_tiles) + stats + PMAX * wsz


def max_features(itemsize: int, out_itemsize: int | None = None) -> int:
    """Largest ``C`` (a multiple of 512) whose tiles fit :data:`SBUF_BUDGET` at ``itemsize`` bytes in and
    ``out_itemsize`` (default ``itemsize``) out."""
    c = CHUNK
    while tile_bytes(c + CHUNK, itemsize, out_itemsize) <= SBUF_BUDGET:
        c += CHUNK
    return c


def frame_tiles(n: int, g: int) -> list[tuple[int, int, int]]:
    """``(frame, first token, tokens)`` of every tile: each frame's ``n // g`` tokens in tiles of <= 128
    (a pure function). Raises ``ValueError`` unless ``n >= 1``, ``g >= 1`` and ``g`` divides ``n``."""
    if isinstance(n, bool) or isinstance(g, bool) or n < 1 or g < 1 or n % g:
        raise ValueError(f"frame_tiles: need n >= 1 tokens in g >= 1 equal frames, got n={n}, g={g}")
    tpf = n // g
    return [(f, f * tpf + t0, min(PMAX, tpf - t0)) for f in range(g) for t0 in range(0, tpf, PMAX)]


def _isz(dt: Any) -> int:
    return 4 if dt == nl.float32 else 2


def _check_c(c: int, dt: Any, od: Any = None) -> None:
    top = max_features(_isz(dt), None if od is None else _isz(od))
    if c > top:
        raise ValueError(f"elementwise: C={c} features exceed the SBUF tiles (at most {top})")


def _out_dtype(out_dtype: Any, dt: Any) -> Any:
    """The kernel's output dtype: ``None`` = x's; ``"bfloat16"`` / ``"float32"`` (strings, so the argument
    is a plain constant under real NKI and the emulator alike)."""
    if out_dtype is None:
        return dt
    if out_dtype not in ("bfloat16", "float32"):
        raise ValueError(f"elementwise: out_dtype must be None, 'bfloat16' or 'float32', got {out_dtype!r}")
    return nl.bfloat16 if out_dtype == "bfloat16" else nl.float32


class _Broadcast:
    """Per-frame modulation rows spread over 128 partitions (two rotating sets; see the module docstring)."""

    def __init__(self, c: int, dt: Any, count: int, nsets: int) -> None:
        self.c, self.dt = c, dt
        self.ones = nl.ndarray((1, PMAX), dtype=dt, buffer=nl.sbuf)
        nisa.memset(self.ones, 1.0)
        self.row32 = nl.ndarray((1, c), dtype=nl.float32, buffer=nl.sbuf)
        self.row = nl.ndarray((1, c), dtype=dt, buffer=nl.sbuf)
        self.ps = [nl.ndarray((PMAX, CHUNK), dtype=nl.float32, buffer=nl.psum) for _ in range(2)]
        self.sets = [
            [nl.ndarray((PMAX, c), dtype=dt, buffer=nl.sbuf) for _ in range(count)] for _ in range(nsets)
        ]
        self.n = 0

    def load(self, rows: list[tuple[Any, int, bool]]) -> list[Any]:
        """``rows``: ``(hbm [G, C] fp32, frame, add_one)``; returns the broadcast tiles of this set."""
        tiles = self.sets[self.n % len(self.sets)]
        self.n += 1
        for k, (src, g, add_one) in enumerate(rows):
            nisa.dma_copy(dst=self.row32[0:1, 0 : self.c], src=src[g : g + 1, 0 : self.c])
            if add_one:
                nisa.tensor_scalar(self.row, self.row32, nl.add, 1.0, engine=nisa.vector_engine)
            else:
                nisa.tensor_copy(dst=self.row, src=self.row32, engine=nisa.vector_engine)
            for j, c0 in enumerate(range(0, self.c, CHUNK)):
                cc = min(CHUNK, self.c - c0)
                ps = self.ps[j % 2]
                nisa.nc_matmul(
                    dst=ps[:, :cc], stationary=self.ones, moving=self.row[0:1, c0 : c0 + cc], accumulate=False
                )
                nisa.activation(tiles[k][:, c0 : c0 + cc], nl.copy, ps[:, :cc])
        return tiles


@nki.jit
def adaln_norm_modulate_kernel(x, shift, scale, eps, out_dtype=None):
    """``out[N, C] = LayerNorm(x)(eps, no affine) * (1 + scale[g]) + shift[g]`` per frame ``g``, ``out`` in
    ``out_dtype`` (``None``: x's dtype; ``"bfloat16"`` / ``"float32"``); see the module docstring for
    layouts, the working dtype and the engine split."""
    N, C = x.shape
    G = shift.shape[0]
    dt = x.dtype
    od = _out_dtype(out_dtype, dt)
    wd = dt if od == dt else nl.float32  # working dtype of the modulation and the product
    _check_c(C, dt, od)
    out = nl.ndarray((N, C), dtype=od, buffer=nl.shared_hbm)
    tiles = frame_tiles(N, G)
    frames = list(range(G))[nl.program_id(0) :: nl.num_programs()]
    if not frames:
        return out
    mine = [t for t in tiles if t[0] in frames]
    bc = _Broadcast(C, wd, 2, 3)  # frames of tiles i .. i + 2 in flight
    xs = [nl.ndarray((PMAX, C), dtype=dt, buffer=nl.sbuf) for _ in range(ROT)]
    xn = [nl.ndarray((PMAX, C), dtype=nl.float32, buffer=nl.sbuf) for _ in range(2)]
    os_ = [] if od == dt else [nl.ndarray((PMAX, C), dtype=od, buffer=nl.sbuf) for _ in range(2)]
    nch = math.ceil(C / CHUNK)
    st = [nl.ndarray((PMAX, 6 * nch), dtype=nl.float32, buffer=nl.sbuf) for _ in range(ROT)]
    cols = [nl.ndarray((PMAX, 4), dtype=nl.float32, buffer=nl.sbuf) for _ in range(ROT)]
    mods: list[Any] = []

    def load_stats(i: int) -> None:  # stage 0: DMA in; VectorE bn_stats per 512 chunk, bn_aggr (fp32)
        g, t0, rows = mine[i]
        if i == 0 or mine[i - 1][0] != g:
            mods.append(bc.load([(scale, g, True), (shift, g, False)]))
        else:
            mods.append(mods[-1])
        xt, sti, cl = xs[i % ROT], st[i % ROT], cols[i % ROT]
        nisa.dma_copy(dst=xt[:rows, :], src=x[t0 : t0 + rows, :])
        for j, c0 in enumerate(range(0, C, CHUNK)):
            nisa.bn_stats(sti[:rows, 6 * j : 6 * j + 6], xt[:rows, c0 : min(C, c0 + CHUNK)])
        nisa.bn_aggr(cl[:rows, 0:2], sti[:rows, :])  # (mean, population variance)

    def rstd_cols(i: int) -> None:  # stage 1: rstd = (var + eps)^-0.5, nmr = -mean * rstd
        _, _, rows = mine[i]
        cl = cols[i % ROT]
        mean, var, rstd, nmr = (cl[:rows, j : j + 1] for j in range(4))
        nisa.activation(rstd, nl.rsqrt, var, bias=float(eps))
        nisa.tensor_scalar(
            nmr, mean, nl.multiply, rstd, op1=nl.multiply, operand1=-1.0, engine=nisa.vector_engine
        )

    def modulate(i: int) -> None:  # stage 2: ScalarE normalise (fp32), GpSimdE * (1 + scale), VectorE + shift
        _, t0, rows = mine[i]
        s1, sh = mods[i]
        xt, xf, cl = xs[i % ROT][:rows, :], xn[i % 2][:rows, :], cols[i % ROT]
        nisa.activation(xf, nl.copy, xt, bias=cl[:rows, 3:4], scale=cl[:rows, 2:3])
        if od == dt:  # the product in x's dtype over x's tile, the sum in place
            nisa.tensor_tensor(xt, xf, s1[:rows, :], nl.multiply, engine=nisa.gpsimd_engine)
            nisa.tensor_tensor(xt, xt, sh[:rows, :], nl.add, engine=nisa.vector_engine)
            nisa.dma_copy(dst=out[t0 : t0 + rows, :], src=xt)
            return
        # mixed dtypes: fp32 product in place (xf), one rounding to the output dtype in the sum
        ot = os_[i % 2][:rows, :]
        nisa.tensor_tensor(xf, xf, s1[:rows, :], nl.multiply, engine=nisa.gpsimd_engine)
        nisa.tensor_tensor(ot, xf, sh[:rows, :], nl.add, engine=nisa.gpsimd_engine)
        nisa.dma_copy(dst=out[t0 : t0 + rows, :], src=ot)

    # software pipeline in program order (each engine runs its queue in order): tile i + 2's load and
    # statistics, tile i + 1's rstd, then tile i's modulation, so no engine's queue holds a step that waits
    # on a
    # later step of another engine's queue (one stage per tile would chain every engine into one loop)
    stages = (load_stats, rstd_cols, modulate)
    for i in range(len(mine) + len(stages) - 1):
        for lag, stage in enumerate(stages):
            if 0 <= i - lag < len(mine):
                stage(i - lag)
    return out


@nki.jit
def gate_residual_kernel(x, y, gate):
    """``out[N, C] = x + gate[g] * y`` per frame ``g``, out in x's dtype; ``y`` in x's dtype or bf16 with
    an fp32 ``x`` (Wan's fp32 residual stream plus a bf16 branch); see the module docstring."""
    N, C = x.shape
    G = gate.shape[0]
    dt, yd = x.dtype, y.dtype
    if yd != dt and not (dt == nl.float32 and yd == nl.bfloat16):
        raise ValueError(f"gate_residual: y dtype {yd} must be x's {dt}, or bfloat16 with a float32 x")
    _check_c(C, dt)
    out = nl.ndarray((N, C), dtype=dt, buffer=nl.shared_hbm)
    tiles = frame_tiles(N, G)
    frames = list(range(G))[nl.program_id(0) :: nl.num_programs()]
    if not frames:
        return out
    mine = [t for t in tiles if t[0] in frames]
    bc = _Broadcast(C, dt, 1, 2)  # frames of tiles i, i + 1 in flight
    xs = [nl.ndarray((PMAX, C), dtype=dt, buffer=nl.sbuf) for _ in range(ROT)]
    ys = [nl.ndarray((PMAX, C), dtype=yd, buffer=nl.sbuf) for _ in range(ROT)]
    acc = [nl.ndarray((PMAX, CHUNK), dtype=nl.float32, buffer=nl.psum) for _ in range(2)]
    tmp = [] if yd == dt else [nl.ndarray((PMAX, C), dtype=nl.float32, buffer=nl.sbuf) for _ in range(2)]
    mods: list[Any] = []

    def load(i: int) -> None:
        g, t0, rows = mine[i]
        if i == 0 or mine[i - 1][0] != g:
            mods.append(bc.load([(gate, g, False)])[0])
        else:
            mods.append(mods[-1])
        nisa.dma_copy(dst=xs[i % ROT][:rows, :], src=x[t0 : t0 + rows, :])
        nisa.dma_copy(dst=ys[i % ROT][:rows, :], src=y[t0 : t0 + rows, :])

    def combine(i: int) -> None:
        _, t0, rows = mine[i]
        xt, yt, gt = xs[i % ROT], ys[i % ROT], mods[i]
        if yd != dt:  # fp32 x, bf16 y: GpSimdE gate * y (fp32), VectorE x + it, in place over x's tile
            tf = tmp[i % 2][:rows, :]
            nisa.tensor_tensor(tf, yt[:rows, :], gt[:rows, :], nl.multiply, engine=nisa.gpsimd_engine)
            nisa.tensor_tensor(xt[:rows, :], xt[:rows, :], tf, nl.add, engine=nisa.vector_engine)
            nisa.dma_copy(dst=out[t0 : t0 + rows, :], src=xt[:rows, :])
            return
        for j, c0 in enumerate(range(0, C, CHUNK)):
            # gate * y into an fp32 PSUM bank (no rounding), then x + it (a PSUM operand keeps VectorE's
            # 1-element/cycle rate that an fp32 SBUF operand would halve)
            cs = slice(c0, min(C, c0 + CHUNK))
            tp = acc[(i * 8 + j) % 2][:rows, : cs.stop - c0]
            nisa.tensor_tensor(tp, yt[:rows, cs], gt[:rows, cs], nl.multiply, engine=nisa.vector_engine)
            nisa.tensor_tensor(yt[:rows, cs], xt[:rows, cs], tp, nl.add, engine=nisa.vector_engine)
        nisa.dma_copy(dst=out[t0 : t0 + rows, :], src=yt[:rows, :])

    for i in range(len(mine) + LAG):  # loads run LAG tiles ahead of the stores (see adaLN)
        if i < len(mine):
            load(i)
        if i >= LAG:
            combine(i - LAG)
    return out


@nki.jit
def rms_norm_kernel(x, weight, eps):
    """``out[N, C] = x * rsqrt(mean(x^2) + eps) * weight[0]``; ``weight`` ``[1, C]`` fp32. Two stages in
    program order: tile ``i + 1``'s load, ScalarE square-sum and rstd, then tile ``i``'s VectorE
    ``(x * rstd) * weight`` (one ``scalar_tensor_tensor``, fp32 math, one rounding) and store."""
    N, C = x.shape
    dt = x.dtype
    _check_c(C, dt)
    out = nl.ndarray((N, C), dtype=dt, buffer=nl.shared_hbm)
    tiles = frame_tiles(N, 1)[nl.program_id(0) :: nl.num_programs()]
    if not tiles:
        return out
    (wt,) = _Broadcast(C, dt, 1, 1).load([(weight, 0, False)])
    xs = [nl.ndarray((PMAX, C), dtype=dt, buffer=nl.sbuf) for _ in range(ROT)]
    cols = [nl.ndarray((PMAX, 2), dtype=nl.float32, buffer=nl.sbuf) for _ in range(ROT)]
    junk = nl.ndarray((PMAX, C), dtype=dt, buffer=nl.sbuf)  # ScalarE's discarded squares

    def stats(i: int) -> None:
        _, t0, rows = tiles[i]
        xt, cl = xs[i % ROT][:rows, :], cols[i % ROT]
        nisa.dma_copy(dst=xt, src=x[t0 : t0 + rows, :])
        nisa.activation_reduce(junk[:rows, :], nl.square, xt, nl.add, cl[:rows, 0:1])
        nisa.activation(cl[:rows, 1:2], nl.rsqrt, cl[:rows, 0:1], bias=float(eps), scale=1.0 / C)

    def scale_store(i: int) -> None:
        _, t0, rows = tiles[i]
        xt = xs[i % ROT][:rows, :]
        nisa.scalar_tensor_tensor(xt, xt, nl.multiply, cols[i % ROT][:rows, 1:2], nl.multiply, wt[:rows, :])
        nisa.dma_copy(dst=out[t0 : t0 + rows, :], src=xt)

    for i in range(len(tiles) + 1):
        if i < len(tiles):
            stats(i)
        if i >= 1:
            scale_store(i - 1)
    return out


GELU_COLS = 4608
"""Most columns per GELU tile (9 KiB per partition in bf16); ``C`` is cut into equal column tiles of at most
this many (Wan's FFN width 8,960 into two of 4,480: long descriptors, no thin tail)."""


@nki.jit
def gelu_tanh_kernel(x):
    """``out[N, C] = gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))`` elementwise (Wan's
    FFN activation, ``nn.GELU(approximate="tanh")``), out in x's dtype (bf16 or fp32), one rounding.

    Tiles of up to 128 rows x ``ceil(C / ceil(C / GELU_COLS))`` columns (:data:`GELU_COLS`; any
    ``N >= 1``, ``C >= 1``: the rows need not fit one partition, unlike the normalising kernels); per tile one
    load DMA, one ScalarE ``activation``
    (``gelu_apprx_tanh``, fp32 inside) in place, one store DMA; loads run one tile ahead of the
    activation in program order, :data:`ROT` tiles rotate. LNC: tiles dealt round-robin."""
    N, C = x.shape
    dt = x.dtype
    out = nl.ndarray((N, C), dtype=dt, buffer=nl.shared_hbm)
    cols = math.ceil(C / math.ceil(C / GELU_COLS))  # equal column tiles of <= GELU_COLS (no thin tail)
    tiles = [
        (r0, min(PMAX, N - r0), c0, min(cols, C - c0)) for r0 in range(0, N, PMAX) for c0 in range(0, C, cols)
    ]
    mine = tiles[nl.program_id(0) :: nl.num_programs()]
    xs = [nl.ndarray((PMAX, cols), dtype=dt, buffer=nl.sbuf) for _ in range(ROT)]

    def load(i: int) -> None:
        r0, rr, c0, cc = mine[i]
        nisa.dma_copy(dst=xs[i % ROT][:rr, :cc], src=x[r0 : r0 + rr, c0 : c0 + cc])

    def act_store(i: int) -> None:
        r0, rr, c0, cc = mine[i]
        xt = xs[i % ROT][:rr, :cc]
        nisa.activation(xt, nl.gelu_apprx_tanh, xt)
        nisa.dma_copy(dst=out[r0 : r0 + rr, c0 : c0 + cc], src=xt)

    for i in range(len(mine) + LAG):
        if i < len(mine):
            load(i)
        if i >= LAG:
            act_store(i - LAG)
    return out


def _rows(t: Any) -> Any:
    """torch ``[B, F, C]`` -> numpy fp32 ``[B * F, C]``."""
    import torch

    from nki_kernels.linear import _to_numpy

    return _to_numpy(t.to(torch.float32).reshape(-1, t.shape[-1]).contiguous())


def adaln_norm_modulate_emulated(
    x: Any, shift: Any, scale: Any, eps: float, lnc: int = 1, out_dtype: Any = None
) -> Any:
    """:func:`adaln_norm_modulate_kernel` on the emulator: x torch ``[B, L, C]`` bf16/fp32 contiguous;
    shift, scale ``[B, F, C]`` (any float dtype, sent as fp32; ``F`` divides ``L``); returns ``[B, L, C]``
    in ``out_dtype`` (a torch dtype, bf16 or fp32; ``None``: x's dtype)."""
    import torch

    from nki_kernels._nki import launch
    from nki_kernels.linear import _to_numpy
    from nki_kernels.rope3d import _to_torch

    b, l, c = x.shape
    res, _ = launch(
        adaln_norm_modulate_kernel,
        _to_numpy(x.reshape(b * l, c)),
        _rows(shift),
        _rows(scale),
        float(eps),
        *(() if out_dtype is None else ("float32" if out_dtype == torch.float32 else "bfloat16",)),
        lnc=lnc,
    )
    return _to_torch(res, x.dtype if out_dtype is None else out_dtype).reshape(b, l, c)


def rms_norm_emulated(x: Any, weight: Any, eps: float, lnc: int = 1) -> Any:
    """:func:`rms_norm_kernel` on the emulator: x torch ``[B, L, C]`` bf16/fp32 contiguous, weight ``[C]``
    (any float dtype, sent as fp32); returns ``[B, L, C]`` in x's dtype."""
    from nki_kernels._nki import launch
    from nki_kernels.linear import _to_numpy
    from nki_kernels.rope3d import _to_torch

    b, l, c = x.shape
    res, _ = launch(rms_norm_kernel, _to_numpy(x.reshape(b * l, c)), _rows(weight), float(eps), lnc=lnc)
    return _to_torch(res, x.dtype).reshape(b, l, c)


def gelu_tanh_emulated(x: Any, lnc: int = 1) -> Any:
    """:func:`gelu_tanh_kernel` on the emulator: x torch ``[..., C]`` bf16/fp32 contiguous (rank >= 1);
    returns x's shape and dtype."""
    from nki_kernels._nki import launch
    from nki_kernels.linear import _to_numpy
    from nki_kernels.rope3d import _to_torch

    c = x.shape[-1]
    res, _ = launch(gelu_tanh_kernel, _to_numpy(x.reshape(-1, c)), lnc=lnc)
    return _to_torch(res, x.dtype).reshape(x.shape)


def gate_residual_emulated(x: Any, y: Any, gate: Any, lnc: int = 1) -> Any:
    """:func:`gate_residual_kernel` on the emulator: x, y torch ``[B, L, C]`` contiguous (y in x's dtype,
    or bf16 with an fp32 x), gate ``[B, F, C]`` (sent as fp32; ``F`` divides ``L``); returns
    ``[B, L, C]`` in x's dtype."""
    from nki_kernels._nki import launch
    from nki_kernels.linear import _to_numpy
    from nki_kernels.rope3d import _to_torch

    b, l, c = x.shape
    res, _ = launch(
        gate_residual_kernel,
        _to_numpy(x.reshape(b * l, c)),
        _to_numpy(y.reshape(b * l, c)),
        _rows(gate),
        lnc=lnc,
    )
    return _to_torch(res, x.dtype).reshape(b, l, c)


__all__ = [
    "adaln_norm_modulate_emulated",
    "adaln_norm_modulate_kernel",
    "frame_tiles",
    "gate_residual_emulated",
    "gate_residual_kernel",
    "gelu_tanh_emulated",
    "gelu_tanh_kernel",
    "max_features",
    "rms_norm_emulated",
    "rms_norm_kernel",
    "tile_bytes",
]
