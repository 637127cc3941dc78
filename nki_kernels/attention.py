"""Attention fused with its transposes (standalone NKI 0.6 API, imported through :mod:`nki_kernels._nki`).

Math, per batch b, head h, query i: ``out[b, i, h] = sum_j softmax_j(scale * q_i . k_j) v_j`` over the keys
``j`` given (all of ``k`` for :func:`attention_emulated`, the concatenation of ``(start, length)`` segments
of a KV buffer for :func:`attention_segments_emulated`); optional ``lse[b, i, h] = log sum_j exp(scale *
q_i . k_j)`` (fp32, natural log) for merging partial results.

Layouts (no permute/transpose pass exists before or after the kernel):

* q ``[B, Lq, H, D]``, k/v (or the KV buffers) ``[B, Lk|S, H, D]``: the projection output viewed per head.
  out ``[B, Lq, H, D]``: what the output projection consumes. lse ``[B, Lq, H]`` fp32.
* q and k tiles are loaded **transposed** (D on partitions) straight from that layout with
  ``nisa.dma_transpose`` (2-byte dtypes) of the HBM view ``x[b, l0:l0+n, h, :]``, issued as one 3-D
  hardware-DGE transpose of its row-permuted view ``[16, n/16, D]`` (+ a 16-row tail; see
  :func:`_load_transposed`); fp32 inputs use a
  permuted HBM view (``.permute((1, 0))``) in a plain ``dma_copy`` (element-sized descriptors: a
  correctness path for tests, not a fast one). v tiles are loaded as they are (keys on partitions).
* Per (b, h) the whole K^T ``[D, Lk]`` and V ``[128, Lk/128, D + 1]`` stay resident in SBUF (Wan: ~129 KiB per
  partition; V's column D is 1, so the PV matmul also sums P into the softmax denominator l) and every query
  tile of 128 rows streams over them: k and v are read from HBM once per head. Segments are loaded in place
  from the buffers into consecutive key positions (never gathered in HBM).

Per query tile (flash-style, fp32 statistics), per key chunk of ``KC`` keys (1024 for 2-byte dtypes = two
PSUM banks of S; 512 for fp32), S double-buffered in PSUM:

1. TensorE: ``S[q, k] = nc_matmul(stationary=q^T [D, 128], moving=K^T [D, 512])`` per bank, one chunk ahead.
2. VectorE: ONE ``tensor_reduce`` max straight from PSUM (no copy of S); ``nm = min(nm_old, -scale*max)``.
3. ScalarE: ``alpha = exp(nm - nm_old)``; ``P = exp(scale*S + nm)`` straight from PSUM into bf16 SBUF.
4. P^T: TensorE transposes each 128x128 block into PSUM; VectorE evicts :data:`VECTOR_EVICT` (3/16) of the
   blocks, ScalarE the rest (the split that balances the two engines). Optional DMA path: for
   ``dma_transpose_chunks`` of the groups of ``dma_group`` 2048-key spans (two full chunks), P stays in SBUF
   and one SBUF->SBUF ``dma_transpose`` per 16 queries moves the group in hardware-DGE-legal pieces
   ``[16 q, 16 g, 128 k] -> [128 k, 16 g, 16 q]``. Then ``PV[q, :] = sum_t nc_matmul(stationary=P^T_t [128 k,
   128 q], moving=V_t [128 k, D + 1])`` in one PSUM accumulation group (two PV buffers).
5. VectorE: ``o = o*alpha + PV`` (column D is l).

Software pipeline (cost model v2 prices the dependencies between in-order engines; docs/kernels/attention.md,
"Engine balance"): per chunk c the program issues the max / exp of c, the P^T of c-1 with its evictions, the
QK^T of c+1, the PV of c-3 (:data:`~nki_kernels.attention_pv.PE_PV_DELAY`; a DMA group's
:data:`~nki_kernels.attention_pv.DMA_PV_DELAY` chunks after its transposes), and a TensorE chunk's o
update after the next chunk's max; o updates stay in chunk order (:class:`~nki_kernels.attention_pv.PvQueue`),
so out and lse do not depend on the transpose path. A tile's tail (its last P^T, PVs, o updates and store)
is interleaved with the next tile's first chunks; the next tile's q^T is prefetched.

The default (``static=True``, :func:`_guarded_rows`) fixes the softmax offset after a tile's first chunk,
so the later chunks skip steps 2-3's max, running max and alpha (alpha = 1). With 2-byte dtypes and every
P^T on TensorE the offset is ONE value per tile (the largest first-chunk score of its rows) and the pass
streams K/V chunk by chunk, scores as ``S^T`` (keys on the partitions), ONE ScalarE exp writing the P^T the
PV reads (:mod:`nki_kernels.attention_stream`). A per-(b, h) guard recomputes with the running max if any
row's ``l`` leaves ``[GUARD_L_MIN, GUARD_L_MAX]`` (docs/kernels/attention.md, "Static softmax offset").

At the end ``out = o / l`` (cast to q's dtype) is stored to ``out[b, q0:q0+128, h, :]`` and
``lse = log(l) - nm``. Tails (Lq or Lk not multiples of 128 or 512) are handled by slicing with ``min``.
LNC: ``kernel[2]`` deals the (b, h) pairs round-robin to the two logical cores.
"""

