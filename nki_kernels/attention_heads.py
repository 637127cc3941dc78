"""The static pass over ONE key chunk for every head at once (standalone NKI 0.6 API): cross-attention over
the 512 text tokens, any attention / segments call with at most 1,024 keys (bf16, every P^T on TensorE).

With one short key set per head the cost is the queries': a per-head loop reads each query row of
``[B, Lq, H, D]`` as a 2*D-byte descriptor, transposed (q^T) and stored back one head at a time. Here the
K^T / V of every head stay in SBUF for the call and the loop runs over 128-query tiles, each tile's q of
ALL heads moved by ONE hwdge ``dma_transpose`` (rows of H*D*2 bytes, 4-D ``[16, 8, H, D] -> [D, 8, H,
16]``) and its output of all heads stored by ONE ``dma_copy``. Per (tile, head), as in
:mod:`nki_kernels.attention_stream` (one offset per query tile and head, the largest scaled score)::

    offset item: S^T = K_h q_t^T (keys on the partitions), its max on VectorE; per tile and group of up to
                 3 heads: GpSimd max across the partitions, a 1-row broadcast matmul, a VectorE scale
    main item:   S^T again, P^T = exp(scale S^T + nm) (ONE ScalarE pass from PSUM), PV (V's column D = 1
                 sums l) into the group's PSUM bank; per group 1/l on VectorE (one instruction for its
                 heads' l), o = PV / l on ScalarE straight from PSUM into the tile's output
    the guard:   after every tile, each row's 1/l against 1/GUARD_L_MIN, per head (with the largest score
                 over all the keys as the offset, l <= Lk: the upper bound cannot trip)

The offset items run :data:`LEAD` (tile, head) units ahead of the main items (interleaved), so TensorE,
ScalarE and VectorE overlap; no P transposes, no P^T or o evictions on VectorE.
"""

from __future__ import annotations

from typing import Any

from nki_kernels._nki import nisa, nl
from nki_kernels.attention_tiles import KC_TWO_BYTE, _load_kv
from nki_kernels.hw_limits import HWDGE_ROWS, PMAX, PSUM_BANK_FMAX

LEAD = 6
"""(tile, head) units by which a unit's offset item runs ahead of its main item."""

HEADS_KV_BYTES = 96 * 1024
"""Per-partition SBUF for every head's K^T and V (bf16); calls needing more keep the per-head loop."""

QLEAD_TILES = 1
"""Query tiles (plus 4 items) by which a tile's q^T load is issued ahead of its first use."""

RECIP_DELAY = 3
"""Items after a head group's last PV at which its 1/l is issued (VectorE keeps reducing maxima first)."""

OUT_DELAY = 4
"""Items after a group's 1/l at which its outputs are issued (ScalarE keeps computing exps first)."""

RING = 3
"""P^T buffers (SBUF); the scores (PSUM) have :func:`score_slots` buffers and TensorE computes the scores
of item j + slots - 1 before item j's PV (the offset and main items alternate, so a ring of 3 would keep
TensorE only one main item ahead)."""


def score_slots(nkb: int) -> int:
    """Score buffers ``[128, nkb, 128]`` fp32 next to the 2 PV banks: 5 of one bank (<= 512 keys), else 3."""
    return 5 if nkb <= 4 else 3


def heads_fit(segments, h: int, d: int, two_byte: bool, dma_chunks: tuple[int, int]) -> bool:
    """Whether a static pass runs here: 2-byte dtype, every P^T on TensorE, at most one 1,024-key chunk in
    segments of whole 16-key rows (the hwdge transpose unit), every head's K^T + V within
    :data:`HEADS_KV_BYTES` per partition."""
    lk = sum(n for _, n in segments)
    nkb = (lk + PMAX - 1) // PMAX
    per_head = 2 * (nkb * PMAX + nkb * (d + 1))
    whole = all(n % HWDGE_ROWS == 0 for _, n in segments)
    return two_byte and not dma_chunks[0] and lk <= KC_TWO_BYTE and whole and h * per_head <= HEADS_KV_BYTES


