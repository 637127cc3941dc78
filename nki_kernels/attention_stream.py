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

With the FP8 option (``kv.v_scale`` set) the P^T ring is e4m3, the offsets add ``ln 16``, each chunk's V is
quantised once per unit on GpSimd and the PVs are double-row matmuls (:mod:`nki_kernels.attention_fp8`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from nki_kernels._nki import nisa, nl
from nki_kernels.attention_fp8 import Fp8Pv
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

PV_RING = 3
"""PV accumulators (PSUM): the o update of step i (VectorE) may wait behind a chunk's K^T eviction, so the
PV of step i + PV_RING, which reuses its buffer, has two steps of slack."""

MAX_LEAD = 8
"""Query tiles by which a tile's offset item (its first chunk's scores and their max) runs ahead of the
tile's first exp; the offsets of the first MAX_LEAD tiles are computed before any exp of the unit."""

OFFSET_BATCH = 4
"""Tiles whose offsets are finished together (one GpSimd max across the partitions, one broadcast matmul,
one VectorE scale)."""

QLEAD = 8
"""Score-ring items by which a tile's q^T load is issued ahead of its first use."""

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
        # the stream the kernel runs next and its (b, h, q_lo, q_hi): its first unit's q^T and first key
        # chunk are loaded while this stream's last unit runs (set by the kernel, None for the last one)
        self.nxt: KvStream | None = None
        self.nxt_rows: tuple[int, int, int, int] | None = None
        # FP8 attention (P.V in e4m3): V's dequantisation scales, HBM [B, H, D] fp32; None: bf16 P.V
        self.v_scale: Any = None

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


def stream_rows(kv: KvStream, q, out, lse, b, h, q_lo, q_hi, scale, return_lse, good, bounds, carry) -> None:
    """The static pass of queries ``[q_lo, q_hi)`` of (b, h) over the keys of ``kv`` (module docstring):
    stores ``out[b, q, h, :]`` (q's dtype) and, with ``return_lse``, ``lse[b, q, h]``; ANDs each row's
    ``l_min <= l <= l_max`` into ``good`` ``[128, 1]`` (``bounds = (l_min, l_max, l_floor)``, l clamped at
    ``l_floor`` before the reciprocal). The range is cut into equal units of at most
    :data:`MAX_UNIT_TILES` 128-query tiles (:func:`unit_rows`); ``kv.lk`` must be > 1024 (two key chunks
    or more). ``carry`` (a dict kept by the kernel) passes the loads a unit starts for the next one
    (the next unit of this range, else the first of ``kv.nxt``, :func:`link_streams`)."""
    units = unit_rows(q_lo, q_hi)
    for u, (lo, hi) in enumerate(units):
        nxt = None
        if u + 1 < len(units):
            nxt = (kv, b, h, *units[u + 1])
        elif kv.nxt is not None and kv.nxt_rows is not None:
            nb_, nh_, nlo, nhi = kv.nxt_rows
            nxt = (kv.nxt, nb_, nh_, *unit_rows(nlo, nhi)[0])
        _unit(kv, q, out, lse, b, h, lo, hi, scale, return_lse, good, bounds, carry, nxt)


def link_streams(units: Sequence[tuple[KvStream, int, int, int, int]]) -> None:
    """Tell each stream of ``units`` (``(kv, b, h, q_lo, q_hi)`` in the order the kernel runs them) which
    one runs next, so that its last unit loads the next one's first q^T tiles and key chunk."""
    for (kv, *_), (nkv, b, h, lo, hi) in zip(units, units[1:]):
        kv.nxt, kv.nxt_rows = nkv, (b, h, lo, hi)


def unit_rows(q_lo: int, q_hi: int) -> list[tuple[int, int]]:
    """Queries ``[q_lo, q_hi)`` cut into equal units of at most :data:`MAX_UNIT_TILES` 128-query tiles."""
    ntiles = (q_hi - q_lo + PMAX - 1) // PMAX
    nunits = math.ceil(ntiles / MAX_UNIT_TILES)
    base, extra = divmod(ntiles, nunits)
    out, t0 = [], 0
    for u in range(nunits):
        nt = base + (1 if u < extra else 0)
        lo = q_lo + t0 * PMAX
        out.append((lo, min(q_hi, lo + nt * PMAX)))
        t0 += nt
    return out


class _Loads:
    """The loads of one unit: its resident q^T ``[D, nt*128]`` (zeros past a partial last tile) and its K/V
    ring slots (allocated when first used), with what was issued; a unit's first q^T tiles and key chunk
    may be loaded while the previous unit runs (:func:`_unit`'s ``nxt``)."""

    def __init__(self, kv: KvStream, q: Any, b: int, h: int, q_lo: int, q_hi: int) -> None:
        self.kv, self.q, self.b, self.h, self.q_lo, self.q_hi = kv, q, b, h, q_lo, q_hi
        self.nt = (q_hi - q_lo + PMAX - 1) // PMAX
        self.d = q.shape[3]
        self.qT = nl.ndarray((self.d, self.nt * PMAX), dtype=q.dtype, buffer=nl.sbuf)
        self.chunks = stream_chunks(kv.lk)
        self.slots: list[Any] = [None] * RING
        self.qloaded: set[int] = set()
        self.issued: set[int] = set()
        self.finished: set[int] = set()

    def rows(self, t: int) -> int:
        return min(PMAX, self.q_hi - self.q_lo - t * PMAX)

    def load_q(self, t: int) -> None:
        if t >= self.nt or t in self.qloaded:
            return
        if not self.qloaded and self.rows(self.nt - 1) < PMAX:  # zeros past the last tile's rows
            last = (self.nt - 1) * PMAX + self.rows(self.nt - 1)
            nisa.memset(self.qT[: self.d, last : self.nt * PMAX], 0.0, engine=nisa.vector_engine)
        q0, n = self.q_lo + t * PMAX, self.rows(t)
        _load_transposed(
            self.qT[: self.d, t * PMAX : t * PMAX + n], self.q[self.b, q0 : q0 + n, self.h, :], n, True
        )
        self.qloaded.add(t)

    def slot(self, c: int) -> Any:
        if self.slots[c % RING] is None:
            self.slots[c % RING] = self.kv.slot()
        return self.slots[c % RING]

    def ensure(self, c: int, finish: bool = True) -> None:
        """Chunk ``c``'s DMAs issued (and, with ``finish``, its slot completed) into slot ``c % RING``."""
        if c >= len(self.chunks):
            return
        if c not in self.issued:
            self.kv.issue(self.chunks[c], self.slot(c))
            self.issued.add(c)
        if finish and c not in self.finished:
            self.kv.finish(self.chunks[c], self.slot(c))
            self.finished.add(c)


def _qk(s, kT, qT, t, kc, d) -> None:
    """``S^T`` of one tile over one chunk: per 128-key block ``s[:kr, blk, :] = K_blk q_t^T`` over all 128
    query columns (a partial last tile's columns past its rows hold zeros: full-width matmuls, no
    small-tile penalty; those columns are never read)."""
    for blk in range((kc + PMAX - 1) // PMAX):
        kr = min(PMAX, kc - blk * PMAX)
        nisa.nc_matmul(
            s[:kr, blk, :],
            stationary=kT[:d, blk * PMAX : blk * PMAX + kr],
            moving=qT[:d, t * PMAX : (t + 1) * PMAX],
            accumulate=False,
        )


def _unit(kv, q, out, lse, b, h, q_lo, q_hi, scale, return_lse, good, bounds, carry, nxt) -> None:
    """One unit of :func:`stream_rows` (its module-docstring schedule, in program order). ``carry`` holds the
    :class:`_Loads` a previous unit started for this one; ``nxt`` = ``(kv, b, h, q_lo, q_hi)`` of the unit
    the kernel runs next, whose q^T and first key chunk this unit loads while it runs (or None)."""
    D = q.shape[3]
    dt, f32 = q.dtype, nl.float32
    ld = carry.pop((id(kv), b, h, q_lo), None) or _Loads(kv, q, b, h, q_lo, q_hi)
    chunks, nt = ld.chunks, ld.nt
    nch = len(chunks)
    rows, qT, ensure = ld.rows, ld.qT, ld.ensure
    nx = None
    if nxt is not None:
        nx = _Loads(nxt[0], q, *nxt[1:])
        carry[(id(nxt[0]), *nxt[1:4])] = nx

    f8 = Fp8Pv(kv, b, h, D)
    o_all = nl.ndarray((PMAX, nt, D + 1), dtype=f32, buffer=nl.sbuf)
    bmax = nl.ndarray((PMAX, nt), dtype=f32, buffer=nl.sbuf)
    mx = nl.ndarray((1, nt), dtype=f32, buffer=nl.sbuf)
    nm = nl.ndarray((PMAX, nt), dtype=f32, buffer=nl.sbuf)
    ones_row = nl.ndarray((1, PMAX), dtype=f32, buffer=nl.sbuf)
    nisa.memset(ones_row, 1.0, engine=nisa.vector_engine)
    s_ps = [nl.ndarray((PMAX, NB, PMAX), dtype=f32, buffer=nl.psum) for _ in range(RING)]
    pv_ps = [nl.ndarray((PMAX, D + 1), dtype=f32, buffer=nl.psum) for _ in range(PV_RING)]
    bc = nl.ndarray((PMAX, nt), dtype=f32, buffer=nl.psum)
    pT = [nl.ndarray((PMAX, NB, PMAX), dtype=f8.p_dtype(dt), buffer=nl.sbuf) for _ in range(RING)]
    o_out = [nl.ndarray((PMAX, D), dtype=dt, buffer=nl.sbuf) for _ in range(2)]
    rl = nl.ndarray((PMAX, 1), dtype=f32, buffer=nl.sbuf)
    lse_t = [nl.ndarray((PMAX, 1), dtype=f32, buffer=nl.sbuf) for _ in range(4)]
    for p_t in pT:  # a partial tile's PV reads all 128 query columns of its P^T: keep them finite
        nisa.memset(p_t, 0.0, engine=nisa.gpsimd_engine)

    def prefetch(c: int) -> None:
        """At the start of key chunk c: a share of the next unit's q^T loads; its first key chunk's DMAs two
        chunks before this unit's last, its completion one chunk before."""
        if nx is None:
            return
        per = -(-nx.nt // max(1, nch - 2))
        for t in range((c - 1) * per, c * per) if c >= 1 else ():
            nx.load_q(t)
        if c == max(0, nch - 2):
            nx.ensure(0, finish=False)
        if c == nch - 1:
            for t in range(nx.nt):
                nx.load_q(t)
            nx.ensure(0)

    # The score-ring items: the offset item of tile t ("max": S^T of chunk 0, its max on VectorE) runs
    # MAX_LEAD tiles ahead of the tile's first main item (c = 0), interleaved with chunk 0's main items
    lead = min(MAX_LEAD, nt)
    seq: list[tuple[int, int]] = [(-1, t) for t in range(lead)]  # (-1, t): tile t's offset item
    for c in range(nch):
        for t in range(nt):
            if c == 0 and t + lead < nt:
                seq.append((-1, t + lead))
            seq.append((c, t))
    at = {it: j for j, it in enumerate(seq)}
    # the offsets of a batch of OFFSET_BATCH tiles: issued 3 items after its last offset item (its max on
    # VectorE has then run), but never after the item before its first tile's first exp
    batches: dict[int, list[tuple[int, int]]] = {}
    for t0 in range(0, nt, OFFSET_BATCH):
        t1 = min(nt, t0 + OFFSET_BATCH)
        last = at[(-1, t1 - 1)]
        batches.setdefault(max(last, min(last + 3, at[(0, t0)] - 1)), []).append((t0, t1))

    def produce(j: int) -> None:
        """Item j's scores S^T into the ring buffer ``j % RING`` (its q^T and K^T chunk first)."""
        c, t = seq[j]
        ld.load_q(t)
        ensure(max(c, 0))
        _qk(s_ps[j % RING], ld.slot(max(c, 0))["kT"], qT, t, chunks[max(c, 0)][1], D)

    def offsets(t0: int, t1: int) -> None:
        """nm[:, t] = -scale * (max over partitions of bmax[:, t]) on every partition, tiles [t0, t1)."""
        nisa.tensor_partition_reduce(mx[0:1, t0:t1], nl.maximum, bmax[:, t0:t1])
        nisa.nc_matmul(bc[:, t0:t1], stationary=ones_row[0:1, :PMAX], moving=mx[0:1, t0:t1], accumulate=False)
        nisa.tensor_scalar(nm[:, t0:t1], bc[:, t0:t1], nl.multiply, -scale, engine=nisa.vector_engine,
                           **f8.offset_shift())  # fmt: skip

    for t in range(min(nt, QLEAD)):
        ld.load_q(t)
    ensure(0)
    f8.start(ld.slot(0), chunks[0][1])  # FP8: V's scales for this (b, h) and chunk 0 quantised
    ensure(1, finish=False)
    for j in range(min(2, len(seq))):
        produce(j)
    i = 0  # main items consumed
    pending: list[Any] = []  # the previous main item's o update (and finalize): VectorE reduces first
    for j, (c, t) in enumerate(seq):
        if c >= 0 and t == 0:  # a new key chunk: the next slot completed, loads 2 ahead, the next unit's
            ensure(c + 1)
            ensure(c + 2, finish=False)
            prefetch(c)
        s, qr = s_ps[j % RING], rows(t)
        if c < 0:  # the offset item: the tile's largest first-chunk score per key partition
            nisa.tensor_reduce(bmax[:, t : t + 1], nl.maximum, s[:, :, :qr], axis=(1, 2))
        else:  # P^T = exp(scale * S^T + nm): ONE ScalarE pass from PSUM (+ one for a partial last block)
            kc = chunks[c][1]
            nbf, kr = divmod(kc, PMAX)
            p = pT[i % RING]
            if nbf:
                nisa.activation(p[:, :nbf, :qr], nl.exp, s[:, :nbf, :qr], bias=nm[:, t : t + 1], scale=scale)
            if kr:
                nisa.activation(
                    p[:kr, nbf, :qr], nl.exp, s[:kr, nbf, :qr], bias=nm[:kr, t : t + 1], scale=scale
                )
        while pending:
            pending.pop()()
        if j + 2 < len(seq):
            produce(j + 2)
        if c >= 0 and t == nt // 2 and c + 1 < nch:  # FP8: the next chunk's V quantised on GpSimd
            f8.quantize(ld.slot(c + 1), c + 1, chunks[c + 1][1])
        if j + QLEAD < len(seq):
            ld.load_q(seq[j + QLEAD][1])
        for t0, t1 in batches.get(j, []):
            offsets(t0, t1)
        if c < 0:
            continue
        pv, v = pv_ps[i % PV_RING], ld.slot(c)["v"]
        if f8.on:  # e4m3 P^T and V: double-row matmuls over pairs of 128-key blocks
            f8.pv(pv, p, ld.slot(c), kc)
        for blk in range(0 if f8.on else nbf + (1 if kr else 0)):
            kb = min(PMAX, kc - blk * PMAX)
            nisa.nc_matmul(
                pv[:, : D + 1], stationary=p[:kb, blk, :], moving=v[:kb, blk, : D + 1], accumulate=blk > 0
            )  # fmt: skip  (all 128 rows: no small-tile penalty)
        i += 1

        def update(c: int = c, t: int = t, qr: int = qr, pv: Any = pv) -> None:
            acc = o_all[:qr, t, :]
            if c == 0:
                nisa.tensor_copy(acc, pv[:qr, : D + 1], engine=nisa.vector_engine)
            else:
                nisa.tensor_tensor(acc, acc, pv[:qr, : D + 1], nl.add)
            if c == nch - 1:
                _finalize(o_all, t, qr, D, rl, o_out[t % 2], lse_t[t % 4], nm, good, bounds, out, lse, b, h,
                          q_lo + t * PMAX, return_lse, f8)  # fmt: skip

        pending.append(update)
    while pending:
        pending.pop()()


def _finalize(o_all, t, qr, D, rl, ob, lt, nm, good, bounds, out, lse, b, h, q0, return_lse, f8) -> None:
    """Tile ``t``'s output ``o / max(l, l_floor)`` (times V's scales with FP8, :class:`Fp8Pv`; stored), its
    guard flags and its lse."""
    l_min, l_max, l_floor = bounds
    l_col = o_all[:qr, t, D : D + 1]
    nisa.tensor_scalar(rl[:qr], l_col, nl.maximum, l_floor, engine=nisa.vector_engine)
    nisa.reciprocal(rl[:qr], rl[:qr])
    if f8.on:
        f8.output(ob, o_all[:qr, t, :D], rl, qr)
    else:
        nisa.tensor_scalar(ob[:qr], o_all[:qr, t, :D], nl.multiply, rl[:qr], engine=nisa.vector_engine)
    nisa.dma_copy(dst=out[b, q0 : q0 + qr, h, :], src=ob[:qr, :D])
    g = good[:qr]  # a row whose l overflowed, underflowed or is NaN clears its flag
    for cmp, bound in ((nl.less_equal, l_max), (nl.greater_equal, l_min)):
        nisa.tensor_scalar(g, l_col, cmp, bound, op1=nl.minimum, operand1=g, engine=nisa.vector_engine)
    if return_lse:
        nisa.activation(lt[:qr], nl.log, l_col)
        nisa.tensor_tensor(lt[:qr], lt[:qr], nm[:qr, t : t + 1], nl.subtract)
        nisa.dma_copy(dst=lse[b, q0 : q0 + qr, h : h + 1], src=lt[:qr])
