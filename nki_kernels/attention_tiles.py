"""Tiles, loads and pure schedules of the flash attention kernels (:mod:`nki_kernels.attention`,
:mod:`nki_kernels.attention_block_table`), standalone NKI 0.6 API.

Pure index maths (no NKI calls): :func:`fit_group`, :func:`p_transpose_plan`, :func:`pair_plan`,
:func:`vector_evict_blocks`; argument checks :func:`_dma_chunks`, :func:`_dma_group`; loads
:func:`_load_transposed`, :func:`_load_kv`; the SBUF/PSUM tiles of the inner loop :func:`_flash_buffers`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nki_kernels._nki import nisa, nl
from nki_kernels.attention_pv import ALPHA_SETS
from nki_kernels.hw_limits import HWDGE_ROWS, PMAX, PSUM_BANK_FMAX

KC_TWO_BYTE = 1024
"""Keys per chunk of the inner loop for 2-byte dtypes: S of one chunk is ``[128, 1024]`` fp32 = two PSUM
banks, double-buffered (4 of the 8 banks), so TensorE computes chunk c+1's scores while VectorE / ScalarE read
chunk c's straight from PSUM (docs/kernels/attention.md, "Engine balance")."""

KC_FP32 = 512
"""Keys per chunk for fp32 inputs (a correctness path): one bank of S, and the fp32 P^T of the chunk (4 x 128
keys x 4 B) fills one bank, so S, P^T and PV all stay double-buffered in PSUM."""

DMA_TRANSPOSE_CHUNKS = (0, 1)
"""Default fraction ``(num, den)`` of the P^T *groups* transposed SBUF->SBUF by the DMA: none. Every P^T is
a TensorE transpose by default: the SBUF->SBUF ``dma_transpose`` price is unmeasured on trn2 (cost model v2
range 50 %..12.5 % of copy throughput), and the design must not depend on its optimistic end. The DMA path
stays available as a compile-time option (``dma_transpose_chunks``); results do not depend on it (exact
copies)."""

DMA_GROUP_CHUNKS = 8
"""2048-key spans per DMA-transposed P^T group (``g``) when the DMA path is on: a span is two consecutive
full 1024-key chunks, the group's P stay in SBUF and one ``dma_transpose`` per 16 queries moves all of them
(``512 x g`` B per destination partition). Costs ``(g - 1) x 8 KiB`` more SBUF per partition (P and P^T of
the group): the kernel lowers g to what fits next to the resident K^T / V (:func:`fit_group`)."""

VECTOR_EVICT = (3, 16)
"""Fraction ``(num, den)`` of the TensorE-transposed P^T blocks evicted PSUM->SBUF by VectorE, dealt per chunk
by a running counter (:func:`vector_evict_blocks`): 3/16 of the 8 blocks of a 1024-key chunk = 1 and 2 blocks
on alternate chunks; ScalarE evicts the rest. It balances the two engines' busy time per chunk in cost model
v2 (table in docs/kernels/attention.md): VectorE carries the row max (~1.21 us per chunk from PSUM), the
running max and the o update, ScalarE the exp (~0.97 us) and alpha; a bf16 block costs VectorE ~67 ns (2-byte
PSUM source, 2x mode) and ScalarE ~107 ns, plus ~147 / ~114 ns per eviction instruction (PSUM access)."""


VECTOR_EVICT_STATIC = (14, 16)
"""The VectorE share of the P^T evictions with a static softmax offset (``_flash_rows(static=True)``): VectorE
no longer reduces a row max per chunk, so it takes more of the evictions from ScalarE, which keeps the exp."""


def vector_evict_blocks(nb: int, n: int, split: tuple[int, int] = VECTOR_EVICT) -> int:
    """P^T blocks (of ``nb``) of the ``n``-th TensorE-transposed chunk evicted by VectorE: the running dealer
    ``floor((n + 1) * nb * num / den) - floor(n * nb * num / den)`` (``nb * num / den`` on average)."""
    num, den = split
    return (n + 1) * nb * num // den - n * nb * num // den


def merge_remainder(chunks: Sequence[tuple[int, int]], kc: int) -> list[tuple[int, int]]:
    """Key chunks ``(c0, n)`` with the remainder after the full ``kc`` chunks in one chunk where possible.

    :func:`nki_kernels.attention._chunks` ends with a multiple-of-512 chunk and a < 512 tail; when both exist
    and their sum ``r`` is even, they become one chunk of ``r`` keys whose S fills two PSUM banks of ``r / 2``
    columns (so it pays the fixed per-chunk work once). Any other list is returned unchanged. Every chunk of
    the result satisfies ``n % ceil(n / 512) == 0`` (equal banks).
    """
    out = list(chunks)
    if len(out) >= 2:
        (c0, m), (c1, t) = out[-2], out[-1]
        if (
            m < kc
            and m % PSUM_BANK_FMAX == 0
            and 0 < t < PSUM_BANK_FMAX
            and c1 == c0 + m
            and (m + t) % 2 == 0
            and m + t <= 2 * PSUM_BANK_FMAX
        ):
            out[-2:] = [(c0, m + t)]
    return out


