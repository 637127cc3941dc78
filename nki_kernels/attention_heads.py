"""The static pass over one short key chunk for every head at once (standalone NKI 0.6 API): cross-attention
over the 512 text tokens, any attention / segments call with at most :data:`MAX_KEYS` keys in whole 16-key
rows (bf16, every P^T on TensorE).

With one short key set per head the cost is the queries': a per-head loop reads each query row of
``[B, Lq, H, D]`` as a 2*D-byte descriptor, transposed (q^T) and stored back one head at a time. Here the
K^T / V of every head stay in SBUF for the call and the loop runs over 128-query tiles, each tile's q of
ALL heads moved by ONE hwdge ``dma_transpose`` (rows of H*D*2 bytes, 4-D ``[16, 8, H, D] -> [D, 8, H,
16]``) and its output of all heads stored by ONE ``dma_copy``. The softmax offset is each row's own largest
score (as the per-head loop's for one key chunk, :func:`nki_kernels.attention._flash_rows`, static) rounded
to bf16, so ``l`` stays within a factor ``exp(scale |max| 2^-8)`` of ``[1, Lk]`` and only a non-finite row
(or one whose scaled max exceeds ~10^4 nats) trips the guard. The scores are computed twice on TensorE,
``S`` (queries on partitions) for the row max and ``S^T`` (keys on partitions) with the offset added by a
second matmul, so ONE ScalarE exp writes P^T straight into the PV's stationary tile: no P^T transposes or
PSUM evictions. Per (tile, head) unit, one stage per turn::

    turn u - 2   S = q_t K_h^T                       (ONE matmul, K^T moving: [128 q, Lk] fp32 in PSUM)
    turn u       negm = bf16(min(-S)) = -max S       (ONE VectorE tensor_scalar_reduce from PSUM)
                 diag(negm) = I * negm               (ONE VectorE tensor_scalar, bf16 SBUF, fast mode)
    turn u       S^T = K_h q_t^T per 128-key block   (K^T block stationary, q^T moving; one PSUM bank)
    turn u + 1   S^T += ones^T diag(negm)            (per block: every key row gets -max of its query)
    turn u + 2   P^T = exp(scale S^T)                (ONE ScalarE pass from PSUM into bf16 SBUF)
    turn u + 3   PV (V's column D = 1 sums l) into the PSUM bank of its group of 3 heads
    per group    1/l (ONE VectorE reciprocal over the group's l columns), o = PV / l on ScalarE from PSUM
    the guard    after every tile, per head: each row's 1/l within [1/GUARD_L_MAX, 1/GUARD_L_MIN]

so no in-order engine waits for the previous stage of the same unit.
"""

from __future__ import annotations

from typing import Any

from nki_kernels._nki import nisa, nl
from nki_kernels.attention_tiles import _load_kv
from nki_kernels.hw_limits import HWDGE_ROWS, PMAX, PSUM_BANK_FMAX

HEADS_KV_BYTES = 96 * 1024
"""Per-partition SBUF for every head's K^T and V (bf16); calls needing more keep the per-head loop."""

MAX_KEYS = 512
"""Keys per call (one PSUM bank of fp32 scores per (tile, head)); longer single-chunk calls keep the
per-head loop."""

LOOK = 2
"""Units by which a unit's scores are computed ahead of its row max (so they wait in PSUM, S_SLOTS of
them)."""

S_SLOTS = 3
"""Row-major score buffers (PSUM, one bank each): a unit's ``S`` lives from turn u - LOOK to its max at u."""

T_SLOTS = 3
"""Transposed score buffers (PSUM, one bank each): a unit's ``S^T`` lives from turn u to its exp at u + 2."""

QLEAD = 8
"""Units by which a tile's q^T load is issued ahead of its first scores."""

RECIP_DELAY = 3
"""Turns after a head group's last PV at which its 1/l is issued (VectorE keeps its row maxima first)."""

OUT_DELAY = 4
"""Turns after a group's 1/l at which its outputs are issued (ScalarE keeps its exps first)."""