class HeadsPass:
    """The static pass of every head of batch ``b`` for queries ``[q_lo, q_hi)`` over the keys of
    ``segments`` of ``kbuf`` / ``vbuf`` (module docstring). :meth:`run` issues it once (later calls do
    nothing); ``good`` ``[128, H]`` then holds each row's guard flag per head (1 = within the bounds over
    every tile); :meth:`resident` gives head h's K^T / V (loaded once) for the running-max recompute."""

    def __init__(self, q, kbuf, vbuf, segments, b, q_lo, q_hi, out, lse, scale, return_lse, bounds) -> None:
        self.q, self.kbuf, self.vbuf, self.segments, self.b = q, kbuf, vbuf, tuple(segments), b
        self.q_lo, self.q_hi, self.out, self.lse = q_lo, q_hi, out, lse
        self.scale, self.return_lse, self.bounds = scale, return_lse, bounds
        _, _, self.H, self.D = q.shape
        self.lk = sum(n for _, n in self.segments)
        self.nkb = (self.lk + PMAX - 1) // PMAX
        self.good = nl.ndarray((PMAX, self.H), dtype=q.dtype, buffer=nl.sbuf)
        self.ran = False

    def resident(self, h: int) -> tuple[Any, Any]:
        """Head h's K^T ``[D, Lk]`` / V ``[128, Lk/128, D + 1]`` in tiles of their own (the recompute)."""
        D, nkb, dt = self.D, self.nkb, self.q.dtype
        kT = nl.ndarray((D, nkb * PMAX), dtype=dt, buffer=nl.sbuf)
        v = nl.ndarray((PMAX, nkb, D + 1), dtype=dt, buffer=nl.sbuf)
        nisa.memset(v[:, :, D : D + 1], 1.0, engine=nisa.gpsimd_engine)  # l's ones column
        _load_kv(kT, v, self.kbuf, self.vbuf, self.b, h, self.segments, D, True)
        return kT, v

    def run(self) -> None:
        if not self.ran:
            self.ran = True
            _pass(self)


