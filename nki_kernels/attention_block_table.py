"""Block-table attention: grouped flash attention whose keys are whole blocks read in place, at runtime
offsets, from several KV sources (standalone NKI 0.6 API, imported through :mod:`nki_kernels._nki`).

The NKI kernel of :func:`nki_kernels.ops.attention_block_table` (the static-shape attention of the merged
forward, ``docs/merged_forward.md``). Math, per batch b, head h, query group g (query tokens
``[lo_g, lo_g + q_groups[g])``)::

    keys(g) = concat over n with table[g, n, 0] >= 0 of src_s[b, blk*T : (blk+1)*T, h, :]
              where (s, blk) = table[g, n]
    out[b, i, h] = sum_j softmax_j(scale * q_i . k_j) v_j   over j in keys(g)   (zeros if keys(g) is empty)
    lse[b, i, h] = log sum_j exp(scale * q_i . k_j)                             (-inf if keys(g) is empty)

**One compiled kernel per shape, whatever the table holds.** The block table ``[G, NB, 2]`` int32 is a
*runtime* HBM input: it is loaded into SBUF and turned on VectorE into per-entry token offsets that are used
as ``scalar_offset`` of ``.ap()`` views of the sources (indirect on the token dim). Python never reads its
values, so the instruction stream (and the trace) does not depend on them. A source is a separate HBM tensor
and an entry's source is a runtime value, so each entry is loaded by one DMA per source, all with
``oob_mode=skip``: the offset is in range for the entry's own source and pushed past the end of storage for
the others, so exactly one of them moves data (none for an empty entry).

Key slot layout: entry n owns key positions ``[n*T, (n+1)*T)`` of the group (``Lk = NB*T``, static). An
empty entry must contribute nothing, exactly, while the flash loop is static:

* **V rows of empty entries are zero** (``v_sb`` is memset per group; the V DMAs of an empty entry all skip)
  and V carries an extra column ``D`` = 1 for keys of valid entries, 0 otherwise. The PV matmul
  (``moving = V[:, :D+1]``) then accumulates the softmax denominator ``l`` in column D with the same P as the
  numerator: empty keys add exactly 0 to both (their P is finite, times 0).
* **K^T columns of empty entries hold a duplicate of a valid block** of the group (the valid entry with the
  largest ``source*M + block`` code, M = max blocks per source). Their scores are therefore scores of real
  keys, so the running row max stays exactly what it would be over the valid keys alone (the stabiliser is
  as robust as in :mod:`nki_kernels.attention`: no overflow, no underflow of valid keys, no -inf bias). An
  all-empty group keeps finite stale keys: P finite, o = l = 0, and ``out = o / max(l, 1e-30) = 0``,
  ``lse = log(0) - m = -inf``.

The static pass (the default with 2-byte dtypes and at least two full key chunks) does not load a group's
K/V whole: it streams them chunk by chunk (:class:`~nki_kernels.attention_block_table_stream.
BlockTableStream`, :mod:`nki_kernels.attention_stream`), each chunk's entry pieces moved by the same
runtime-offset DMAs and K^T transposed on TensorE, while the previous chunks compute. The loads below are
those of the other paths and of the guard's running-max recompute.

Loads per (b, h, g), per entry n and source s (all runtime-offset DMAs, software DGE):
V straight into ``v_sb[key % 128, key // 128, :D]`` (head piece, run of full 128-row tiles, tail piece);
K into a staging tile in natural layout (``[128 rows, tiles, D]``, two DMAs), then per entry eight SBUF->SBUF
hardware-DGE ``dma_transpose`` pieces ``[16, tiles, D] -> [D, tiles, 16]`` (+ 16-row 2-D pieces for a tail,
the last one overlapping; a tail under 16 rows on TensorE) into ``K^T`` (fp32: TensorE
``nc_transpose`` per 128 rows; a correctness path). ``dma_transpose`` from an HBM view has no out-of-bounds
skip in the emulator (the skip must be exact), hence the staging.

The flash inner loop is the one of :mod:`nki_kernels.attention` (the same code,
:func:`nki_kernels.attention._flash_rows`: 1024-key chunks, row max straight from PSUM, exp with the negated
running max as bias, P^T on TensorE, or by SBUF->SBUF DMA transpose for a share :data:`DMA_TRANSPOSE_CHUNKS`
(none by default) of groups of :data:`DMA_GROUP_CHUNKS` 2048-key spans): l comes from the PV matmul's column
D (V's valid column; an exp row sum would count the duplicates) and is clamped at
:data:`nki_kernels.attention.L_FLOOR` before the reciprocal.
Layouts as :mod:`nki_kernels.attention`: q ``[B, Lq, H, D]``,
sources ``[B, S_i, H, D]``, out ``[B, Lq, H, D]``, lse ``[B, Lq, H]`` fp32; no transpose pass before or after.
LNC: ``kernel[2]`` deals the (b, h) pairs round-robin to the two logical cores.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from nki_kernels._nki import nisa, nki, nl
from nki_kernels.attention import _chunks, _guarded_rows, streams
from nki_kernels.attention_block_table_stream import BlockTableStream
from nki_kernels.attention_entries import _check_fp8, _check_static, _validate, fp8_v_scale
from nki_kernels.attention_pv import ALPHA_SETS
from nki_kernels.attention_stream import link_streams
from nki_kernels.attention_tiles import (
    KC_FP32,
    KC_TWO_BYTE,
    _dma_chunks,
    _dma_group,
    _flash_buffers,
    fit_group,
    flash_sbuf_bytes,
    guard_buffers,
    merge_remainder,
    owned_pairs,
)
from nki_kernels.block_table_checks import check_table_values
from nki_kernels.hw_limits import HWDGE_ROWS, PMAX

DMA_TRANSPOSE_CHUNKS = (0, 1)
"""Default share of P^T *groups* (:data:`DMA_GROUP_CHUNKS` consecutive 2048-key spans of a query tile)
transposed by SBUF->SBUF DMAs: none, as :data:`nki_kernels.attention_tiles.DMA_TRANSPOSE_CHUNKS` (the DMA
transpose price is unmeasured; every P^T is a TensorE transpose by default). The option stays; results do
not depend on it (exact copies)."""

DMA_GROUP_CHUNKS = 7
"""2048-key spans per DMA-transposed P^T group (as :data:`nki_kernels.attention_tiles.DMA_GROUP_CHUNKS`); 7
here, not 8, because V's extra column and the K staging tile leave less SBUF (8 does not fit at Lk = 32,760);
lowered further to what fits for longer key sequences."""

OFFSET_EXACT_LIMIT = 1 << 24
"""Token offsets are computed in fp32 on VectorE: ``B * S_i`` (the out-of-range sentinel) must stay below
2^24 to be exact."""


def _pieces(base: int, length: int) -> list[tuple[int, int, int, int, int]]:
    """Split key positions ``[base, base+length)`` into v_sb pieces ``(tile, p0, rows, ntiles, r0)``.

    A piece is either a partial tile (``ntiles == 0``: rows ``p0..p0+rows`` of tile ``tile``) or a run of
    ``ntiles`` full 128-row tiles starting at ``tile`` (``p0 == 0``, ``rows == 128``); ``r0`` is the first
    row of the piece within the block.
    """
    out = []
    j = base
    end = base + length
    while j < end:
        t, p = divmod(j, PMAX)
        if p == 0 and end - j >= PMAX:
            nt = (end - j) // PMAX
            out.append((t, 0, PMAX, nt, j - base))
            j += nt * PMAX
        else:
            n = min(PMAX - p, end - j)
            out.append((t, p, n, 0, j - base))
            j += n
    return out


def _offset_tiles(table, g, n_src, nblk, B, T, M, nkt):
    """Per-entry runtime token offsets of group g (VectorE, on all 128 partitions; values from partition 0
    are used as ``scalar_offset``): ``(k_tok[s], v_tok[s]) for s in sources`` int32 ``[128, NB]`` and V's
    valid column ``[128, nkt]`` uint8: ``vcol[p, t]`` = 1 when key position ``t*128 + p`` belongs to an
    entry that has a source, else 0 (also 0 past ``NB*T``)."""
    NB = table.shape[1]
    f32 = nl.float32
    tb = nl.ndarray((PMAX, NB, 2), dtype=nl.int32, buffer=nl.sbuf)
    # the group's row, broadcast to every partition (partition stride 0 on the HBM side)
    nisa.dma_copy(dst=tb, src=table.ap([[0, PMAX], [2, NB], [1, 2]], offset=g * NB * 2))
    src = nl.ndarray((PMAX, NB), dtype=f32, buffer=nl.sbuf)
    blk = nl.ndarray((PMAX, NB), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_copy(src, tb[:, :, 0], engine=nisa.vector_engine)
    nisa.tensor_copy(blk, tb[:, :, 1], engine=nisa.vector_engine)
    valid = nl.ndarray((PMAX, NB), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_scalar(valid, src, nl.greater_equal, 0.0, engine=nisa.vector_engine)
    # code = valid ? src*M + blk : -1
    code = nl.ndarray((PMAX, NB), dtype=f32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(code, src, nl.multiply, float(M), nl.add, blk)
    nisa.scalar_tensor_tensor(code, code, nl.add, 1.0, nl.multiply, valid)
    nisa.tensor_scalar(code, code, nl.subtract, 1.0, engine=nisa.vector_engine)
    # fallback = largest valid code (-1 if none); eff = valid ? code : fallback
    fb1 = nl.ndarray((PMAX, 1), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_reduce(fb1, nl.maximum, code, axis=1)
    nisa.tensor_scalar(fb1, fb1, nl.add, 1.0, engine=nisa.vector_engine)
    inv = nl.ndarray((PMAX, NB), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_scalar(inv, valid, nl.multiply, -1.0, op1=nl.add, operand1=1.0, engine=nisa.vector_engine)
    eff = nl.ndarray((PMAX, NB), dtype=f32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(eff, inv, nl.multiply, fb1, nl.add, code)
    k_tok: list[Any] = []
    v_tok: list[Any] = []
    off = nl.ndarray((PMAX, NB), dtype=f32, buffer=nl.sbuf)
    bad = nl.ndarray((PMAX, NB), dtype=f32, buffer=nl.sbuf)
    hi = nl.ndarray((PMAX, NB), dtype=f32, buffer=nl.sbuf)
    for s in range(n_src):
        # a block index in range only for source s; anything else moves past the end of the storage
        huge = float(B * nblk[s] + (n_src + 1) * M + 1)
        for x, dst_list in ((eff, k_tok), (code, v_tok)):
            nisa.tensor_scalar(off, x, nl.subtract, float(s * M), engine=nisa.vector_engine)
            nisa.tensor_scalar(bad, off, nl.less, 0.0, engine=nisa.vector_engine)
            nisa.tensor_scalar(hi, off, nl.greater_equal, float(nblk[s]), engine=nisa.vector_engine)
            nisa.tensor_tensor(bad, bad, hi, nl.add)
            nisa.scalar_tensor_tensor(bad, bad, nl.multiply, huge, nl.add, off)
            tok = nl.ndarray((PMAX, NB), dtype=nl.int32, buffer=nl.sbuf)
            nisa.tensor_scalar(tok, bad, nl.multiply, float(T), engine=nisa.vector_engine)
            dst_list.append(tok)
    return k_tok, v_tok, _valid_column(valid, T, nkt)


def _valid_column(valid, T, nkt):
    """``vcol[p, t] = valid[entry of key t*128 + p]`` as a ``[128, nkt]`` uint8 tile, built with accesses
    on all 128 partitions only (a per-entry write into ``v_sb[p0:p0+rows]`` would start mid-quadrant, which
    the engines' start-partition rule forbids). Telescoping sum over entry starts, exact in fp32 (integers
    -1/0/1 and key positions < 2^24)::

        vcol = valid[0] + sum_{n=1..NB-1} [key >= n*T] (valid[n] - valid[n-1]) - [key >= NB*T] valid[NB-1]
    """
    NB = valid.shape[1]
    f32 = nl.float32
    key = nl.ndarray((PMAX, nkt), dtype=f32, buffer=nl.sbuf)
    nisa.iota(key, [[PMAX, nkt]], offset=0, channel_multiplier=1)  # key[p, t] = t*128 + p
    step = nl.ndarray((PMAX, NB + 1), dtype=f32, buffer=nl.sbuf)  # step[n] = valid[n] - valid[n-1]
    if NB > 1:
        nisa.tensor_tensor(step[:, 1:NB], valid[:, 1:NB], valid[:, 0 : NB - 1], nl.subtract)
    nisa.tensor_scalar(
        step[:, NB : NB + 1], valid[:, NB - 1 : NB], nl.multiply, -1.0, engine=nisa.vector_engine
    )
    acc = nl.ndarray((PMAX, nkt), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_scalar(
        acc, key, nl.multiply, 0.0, op1=nl.add, operand1=valid[:, 0:1], engine=nisa.vector_engine
    )
    term = nl.ndarray((PMAX, nkt), dtype=f32, buffer=nl.sbuf)
    for n in range(1, NB + 1):
        nisa.tensor_scalar(term, key, nl.greater_equal, float(n * T), op1=nl.multiply,
                           operand1=step[:, n : n + 1], engine=nisa.vector_engine)  # fmt: skip
        nisa.tensor_tensor(acc, acc, term, nl.add)
    vcol = nl.ndarray((PMAX, nkt), dtype=nl.uint8, buffer=nl.sbuf)  # 0/1: uint8 keeps it 1 B per key tile
    nisa.tensor_copy(vcol, acc, engine=nisa.vector_engine)
    return vcol


def _load_group(kT_sb, v_sb, k_st, kT_ps, k_sources, v_sources, offs, b, h, T, D, two_byte):
    """K^T and V (+ valid column) of one (b, h, group) from the runtime block offsets ``offs``."""
    k_tok, v_tok, vcol = offs
    NB = k_tok[0].shape[1]
    n_src = len(k_sources)
    nft, rem = divmod(T, PMAX)
    nisa.memset(v_sb, 0.0, engine=nisa.gpsimd_engine)
    # valid column: 1 for keys of entries that have a source (one copy on all 128 partitions)
    nisa.tensor_copy(v_sb[:, :, D : D + 1], vcol, engine=nisa.vector_engine)
    for n in range(NB):
        base = n * T
        pieces = _pieces(base, T)
        for s in range(n_src):
            kb, vb = k_sources[s], v_sources[s]
            _, S, H, _ = kb.shape
            hd = H * D
            at = b * S * hd + h * D
            # V: straight into its key positions (skip unless this entry's source is s)
            for t, p0, rows, nt, r0 in pieces:
                if nt:
                    src = vb.ap([[hd, PMAX], [PMAX * hd, nt], [1, D]], offset=at + r0 * hd,
                                scalar_offset=v_tok[s][0:1, n : n + 1], indirect_dim=1)  # fmt: skip
                    nisa.dma_copy(dst=v_sb[:, t : t + nt, :D], src=src, oob_mode=nisa.oob_mode.skip)
                else:
                    src = vb.ap([[hd, rows], [1, D]], offset=at + r0 * hd,
                                scalar_offset=v_tok[s][0:1, n : n + 1], indirect_dim=1)  # fmt: skip
                    nisa.dma_copy(dst=v_sb[p0 : p0 + rows, t, :D], src=src, oob_mode=nisa.oob_mode.skip)
            # K: natural layout into the staging tile (the entry's block, or the fallback block if empty)
            if nft:
                src = kb.ap([[hd, PMAX], [PMAX * hd, nft], [1, D]], offset=at,
                            scalar_offset=k_tok[s][0:1, n : n + 1], indirect_dim=1)  # fmt: skip
                nisa.dma_copy(dst=k_st[:, :nft, :D], src=src, oob_mode=nisa.oob_mode.skip)
            if rem:
                src = kb.ap([[hd, rem], [1, D]], offset=at + nft * PMAX * hd,
                            scalar_offset=k_tok[s][0:1, n : n + 1], indirect_dim=1)  # fmt: skip
                nisa.dma_copy(dst=k_st[:rem, nft, :D], src=src, oob_mode=nisa.oob_mode.skip)
        # K^T of the entry: staged rows -> key columns [base, base + T)
        if two_byte:
            # hardware-DGE-legal SBUF->SBUF pieces of 16 staged partitions: [16, nft, D] -> [D, nft, 16]
            if nft:
                dst = kT_sb[:D, base : base + nft * PMAX].reshape_dim(1, (nft, PMAX))
                for g in range(0, PMAX, HWDGE_ROWS):
                    nisa.dma_transpose(
                        dst=dst[:, :, g : g + HWDGE_ROWS],
                        src=k_st[g : g + HWDGE_ROWS, :nft, :D],
                        axes=(2, 1, 0),
                    )
            if rem >= HWDGE_ROWS:
                # 2-D [16, D] pieces; the last one ends at rem (overlapping columns get identical values)
                c0 = base + nft * PMAX
                for g in sorted({*range(0, rem - HWDGE_ROWS + 1, HWDGE_ROWS), rem - HWDGE_ROWS}):
                    nisa.dma_transpose(
                        dst=kT_sb[:D, c0 + g : c0 + g + HWDGE_ROWS],
                        src=k_st[g : g + HWDGE_ROWS, nft, :D],
                        axes=(1, 0),
                    )
            elif rem:  # fewer than 16 tail rows: TensorE transpose (dst dtype = data dtype)
                nisa.nc_transpose(kT_ps[:D, :rem], k_st[:rem, nft, :D])
                nisa.tensor_copy(
                    kT_sb[:D, base + nft * PMAX : base + T], kT_ps[:D, :rem], engine=nisa.vector_engine
                )
        else:
            for u in range(nft + (1 if rem else 0)):
                rows = min(PMAX, T - u * PMAX)
                nisa.nc_transpose(kT_ps[:D, :rows], k_st[:rows, u, :D])
                nisa.tensor_copy(
                    kT_sb[:D, base + u * PMAX : base + u * PMAX + rows],
                    kT_ps[:D, :rows],
                    engine=nisa.vector_engine,
                )


def _block_table_body(
    q, k_sources, v_sources, table, q_groups, T, scale, return_lse, dma_chunks, dma_group, static=False,
    v_scale=None,
):  # fmt: skip
    B, Lq, H, D = q.shape
    G, NB, _ = table.shape
    n_src = len(k_sources)
    nblk = [int(kb.shape[1]) // T for kb in k_sources]
    M = max(nblk)
    Lk = NB * T
    dt = q.dtype
    two_byte = dt != nl.float32
    f32 = nl.float32
    KC = KC_TWO_BYTE if two_byte else KC_FP32
    nkt = (Lk + PMAX - 1) // PMAX
    ntile_blk = (T + PMAX - 1) // PMAX
    Dv = D + 1  # V's extra column: 1 for keys of valid entries (the PV matmul then also yields l)
    out = nl.ndarray(q.shape, dtype=dt, buffer=nl.shared_hbm)
    lse: Any = nl.ndarray((B, Lq, H), dtype=f32, buffer=nl.shared_hbm) if return_lse else None
    pid = nl.program_id(0)
    nprog = nl.num_programs()

    offs = [_offset_tiles(table, g, n_src, nblk, B, T, M, nkt) for g in range(G)]
    chunks = merge_remainder(_chunks(Lk, KC), KC)
    if v_scale is not None and not (static and streams(chunks, two_byte, dma_chunks)):
        raise ValueError(
            "attention_block_table: v_scale (FP8 P.V) needs the streamed static pass: a 2-byte dtype, "
            f"static=True, no DMA transpose share and NB*T >= 2048 key positions, got {Lk}, dtype={dt}"
        )
    if static and streams(chunks, two_byte, dma_chunks):  # K/V streamed per (b, h, group): none resident
        w = guard_buffers(dt, count_psum=True)
        units = []
        for b, h in owned_pairs(B, H, pid, nprog):
            lo = 0
            for g in range(G):
                res = _resident_group(k_sources, v_sources, offs[g], b, h, T, D, nkt, dt)
                kv = BlockTableStream(k_sources, v_sources, offs[g], b, h, T, D, dt, res)
                kv.v_scale = v_scale
                units.append((kv, b, h, lo, lo + q_groups[g]))
                lo += q_groups[g]
        link_streams(units)
        for kv, b, h, lo, hi in units:
            _guarded_rows(
                w, kv, None, q, out, lse, b, h, lo, hi, chunks, 0, dma_chunks, scale, return_lse, True
            )
        return (out, lse) if return_lse else out

    kT_sb = nl.ndarray((D, nkt * PMAX), dtype=dt, buffer=nl.sbuf)
    v_sb = nl.ndarray((PMAX, nkt, Dv), dtype=dt, buffer=nl.sbuf)
    k_st = nl.ndarray((PMAX, ntile_blk, D), dtype=dt, buffer=nl.sbuf)
    nisa.memset(k_st, 0.0, engine=nisa.gpsimd_engine)  # an all-empty group transposes these: keep finite
    # TensorE K^T: every fp32 tile; for 2-byte dtypes only a tail of < 16 rows per block (DMA otherwise)
    kT_ps: Any = (
        nl.ndarray((D, PMAX), dtype=dt if two_byte else f32, buffer=nl.psum)
        if not two_byte or 0 < T % PMAX < HWDGE_ROWS
        else None
    )
    # P / P^T hold a whole DMA group (see nki_kernels.attention_tiles.DMA_GROUP_CHUNKS), lowered to what fits
    gmax = 0
    if two_byte and dma_chunks[0] and sum(n == KC for _, n in chunks) >= 2:
        # per-partition bytes of every other SBUF tile (K^T, V, K staging, flash tiles, offsets), +4 KiB
        fixed = 2 * (nkt * PMAX + nkt * Dv + ntile_blk * D) + flash_sbuf_bytes(D, KC, 0, 2)
        fixed += 4 * ALPHA_SETS * 2 * dma_group + 4 * 16 * NB * (G + 1)
        fixed += nkt * G  # V's valid column of each group (vcol, uint8)
        gmax = fit_group(dma_group, nl.tile_size.sbuf_fmax_bytes, fixed + 4096, 2 * KC * 2)
    w = _flash_buffers(D, Dv, KC, gmax, dt, static)

    n_grp = 0
    for b, h in owned_pairs(B, H, pid, nprog):
        lo = 0
        for g in range(G):
            nq = q_groups[g]
            _load_group(kT_sb, v_sb, k_st, kT_ps, k_sources, v_sources, offs[g], b, h, T, D, two_byte)
            n_grp = _guarded_rows(
                w, kT_sb, v_sb, q, out, lse, b, h, lo, lo + nq, chunks, n_grp, dma_chunks, scale, return_lse,
                static,
            )  # fmt: skip
            lo += nq
    if return_lse:
        return out, lse
    return out


def _resident_group(k_sources, v_sources, offs, b, h, T, D, nkt, dt):
    """The guard's recompute of a streamed (b, h, group): a function loading the group's whole K^T / V
    (:func:`_load_group`) into tiles allocated when it runs (live only during the recompute)."""

    def load() -> tuple[Any, Any]:
        kT_sb = nl.ndarray((D, nkt * PMAX), dtype=dt, buffer=nl.sbuf)
        v_sb = nl.ndarray((PMAX, nkt, D + 1), dtype=dt, buffer=nl.sbuf)
        k_st = nl.ndarray((PMAX, (T + PMAX - 1) // PMAX, D), dtype=dt, buffer=nl.sbuf)
        nisa.memset(k_st, 0.0, engine=nisa.gpsimd_engine)
        kT_ps = nl.ndarray((D, PMAX), dtype=dt, buffer=nl.psum) if 0 < T % PMAX < HWDGE_ROWS else None
        _load_group(kT_sb, v_sb, k_st, kT_ps, k_sources, v_sources, offs, b, h, T, D, True)
        return kT_sb, v_sb

    return load


@nki.jit
def attention_block_table_kernel(
    q,
    k_sources,
    v_sources,
    block_table,
    q_groups,
    block_tokens,
    scale,
    return_lse,
    dma_transpose_chunks=None,
    dma_group=None,
    static=True,
    v_scale=None,
):
    """Grouped flash attention over key blocks picked at runtime from ``k_sources``/``v_sources``.

    q ``[B, Lq, H, D]``; k_sources/v_sources: lists of ``[B, S_i, H, D]`` HBM tensors (S_i a multiple of
    ``block_tokens``); block_table ``[G, NB, 2]`` int32 HBM tensor (runtime values: ``(source, block)``,
    source -1 = empty). Compile-time: ``q_groups`` (tuple of G ints summing to Lq), ``block_tokens`` (T),
    ``scale``, ``return_lse``, ``dma_transpose_chunks`` (as :func:`nki_kernels.attention.attention_kernel`;
    default :data:`DMA_TRANSPOSE_CHUNKS`), ``static`` (the guarded static softmax offset,
    :func:`nki_kernels.attention._guarded_rows`; per (b, h, group)), ``v_scale`` (FP8 P.V, as
    :func:`nki_kernels.attention.attention_kernel`; one ``[B, H, D]`` scale for every source).
    Returns out ``[B, Lq, H, D]`` (+ lse ``[B, Lq, H]`` fp32).
    """
    return _block_table_body(
        q,
        list(k_sources),
        list(v_sources),
        block_table,
        tuple(int(n) for n in q_groups),
        int(block_tokens),
        scale,
        return_lse,
        _dma_chunks(DMA_TRANSPOSE_CHUNKS if dma_transpose_chunks is None else dma_transpose_chunks),
        _dma_group(DMA_GROUP_CHUNKS if dma_group is None else dma_group),
        bool(static),
        v_scale,
    )


# --------------------------------------------------------------------------------------------------
# torch-facing entry


def _check_args(
    q: Any,
    k_sources: Sequence[Any],
    v_sources: Sequence[Any],
    block_table: Any,
    q_groups: Sequence[int],
    block_tokens: int,
) -> tuple[list[Any], list[Any], np.ndarray, tuple[int, ...], int]:
    import torch

    for name, srcs in (("k_sources", k_sources), ("v_sources", v_sources)):
        if isinstance(srcs, torch.Tensor) or not isinstance(srcs, Sequence) or len(srcs) == 0:
            raise TypeError(f"{name} must be a non-empty list of [B, S, H, D] tensors")
    if len(k_sources) != len(v_sources):
        raise ValueError(f"k_sources has {len(k_sources)} tensors but v_sources has {len(v_sources)}")
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, (int, np.integer)) or block_tokens < 1:
        raise ValueError(f"block_tokens must be an int >= 1, got {block_tokens!r}")
    t = int(block_tokens)
    ks, vs = [], []
    for i, (kb, vb) in enumerate(zip(k_sources, v_sources)):
        _validate(q, kb, vb, f"k_sources[{i}]", f"v_sources[{i}]")
        if kb.shape[1] % t or kb.shape[1] < t:
            raise ValueError(f"k_sources[{i}] length S={kb.shape[1]} must be a positive multiple of {t}")
        if kb.shape[0] * kb.shape[1] + 2 * kb.shape[1] >= OFFSET_EXACT_LIMIT:
            raise ValueError(
                f"k_sources[{i}]: B*S = {kb.shape[0] * kb.shape[1]} tokens is too large for exact fp32 "
                f"offset arithmetic (limit {OFFSET_EXACT_LIMIT})"
            )
        ks.append(kb.contiguous())
        vs.append(vb.contiguous())
    if isinstance(q_groups, (str, bytes)) or not isinstance(q_groups, Sequence) or len(q_groups) == 0:
        raise ValueError(f"q_groups must be a non-empty sequence of ints, got {q_groups!r}")
    groups = tuple(int(n) for n in q_groups)
    if any(n < 1 for n in groups) or sum(groups) != q.shape[1]:
        raise ValueError(f"q_groups {list(groups)} must be ints >= 1 summing to Lq={q.shape[1]}")
    if not isinstance(block_table, torch.Tensor) or block_table.dtype.is_floating_point:
        raise TypeError("block_table must be an integer torch tensor [G, NB, 2]")
    if block_table.dim() != 3 or block_table.shape[0] != len(groups) or block_table.shape[2] != 2:
        raise ValueError(f"block_table must be [G={len(groups)}, NB, 2], got {tuple(block_table.shape)}")
    if block_table.shape[1] < 1:
        raise ValueError("block_table must have NB >= 1 entries per group")
    tab = block_table.detach().cpu().to(torch.int64).numpy()
    check_table_values(tab.tolist(), [int(kb.shape[1]) for kb in ks], t)
    return ks, vs, tab.astype(np.int32), groups, t


def attention_block_table_emulated(
    q: Any,
    k_sources: Sequence[Any],
    v_sources: Sequence[Any],
    block_table: Any,
    q_groups: Sequence[int],
    block_tokens: int,
    scale: float | None = None,
    return_lse: bool = False,
    lnc: int = 1,
    dma_transpose_chunks: tuple[int, int] | None = None,
    static: bool = True,
    fp8: bool = False,
) -> Any:
    """:func:`nki_kernels.ops.attention_block_table` through :func:`attention_block_table_kernel` (emulator).

    Args:
        q: torch ``[B, Lq, H, D]`` bf16/fp32, D <= 128.
        k_sources, v_sources: equally long lists of torch ``[B, S_i, H, D]`` (q's dtype, same B, H, D),
            S_i a positive multiple of ``block_tokens``.
        block_table: integer torch ``[G, NB, 2]``: entry ``(g, n) = (source, block)``, source -1 = empty;
            checked here (sources in range, blocks within their source, no block twice per group), then
            passed to the kernel as a runtime int32 input (the traced kernel does not depend on it).
        q_groups: G ints >= 1 summing to Lq (consecutive query groups).
        block_tokens: T, tokens per block.
        scale: softmax scale (default ``1/sqrt(D)``). return_lse: also return lse ``[B, Lq, H]`` fp32.
        lnc: logical cores (1 or 2). dma_transpose_chunks: see :func:`attention_block_table_kernel`.
        static: the guarded static softmax offset (:func:`nki_kernels.attention.attention_emulated`).
        fp8: P.V in e4m3 (:func:`nki_kernels.attention.attention_emulated`); V's scales over every source.

    Returns:
        out ``[B, Lq, H, D]`` in q's dtype, or ``(out, lse)``; a group without keys gives zeros / -inf.
    """
    from nki_kernels._nki import launch
    from nki_kernels.attention_entries import _finish

    ks, vs, tab, groups, t = _check_args(q, k_sources, v_sources, block_table, q_groups, block_tokens)
    sc = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    extra = {"v_scale": fp8_v_scale(vs, "v_sources")} if _check_fp8(fp8) else {}
    res, _ = launch(
        attention_block_table_kernel,
        q.contiguous(),
        ks,
        vs,
        tab,
        groups,
        t,
        sc,
        bool(return_lse),
        dma_transpose_chunks,
        static=_check_static(static),
        lnc=lnc,
        **extra,
    )
    return _finish(res, q, return_lse)


__all__ = [
    "DMA_TRANSPOSE_CHUNKS",
    "attention_block_table_emulated",
    "attention_block_table_kernel",
]
