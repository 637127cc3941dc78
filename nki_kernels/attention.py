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
* Per (b, h) the whole K^T ``[D, Lk]`` and V ``[128, Lk/128, D]`` stay resident in SBUF (Wan: 2 x 64 KiB per
  partition) and every query tile of 128 rows streams over them: k and v are read from HBM once per head.
  Segments are loaded in place from the buffers into consecutive key positions (never gathered in HBM).

Per query tile (flash-style, fp32 statistics), per key chunk of ``KC`` keys (2048 for 2-byte dtypes, four
PSUM banks; 1024 for fp32):

1. TensorE: ``S[q, k] = nc_matmul(stationary=q^T [D, 128], moving=K^T [D, 512])`` per bank.
2. Row max of the chunk: VectorE copies S to fp32 SBUF, GpSimdE halves it three times with ``maximum``,
   VectorE reduces the rest; new negated scaled max ``nm = min(nm_old, -scale*max)``.
3. ScalarE: ``P = exp(scale*S + nm)`` (bf16/fp32) with the fp32 row sum in the same instruction
   (``activation_reduce``); ``alpha = exp(nm - nm_old)``.
4. P^T: the full chunks of a query tile form groups of :data:`DMA_GROUP_CHUNKS` (g = 8) consecutive chunks;
   for :data:`DMA_TRANSPOSE_CHUNKS` (3/5) of the groups the P of all g chunks stays in SBUF and one SBUF->SBUF
   ``dma_transpose`` per 16 queries moves the group, in hardware-DGE-legal pieces
   ``[16 q, 16 g, 128 k] -> [128 k, 16 g, 16 q]`` (8 per 128-query tile), before the group's PV matmuls; for
   the other chunks TensorE transposes each 128x128 block (``nc_transpose`` into PSUM), evicted to SBUF (split
   between VectorE and ScalarE). Then ``PV[q, d] += nc_matmul(stationary=P^T [128 k, 128 q], moving=V [128 k,
   D])`` accumulates the chunk in one PSUM bank. Both transposes are exact copies and the o updates keep the
   chunk order, so the result does not depend on the split or the grouping.
5. VectorE: ``o = o*alpha + PV``, ``l = l*alpha + rowsum``.