def _pass(hp: HeadsPass) -> None:
    q, H, D, b, lk, nkb = hp.q, hp.H, hp.D, hp.b, hp.lk, hp.nkb
    dt, f32 = q.dtype, nl.float32
    l_min = hp.bounds[0]
    nt = (hp.q_hi - hp.q_lo + PMAX - 1) // PMAX
    nbf, kr = divmod(lk, PMAX)

    def rows(t: int) -> int:
        return min(PMAX, hp.q_hi - hp.q_lo - t * PMAX)

    # every head's K^T / V: rows of H*D elements per key, K transposed per 16 keys (4-D hwdge pieces):
    # kT[d, c, h, a] = k[b, 16c + a, h, d] (key position), v[p, t, h, :D] = v[b, 128t + p, h, :]
    kT = nl.ndarray((D, nkb * 8, H, HWDGE_ROWS), dtype=dt, buffer=nl.sbuf)
    v = nl.ndarray((PMAX, nkb, H, D + 1), dtype=dt, buffer=nl.sbuf)
    nisa.memset(v[:, :, :, D : D + 1], 1.0, engine=nisa.gpsimd_engine)  # l's ones column
    per_bank = PSUM_BANK_FMAX // (D + 1)  # PV accumulators per bank: a group of heads
    groups = [(t, h0, min(H, h0 + per_bank)) for t in range(nt) for h0 in range(0, H, per_bank)]
    ns = score_slots(nkb)
    qlead = 2 * H * QLEAD_TILES + 4  # items
    nq = -(-(LEAD + qlead) // H) + 2  # q^T tiles in flight: from the main items' tile to the loads' one
    qT = [nl.ndarray((D, 8, H, HWDGE_ROWS), dtype=dt, buffer=nl.sbuf) for _ in range(nq)]
    s_ps = [nl.ndarray((PMAX, nkb, PMAX), dtype=f32, buffer=nl.psum) for _ in range(ns)]
    pT = [nl.ndarray((PMAX, nkb, PMAX), dtype=dt, buffer=nl.sbuf) for _ in range(RING)]
    pv_ps = [nl.ndarray((PMAX, per_bank, D + 1), dtype=f32, buffer=nl.psum) for _ in range(2)]
    bc = [nl.ndarray((PMAX, per_bank), dtype=f32, buffer=nl.psum) for _ in range(2)]
    bmax = nl.ndarray((PMAX, nt * H), dtype=f32, buffer=nl.sbuf)
    mx = nl.ndarray((1, nt * H), dtype=f32, buffer=nl.sbuf)
    nm = nl.ndarray((PMAX, nt * H), dtype=f32, buffer=nl.sbuf)
    rl = nl.ndarray((PMAX, H, nt), dtype=f32, buffer=nl.sbuf)  # 1/l per row, head and tile
    o_out = [nl.ndarray((PMAX, H, D), dtype=dt, buffer=nl.sbuf) for _ in range(2)]
    lse_t = [nl.ndarray((PMAX, H), dtype=f32, buffer=nl.sbuf) for _ in range(2)]
    ones_row = nl.ndarray((1, PMAX), dtype=f32, buffer=nl.sbuf)
    nisa.memset(ones_row, 1.0, engine=nisa.vector_engine)
    for p_t in pT:  # the PV reads all 128 query columns of P^T: keep those past a partial tile finite
        nisa.memset(p_t, 0.0, engine=nisa.gpsimd_engine)
    if kr:  # a partial last key block: its rows past the keys never count in the max (QK^T writes [:kr])
        for s_t in s_ps:
            nisa.memset(s_t[:, nbf, :], -3.0e38, engine=nisa.vector_engine)
    if rows(nt - 1) < PMAX:  # rows past the last query: 1/l = 1 (inside the guard's bounds)
        nisa.memset(rl[:, :, nt - 1 : nt], 1.0, engine=nisa.vector_engine)

    loaded: set[int] = set()

    def load_q(t: int) -> None:
        """Tile t's q of every head, transposed: ``qT[d, c, h, a] = q[b, q0 + 16c + a, h, d]``."""
        if t in loaded:
            return
        loaded.add(t)
        n, q0, dst = rows(t), hp.q_lo + t * PMAX, qT[t % nq]
        if n < PMAX:  # zeros past the last query (full-width matmuls; those columns are never read)
            nisa.memset(dst, 0.0, engine=nisa.vector_engine)
        full = n // HWDGE_ROWS
        if full:
            src = q[b, q0 : q0 + full * HWDGE_ROWS, :, :].reshape_dim(0, (full, HWDGE_ROWS))
            src = src.permute((1, 0, 2, 3))
            nisa.dma_transpose(dst=dst[:, :full, :, :], src=src, axes=(3, 1, 2, 0))
        r0 = full * HWDGE_ROWS
        if n > r0:  # a tail of < 16 queries (once per call): rows as they are, per-head TensorE transposes
            stage = nl.ndarray((HWDGE_ROWS, H, D), dtype=dt, buffer=nl.sbuf)
            nisa.dma_copy(dst=stage[: n - r0], src=q[b, q0 + r0 : q0 + n, :, :])
            tq = nl.ndarray((D, H, HWDGE_ROWS), dtype=dt, buffer=nl.psum)
            for h in range(H):
                nisa.nc_transpose(tq[:D, h, : n - r0], stage[: n - r0, h, :D])
            nisa.tensor_copy(dst[:, full, :, : n - r0], tq[:D, :, : n - r0], engine=nisa.vector_engine)

    def qk(s, t: int, h: int) -> None:
        for blk in range(nkb):
            g = min(PMAX, lk - blk * PMAX) // HWDGE_ROWS  # 16-key groups of the block
            nisa.nc_matmul(s[: g * HWDGE_ROWS, blk, :].reshape_dim(1, (8, HWDGE_ROWS)),
                           stationary=kT[:D, blk * 8 : blk * 8 + g, h, :], moving=qT[t % nq][:D, :, h, :],
                           accumulate=False)  # fmt: skip

    units = [(t, h) for t in range(nt) for h in range(H)]
    lead = min(LEAD, len(units))
    seq: list[tuple[int, int]] = [(-1, u) for u in range(lead)]  # (-1, u): offset item, (1, u): main item
    for u in range(len(units)):
        if u + lead < len(units):
            seq.append((-1, u + lead))
        seq.append((1, u))
    at = {it: j for j, it in enumerate(seq)}
    gturn: dict[int, list[int]] = {}  # offsets of group k at the turn 3 items after its last offset item
    for k, (t, h0, h1) in enumerate(groups):
        last = at[(-1, t * H + h1 - 1)]
        gturn.setdefault(max(last, min(last + 3, at[(1, t * H + h0)] - 1)), []).append(k)

    def offsets(k: int) -> None:
        t, h0, h1 = groups[k]
        u0, u1 = t * H + h0, t * H + h1
        nisa.tensor_partition_reduce(mx[0:1, u0:u1], nl.maximum, bmax[:, u0:u1])
        c = bc[k % 2][:, : u1 - u0]
        nisa.nc_matmul(c, stationary=ones_row[0:1, :PMAX], moving=mx[0:1, u0:u1], accumulate=False)
        nisa.activation(nm[:, u0:u1], nl.copy, c, scale=-hp.scale)  # ScalarE: VectorE has the maxima

    def finish(k: int) -> list[Any]:
        """Group k's 1/l (VectorE, now) and its outputs (ScalarE, :data:`OUT_DELAY` items later)."""
        t, h0, h1 = groups[k]
        qr, pv = rows(t), pv_ps[k % 2]
        nisa.reciprocal(rl[:qr, h0:h1, t], pv[:qr, : h1 - h0, D])

        def outputs() -> None:
            out_done.add(k)
            ob = o_out[t % 2]
            for h in range(h0, h1):
                nisa.activation(ob[:qr, h, :], nl.copy, pv[:qr, h - h0, :D], scale=rl[:qr, h, t : t + 1])
            if h1 < H:
                return
            q0 = hp.q_lo + t * PMAX
            nisa.dma_copy(dst=hp.out[b, q0 : q0 + qr, :, :], src=ob[:qr, :, :])
            if hp.return_lse:  # lse = log(l) - nm = -log(1/l) - nm
                lt = lse_t[t % 2]
                nisa.activation(lt[:qr, :], nl.log, rl[:qr, :, t])
                nisa.scalar_tensor_tensor(lt[:qr, :], lt[:qr, :], nl.multiply, -1.0, nl.subtract,
                                          nm[:qr, t * H : t * H + H])  # fmt: skip
                nisa.dma_copy(dst=hp.lse[b, q0 : q0 + qr, :], src=lt[:qr, :])

        return [outputs]

    load_q(0)
    _load_heads_kv(hp, kT, v)
    for j in range(min(qlead, len(seq))):
        load_q(units[seq[j][1]][0])
    for j in range(min(ns - 1, len(seq))):
        qk(s_ps[j % ns], *units[seq[j][1]])
    later: list[list[Any]] = [[] for _ in range(RECIP_DELAY + OUT_DELAY)]  # work deferred by n items
    out_done: set[int] = set()

    def step() -> None:
        """Issue the deferred work due now and shift the rest one item closer."""
        due = later.pop(0)
        later.append([])
        for fn in due:
            fn()

    i = 0  # main items
    for j, (kind, u) in enumerate(seq):
        t, h = units[u]
        s, qr = s_ps[j % ns], rows(t)
        if kind < 0:
            nisa.tensor_reduce(bmax[:, u : u + 1], nl.maximum, s[:, :, :qr], axis=(1, 2))
        else:
            p = pT[i % RING]
            if nbf:
                bias = nm[:, u : u + 1]
                nisa.activation(p[:, :nbf, :qr], nl.exp, s[:, :nbf, :qr], bias=bias, scale=hp.scale)
            if kr:
                nisa.activation(p[:kr, nbf, :qr], nl.exp, s[:kr, nbf, :qr], bias=nm[:kr, u : u + 1],
                                scale=hp.scale)  # fmt: skip
        for k in gturn.get(j, []):  # (before this turn's scores in TensorE's order: the broadcast is awaited)
            offsets(k)
        step()
        if j + ns - 1 < len(seq):
            qk(s_ps[(j + ns - 1) % ns], *units[seq[j + ns - 1][1]])
        if j + qlead < len(seq):
            load_q(units[seq[j + qlead][1]][0])
        if kind < 0:
            continue
        k = next(g for g, (tt, h0, h1) in enumerate(groups) if tt == t and h0 <= h < h1)
        _, h0, h1 = groups[k]
        pv = pv_ps[k % 2]
        while h == h0 and k >= 2 and k - 2 not in out_done:  # group k-2's outputs read this bank first
            step()
        for blk in range(nkb):
            kb = min(PMAX, lk - blk * PMAX)
            nisa.nc_matmul(pv[:, h - h0, :], stationary=p[:kb, blk, :], moving=v[:kb, blk, h, :],
                           accumulate=blk > 0)  # fmt: skip
        i += 1
        if h == h1 - 1:
            later[RECIP_DELAY - 1].append(lambda k=k: later[OUT_DELAY - 1].extend(finish(k)))
    while any(later):  # the last groups' 1/l, then their outputs
        step()
    # the guard: a row is good for head h when l >= l_min (1/l <= 1/l_min) in every tile; NaN fails the
    # comparison. The offset is the largest score over ALL the keys (one chunk), so every P <= 1 and
    # l <= Lk <= 1024: the upper bound l_max cannot trip here
    f = nl.ndarray((PMAX, H, nt), dtype=f32, buffer=nl.sbuf)
    inv_min = 1.0 / l_min if l_min > 0 else float("inf")  # (a lower bound of 0 checks nothing but NaN)
    nisa.tensor_scalar(f, rl, nl.less_equal, inv_min, engine=nisa.vector_engine)
    nisa.tensor_reduce(hp.good[:, :H], nl.minimum, f, axis=(2,))


def _load_heads_kv(hp: HeadsPass, kT, v) -> None:
    """Every head's K^T and V of ``hp``'s segments, each key's H*D elements one descriptor: K by 4-D hwdge
    transposes ``[16, n/16, H, D] -> [D, n/16, H, 16]`` (all of K first, the offsets need it first); V
    into a staging tile at its key positions (partition ``j % 128`` of tile ``j // 128``, rows contiguous),
    then one GpSimd copy into ``v``'s ``[.., H, D + 1]`` layout (column D is l's ones column)."""
    b, D, H, off = hp.b, hp.D, hp.H, 0
    for start, n in hp.segments:
        src = hp.kbuf[b, start : start + n, :, :].reshape_dim(0, (n // HWDGE_ROWS, HWDGE_ROWS))
        c0 = off // HWDGE_ROWS
        nisa.dma_transpose(dst=kT[:, c0 : c0 + n // HWDGE_ROWS, :, :], src=src.permute((1, 0, 2, 3)),
                           axes=(3, 1, 2, 0))  # fmt: skip
        off += n
    st = nl.ndarray((PMAX, hp.nkb, H, D), dtype=hp.q.dtype, buffer=nl.sbuf)
    off = 0
    for start, n in hp.segments:
        j = off
        while j < off + n:
            t, p = divmod(j, PMAX)
            m = min(PMAX - p, off + n - j)
            r = start + j - off
            if p == 0 and m == PMAX:
                m = (off + n - j) // PMAX * PMAX
                src = hp.vbuf[b, r : r + m, :, :].reshape_dim(0, (m // PMAX, PMAX)).permute((1, 0, 2, 3))
                nisa.dma_copy(dst=st[:, t : t + m // PMAX, :, :], src=src)
            else:
                nisa.dma_copy(dst=st[p : p + m, t, :, :], src=hp.vbuf[b, r : r + m, :, :])
            j += m
        off += n
    if hp.lk % PMAX:  # rows past the last key: finite (the PV reads only the keys' rows)
        nisa.memset(v[:, hp.nkb - 1, :, :D], 0.0, engine=nisa.gpsimd_engine)
    nkf = hp.lk // PMAX
    if nkf:
        nisa.tensor_copy(v[:, :nkf, :, :D], st[:, :nkf, :, :], engine=nisa.gpsimd_engine)
    if hp.lk % PMAX:
        kr = hp.lk % PMAX
        nisa.tensor_copy(v[:kr, nkf, :, :D], st[:kr, nkf, :, :], engine=nisa.gpsimd_engine)