from __future__ import annotations

from typing import Any

from nki_kernels._nki import nisa, nki, nl
from nki_kernels.attention_fp8 import FP8_GUARD_L_MIN
from nki_kernels.attention_heads import HeadsPass, heads_fit
from nki_kernels.attention_pv import (
    ALPHA_SETS,
    PvQueue,
    _Tail,
    _transpose_unit,
)
from nki_kernels.attention_stream import KvStream, SegmentStream, link_streams, stream_rows, streams
from nki_kernels.attention_tiles import (
    DMA_GROUP_CHUNKS,
    DMA_TRANSPOSE_CHUNKS,
    KC_FP32,
    KC_TWO_BYTE,
    VECTOR_EVICT,
    VECTOR_EVICT_STATIC,
    _dma_chunks,
    _dma_group,
    _flash_buffers,
    _load_kv,
    _load_transposed,
    fit_group,
    flash_sbuf_bytes,
    guard_buffers,
    merge_remainder,
    owned_pairs,
    p_transpose_plan,
    pair_plan,
    vector_evict_blocks,
)
from nki_kernels.hw_limits import PMAX, PSUM_BANK_FMAX


def _chunks(total: int, kc: int) -> list[tuple[int, int]]:
    """Key chunks ``(c0, n)``: full ``kc`` chunks, then a multiple of 512, then a < 512 tail."""
    out = []
    c0 = 0
    while c0 < total:
        rem = total - c0
        n = kc if rem >= kc else (rem // PSUM_BANK_FMAX) * PSUM_BANK_FMAX if rem >= PSUM_BANK_FMAX else rem
        out.append((c0, n))
        c0 += n
    return out


GUARD_L_MAX = 1e30
"""The static softmax offset's guard (``static=True``: each query tile's offset is the scaled row max of its
first key chunk, fixed for the other chunks): a row whose softmax denominator ``l`` exceeds this (or is NaN)
is recomputed with the running max. Below it, ``o = sum P v`` stays finite for ``|v| < 3e8``. A row trips it
only if later keys' scaled scores exceed the first chunk's maximum by about ``ln(1e30) - ln(count)`` =
69 nats minus the log of how many do (docs/kernels/attention.md); the terms that underflow are, as with the
running max, those more than ~87 nats below the offset."""

GUARD_L_MIN = 1e-18
"""With one offset per query tile (the tile's largest first-chunk score, 2-byte dtypes), a row whose own
scores sit far below it could lose its terms to underflow: a row whose ``l`` falls below this (its largest
term ~41 nats under the offset) is recomputed too. A block-table group with no valid key (``l = 0``) trips
it and is recomputed into the same zeros."""

L_FLOOR = 1e-30
"""Lower clamp of the softmax denominator l (the PV matmul's column D, :func:`_flash_rows`) before the
reciprocal: only a query tile without any valid key (l = 0 exactly, block-table kernel) reaches it (with the
running max any valid key contributes exp(0) = 1; with the static offset the guard recomputes any row whose
l is below :data:`GUARD_L_MIN`), so ``out = 0 * 1e30 = 0`` there."""


def _flash_rows(
    w, kT_sb, v_sb, q, out, lse, b, h, q_lo, q_hi, chunks, n_grp, dma_chunks, scale, return_lse, static=False
):
    """Flash attention of queries ``[q_lo, q_hi)`` of (b, h) over the resident ``kT_sb`` ``[D, Lk]`` /
    ``v_sb`` ``[128, Lk/128, D + 1]`` (key chunks ``chunks``), one 128-query tile at a time (steps 1-5 of the
    module docstring); stores ``out[b, q, h, :]`` (and ``lse[b, q, h]`` if ``return_lse``). ``w`` from
    :func:`~nki_kernels.attention_tiles._flash_buffers` (KC = the width of its ``p_pe`` tiles).

    V's column D is 1 for keys that count and 0 for keys that must not, so the PV matmul's last column is the
    softmax denominator l (summed from the same rounded P as the numerator), clamped at :data:`L_FLOOR` before
    the reciprocal. ``n_grp`` (P^T groups seen, dealt to the DMA by ``dma_chunks``) is returned advanced.

    ``static``: the softmax offset of each query tile is fixed after its first key chunk (that chunk's
    scaled row max; with 2-byte dtypes and no DMA share the tile's largest, and the later full chunks in
    the transposed orientation, see the module docstring) instead of the running max: no row max, running
    max or alpha after the first chunk (``w["alpha"]`` must hold 1.0), more P^T evictions on VectorE
    (:data:`VECTOR_EVICT_STATIC`), and each row ANDs ``GUARD_L_MIN <= l <= GUARD_L_MAX`` into ``w["good"]``
    for :func:`_guarded_rows`' check.

    ``kT_sb`` may instead be a :class:`~nki_kernels.attention_stream.KvStream` (``v_sb`` None, ``static``
    True): the static pass then streams the K/V chunk by chunk with one offset per query tile
    (:func:`~nki_kernels.attention_stream.stream_rows`, used when :func:`streams` holds).
    """
    if isinstance(kT_sb, HeadsPass):  # every head's pass at the first head's guard (once)
        if not static:
            raise ValueError("_flash_rows: a HeadsPass is the static pass only")
        kT_sb.run()
        return n_grp
    if isinstance(kT_sb, KvStream):
        if not static:
            raise ValueError("_flash_rows: a KvStream streams the static pass only")
        bounds = (GUARD_L_MIN if kT_sb.v_scale is None else FP8_GUARD_L_MIN, GUARD_L_MAX, L_FLOOR)
        stream_rows(kT_sb, q, out, lse, b, h, q_lo, q_hi, scale, return_lse, w["good"], bounds, w["carry"])
        return n_grp
    D = q.shape[3]
    dv = v_sb.shape[2]
    two_byte = q.dtype != nl.float32
    KC = w["p_pe"][0].shape[1]
    slots = w["alpha"].shape[1] // ALPHA_SETS
    nbc = KC // PMAX
    s_ps, p_sb, p_pe = w["s_ps"], w["p_sb"], w["p_pe"]
    o_out, alpha, bmax = w["o_out"], w["alpha"], w["bmax"]
    rl, lse_t = w["rl"], w["lse_t"]

    def nv_of(nb: int, n: int) -> int:
        return vector_evict_blocks(nb, n, VECTOR_EVICT_STATIC if static else VECTOR_EVICT)

    def load_q(q0: int) -> None:
        qr = min(PMAX, q_hi - q0)
        qT = w["qT_b"] if (q0 - q_lo) // PMAX % 2 else w["qT_a"]
        _load_transposed(qT[:D, :qr], q[b, q0 : q0 + qr, h, :], qr, two_byte)

    def finish(t: _Tail, queues: list, ci: int | None) -> bool:
        """Advance tile tail ``t`` at the next tile's chunk ``ci`` (None: drain it now); True once stored."""
        if t.done:
            _transpose_unit(t.done, [t.queue, *queues], t.nchunks, t.aset, w, t.qr, nbc, nv_of)
            t.done = []
        if ci is not None:
            t.queue.issue_ready(t.nchunks + ci)
            if t.queue.pending():
                return False
        t.queue.flush_until(lambda st, u: True)
        t.queue.issue_deferred()
        # finalize: out = o / l ; lse = log(l) - nm  (nm holds the final negated scaled max)
        qr, o_acc, nm_old = t.qr, t.o_acc, t.nm
        l_col = o_acc[:qr, D : D + 1]
        nisa.tensor_scalar(rl[:qr], l_col, nl.maximum, L_FLOOR, engine=nisa.vector_engine)
        nisa.reciprocal(rl[:qr], rl[:qr])
        nisa.tensor_scalar(o_out[:qr], o_acc[:qr, :D], nl.multiply, rl[:qr], engine=nisa.vector_engine)
        nisa.dma_copy(dst=out[b, t.q0 : t.q0 + qr, h, :], src=o_out[:qr, :D])
        if static:  # the guard: a row whose l overflowed (or is NaN) clears its "good" flag
            good = w["good"][:qr]
            nisa.tensor_scalar(
                good, l_col, nl.less_equal, GUARD_L_MAX, op1=nl.minimum, operand1=good,
                engine=nisa.vector_engine,
            )  # fmt: skip
        if return_lse:
            nisa.activation(lse_t[:qr], nl.log, l_col)
            nisa.tensor_tensor(lse_t[:qr], lse_t[:qr], nm_old[:qr], nl.subtract)
            nisa.dma_copy(dst=lse[b, t.q0 : t.q0 + qr, h : h + 1], src=lse_t[:qr])
        return True

    def qk(ti: int, ci: int, g: int) -> None:
        """QK^T of chunk ``ci`` of tile ``ti`` into ``s_ps[g % 2]`` (``g``: chunks issued in this call)."""
        q0 = q_lo + ti * PMAX
        qr = min(PMAX, q_hi - q0)
        qT = w["qT_b"] if ti % 2 else w["qT_a"]
        c0, kc = chunks[ci]
        nsub = (kc + PSUM_BANK_FMAX - 1) // PSUM_BANK_FMAX
        wd = kc // nsub  # equal banks (merge_remainder keeps kc % nsub == 0)
        for j in range(nsub):
            nisa.nc_matmul(
                s_ps[g % 2][:qr, j, :wd],
                stationary=qT[:D, :qr],
                moving=kT_sb[:D, c0 + j * wd : c0 + (j + 1) * wd],
                accumulate=False,
            )

    ntiles = (q_hi - q_lo + PMAX - 1) // PMAX
    load_q(q_lo)
    qk(0, 0, 0)
    g = 0  # chunks started in this call (the S buffer of chunk g is s_ps[g % 2])
    tail: _Tail | None = None  # the previous tile, finished during this one's first chunks
    deferred: list = []  # o updates issued after the next chunk's row max (PvQueue)
    unit = 0  # P^T units (a TensorE chunk or a DMA group) started: alpha sets rotate over them
    npe = 0  # TensorE units started: their P / P^T / PSUM P^T rotate over 2 / 3 / 2 buffers
    for ti, q0 in enumerate(range(q_lo, q_hi, PMAX)):
        qr = min(PMAX, q_hi - q0)
        if ti + 1 < ntiles:  # prefetch: the next tile's q^T loads while this tile runs (not behind its store)
            load_q(q0 + PMAX)
        o_acc = w["o_acc"][ti % 2]
        nm_old, nm_new = w["nm"][2 * (ti % 2)], w["nm"][2 * (ti % 2) + 1]
        plan, n_grp = pair_plan(chunks, KC, max(slots // 2, 1), n_grp, dma_chunks if two_byte else (0, 1))
        pending: list[tuple[int, int, int, int, int]] = []  # (ci, c0, kc, slot, col) of the open DMA group
        done: list[tuple[int, int, int, int, int]] = []  # the unit completed by the previous chunk
        queue = PvQueue(w["pv_ps"], o_acc, w["pT_sb"], w["pT_pe"], v_sb, alpha, qr, dv, nbc, deferred)
        for ci, (c0, kc) in enumerate(chunks):
            dma, slot, flush = plan[ci]
            queues = [queue] if tail is None else [queue, tail.queue]
            aset = unit % ALPHA_SETS
            col = aset * slots + slot
            nsub = (kc + PSUM_BANK_FMAX - 1) // PSUM_BANK_FMAX
            wd = kc // nsub
            s = s_ps[g % 2]  # this chunk's scores, computed one chunk ahead
            s_view = s[:qr, :nsub, :wd]
            # software pipeline (TensorE: QK(c), P^T(c-1), PV(c-3)): a DMA group's P^T goes here, before this
            # chunk's exp may rewrite its P slots; a TensorE chunk's P^T after this chunk's exp, so VectorE
            # reduces this chunk's max before it evicts the previous chunk's P^T (no loop-carried wait)
            if tail is not None and tail.done and tail.done[0][3] >= 0:
                finish(tail, [queue], None)
                tail = None
                queues = [queue]
            if done and done[0][3] >= 0:
                _transpose_unit(done, queues, ci, (unit - 1) % ALPHA_SETS, w, qr, nbc, nv_of)
                done = []
            for qu in queues:
                qu.flush_alpha(aset)  # this chunk's alpha column is free
            # row max: ONE VectorE reduce straight from PSUM (fp32, exact); a static offset: first chunk only
            if not static or ci == 0:
                nisa.tensor_reduce(bmax[:qr], nl.maximum, s_view, axis=(1, 2))
            if dma:
                p_dst = p_sb[:qr, slot * KC : slot * KC + kc]
            else:
                p_dst = p_pe[npe % len(p_pe)][:qr, :kc]
            p_view = p_dst.reshape_dim(1, (nsub, wd))
            a_col = alpha[:qr, col : col + 1]
            if ci == 0:  # static: this offset stays for the tile's other chunks
                nisa.tensor_scalar(nm_new[:qr], bmax[:qr], nl.multiply, -scale, engine=nisa.vector_engine)
            elif not static:
                nisa.tensor_scalar(
                    nm_new[:qr],
                    bmax[:qr],
                    nl.multiply,
                    -scale,
                    op1=nl.minimum,
                    operand1=nm_old[:qr],
                    engine=nisa.vector_engine,
                )
                # alpha = exp(nm_new - nm_old) = exp(scale*(m_old - m_new))
                nisa.activation(a_col, nl.exp, nm_old[:qr], bias=nm_new[:qr], scale=-1.0)
            queue.issue_deferred()  # VectorE: the previous unit's o update after this chunk's max
            # P = exp(scale*S + nm) on ScalarE straight from PSUM (l comes from V's ones column)
            nm_b = nm_old if static and ci > 0 else nm_new  # static: the first chunk's offset
            nisa.activation(p_view, nl.exp, s_view, bias=nm_b[:qr], scale=scale)
            if tail is not None and finish(tail, [queue], ci):
                tail = None
            if done:
                _transpose_unit(done, [queue] if tail is None else [queue, tail.queue], ci,
                                (unit - 1) % ALPHA_SETS, w, qr, nbc, nv_of)  # fmt: skip
                done = []
            # QK^T one chunk ahead (TensorE: P^T(c-1), QK(c+1), PV(c-3)): S is double-buffered, so it waits
            # only for the exp of chunk c-1, and the next chunk's max never waits behind this chunk's PVs
            if ci + 1 < len(chunks):
                qk(ti, ci + 1, g + 1)
            elif ti + 1 < ntiles:
                qk(ti + 1, 0, g + 1)
            g += 1
            queue.issue_ready(ci)
            # P^T: a DMA group's P waits in p_sb (its slot) until the group's last chunk, then one
            # dma_transpose per 16 queries moves the whole group and its PV / o updates follow in
            # chunk order; any other chunk is transposed per 128-key block on TensorE
            if dma:
                pending.append((ci, c0, kc, slot, col))
                if flush:
                    done, pending = pending, []
                    unit += 1
            else:
                done = [(ci, c0, kc, -1 - npe, col)]
                npe += 1
                unit += 1
            if not static or ci == 0:
                nm_old, nm_new = nm_new, nm_old
        if tail is not None:  # fewer chunks than the tail needed: drain it before this tile's
            finish(tail, [queue], None)
        tail = _Tail(queue, done, (unit - 1) % ALPHA_SETS, q0, qr, o_acc, nm_old, len(chunks))
    if tail is not None:
        finish(tail, [], None)
    return n_grp


def _guarded_rows(
    w, kT_sb, v_sb, q, out, lse, b, h, q_lo, q_hi, chunks, n_grp, dma_chunks, scale, return_lse, static
):
    """:func:`_flash_rows` of queries ``[q_lo, q_hi)`` of (b, h); with ``static`` the static-offset pass,
    then its guard: the rows whose ``l`` stayed within ``[GUARD_L_MIN, GUARD_L_MAX]`` (the lower bound only
    with a per-tile offset) are counted on TensorE (``w["good"]``
    against a ones column) and, if any row of any tile failed, the same queries are recomputed with the
    running max inside a runtime loop of 0 or 1 iterations (``nl.fori_loop`` bounded by a register loaded
    from that count), overwriting ``out`` / ``lse``. The recompute runs only when the guard trips, so the
    static pass's cost is the fast path's; the instruction stream carries both.

    With a :class:`~nki_kernels.attention_stream.KvStream` as ``kT_sb`` (``w`` from
    :func:`~nki_kernels.attention_tiles.guard_buffers`) the static pass streams the K/V, and the recompute
    first loads the whole K/V of the unit (``kT_sb.resident()``) into tiles of its own, with flash buffers
    of its own (allocated inside the loop: live only while a recompute runs)."""
    args = (w, kT_sb, v_sb, q, out, lse, b, h, q_lo, q_hi, chunks)
    stream = isinstance(kT_sb, KvStream)
    heads = isinstance(kT_sb, HeadsPass)

    def running() -> int:
        """The running-max pass over the resident K/V (a stream's loaded first, into tiles of its own)."""
        if stream or heads:
            kT, v = kT_sb.resident(h) if heads else kT_sb.resident()
            w_run = _flash_buffers(q.shape[3], q.shape[3] + 1, KC_TWO_BYTE, 0, q.dtype)
            return _flash_rows(w_run, kT, v, *args[3:], n_grp, dma_chunks, scale, return_lse)
        return _flash_rows(*args, n_grp, dma_chunks, scale, return_lse)

    if not static:
        return running()
    good, flag = (kT_sb.good[:, h : h + 1] if heads else w["good"]), w["flag"]
    if not heads:  # (a HeadsPass writes its flags)
        nisa.memset(good, 1.0, engine=nisa.vector_engine)
    if not stream and not heads:
        nisa.memset(w["alpha"], 1.0, engine=nisa.vector_engine)  # the o update becomes o + PV
    n_next = _flash_rows(*args, n_grp, dma_chunks, scale, return_lse, static=True)
    cnt = w["cnt"] if stream or heads else w["pv_ps"][0][:1, :1]  # the PV buffers are drained here
    nisa.nc_matmul(cnt, stationary=good[:, 0:1], moving=w["ones"][:, 0:1], accumulate=False)
    # failed rows = 128 - good rows; the loop bound is min(failed, 1)
    nisa.tensor_scalar(
        flag, cnt, nl.multiply, -1.0, op1=nl.add, operand1=float(PMAX), engine=nisa.vector_engine
    )
    nisa.tensor_scalar(flag, flag, nl.minimum, 1.0, engine=nisa.vector_engine)
    reg = nisa.register_alloc()
    nisa.register_load(reg, flag)

    def recompute(_i: Any) -> None:
        running()

    nl.fori_loop(0, reg, recompute)
    return n_next


def _attention_body(
    q, kbuf, vbuf, segments, scale, return_lse, dma_chunks, dma_group, static=False, v_scale=None
):
    B, Lq, H, D = q.shape
    Lk = sum(n for _, n in segments)
    dt = q.dtype
    two_byte = dt != nl.float32
    f32 = nl.float32
    KC = KC_TWO_BYTE if two_byte else KC_FP32
    nkt = (Lk + PMAX - 1) // PMAX
    out = nl.ndarray(q.shape, dtype=dt, buffer=nl.shared_hbm)
    lse: Any = nl.ndarray((B, Lq, H), dtype=f32, buffer=nl.shared_hbm) if return_lse else None
    pid = nl.program_id(0)
    nprog = nl.num_programs()

    chunks = merge_remainder(_chunks(Lk, KC), KC)
    if v_scale is not None and not (static and streams(chunks, two_byte, dma_chunks)):
        raise ValueError(
            "attention: v_scale (FP8 P.V) needs the streamed static pass: a 2-byte dtype, static=True, no "
            f"DMA transpose share and a second full 1,024-key chunk (Lk >= 2048), got Lk={Lk}, dtype={dt}"
        )
    if static and len(chunks) == 1 and heads_fit(segments, H, D, two_byte, dma_chunks):  # every head at once
        w = guard_buffers(dt, count_psum=True)
        ntl = (Lq + PMAX - 1) // PMAX  # the query tiles, split in contiguous ranges over the cores
        lo, hi = min(Lq, pid * ntl // nprog * PMAX), min(Lq, (pid + 1) * ntl // nprog * PMAX)
        for b in range(B if lo < hi else 0):
            hp = HeadsPass(q, kbuf, vbuf, segments, b, lo, hi, out, lse, scale, return_lse,
                           (GUARD_L_MIN, GUARD_L_MAX, L_FLOOR))  # fmt: skip
            for h in range(H):
                args = (q, out, lse, b, h, lo, hi, chunks, 0, dma_chunks, scale, return_lse, True)
                _guarded_rows(w, hp, None, *args)
        return (out, lse) if return_lse else out
    if static and streams(chunks, two_byte, dma_chunks):  # K/V streamed per unit: nothing resident
        w = guard_buffers(dt, count_psum=True)
        pairs = owned_pairs(B, H, pid, nprog)
        units = [(SegmentStream(kbuf, vbuf, b, h, segments, D, dt), b, h, 0, Lq) for b, h in pairs]
        for kv, *_ in units:
            kv.v_scale = v_scale
        link_streams(units)
        for kv, b, h, lo, hi in units:
            _guarded_rows(
                w, kv, None, q, out, lse, b, h, lo, hi, chunks, 0, dma_chunks, scale, return_lse, True
            )
        return (out, lse) if return_lse else out
    kT_sb = nl.ndarray((D, nkt * PMAX), dtype=dt, buffer=nl.sbuf)
    # V carries a ones column D: the PV matmul then also sums P into l (written once; loads fill [0, D))
    v_sb = nl.ndarray((PMAX, nkt, D + 1), dtype=dt, buffer=nl.sbuf)
    nisa.memset(v_sb[:, :, D : D + 1], 1.0, engine=nisa.gpsimd_engine)
    # P / P^T hold a whole DMA group (dma_group 2048-key spans) when a span can be dealt to the DMA
    gmax = 0
    if two_byte and dma_chunks[0] and sum(n == KC for _, n in chunks) >= 2:
        # per-partition bytes of K^T, V and the other _flash_buffers tiles, plus a 1 KiB margin
        fixed = (
            2 * (nkt * PMAX + nkt * (D + 1)) + flash_sbuf_bytes(D, KC, 0, 2) + 4 * ALPHA_SETS * 2 * dma_group
        )
        gmax = fit_group(dma_group, nl.tile_size.sbuf_fmax_bytes, fixed + 1024, 2 * KC * 2)
    w = _flash_buffers(D, D + 1, KC, gmax, dt, static)

    n_grp = 0  # P^T groups seen by this program: the DMA-transposed ones are dealt by this counter
    for b, h in owned_pairs(B, H, pid, nprog):
        _load_kv(kT_sb, v_sb, kbuf, vbuf, b, h, segments, D, two_byte)
        n_grp = _guarded_rows(
            w, kT_sb, v_sb, q, out, lse, b, h, 0, Lq, chunks, n_grp, dma_chunks, scale, return_lse, static
        )
    if return_lse:
        return out, lse
    return out


@nki.jit
def attention_kernel(
    q, k, v, scale, return_lse, dma_transpose_chunks=None, dma_group=None, static=True, v_scale=None
):
    """Flash attention ``[B, Lq, H, D] x [B, Lk, H, D]`` -> out ``[B, Lq, H, D]`` (+ lse ``[B, Lq, H]``).

    ``scale`` (float) and ``return_lse`` (bool) are compile-time constants; ``dma_transpose_chunks``
    (``(num, den)``, default :data:`DMA_TRANSPOSE_CHUNKS`) is the fraction of full 2048-key chunks whose P is
    transposed by the DMA instead of TensorE (``(0, 1)``: all on TensorE). Results are bit-identical either
    way. ``static`` (default): the guarded static softmax offset (:func:`_guarded_rows`,
    :data:`GUARD_L_MAX`); False: the running max. ``v_scale`` (HBM ``[B, H, D]`` fp32, V's per-channel
    dequantisation scales ``max_j |v| / 240``): FP8 attention, P.V in e4m3 on the streamed static pass
    (:mod:`nki_kernels.attention_fp8`; ValueError where that pass does not run); None (default): bf16.
    """
    return _attention_body(
        q,
        k,
        v,
        ((0, k.shape[1]),),
        scale,
        return_lse,
        _dma_chunks(dma_transpose_chunks),
        _dma_group(dma_group),
        bool(static),
        v_scale,
    )


@nki.jit
def attention_segments_kernel(
    q, kv_k, kv_v, segments, scale, return_lse, dma_transpose_chunks=None, dma_group=None, static=True,
    v_scale=None,
):  # fmt: skip
    """Attention over keys/values read in place from ordered ``(start, length)`` segments of ``[B, S, H, D]``
    buffers (compile-time tuple of int pairs); ``dma_transpose_chunks``, ``static``, ``v_scale`` as
    :func:`attention_kernel`."""
    return _attention_body(
        q,
        kv_k,
        kv_v,
        tuple(segments),
        scale,
        return_lse,
        _dma_chunks(dma_transpose_chunks),
        _dma_group(dma_group),
        bool(static),
        v_scale,
    )


# the torch-facing entries (nki_kernels.attention_entries), re-exported: ops dispatches to this module
from nki_kernels.attention_entries import attention_emulated, attention_segments_emulated  # noqa: E402

__all__ = [
    "DMA_GROUP_CHUNKS",
    "DMA_TRANSPOSE_CHUNKS",
    "attention_emulated",
    "attention_kernel",
    "attention_segments_emulated",
    "attention_segments_kernel",
    "fit_group",
    "p_transpose_plan",
]