Buffering and order (cost model v2 prices the dependencies, docs/kernels/attention.md): the scores are copied
once from PSUM to fp32 SBUF (``s_bf``; exp and the GpSimdE max tree read that copy, and the bf16 max equals the
max of the bf16-rounded scores since rounding is monotone), so the next chunk's QK^T can reuse the 4 PSUM banks
of S right after the copy; the chunks are software-pipelined: a unit's P^T (a TensorE chunk, or a DMA group) is
issued after the next chunk's score copy and its PV / o updates after the next chunk's exp (a DMA group's
:data:`DMA_PV_DELAY` chunks later; o updates stay in chunk order, :class:`~nki_kernels.attention_pv.PvQueue`).
TensorE chunks keep P / P^T in their own tiles (``p_pe`` / ``pT_pe``), alpha has :data:`ALPHA_SETS` column
sets, q^T two tiles (the next query tile's load overlaps). PSUM stays at S 4 + P^T 2 + PV 1 banks (of 8).
Outputs are bit-identical to the unpipelined kernel.

At the end ``out = o / l`` (cast to q's dtype) is stored to ``out[b, q0:q0+128, h, :]`` and
``lse = log(l) - nm``. Tails (Lq or Lk not multiples of 128 or 512) are handled by slicing with ``min``.
LNC: ``kernel[2]`` deals the (b, h) pairs round-robin to the two logical cores.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from nki_kernels._nki import nisa, nki, nl
from nki_kernels.attention_pv import (
    ALPHA_SETS,
    DMA_PV_DELAY,
    HWDGE_ROWS,
    PMAX,
    PvQueue,
    _issue_p_transpose,
)

BANK = 512
"""fp32 elements per partition in one PSUM bank; also the moving free size of the QK^T matmul."""

DMA_TRANSPOSE_CHUNKS = (3, 5)
"""Fraction ``(num, den)`` of the P^T *groups* (up to :data:`DMA_GROUP_CHUNKS` consecutive full 2048-key chunks
of one query tile, 2-byte dtypes) transposed SBUF->SBUF by the DMA instead of by 16 TensorE transposes per
chunk; groups are dealt by a running counter per program. NKI 0.6 hardware-DGE transposes take at most 16
source partitions, so a group costs one ``[<=16 q, 16 x g, 128 k] -> [128 k, 16 x g, <=16 q]`` DMA per 16
queries (8 per 128-query tile), each landing ``512 x g`` bytes per destination partition. 3/5 (with g = 8)
balanced TensorE against the DMA queues under cost model v1 (busy-time sums); under v2 (dependency-aware) a
group's chained transposes sit on the critical path and lower shares model faster (sweep in
docs/kernels/attention.md), not yet retuned."""

DMA_GROUP_CHUNKS = 8
"""Chunks per DMA-transposed P^T group (``g``): their P stay in SBUF and their PV matmuls wait until one
transpose per 16 queries has moved all of them, so each lands ``512 x g`` B per destination partition (4 KiB
at g = 8, ~97 % DMA efficiency in the trn2 cost model, vs 512 B / ~21 % for one chunk). Costs
``(g - 1) x 8 KiB`` more SBUF per partition (p_sb and pT_sb): the kernel lowers g to what fits next to the
resident K^T / V (:func:`fit_group`), so long key sequences still compile (with smaller groups)."""


def fit_group(group: int, sbuf_bytes: int, fixed_bytes: int, chunk_bytes: int) -> int:
    """Largest ``g <= group`` with ``fixed_bytes + 2 * g * chunk_bytes <= sbuf_bytes`` (P and P^T of g chunks
    next to everything else a kernel keeps in SBUF, per partition), at least 1."""
    g = group
    while g > 1 and fixed_bytes + 2 * g * chunk_bytes > sbuf_bytes:
        g -= 1
    return g


def _dma_chunks(frac: Any) -> tuple[int, int]:
    """Validate the compile-time ``dma_transpose_chunks`` fraction (None = :data:`DMA_TRANSPOSE_CHUNKS`)."""
    if frac is None:
        return DMA_TRANSPOSE_CHUNKS
    num, den = (int(x) for x in frac)
    if den < 1 or not 0 <= num <= den:
        raise ValueError(f"dma_transpose_chunks={frac!r} must be (num, den) with 0 <= num <= den, den >= 1")
    return num, den


def _dma_group(g: Any) -> int:
    """Validate the compile-time ``dma_group`` (None = :data:`DMA_GROUP_CHUNKS`)."""
    if g is None:
        return DMA_GROUP_CHUNKS
    if isinstance(g, bool) or int(g) != g or int(g) < 1:
        raise ValueError(f"dma_group={g!r} must be an int >= 1 (full chunks per DMA-transposed P^T group)")
    return int(g)


def p_transpose_plan(
    chunks: Sequence[tuple[int, int]], kc_full: int, group: int, n_grp: int, share: tuple[int, int]
) -> tuple[list[tuple[bool, int, bool]], int]:
    """Pure schedule of one query tile's P^T transposes.

    The full chunks (``n == kc_full``) are cut into groups of ``group`` consecutive chunks (the last one
    shorter); group number ``n_grp`` (a running counter carried across tiles, returned advanced) goes to the DMA
    when ``(n_grp * num) % den < num``. Returns per chunk ``(dma, slot, flush)``: ``slot`` is the chunk's place
    in its group (its P and alpha live at that slot; 0 for TensorE chunks) and ``flush`` marks the last chunk of
    a DMA group (transpose the group, then its PV matmuls and o updates in chunk order). TensorE chunks
    (including partial ones) are never inside a pending group, so the o updates keep the chunk order.
    """
    num, den = share
    full = [i for i, (_, n) in enumerate(chunks) if n == kc_full]
    plan: list[tuple[bool, int, bool]] = [(False, 0, False)] * len(chunks)
    for g0 in range(0, len(full), group):
        members = full[g0 : g0 + group]
        dma = (n_grp * num) % den < num
        n_grp += 1
        for slot, i in enumerate(members):
            plan[i] = (True, slot, slot == len(members) - 1) if dma else (False, 0, False)
    return plan, n_grp


def _load_transposed(dst, src, n, two_byte):
    """``dst[:, :n] = src[:n, :].T`` for an HBM view ``src`` ``[n, D]`` (rows any stride) into SBUF ``dst``
    ``[D, >= n]``, in hardware-DGE-legal forms (2-byte dtypes).

    The first ``16 * (n // 16)`` rows go in ONE 3-D transpose of the row-permuted view
    ``src3[a, c, :] = src[c*16 + a, :]`` (``[16, n/16, D]``, permutation (2, 1, 0)) into
    ``dst`` viewed ``[D, n/16, 16]``: element ``dst[d, c, a] = src[c*16 + a, d]``, i.e. exactly the transpose,
    with the same 2*D-byte row descriptors as a plain 2-D transpose. A tail of r < 16 rows re-transposes the
    last 16 rows (2-D, ``src.shape[0] == 16``), rewriting overlapping columns with identical values; fewer than
    16 rows in total (or fp32) take a ``dma_copy`` of the permuted view (element-sized descriptors).
    """
    n16 = (n // HWDGE_ROWS) * HWDGE_ROWS
    if not two_byte or n16 == 0:
        nisa.dma_copy(dst=dst[:, :n], src=src[:n, :].permute((1, 0)))
        return
    nc = n16 // HWDGE_ROWS
    src3 = src[:n16, :].reshape_dim(0, (nc, HWDGE_ROWS)).permute((1, 0, 2))
    nisa.dma_transpose(dst=dst[:, :n16].reshape_dim(1, (nc, HWDGE_ROWS)), src=src3, axes=(2, 1, 0))
    if n16 < n:
        nisa.dma_transpose(dst=dst[:, n - HWDGE_ROWS : n], src=src[n - HWDGE_ROWS : n, :], axes=(1, 0))


GPSIMD_MAX_MIN_WIDTH = 512
"""Rows at least this wide are halved with GpSimdE ``maximum`` (2048 -> 1024 -> 512 -> 256 for a full chunk)
before VectorE reduces the rest: GpSimdE has headroom, VectorE does not."""


def _copy_scores(s_bf, s_view, qr, kc, nsub, w):
    """VectorE copies the fp32 PSUM scores ``s_view`` ``[qr, nsub, w]`` to the fp32 SBUF tile ``s_bf[:qr, :kc]``
    (exact; half rate from PSUM): the input of :func:`_row_max` and of the exp, so PSUM's S is free after it."""
    nisa.tensor_copy(s_bf[:qr, :kc].reshape_dim(1, (nsub, w)), s_view, engine=nisa.vector_engine)


def _row_max(bmax, s_bf, mx_a, mx_b, qr, kc):
    """Row max of the fp32 scores ``s_bf[:qr, :kc]`` (from :func:`_copy_scores`) into ``bmax`` ``[qr, 1]`` (q's
    dtype; equal to the max of the rounded scores: rounding is monotone).

    GpSimdE (which cannot read PSUM) halves the row with elementwise ``maximum`` while the row is >=
    :data:`GPSIMD_MAX_MIN_WIDTH` and even; VectorE reduces the rest. The max is only the softmax
    stabiliser: the same (bf16-rounded) value is used in every exp and in the lse, so the rounding cancels
    exactly up to fp32 arithmetic.
    """
    cur = s_bf
    width = kc
    bufs = (mx_a, mx_b)
    i = 0
    while width >= GPSIMD_MAX_MIN_WIDTH and width % 2 == 0:
        half = width // 2
        dst = bufs[i % 2]
        nisa.tensor_tensor(
            dst[:qr, :half], cur[:qr, :half], cur[:qr, half:width], nl.maximum, engine=nisa.gpsimd_engine
        )
        cur = dst
        width = half
        i += 1
    nisa.tensor_reduce(bmax[:qr], nl.maximum, cur[:qr, :width], axis=1)


def _chunks(total: int, kc: int) -> list[tuple[int, int]]:
    """Key chunks ``(c0, n)``: full ``kc`` chunks, then a multiple of 512, then a < 512 tail."""
    out = []
    c0 = 0
    while c0 < total:
        rem = total - c0
        n = kc if rem >= kc else (rem // BANK) * BANK if rem >= BANK else rem
        out.append((c0, n))
        c0 += n
    return out


def _load_kv(kT_sb, v_sb, kbuf, vbuf, b, h, segments, D, two_byte):
    """Load the segments' keys (transposed) and values of head h into consecutive key positions."""
    off = 0
    for start, length in segments:
        # [length, D] HBM view, rows H*D apart -> key columns [off, off + length) of K^T
        _load_transposed(
            kT_sb[:D, off : off + length], kbuf[b, start : start + length, h, :], length, two_byte
        )
        # values: key position j lives at partition j % 128 of tile j // 128
        j = off
        while j < off + length:
            t, p = divmod(j, PMAX)
            n = min(PMAX - p, off + length - j)
            if p == 0 and n == PMAX:
                nt = (off + length - j) // PMAX
                src = vbuf[b, start + (j - off) : start + (j - off) + nt * PMAX, h, :]
                src = src.reshape_dim(0, (nt, PMAX)).permute((1, 0, 2))
                nisa.dma_copy(dst=v_sb[:, t : t + nt, :], src=src)
                n = nt * PMAX
            else:
                src = vbuf[b, start + (j - off) : start + (j - off) + n, h, :]
                nisa.dma_copy(dst=v_sb[p : p + n, t, :], src=src)
            j += n
        off += length


L_FLOOR = 1e-30
"""Lower clamp of the softmax denominator before the reciprocal when l comes from V's valid column
(:func:`_flash_rows` with ``l_in_v``): only a query tile without any valid key (l = 0 exactly) reaches it (any
valid key contributes ~1 via its maximum), so ``out = 0 * 1e30 = 0`` there."""


def _flash_buffers(D, dv, KC, gmax, dt, l_in_v):
    """SBUF/PSUM tiles of :func:`_flash_rows` (a dict with string keys): q^T, scores, P and P^T (``gmax`` chunks
    of ``KC`` keys), the fp32 accumulator ``o_acc`` ``[128, dv]`` and statistics. ``rs`` / ``l_sum`` (the exp
    row sums) only without ``l_in_v``."""
    f32 = nl.float32
    w = {
        "qT_a": nl.ndarray((D, PMAX), dtype=dt, buffer=nl.sbuf),
        "qT_b": nl.ndarray((D, PMAX), dtype=dt, buffer=nl.sbuf),
        "s_ps": nl.ndarray((PMAX, KC // BANK, BANK), dtype=f32, buffer=nl.psum),
        "pT_ps": nl.ndarray((PMAX, KC // PMAX, PMAX), dtype=dt, buffer=nl.psum),
        "pv_ps": nl.ndarray((PMAX, dv), dtype=f32, buffer=nl.psum),
        "p_sb": nl.ndarray((PMAX, gmax * KC), dtype=dt, buffer=nl.sbuf),
        "p_pe": nl.ndarray((PMAX, KC), dtype=dt, buffer=nl.sbuf),
        "pT_pe": nl.ndarray((PMAX, KC // PMAX, PMAX), dtype=dt, buffer=nl.sbuf),
        "pT_sb": nl.ndarray((PMAX, gmax * KC // PMAX, PMAX), dtype=dt, buffer=nl.sbuf),
        "o_acc": nl.ndarray((PMAX, dv), dtype=f32, buffer=nl.sbuf),
        "o_out": nl.ndarray((PMAX, D), dtype=dt, buffer=nl.sbuf),
        "bmax": nl.ndarray((PMAX, 1), dtype=dt, buffer=nl.sbuf),
        "s_bf": nl.ndarray((PMAX, KC), dtype=f32, buffer=nl.sbuf),
        "mx_a": nl.ndarray((PMAX, KC // 2), dtype=f32, buffer=nl.sbuf),
        "mx_b": nl.ndarray((PMAX, KC // 4), dtype=f32, buffer=nl.sbuf),
    }
    if not l_in_v:
        w["rs"] = nl.ndarray((PMAX, 1), dtype=f32, buffer=nl.sbuf)
        w["l_sum"] = nl.ndarray((PMAX, 1), dtype=f32, buffer=nl.sbuf)
    # two sets of one column per chunk of a group: the unit whose PV is deferred and the one being built
    w["alpha"] = nl.ndarray((PMAX, ALPHA_SETS * gmax), dtype=f32, buffer=nl.sbuf)
    for name in ("nm_a", "nm_b", "rl", "lse_t"):
        w[name] = nl.ndarray((PMAX, 1), dtype=f32, buffer=nl.sbuf)
    return w


def _transpose_unit(unit, queue, ci, alpha_set, w, qr, nbc):
    """Issue the P^T of ``unit`` (completed by chunk ``ci - 1``) and queue its PV: due at chunk ``ci`` for a
    TensorE chunk, :data:`DMA_PV_DELAY` chunks later for a DMA group. A queued unit still reading the same P^T
    tile (``pT_pe`` or ``pT_sb``) is issued first."""
    is_pe = unit[0][3] < 0
    queue.flush_until(lambda st, u: (u[0][3] < 0) == is_pe)
    _issue_p_transpose(unit, w["pT_sb"], w["pT_pe"], w["pT_ps"], w["p_sb"], w["p_pe"], qr, nbc)
    queue.push(ci + (0 if is_pe else DMA_PV_DELAY), alpha_set, list(unit))


def _flash_rows(
    w, kT_sb, v_sb, q, out, lse, b, h, q_lo, q_hi, chunks, n_grp, dma_chunks, scale, return_lse, l_in_v
):
    """Flash attention of queries ``[q_lo, q_hi)`` of (b, h) over the resident ``kT_sb`` ``[D, Lk]`` / ``v_sb``
    ``[128, Lk/128, dv]`` (key chunks ``chunks``), one 128-query tile at a time (steps 1-5 of the module
    docstring); stores ``out[b, q, h, :]`` (and ``lse[b, q, h]`` if ``return_lse``). ``w`` from
    :func:`_flash_buffers` (KC = its ``s_bf`` width, the group size its ``alpha`` width).

    The denominator l is the exp's fp32 row sum, or with ``l_in_v`` the PV matmul's last column (V carries
    ``dv = D + 1`` columns, the last one 1 for keys that count, 0 for keys that must not), clamped at
    :data:`L_FLOOR` before the reciprocal. ``n_grp`` (P^T groups seen, dealt to the DMA by
    ``dma_chunks``) is returned advanced.
    """
    D = q.shape[3]
    dv = v_sb.shape[2]
    two_byte = q.dtype != nl.float32
    KC = w["s_bf"].shape[1]
    gmax = w["alpha"].shape[1] // ALPHA_SETS
    nbc = KC // PMAX
    s_ps, p_sb, pT_sb, pT_pe = w["s_ps"], w["p_sb"], w["pT_sb"], w["pT_pe"]
    pv_ps, o_acc, o_out, alpha, bmax = w["pv_ps"], w["o_acc"], w["o_out"], w["alpha"], w["bmax"]
    rl, lse_t = w["rl"], w["lse_t"]
    for q0 in range(q_lo, q_hi, PMAX):
        qr = min(PMAX, q_hi - q0)
        qT = w["qT_b"] if (q0 - q_lo) // PMAX % 2 else w["qT_a"]  # the next tile's q^T loads during this one
        _load_transposed(qT[:D, :qr], q[b, q0 : q0 + qr, h, :], qr, two_byte)
        nm_old, nm_new = w["nm_a"], w["nm_b"]
        plan, n_grp = p_transpose_plan(chunks, KC, gmax, n_grp, dma_chunks if two_byte else (0, 1))
        pending: list[tuple[int, int, int, int, int]] = []  # (ci, c0, kc, slot, col) of the open DMA group
        done: list[tuple[int, int, int, int, int]] = []  # the unit completed by the previous chunk
        queue = PvQueue(pv_ps, o_acc, pT_sb, pT_pe, v_sb, alpha, qr, dv, nbc)
        unit = 0  # P^T units (a TensorE chunk or a DMA group) started in this tile
        for ci, (c0, kc) in enumerate(chunks):
            dma, slot, flush = plan[ci]
            aset = unit % ALPHA_SETS
            col = aset * gmax + slot
            nsub = (kc + BANK - 1) // BANK
            wd = min(kc, BANK)
            for j in range(nsub):
                nisa.nc_matmul(
                    s_ps[:qr, j, :wd],
                    stationary=qT[:D, :qr],
                    moving=kT_sb[:D, c0 + j * BANK : c0 + j * BANK + wd],
                    accumulate=False,
                )
            _copy_scores(w["s_bf"], s_ps[:qr, :nsub, :wd], qr, kc, nsub, wd)
            s_view = w["s_bf"][:qr, :kc].reshape_dim(1, (nsub, wd))
            # software pipeline: the previous unit's P^T goes here (it reads P before this chunk's exp
            # overwrites it), PVs after this chunk's exp (a DMA group's DMA_PV_DELAY chunks later), so the
            # in-order engines work on several chunks at once
            if done:
                _transpose_unit(done, queue, ci, (unit - 1) % ALPHA_SETS, w, qr, nbc)
                done = []
            queue.flush_until(lambda st, u, a=aset: st == a)  # this chunk's alpha column is free
            _row_max(bmax, w["s_bf"], w["mx_a"], w["mx_b"], qr, kc)
            p_dst = p_sb[:qr, slot * KC : slot * KC + kc] if dma else w["p_pe"][:qr, :kc]
            p_view = p_dst.reshape_dim(1, (nsub, wd))
            a_col = alpha[:qr, col : col + 1]
            if ci == 0:
                nisa.tensor_scalar(nm_new[:qr], bmax[:qr], nl.multiply, -scale, engine=nisa.vector_engine)
            else:
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
            if l_in_v:
                nisa.activation(p_view, nl.exp, s_view, bias=nm_new[:qr], scale=scale)
            else:
                rsum = w["l_sum"][:qr] if ci == 0 else w["rs"][:qr]
                nisa.activation_reduce(
                    p_view, nl.exp, s_view, reduce_op=nl.add, reduce_res=rsum, bias=nm_new[:qr], scale=scale
                )
                if ci > 0:
                    nisa.scalar_tensor_tensor(
                        w["l_sum"][:qr], w["l_sum"][:qr], nl.multiply, a_col, nl.add, w["rs"][:qr]
                    )
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
                done = [(ci, c0, kc, -1, col)]
                unit += 1
            nm_old, nm_new = nm_new, nm_old
        if done:
            _transpose_unit(done, queue, len(chunks), (unit - 1) % ALPHA_SETS, w, qr, nbc)
        queue.flush_until(lambda st, u: True)
        # finalize: out = o / l ; lse = log(l) - nm  (nm_old holds the final negated scaled max)
        if l_in_v:
            l_col = o_acc[:qr, D : D + 1]
            nisa.tensor_scalar(rl[:qr], l_col, nl.maximum, L_FLOOR, engine=nisa.vector_engine)
            nisa.reciprocal(rl[:qr], rl[:qr])
        else:
            l_col = w["l_sum"][:qr]
            nisa.reciprocal(rl[:qr], l_col)
        nisa.tensor_scalar(o_out[:qr], o_acc[:qr, :D], nl.multiply, rl[:qr], engine=nisa.vector_engine)
        nisa.dma_copy(dst=out[b, q0 : q0 + qr, h, :], src=o_out[:qr, :D])
        if return_lse:
            nisa.activation(lse_t[:qr], nl.log, l_col)
            nisa.tensor_tensor(lse_t[:qr], lse_t[:qr], nm_old[:qr], nl.subtract)
            nisa.dma_copy(dst=lse[b, q0 : q0 + qr, h : h + 1], src=lse_t[:qr])
    return n_grp


def _attention_body(q, kbuf, vbuf, segments, scale, return_lse, dma_chunks, dma_group):
    B, Lq, H, D = q.shape
    Lk = sum(n for _, n in segments)
    dt = q.dtype
    two_byte = dt != nl.float32
    f32 = nl.float32
    KC = 2048 if two_byte else 1024
    nkt = (Lk + PMAX - 1) // PMAX
    out = nl.ndarray(q.shape, dtype=dt, buffer=nl.shared_hbm)
    lse: Any = nl.ndarray((B, Lq, H), dtype=f32, buffer=nl.shared_hbm) if return_lse else None
    pid = nl.program_id(0)
    nprog = nl.num_programs()

    kT_sb = nl.ndarray((D, nkt * PMAX), dtype=dt, buffer=nl.sbuf)
    v_sb = nl.ndarray((PMAX, nkt, D), dtype=dt, buffer=nl.sbuf)
    chunks = _chunks(Lk, KC)
    # P / P^T hold a whole DMA group (dma_group chunks) when any full chunk can be dealt to the DMA
    gmax = 1
    if two_byte and dma_chunks[0] and any(n == KC for _, n in chunks):
        isz = 2
        # per-partition bytes of K^T, V and the other _flash_buffers tiles, plus a 1 KiB margin
        fixed = isz * (nkt * PMAX + nkt * D + 2 * PMAX + 2 * KC + D + 1) + 4 * (
            KC + KC // 2 + KC // 4 + D + 7
        )
        fixed += 4 * ALPHA_SETS * dma_group
        gmax = fit_group(dma_group, nl.tile_size.sbuf_fmax_bytes, fixed + 1024, KC * isz)
    w = _flash_buffers(D, D, KC, gmax, dt, False)

    pair = 0
    n_grp = 0  # P^T groups seen by this program: the DMA-transposed ones are dealt by this counter
    for b in range(B):
        for h in range(H):
            mine = pair % nprog == pid
            pair += 1
            if not mine:
                continue
            _load_kv(kT_sb, v_sb, kbuf, vbuf, b, h, segments, D, two_byte)
            n_grp = _flash_rows(
                w, kT_sb, v_sb, q, out, lse, b, h, 0, Lq, chunks, n_grp, dma_chunks, scale, return_lse, False
            )
    if return_lse:
        return out, lse
    return out


@nki.jit
def attention_kernel(q, k, v, scale, return_lse, dma_transpose_chunks=None, dma_group=None):
    """Flash attention ``[B, Lq, H, D] x [B, Lk, H, D]`` -> out ``[B, Lq, H, D]`` (+ lse ``[B, Lq, H]``).

    ``scale`` (float) and ``return_lse`` (bool) are compile-time constants; ``dma_transpose_chunks``
    (``(num, den)``, default :data:`DMA_TRANSPOSE_CHUNKS`) is the fraction of full 2048-key chunks whose P is
    transposed by the DMA instead of TensorE (``(0, 1)``: all on TensorE). Results are bit-identical either way.
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
    )


@nki.jit
def attention_segments_kernel(
    q, kv_k, kv_v, segments, scale, return_lse, dma_transpose_chunks=None, dma_group=None
):
    """Attention over keys/values read in place from ordered ``(start, length)`` segments of ``[B, S, H, D]``
    buffers (compile-time tuple of int pairs); ``dma_transpose_chunks`` as :func:`attention_kernel`."""
    return _attention_body(
        q,
        kv_k,
        kv_v,
        tuple(segments),
        scale,
        return_lse,
        _dma_chunks(dma_transpose_chunks),
        _dma_group(dma_group),
    )


# --------------------------------------------------------------------------------------------------
# torch-facing entries


def _validate(q: Any, k: Any, v: Any, kname: str, vname: str) -> None:
    import torch

    for name, t in (("q", q), (kname, k), (vname, v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(
                f"{name} must be a 4-D torch tensor [B, L, H, D], got {getattr(t, 'shape', t)!r}"
            )
        if t.dtype != q.dtype or t.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"{name} dtype {t.dtype} must be bfloat16 or float32 and match q ({q.dtype})")
    if k.shape != v.shape:
        raise ValueError(f"{vname} shape {tuple(v.shape)} must equal {kname} shape {tuple(k.shape)}")
    if (k.shape[0], k.shape[2], k.shape[3]) != (q.shape[0], q.shape[2], q.shape[3]):
        raise ValueError(f"{kname} shape {tuple(k.shape)} must match q {tuple(q.shape)} in B, H and D")
    if q.shape[3] > PMAX:
        raise ValueError(f"head_dim D={q.shape[3]} must be <= {PMAX} (D lives on the partitions)")


def _finish(res: Any, q: Any, return_lse: bool) -> Any:
    import torch

    from nki_kernels.rope3d import _to_torch

    if return_lse:
        out, lse = res
        return _to_torch(out, q.dtype), _to_torch(lse, torch.float32)
    return _to_torch(res, q.dtype)


def attention_emulated(
    q: Any, k: Any, v: Any, scale: float | None = None, return_lse: bool = False, lnc: int = 1
) -> Any:
    """Attention through :func:`attention_kernel` on the emulator.

    Args:
        q: torch ``[B, Lq, H, D]``; k, v: ``[B, Lk, H, D]``; bf16 or fp32 (all the same); D <= 128; Lk >= 1.
        scale: softmax scale (default ``1/sqrt(D)``).
        return_lse: also return lse ``[B, Lq, H]`` fp32.
        lnc: logical cores (1 or 2).

    Returns:
        out ``[B, Lq, H, D]`` in q's dtype, or ``(out, lse)``.
    """
    from nki_kernels._nki import launch

    _validate(q, k, v, "k", "v")
    if k.shape[1] < 1:
        raise ValueError("k must hold at least one key (Lk >= 1)")
    sc = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    res, _ = launch(
        attention_kernel, q.contiguous(), k.contiguous(), v.contiguous(), sc, bool(return_lse), lnc=lnc
    )
    return _finish(res, q, return_lse)


def attention_segments_emulated(
    q: Any,
    kv_k: Any,
    kv_v: Any,
    segments: Sequence[tuple[int, int]],
    scale: float | None = None,
    return_lse: bool = False,
    lnc: int = 1,
) -> Any:
    """Attention over ordered ``(start, length)`` segments of KV buffers ``[B, S, H, D]``, read in place.

    Segments with length 0 are skipped; each must satisfy ``0 <= start`` and ``start + length <= S``; at
    least one key in total. Other arguments as :func:`attention_emulated`.
    """
    from nki_kernels._nki import launch

    _validate(q, kv_k, kv_v, "kv_k", "kv_v")
    s = kv_k.shape[1]
    segs = []
    for i, seg in enumerate(segments):
        start, length = (int(x) for x in seg)
        if start < 0 or length < 0 or start + length > s:
            raise ValueError(
                f"segments[{i}]=({start}, {length}) must satisfy 0 <= start, start + length <= S={s}"
            )
        if length:
            segs.append((start, length))
    if not segs:
        raise ValueError("segments must hold at least one key in total")
    sc = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    res, _ = launch(
        attention_segments_kernel,
        q.contiguous(),
        kv_k.contiguous(),
        kv_v.contiguous(),
        tuple(segs),
        sc,
        bool(return_lse),
        lnc=lnc,
    )
    return _finish(res, q, return_lse)


_ = np

__all__ = [
    "attention_emulated",
    "attention_kernel",
    "attention_segments_emulated",
    "attention_segments_kernel",
]