def owned_pairs(B: int, H: int, pid: int, nprog: int) -> list[tuple[int, int]]:
    """The (batch, head) pairs program ``pid`` of ``nprog`` computes: all ``B x H`` pairs in b-major order,
    dealt round-robin (pair ``i`` to program ``i % nprog``), so LNC2 splits the heads evenly."""
    return [(b, h) for i, (b, h) in enumerate((b, h) for b in range(B) for h in range(H)) if i % nprog == pid]


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
        raise ValueError(f"dma_group={g!r} must be an int >= 1 (2048-key spans per DMA-transposed P^T group)")
    return int(g)


def p_transpose_plan(
    chunks: Sequence[tuple[int, int]], kc_full: int, group: int, n_grp: int, share: tuple[int, int]
) -> tuple[list[tuple[bool, int, bool]], int]:
    """Pure schedule of one query tile's P^T transposes.

    The full chunks (``n == kc_full``) are cut into groups of ``group`` consecutive chunks (the last one
    shorter); group number ``n_grp`` (a running counter carried across tiles, returned advanced) goes to the
    DMA when ``(n_grp * num) % den < num``. Returns per chunk ``(dma, slot, flush)``: ``slot`` is the chunk's
    place in its group (its P and alpha live at that slot; 0 for TensorE chunks) and ``flush`` marks the last
    chunk of a DMA group (transpose the group, then its PV matmuls and o updates in chunk order). TensorE
    chunks (including partial ones) are never inside a pending group, so the o updates keep the chunk order.
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


def pair_plan(
    chunks: Sequence[tuple[int, int]], kc: int, group: int, n_grp: int, share: tuple[int, int]
) -> tuple[list[tuple[bool, int, bool]], int]:
    """:func:`p_transpose_plan` over 2048-key *spans* for the inner loop's ``kc``-key chunks.

    Two consecutive full ``kc`` chunks form a span of ``2 * kc`` keys (the DMA path's unit: its hwdge pieces
    ``[<=16 q, 16 x g, 128 k]`` need 16 blocks per span); any other chunk is a span of its own (never full, so
    always on TensorE). Spans are planned by :func:`p_transpose_plan` (``kc_full = 2 * kc``) and mapped back:
    per chunk ``(dma, slot, flush)`` with ``slot = 2 * span_slot + half`` and ``flush`` on the group's last
    chunk. Returns the plan and ``n_grp`` advanced.
    """
    spans: list[tuple[int, int, int]] = []  # (first chunk, chunks in span, keys)
    i = 0
    while i < len(chunks):
        if chunks[i][1] == kc and i + 1 < len(chunks) and chunks[i + 1][1] == kc:
            spans.append((i, 2, 2 * kc))
            i += 2
        else:
            spans.append((i, 1, chunks[i][1]))
            i += 1
    plan2, n_grp = p_transpose_plan([(chunks[i0][0], n) for i0, _, n in spans], 2 * kc, group, n_grp, share)
    out: list[tuple[bool, int, bool]] = []
    for (_, cnt, _), (dma, slot, flush) in zip(spans, plan2):
        for j in range(cnt):
            out.append((True, 2 * slot + j, flush and j == cnt - 1) if dma else (False, 0, False))
    return out, n_grp


def _load_transposed(dst, src, n, two_byte):
    """``dst[:, :n] = src[:n, :].T`` for an HBM view ``src`` ``[n, D]`` (rows any stride) into SBUF ``dst``
    ``[D, >= n]``, in hardware-DGE-legal forms (2-byte dtypes).

    The first ``16 * (n // 16)`` rows go in ONE 3-D transpose of the row-permuted view
    ``src3[a, c, :] = src[c*16 + a, :]`` (``[16, n/16, D]``, permutation (2, 1, 0)) into
    ``dst`` viewed ``[D, n/16, 16]``: element ``dst[d, c, a] = src[c*16 + a, d]``, i.e. exactly the transpose,
    with the same 2*D-byte row descriptors as a plain 2-D transpose. A tail of r < 16 rows re-transposes the
    last 16 rows (2-D, ``src.shape[0] == 16``), rewriting overlapping columns with identical values; fewer
    than 16 rows in total (or fp32) take a ``dma_copy`` of the permuted view (element-sized descriptors).
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


def _load_kv(kT_sb, v_sb, kbuf, vbuf, b, h, segments, D, two_byte, off0=0):
    """Load the segments' keys (transposed) and values of head h into consecutive key positions from
    ``off0`` on (V into columns ``[0, D)`` of ``v_sb``; its column D, the ones column of l, is not
    touched)."""
    off = off0
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
                nisa.dma_copy(dst=v_sb[:, t : t + nt, :D], src=src)
                n = nt * PMAX
            else:
                src = vbuf[b, start + (j - off) : start + (j - off) + n, h, :]
                nisa.dma_copy(dst=v_sb[p : p + n, t, :D], src=src)
            j += n
        off += length


def flash_sbuf_bytes(D: int, KC: int, gmax: int, isz: int) -> int:
    """Per-partition SBUF bytes of :func:`_flash_buffers` (``gmax`` 2048-key spans of P / P^T, 0 = none;
    ``isz`` bytes of q's dtype), for the kernels' capacity arithmetic."""
    slots = max(2 * gmax, 1)
    group = 2 * slots * KC if gmax else 0
    return isz * (2 * PMAX + 2 * KC + 3 * KC + group + D) + 4 * (2 * (D + 1) + ALPHA_SETS * slots + 7)


def _flash_buffers(D, dv, KC, gmax, dt, static=False):
    """SBUF/PSUM tiles of :func:`nki_kernels.attention._flash_rows` (a dict with string keys).

    PSUM (8 banks of 2 KiB per partition): ``s_ps`` two ``[128, KC/512, 512]`` fp32 score buffers (2 banks
    each at KC = 1024), ``pT_ps`` two ``[128, KC/128, 128]`` P^T buffers (1 bank each), ``pv_ps`` two
    ``[128, dv]`` fp32 PV accumulators. SBUF: two q^T tiles, two P and three P^T tiles of TensorE chunks
    (``p_pe`` / ``pT_pe``), P / P^T of a DMA group (``gmax`` spans = ``2 * gmax`` chunk slots), two fp32
    accumulators ``o_acc`` ``[128, dv]`` (column D is l; a tile's tail overlaps the next tile) and the
    statistics (``nm``: two running-max pairs, one per tile parity).
    """
    f32 = nl.float32
    slots = max(2 * gmax, 1)  # gmax = 0: no DMA group tiles (every P^T on TensorE), one alpha column per set
    pdt = dt if dt != f32 else f32
    w: dict[str, Any] = {
        "qT_a": nl.ndarray((D, PMAX), dtype=dt, buffer=nl.sbuf),
        "qT_b": nl.ndarray((D, PMAX), dtype=dt, buffer=nl.sbuf),
        "s_ps": [
            nl.ndarray((PMAX, KC // PSUM_BANK_FMAX, PSUM_BANK_FMAX), dtype=f32, buffer=nl.psum)
            for _ in range(2)
        ],
        "pT_ps": [nl.ndarray((PMAX, KC // PMAX, PMAX), dtype=pdt, buffer=nl.psum) for _ in range(2)],
        "pv_ps": [nl.ndarray((PMAX, dv), dtype=f32, buffer=nl.psum) for _ in range(2)],
        "p_pe": [nl.ndarray((PMAX, KC), dtype=dt, buffer=nl.sbuf) for _ in range(2)],
        "pT_pe": [nl.ndarray((PMAX, KC // PMAX, PMAX), dtype=dt, buffer=nl.sbuf) for _ in range(3)],
        "p_sb": nl.ndarray((PMAX, slots * KC), dtype=dt, buffer=nl.sbuf) if gmax else None,
        "pT_sb": nl.ndarray((PMAX, slots * KC // PMAX, PMAX), dtype=dt, buffer=nl.sbuf) if gmax else None,
        "o_acc": [nl.ndarray((PMAX, dv), dtype=f32, buffer=nl.sbuf) for _ in range(2)],
        "nm": [nl.ndarray((PMAX, 1), dtype=f32, buffer=nl.sbuf) for _ in range(4)],
        "o_out": nl.ndarray((PMAX, D), dtype=dt, buffer=nl.sbuf),
        # two sets of one column per chunk of a group: the unit whose PV is deferred and the one being built
        "alpha": nl.ndarray((PMAX, ALPHA_SETS * slots), dtype=f32, buffer=nl.sbuf),
    }
    for name in ("bmax", "rl", "lse_t"):
        w[name] = nl.ndarray((PMAX, 1), dtype=f32, buffer=nl.sbuf)
    if static:
        w.update(guard_buffers(dt))
    return w


def guard_buffers(dt, count_psum=False):
    """The static offset's guard tiles (:func:`nki_kernels.attention._guarded_rows`): per-row flags
    ``good`` ``[128, 1]`` (q's dtype), a ones column, the loop-bound ``flag`` ``[1, 1]`` int32 and, with
    ``count_psum``, a ``[1, 1]`` fp32 PSUM tile ``cnt`` for the count (else the count uses a PV buffer)."""
    w = {
        "good": nl.ndarray((PMAX, 1), dtype=dt, buffer=nl.sbuf),
        "ones": nl.ndarray((PMAX, 1), dtype=dt, buffer=nl.sbuf),
        "flag": nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf),
    }
    nisa.memset(w["ones"], 1.0, engine=nisa.vector_engine)
    if count_psum:  # a streaming kernel: the count's PSUM tile, and the loads one unit starts for the next
        w["cnt"] = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.psum)
        w["carry"] = {}
    return w
