"""The streaming static-offset pass of the flash attention kernels (standalone NKI 0.6 API): K/V stream
through SBUF chunk by chunk while q^T and the output accumulators of up to :data:`MAX_UNIT_TILES` query tiles
stay resident (key chunks outer, query tiles inner).

Used by :func:`nki_kernels.attention._flash_rows` for its static pass whenever the offset is one per query
tile (2-byte dtypes, every P^T on TensorE, a full key chunk after the first; docs/kernels/attention.md,
"Static softmax offset"). With one offset per tile the partial sums of a tile over different key chunks are
plain sums (no rescaling), so the chunks of a tile need not be consecutive: the pass visits every tile of a
*unit* with key chunk 0, then every tile with chunk 1, and so on. Each chunk's K^T / V are then read from
HBM once per unit and only :data:`RING` chunks are in SBUF at a time, so their loads run while the previous
chunks compute (a resident-K/V kernel waits for each head's or block-table group's whole K/V before its first
matmul). Per unit (queries ``[q_lo, q_hi)`` of one (b, h), at most :data:`MAX_UNIT_TILES` tiles)::

    q^T of every tile                                 (hwdge dma_transpose per tile, resident [D, nt*128])
    offsets: per tile t  S^T_0 = K_0 q_t^T (8 matmuls) ; bmax[:, t] = max over S^T_0 (VectorE, from PSUM)
             mx = max over partitions of bmax (ONE GpSimd tensor_partition_reduce for the unit)
             nm[:, t] = -scale * mx[t] broadcast to 128 partitions (one 1-row matmul + one VectorE op)
    for key chunk c (loads of chunk c+2 issued here, into the ring slot chunk c-1 used):
        for tile t:  S^T = K_c q_t^T          8 x nc_matmul [128 keys, 128 q]  (TensorE, issued 2 steps ahead)
                     P^T = exp(scale S^T + nm[:, t])   ONE ScalarE pass from PSUM into the P^T ring
                     PV  = sum_blocks P^T_blk^T V_blk   8 x nc_matmul, V's column D = 1 sums l
                     o[t] (+)= PV                        VectorE (fp32, SBUF)
                     last chunk: out = o / max(l, floor), guard flags, lse = log(l) - nm
    (the guard and its running-max recompute: :func:`nki_kernels.attention._guarded_rows`)

Buffers (per partition, Wan bf16, 92 tiles): q^T 23.0 KiB, o 46.4 KiB, K^T / V ring 3 x 4.0 KiB (+ the
block-table K staging, 2 x 2 KiB), P^T ring 3 x 2 KiB; PSUM: scores 3 x 4 KiB (a ring: the exp of step i
and the QK^T of step i+2 never share a buffer), PV 2 x 516 B, the offsets' broadcast ``4 nt`` B (+ the
block-table K^T transposes, 2 KiB). The offset of a tile is the largest scaled score of its first key chunk
(the same keys, scores and value as the resident loop's); the scores of chunk 0 are computed twice (for the
offsets, then for the exp: 8 matmuls more per tile).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from nki_kernels._nki import nisa, nl
from nki_kernels.attention_tiles import KC_TWO_BYTE, _load_kv, _load_transposed
from nki_kernels.hw_limits import PMAX

MAX_UNIT_TILES = 96
"""Query tiles per unit: q^T (256 B) and the fp32 accumulator (``4 (D + 1)`` B) of each stay in SBUF, so a
unit of 96 tiles (12,288 queries) holds ~72 KiB per partition at D = 128. Longer query ranges are split
into equal units, each streaming the K/V once."""

RING = 3
"""Buffers of the score ring (PSUM), the P^T ring and the K/V chunk ring: step i's exp reads the scores
the QK^T of step i-2 wrote, so three keep TensorE two steps ahead; the K/V of chunks c, c+1 and c+2 are
live while column c runs (c+2 loading)."""

NB = KC_TWO_BYTE // PMAX
"""128-key blocks per key chunk."""


def stream_chunks(lk: int) -> list[tuple[int, int]]:
    """Key chunks ``(c0, n)`` of the streaming pass: 1024 keys each, the last one the remainder (any
    ``1 <= n <= 1024``; a partial last 128-key block is handled by the instructions' partition range)."""
    return [(c0, min(KC_TWO_BYTE, lk - c0)) for c0 in range(0, lk, KC_TWO_BYTE)]


def streams(chunks: Sequence[tuple[int, int]], two_byte: bool, dma_chunks: tuple[int, int]) -> bool:
    """Whether a static pass streams its K/V: with one softmax offset per query tile, i.e. a 2-byte dtype,
    every P^T on TensorE and a full key chunk after the first among the resident loop's ``chunks`` (a call
    of one chunk, or one chunk and a remainder, keeps the per-row offset of
    :func:`nki_kernels.attention._flash_rows`)."""
    return two_byte and not dma_chunks[0] and any(n == KC_TWO_BYTE for _, n in chunks[1:])


class KvStream:
    """The K/V of one (b, h) (or block-table group) for :func:`stream_rows`: the keys ``[0, lk)`` in chunks.

    Subclasses implement :meth:`slot` (one ring slot's SBUF tiles: ``"kT"`` ``[D, 1024]``, ``"v"``
    ``[128, 8, D + 1]`` with column D the softmax denominator's column), :meth:`issue` (the DMAs of chunk
    ``(c0, n)`` into a slot), :meth:`finish` (any engine work that completes a slot after its DMAs, e.g. K^T
    transposes; issued a chunk later so the engine does not wait for the DMA) and :meth:`resident` (the
    whole K^T ``[D, Lk]`` / V ``[128, Lk/128, D + 1]`` in SBUF, for the guard's running-max recompute)."""

    def __init__(self, lk: int, d: int, dt: Any) -> None:
        self.lk, self.d, self.dt = lk, d, dt

    def slot(self) -> dict[str, Any]:
        raise NotImplementedError

    def issue(self, chunk: tuple[int, int], slot: dict[str, Any]) -> None:
        raise NotImplementedError

    def finish(self, chunk: tuple[int, int], slot: dict[str, Any]) -> None:
        """Nothing to complete by default (K^T arrives transposed)."""

    def resident(self) -> tuple[Any, Any]:
        raise NotImplementedError


class SegmentStream(KvStream):
    """K/V of (b, h) read in place from ordered ``(start, length)`` segments of ``[B, S, H, D]`` buffers
    (:mod:`nki_kernels.attention`): K^T by hwdge ``dma_transpose`` from HBM, V by ``dma_copy``, each
    segment piece of a chunk in place (no gather)."""

    def __init__(self, kbuf: Any, vbuf: Any, b: int, h: int, segments: Any, d: int, dt: Any) -> None:
        super().__init__(sum(n for _, n in segments), d, dt)
        self.kbuf, self.vbuf, self.b, self.h, self.segments = kbuf, vbuf, b, h, tuple(segments)

    def slot(self) -> dict[str, Any]:
        v = nl.ndarray((PMAX, NB, self.d + 1), dtype=self.dt, buffer=nl.sbuf)
        nisa.memset(v[:, :, self.d : self.d + 1], 1.0, engine=nisa.gpsimd_engine)  # l's ones column
        return {"kT": nl.ndarray((self.d, KC_TWO_BYTE), dtype=self.dt, buffer=nl.sbuf), "v": v}

    def issue(self, chunk: tuple[int, int], slot: dict[str, Any]) -> None:
        c0, n = chunk
        off = 0
        for start, length in self.segments:
            lo, hi = max(off, c0), min(off + length, c0 + n)
            if lo < hi:  # this segment's keys [lo, hi) of the chunk, chunk-local columns [lo - c0, hi - c0)
                seg = ((start + lo - off, hi - lo),)
                _load_kv(slot["kT"], slot["v"], self.kbuf, self.vbuf, self.b, self.h, seg, self.d, True,
                         off0=lo - c0)  # fmt: skip
            off += length

    def resident(self) -> tuple[Any, Any]:
        nkt = (self.lk + PMAX - 1) // PMAX
        kT_sb = nl.ndarray((self.d, nkt * PMAX), dtype=self.dt, buffer=nl.sbuf)
        v_sb = nl.ndarray((PMAX, nkt, self.d + 1), dtype=self.dt, buffer=nl.sbuf)
        nisa.memset(v_sb[:, :, self.d : self.d + 1], 1.0, engine=nisa.gpsimd_engine)
        _load_kv(kT_sb, v_sb, self.kbuf, self.vbuf, self.b, self.h, self.segments, self.d, True)
        return kT_sb, v_sb


def stream_rows(kv: KvStream, q, out, lse, b, h, q_lo, q_hi, scale, return_lse, good, bounds) -> None:
    """The static pass of queries ``[q_lo, q_hi)`` of (b, h) over the keys of ``kv`` (module docstring):
    stores ``out[b, q, h, :]`` (q's dtype) and, with ``return_lse``, ``lse[b, q, h]``; ANDs each row's
    ``l_min <= l <= l_max`` into ``good`` ``[128, 1]`` (``bounds = (l_min, l_max, l_floor)``, l clamped at
    ``l_floor`` before the reciprocal). The range is cut into equal units of at most
    :data:`MAX_UNIT_TILES` 128-query tiles; ``kv.lk`` must be > 1024 (two key chunks or more)."""
    ntiles = (q_hi - q_lo + PMAX - 1) // PMAX
    nunits = math.ceil(ntiles / MAX_UNIT_TILES)
    base, extra = divmod(ntiles, nunits)
    t0 = 0
    for u in range(nunits):
        nt = base + (1 if u < extra else 0)
        lo = q_lo + t0 * PMAX
        _unit(kv, q, out, lse, b, h, lo, min(q_hi, lo + nt * PMAX), scale, return_lse, good, bounds)
        t0 += nt


def _qk(s, kT, qT, t, qr, kc, d) -> None:
    """``S^T`` of one tile over one chunk: per 128-key block ``s[:kr, blk, :qr] = K_blk q_t^T``."""
    for blk in range((kc + PMAX - 1) // PMAX):
        kr = min(PMAX, kc - blk * PMAX)
        nisa.nc_matmul(
            s[:kr, blk, :qr],
            stationary=kT[:d, blk * PMAX : blk * PMAX + kr],
            moving=qT[:d, t * PMAX : t * PMAX + qr],
            accumulate=False,
        )


def _unit(kv, q, out, lse, b, h, q_lo, q_hi, scale, return_lse, good, bounds) -> None:
    """One unit of :func:`stream_rows` (its module-docstring schedule, in program order)."""
    D = q.shape[3]
    dt, f32 = q.dtype, nl.float32
    chunks = stream_chunks(kv.lk)
    nch = len(chunks)
    nt = (q_hi - q_lo + PMAX - 1) // PMAX

    def rows(t: int) -> int:
        return min(PMAX, q_hi - q_lo - t * PMAX)

    qT = nl.ndarray((D, nt * PMAX), dtype=dt, buffer=nl.sbuf)
    o_all = nl.ndarray((PMAX, nt, D + 1), dtype=f32, buffer=nl.sbuf)
    bmax = nl.ndarray((PMAX, nt), dtype=f32, buffer=nl.sbuf)
    mx = nl.ndarray((1, nt), dtype=f32, buffer=nl.sbuf)
    nm = nl.ndarray((PMAX, nt), dtype=f32, buffer=nl.sbuf)
    ones_row = nl.ndarray((1, PMAX), dtype=f32, buffer=nl.sbuf)
    nisa.memset(ones_row, 1.0, engine=nisa.vector_engine)
    s_ps = [nl.ndarray((PMAX, NB, PMAX), dtype=f32, buffer=nl.psum) for _ in range(RING)]
    pv_ps = [nl.ndarray((PMAX, D + 1), dtype=f32, buffer=nl.psum) for _ in range(2)]
    bc = nl.ndarray((PMAX, nt), dtype=f32, buffer=nl.psum)
    pT = [nl.ndarray((PMAX, NB, PMAX), dtype=dt, buffer=nl.sbuf) for _ in range(RING)]
    o_out = [nl.ndarray((PMAX, D), dtype=dt, buffer=nl.sbuf) for _ in range(2)]
    rl = nl.ndarray((PMAX, 1), dtype=f32, buffer=nl.sbuf)
    lse_t = [nl.ndarray((PMAX, 1), dtype=f32, buffer=nl.sbuf) for _ in range(4)]
    slots = [kv.slot() for _ in range(RING)]
    issued: set[int] = set()
    finished: set[int] = set()

    def ensure(c: int, finish: bool = True) -> None:
        """Chunk ``c``'s DMAs issued (and, with ``finish``, its slot completed) into slot ``c % RING``."""
        if c >= nch:
            return
        if c not in issued:
            kv.issue(chunks[c], slots[c % RING])
            issued.add(c)
        if finish and c not in finished:
            kv.finish(chunks[c], slots[c % RING])
            finished.add(c)

    # q^T of every tile (resident for the unit), chunk 0 and the load of chunk 1
    for t in range(nt):
        q0 = q_lo + t * PMAX
        _load_transposed(qT[:D, t * PMAX : t * PMAX + rows(t)], q[b, q0 : q0 + rows(t), h, :], rows(t), True)
    ensure(0)
    ensure(1, finish=False)
    # the offsets: the largest scaled score of each tile's first chunk, on every partition
    g = 0  # score buffers used in this unit (a ring)
    for t in range(nt):
        s = s_ps[g % RING]
        g += 1
        _qk(s, slots[0]["kT"], qT, t, rows(t), chunks[0][1], D)
        nisa.tensor_reduce(bmax[:, t : t + 1], nl.maximum, s[:, :, : rows(t)], axis=(1, 2))
    nisa.tensor_partition_reduce(mx[0:1, :nt], nl.maximum, bmax[:, :nt])
    nisa.nc_matmul(bc[:, :nt], stationary=ones_row[0:1, :PMAX], moving=mx[0:1, :nt], accumulate=False)
    nisa.tensor_scalar(nm[:, :nt], bc[:, :nt], nl.multiply, -scale, engine=nisa.vector_engine)

    steps = [(c, t) for c in range(nch) for t in range(nt)]

    def qk_step(j: int) -> None:
        c, t = steps[j]
        ensure(c)
        _qk(s_ps[(g + j) % RING], slots[c % RING]["kT"], qT, t, rows(t), chunks[c][1], D)

    qk_step(0)
    if len(steps) > 1:
        qk_step(1)
    for i, (c, t) in enumerate(steps):
        if t == 0:  # a new key chunk: the loads two chunks ahead, the slot of the next one completed
            ensure(c + 2, finish=False)
            ensure(c + 1)
        kc, qr = chunks[c][1], rows(t)
        nbf, kr = divmod(kc, PMAX)
        s, p, bias = s_ps[(g + i) % RING], pT[i % RING], nm[:, t : t + 1]
        # P^T = exp(scale * S^T + nm): ONE ScalarE pass from PSUM (+ one for a partial last block)
        if nbf:
            nisa.activation(p[:, :nbf, :qr], nl.exp, s[:, :nbf, :qr], bias=bias, scale=scale)
        if kr:
            nisa.activation(p[:kr, nbf, :qr], nl.exp, s[:kr, nbf, :qr], bias=nm[:kr, t : t + 1], scale=scale)
        if i + 2 < len(steps):
            qk_step(i + 2)
        pv, v = pv_ps[i % 2], slots[c % RING]["v"]
        for blk in range(nbf + (1 if kr else 0)):
            kb = min(PMAX, kc - blk * PMAX)
            nisa.nc_matmul(pv[:qr, : D + 1], stationary=p[:kb, blk, :qr], moving=v[:kb, blk, : D + 1],
                           accumulate=blk > 0)  # fmt: skip
        acc = o_all[:qr, t, :]
        if c == 0:
            nisa.tensor_copy(acc, pv[:qr, : D + 1], engine=nisa.vector_engine)
        else:
            nisa.tensor_tensor(acc, acc, pv[:qr, : D + 1], nl.add)
        if c == nch - 1:
            _finalize(o_all, t, qr, D, rl, o_out[t % 2], lse_t[t % 4], nm, good, bounds, out, lse, b, h,
                      q_lo + t * PMAX, return_lse)  # fmt: skip


def _finalize(o_all, t, qr, D, rl, ob, lt, nm, good, bounds, out, lse, b, h, q0, return_lse) -> None:
    """Tile ``t``'s output ``o / max(l, l_floor)`` (stored), its guard flags and its lse."""
    l_min, l_max, l_floor = bounds
    l_col = o_all[:qr, t, D : D + 1]
    nisa.tensor_scalar(rl[:qr], l_col, nl.maximum, l_floor, engine=nisa.vector_engine)
    nisa.reciprocal(rl[:qr], rl[:qr])
    nisa.tensor_scalar(ob[:qr], o_all[:qr, t, :D], nl.multiply, rl[:qr], engine=nisa.vector_engine)
    nisa.dma_copy(dst=out[b, q0 : q0 + qr, h, :], src=ob[:qr, :D])
    g = good[:qr]  # a row whose l overflowed, underflowed or is NaN clears its flag
    for cmp, bound in ((nl.less_equal, l_max), (nl.greater_equal, l_min)):
        nisa.tensor_scalar(g, l_col, cmp, bound, op1=nl.minimum, operand1=g, engine=nisa.vector_engine)
    if return_lse:
        nisa.activation(lt[:qr], nl.log, l_col)
        nisa.tensor_tensor(lt[:qr], lt[:qr], nm[:qr, t : t + 1], nl.subtract)
        nisa.dma_copy(dst=lse[b, q0 : q0 + qr, h : h + 1], src=lt[:qr])