RING = 3
"""P and P^T buffers (SBUF)."""


def heads_fit(segments, h: int, d: int, two_byte: bool, dma_chunks: tuple[int, int]) -> bool:
    """Whether a static pass runs here: 2-byte dtype, every P^T on TensorE, at most :data:`MAX_KEYS` keys
    in segments of whole 16-key rows (the hwdge transpose unit), every head's K^T + V within
    :data:`HEADS_KV_BYTES` per partition."""
    lk = sum(n for _, n in segments)
    nkb = (lk + PMAX - 1) // PMAX
    per_head = 2 * (nkb * PMAX + nkb * (d + 1))
    whole = all(n % HWDGE_ROWS == 0 for _, n in segments)
    return two_byte and not dma_chunks[0] and lk <= MAX_KEYS and whole and h * per_head <= HEADS_KV_BYTES


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
    l_min, l_max = hp.bounds[0], hp.bounds[1]
    nt = (hp.q_hi - hp.q_lo + PMAX - 1) // PMAX
    units = [(t, h) for t in range(nt) for h in range(H)]
    nu = len(units)

    def rows(t: int) -> int:
        return min(PMAX, hp.q_hi - hp.q_lo - t * PMAX)

    # every head's K^T / V: rows of H*D elements per key, K transposed per 16 keys (4-D hwdge pieces):
    # kT[d, c, h, a] = k[b, 16c + a, h, d] (key position), v[p, t, h, :D] = v[b, 128t + p, h, :]
    kT = nl.ndarray((D, nkb * 8, H, HWDGE_ROWS), dtype=dt, buffer=nl.sbuf)
    v = nl.ndarray((PMAX, nkb, H, D + 1), dtype=dt, buffer=nl.sbuf)
    nisa.memset(v[:, :, :, D : D + 1], 1.0, engine=nisa.gpsimd_engine)  # l's ones column
    per_bank = PSUM_BANK_FMAX // (D + 1)  # PV accumulators per bank: a group of heads
    groups = [(t, h0, min(H, h0 + per_bank)) for t in range(nt) for h0 in range(0, H, per_bank)]
    group_of = {(t, h): k for k, (t, h0, h1) in enumerate(groups) for h in range(h0, h1)}
    nq = -(-(QLEAD + 1) // H) + 2  # q^T tiles in flight
    qT = [nl.ndarray((D, 8, H, HWDGE_ROWS), dtype=dt, buffer=nl.sbuf) for _ in range(nq)]
    s_ps = [nl.ndarray((PMAX, lk), dtype=f32, buffer=nl.psum) for _ in range(S_SLOTS)]
    sT_ps = [nl.ndarray((PMAX, nkb, PMAX), dtype=f32, buffer=nl.psum) for _ in range(T_SLOTS)]
    pT = [nl.ndarray((PMAX, nkb, PMAX), dtype=dt, buffer=nl.sbuf) for _ in range(RING)]
    diag = [nl.ndarray((PMAX, PMAX), dtype=dt, buffer=nl.sbuf) for _ in range(RING)]
    ones = nl.ndarray((PMAX, PMAX), dtype=dt, buffer=nl.sbuf)
    ident = nl.ndarray((PMAX, PMAX), dtype=dt, buffer=nl.sbuf)
    nisa.memset(ones, 1.0, engine=nisa.gpsimd_engine)
    nisa.affine_select(ident, [[-1, PMAX]], 1, ones, 0.0)  # ident[p, i] = 1 where p - i == 0
    pv_ps = [nl.ndarray((PMAX, per_bank, D + 1), dtype=f32, buffer=nl.psum) for _ in range(2)]
    scratch = nl.ndarray((PMAX, lk), dtype=f32, buffer=nl.sbuf)  # the row max's by-product
    negm = nl.ndarray((PMAX, nu), dtype=dt, buffer=nl.sbuf)  # -(row max) per unit, rounded to bf16
    rl = nl.ndarray((PMAX, H, nt), dtype=f32, buffer=nl.sbuf)  # 1/l per row, head and tile
    o_out = [nl.ndarray((PMAX, H, D), dtype=dt, buffer=nl.sbuf) for _ in range(2)]
    lse_t = [nl.ndarray((PMAX, H), dtype=f32, buffer=nl.sbuf) for _ in range(2)]
    lo = nl.ndarray((PMAX, H), dtype=f32, buffer=nl.sbuf)
    if rows(nt - 1) < PMAX:  # rows past the last query: 1/l = 1 (inside the guard's bound)
        nisa.memset(rl[:, :, nt - 1 : nt], 1.0, engine=nisa.vector_engine)

    loaded: set[int] = set()

    def load_q(t: int) -> None:
        """Tile t's q of every head, transposed: ``qT[d, c, h, a] = q[b, q0 + 16c + a, h, d]``."""
        if t >= nt or t in loaded:
            return
        loaded.add(t)
        n, q0, dst = rows(t), hp.q_lo + t * PMAX, qT[t % nq]
        if n < PMAX:  # zeros past the last query (full-width matmuls; those rows are never read)
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

    # the stages of unit u (tile t, head h), each on its own turn so no in-order engine waits for the
    # previous stage: S at turn u - LOOK, max and S^T u, offset u + 1, exp u + 2, PV u + 3
    def scores(u: int) -> None:
        t, h = units[u]
        load_q(t)
        g = lk // HWDGE_ROWS  # S [128 q, lk] = q_t K_h^T: q^T stationary, K^T moving (16-key groups)
        dst = s_ps[u % S_SLOTS][:, :lk].reshape_dim(1, (g, HWDGE_ROWS))
        nisa.nc_matmul(dst, stationary=qT[t % nq][:D, :, h, :], moving=kT[:D, :g, h, :], accumulate=False)

    def row_max(u: int) -> None:
        # negm = min(-S) = -max(S) (exact in fp32); the products land in a scratch tile. Then the offset's
        # diagonal matrix diag(-max) (bf16, so the offset is -max rounded to bf16) for the S^T matmul
        nisa.tensor_scalar_reduce(
            dst=scratch, data=s_ps[u % S_SLOTS][:, :lk], op0=nl.multiply, operand0=-1.0,
            reduce_op=nl.minimum, reduce_res=negm[:, u : u + 1],
        )  # fmt: skip
        nisa.tensor_scalar(diag[u % RING], ident, nl.multiply, negm[:, u : u + 1], engine=nisa.vector_engine)

    def scores_t(u: int) -> None:
        """S^T [128 k, blk, 128 q] = K_blk q_t^T per 128-key block (K^T stationary, q^T moving)."""
        t, h = units[u]
        for blk in range(nkb):
            kb = min(PMAX, lk - blk * PMAX)
            g0, g1 = blk * 8, blk * 8 + kb // HWDGE_ROWS
            nisa.nc_matmul(sT_ps[u % T_SLOTS][:kb, blk, :], stationary=kT[:D, g0:g1, h, :],
                           moving=qT[t % nq][:D, :, h, :], accumulate=False)  # fmt: skip

    def offsets(u: int) -> None:
        """S^T[k, q] += -max_q (bf16): ones [128 q', 128 k] stationary, diag(-max) [128 q', 128 q] moving."""
        for blk in range(nkb):
            kb = min(PMAX, lk - blk * PMAX)
            nisa.nc_matmul(sT_ps[u % T_SLOTS][:kb, blk, :], stationary=ones[:, :kb], moving=diag[u % RING],
                           accumulate=True)  # fmt: skip

    def exps(u: int) -> None:
        """P^T = exp(scale * (S^T - max)) straight from PSUM into the PV's bf16 stationary tile."""
        st, dst = sT_ps[u % T_SLOTS], pT[u % RING]
        nbf, kr = divmod(lk, PMAX)
        if nbf:
            nisa.activation(dst[:, :nbf, :], nl.exp, st[:, :nbf, :], scale=hp.scale)
        if kr:
            nisa.activation(dst[:kr, nbf, :], nl.exp, st[:kr, nbf, :], scale=hp.scale)

    out_done: set[int] = set()
    later: list[list[Any]] = [[] for _ in range(RECIP_DELAY + OUT_DELAY)]  # work deferred by n turns

    def step() -> None:
        """Issue the deferred work due now and shift the rest one turn closer."""
        due = later.pop(0)
        later.append([])
        for fn in due:
            fn()

    def pv(u: int) -> None:
        t, h = units[u]
        k = group_of[(t, h)]
        _, h0, h1 = groups[k]
        while h == h0 and k >= 2 and k - 2 not in out_done:  # group k-2's outputs read this bank first
            step()
        for blk in range(nkb):
            kb = min(PMAX, lk - blk * PMAX)
            nisa.nc_matmul(pv_ps[k % 2][:, h - h0, :], stationary=pT[u % RING][:kb, blk, :],
                           moving=v[:kb, blk, h, :], accumulate=blk > 0)  # fmt: skip
        if h == h1 - 1:
            later[RECIP_DELAY - 1].append(lambda k=k: later[OUT_DELAY - 1].extend(finish(k)))

    def finish(k: int) -> list[Any]:
        """Group k's 1/l (VectorE, now) and its outputs (ScalarE, :data:`OUT_DELAY` turns later)."""
        t, h0, h1 = groups[k]
        qr, ps = rows(t), pv_ps[k % 2]
        nisa.reciprocal(rl[:qr, h0:h1, t], ps[:qr, : h1 - h0, D])

        def outputs() -> None:
            out_done.add(k)
            ob = o_out[t % 2]
            for h in range(h0, h1):
                nisa.activation(ob[:qr, h, :], nl.copy, ps[:qr, h - h0, :D], scale=rl[:qr, h, t : t + 1])
            if h1 < H:
                return
            q0 = hp.q_lo + t * PMAX
            nisa.dma_copy(dst=hp.out[b, q0 : q0 + qr, :, :], src=ob[:qr, :, :])
            if hp.return_lse:  # lse = log(l) + scale * bf16(max) = -log(1/l) - scale * bf16(-max)
                lt = lse_t[t % 2]
                nisa.tensor_scalar(lt[:qr, :], negm[:qr, t * H : t * H + H], nl.multiply, hp.scale,
                                   engine=nisa.vector_engine)  # fmt: skip
                nisa.activation(lo[:qr, :], nl.log, rl[:qr, :, t])
                nisa.scalar_tensor_tensor(lt[:qr, :], lo[:qr, :], nl.multiply, -1.0, nl.subtract,
                                          lt[:qr, :])  # fmt: skip
                nisa.dma_copy(dst=hp.lse[b, q0 : q0 + qr, :], src=lt[:qr, :])

        return [outputs]

    load_q(0)
    _load_heads_kv(hp, kT, v)
    for u in range(min(LOOK, nu)):
        scores(u)
    for j in range(nu + 3):  # turn j: stage s of unit j - s
        if 0 <= j < nu:
            row_max(j)
        if 0 <= j - 2 < nu:
            exps(j - 2)
        step()
        if j + LOOK < nu:
            scores(j + LOOK)
        load_q(units[min(nu - 1, j + QLEAD)][0])
        if j < nu:
            scores_t(j)
        if 0 <= j - 1 < nu:
            offsets(j - 1)
        if 0 <= j - 3 < nu:
            pv(j - 3)
    while any(later):  # the last groups' 1/l, then their outputs
        step()
    # the guard: each row's offset is its own largest score rounded to bf16 (relative error <= 2^-9), so
    # l stays within [exp(-scale |max| 2^-8), Lk exp(scale |max| 2^-9)]: only a NaN / infinite row, or one
    # whose scaled max exceeds ~10^4 nats, can fail l_min <= l <= l_max (on 1/l; NaN fails)
    f = nl.ndarray((PMAX, H, nt), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_scalar(f, rl, nl.greater_equal, 1.0 / l_max, engine=nisa.vector_engine)
    nisa.scalar_tensor_tensor(f, rl, nl.less_equal, 1.0 / l_min, nl.minimum, f)
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
