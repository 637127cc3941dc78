"""The measured peer's self-attention, re-written in this project's NKI 0.6 API to price it (all *modelled*).

The open Rolling Forcing port on trn2 (github.com/yahavb/rolling_forcing, ``kernels/self_attention_nst.py``
``wan_flash_self_attn``, called from ``models/dit_attention.py`` ``_attend``) runs its own NKI flash
attention. :func:`peer_attention_kernel` has that kernel's structure (our code, written from reading it):

* Layouts: q ``[B, d, Lq]`` and k ``[B, d, Lk]`` **D-major** (no load transposes in the kernel; the model's
  XLA graph permutes them before the call, see :func:`dmajor_layout_kernel`), v ``[B, Lk, d]``, out
  ``[Lq, B, d]`` (``B`` = the core's heads, ``d <= 128``). 2-byte dtypes (bf16). ``actual_seqlen_k`` keys of
  the ``Lk``-wide (padded) buffers are attended.
* Keys in sections of :data:`SECTION` (8,192) when more than :data:`FLASH_THRESHOLD` (10,240) keys, else one
  section; the section's K (``[d, 512]`` tiles, one DMA each) and V (``[128, d]`` tiles, one DMA each) stay
  in SBUF. Queries in groups of 128; q^T loaded :data:`Q_GROUPS_PER_LOAD` (8) groups per DMA.
* Per group and section: QK^T ``nc_matmul`` (stationary q^T ``[d, 128]``, moving K ``[d, 512]``) into one of
  4 PSUM banks; VectorE ``tensor_scalar_reduce`` evicts ``scale * S`` to fp32 SBUF with the running max of
  each 512-key tile; VectorE ``tensor_reduce`` (negated) gives the section max; ScalarE ``activation_reduce``
  ``exp(S - max)`` -> bf16 with its row sum; P^T by SBUF->SBUF ``dma_transpose``; PV ``nc_matmul``
  (stationary P^T ``[128 k, 128 q]``, moving V ``[128 k, d]``) accumulated over 2,048 keys in a PSUM bank
  (4 banks), then copied / added on VectorE into an fp32 SBUF accumulator.
* Sections merge flash-style through an fp32 partial output in HBM (correction ``exp(max_old - max_new)``
  on ScalarE, ``o = o_prev * corr + o_section`` on VectorE); the last section scales by ``1 / rowsum``.
* A two-stage software pipeline over the groups (the peer's order): group g+2's q load and QK^T/max run
  interleaved with group g's PV, group g+1's exp, g's write-back; every per-group buffer has 2 copies.

**One difference, forced by the emulator's DMA rule** (hardware-DGE transpose sources of at most 16
partitions, ``src.shape[0] in {1, 2, 4, 8, 16}``; NKI 0.6's ``dge_mode.unknown`` is treated as hwdge, see
docs/emulator.md): the peer transposes each 512-key exp tile of a group (``[128 q, 4 x 128 k] -> [128 k, 4,
128 q]``, 128 source partitions) in one DMA. Here each 16-query slice of :data:`TRANSPOSE_KEYS` (4,096) keys
goes in one DMA (``[16 q, 32, 128 k] -> [128 k, 32, 16 q]``). Per group and 8,192-key section both make 16
DMAs of 2 MiB in total, each with 1 KiB descriptors (cost model v2 splits a DMA into descriptors of at most
its bytes per partition) over all 16 DMA engines (128 destination partitions): the DMA count, bytes,
descriptor size and engines the cost model charges are the peer's. What differs is the dependency
granularity (a PV waits for the 4,096-key slice, not the 512-key tile: it runs one pipeline stage later
anyway). A key tail (not a multiple of 128) rides in its slice as a whole 128-key block (the peer issues one
more DMA of ``[128 q, r]`` for it); query tails transpose whole 16-row slices (the rows past the group are
never read by the PV matmuls). With fewer than 4,096 keys per section (the cross-attention's 512 text keys)
the slices are smaller than the peer's DMAs: ``[16 q, 512 k]`` moves 128 B per destination partition where
the peer's ``[128 q, 512 k]`` moves 1 KiB, 8 DMAs for the peer's one, so the cost model charges smaller
descriptors (an upper end for that case; docs/e2e_model.md gives the figures).

Other small differences: the final ``o / rowsum`` is written in bf16 by VectorE (the peer writes fp32 and
lets the DMA cast), and small per-row statistics instructions use the group's rows only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nki_kernels._nki import nisa, nki, nl
from nki_kernels.hw_limits import HWDGE_ROWS, PMAX

__all__ = [
    "FLASH_THRESHOLD",
    "SECTION",
    "TRANSPOSE_KEYS",
    "Q_GROUPS_PER_LOAD",
    "peer_sections",
    "transpose_pieces",
    "run_group_pipeline",
    "peer_attention_kernel",
    "dmajor_layout_kernel",
    "padded_keys",
    "row_tiles",
]

Q_GRP = 128
K_TILE = 512
LARGE_TILE = 2048
SECTION = 8192
"""Keys per flash section (the peer's ``_FLASH_ATTENTION_SECTION_LENGTH``)."""
FLASH_THRESHOLD = 10 * 1024
"""More attended keys than this: flash sections; else one section (the peer's threshold)."""
Q_GROUPS_PER_LOAD = 8
"""128-query groups per q^T DMA (the peer's, for 2-byte dtypes)."""
TRANSPOSE_KEYS = 4096
"""Keys of one 16-query P^T ``dma_transpose`` (module docstring: the peer's DMA count and sizes per
section)."""
SEQLEN_MULTIPLE = 8192
"""The peer pads its K/V buffers to a multiple of this (``models/dit_layers.py`` ``ATTN_SEQLEN_MULTIPLE``)."""
_F32_MIN = -3.4028235e38


def padded_keys(keys: int) -> int:
    """Width of the peer's K/V buffer holding ``keys`` keys: rounded up to :data:`SEQLEN_MULTIPLE`."""
    if keys < 1:
        raise ValueError(f"padded_keys: keys must be >= 1, got {keys}")
    return -(-keys // SEQLEN_MULTIPLE) * SEQLEN_MULTIPLE


def peer_sections(keys: int) -> tuple[int, int]:
    """``(section_len, num_sections)`` for ``keys`` attended keys (pure): sections of :data:`SECTION` above
    :data:`FLASH_THRESHOLD` keys, else one section of all keys."""
    if keys < 1:
        raise ValueError(f"peer_sections: keys must be >= 1, got {keys}")
    sec = min(keys, SECTION) if keys > FLASH_THRESHOLD else keys
    return sec, -(-keys // sec)


def transpose_pieces(qr: int, nkeys: int) -> list[tuple[int, int, int]]:
    """P^T DMAs of one group's ``nkeys`` keys (pure): ``(q0, k0, n)`` = 16 query rows from ``q0``, keys
    ``[k0, k0 + n)`` of the section, ``n`` a multiple of 128 (a key tail is rounded up to a whole 128-key
    block: its extra columns are never read by the PV matmuls). Query rows go in slices of 16 (the last
    slice may reach past ``qr``, ``qr <= 128``)."""
    if not (1 <= qr <= PMAX) or nkeys < 1:
        raise ValueError(
            f"transpose_pieces: need 1 <= qr <= {PMAX} and nkeys >= 1, got qr={qr} nkeys={nkeys}"
        )
    out = []
    for k0 in range(0, nkeys, TRANSPOSE_KEYS):
        n = -(-min(TRANSPOSE_KEYS, nkeys - k0) // PMAX) * PMAX
        out += [(q0, k0, n) for q0 in range(0, qr, HWDGE_ROWS)]
    return out


class _Bufs:
    """SBUF/PSUM tiles of one kernel (2 copies of every per-group buffer, indexed ``g % 2``)."""

    def __init__(self, d: int, n_k_tiles: int, n_v_tiles: int, n_grps: int, dt: Any) -> None:
        f32 = nl.float32
        sb, ps = nl.sbuf, nl.psum
        two = range(2)
        self.q = [nl.ndarray((d, Q_GRP * Q_GROUPS_PER_LOAD), dtype=dt, buffer=sb) for _ in two]
        self.k = nl.ndarray((d, n_k_tiles, K_TILE), dtype=dt, buffer=sb)
        self.v = nl.ndarray((PMAX, n_v_tiles, d), dtype=dt, buffer=sb)
        n_large = -(-n_k_tiles * K_TILE // LARGE_TILE)
        self.s = [nl.ndarray((PMAX, n_large * LARGE_TILE), dtype=f32, buffer=sb) for _ in two]
        self.p = nl.ndarray((PMAX, n_large * LARGE_TILE), dtype=dt, buffer=sb)
        self.pt = [nl.ndarray((PMAX, n_v_tiles, PMAX), dtype=dt, buffer=sb) for _ in two]
        self.s_ps = [nl.ndarray((PMAX, K_TILE), dtype=f32, buffer=ps) for _ in range(4)]
        self.o_ps = [nl.ndarray((PMAX, d), dtype=f32, buffer=ps) for _ in range(4)]
        self.pmax = [nl.ndarray((PMAX, n_k_tiles), dtype=f32, buffer=sb) for _ in two]
        self.psum_part = [nl.ndarray((PMAX, n_k_tiles), dtype=f32, buffer=sb) for _ in two]
        self.o_sec = [nl.ndarray((PMAX, d), dtype=f32, buffer=sb) for _ in two]
        self.o_prev = [nl.ndarray((PMAX, d), dtype=f32, buffer=sb) for _ in two]
        self.o_acc = [nl.ndarray((PMAX, d), dtype=f32, buffer=sb) for _ in two]
        self.o_out = [nl.ndarray((PMAX, d), dtype=dt, buffer=sb) for _ in two]
        self.col = {
            name: [nl.ndarray((PMAX, 1), dtype=f32, buffer=sb) for _ in two]
            for name in ("sec_max", "prev_max", "corr", "sec_sum")
        }
        self.run_max = nl.ndarray((PMAX, n_grps), dtype=f32, buffer=sb)
        self.run_sum = nl.ndarray((PMAX, n_grps), dtype=f32, buffer=sb)
        self.recip = nl.ndarray((PMAX, n_grps), dtype=f32, buffer=sb)
        self.zero = nl.ndarray((PMAX, 1), dtype=f32, buffer=sb)


class _Ctx:
    """Shapes of one (head, section) pass: queries, keys, the section's offset and size."""

    def __init__(self, b, lq, lk_act, d, scale, sec_idx, sec_len, n_sec, n_grps):
        self.b, self.lq, self.lk_act, self.d, self.scale = b, lq, lk_act, d, scale
        self.si, self.n_sec, self.n_grps = sec_idx, n_sec, n_grps
        self.off = sec_idx * sec_len
        self.n_keys = min(sec_len, lk_act - self.off)  # keys of this section that are attended
        self.n_k_tiles = -(-self.n_keys // K_TILE)

    def qr(self, g: int) -> int:
        return min(Q_GRP, self.lq - g * Q_GRP)


def _load_q(c: _Ctx, B: _Bufs, q: Any, g: int) -> None:
    if g % Q_GROUPS_PER_LOAD:
        return
    q0 = g * Q_GRP
    n = min(c.lq - q0, Q_GRP * Q_GROUPS_PER_LOAD)
    nisa.dma_copy(dst=B.q[(g // Q_GROUPS_PER_LOAD) % 2][: c.d, :n], src=q[c.b, :, q0 : q0 + n])


def _qk_large(c: _Ctx, B: _Bufs, g: int, lt: int) -> None:
    """QK^T of group g over large tile ``lt`` (4 x 512 keys): matmul into a PSUM bank, VectorE evicts
    ``scale * S`` to fp32 SBUF with the 512-key tile's max."""
    qr, slot = c.qr(g), g % 2
    qcol = (g % Q_GROUPS_PER_LOAD) * Q_GRP
    qt = B.q[(g // Q_GROUPS_PER_LOAD) % 2]
    for kt in range(LARGE_TILE // K_TILE):
        ki = lt * (LARGE_TILE // K_TILE) + kt
        if ki >= c.n_k_tiles:
            return
        nf = min(c.n_keys - ki * K_TILE, K_TILE)
        ps = B.s_ps[kt]
        nisa.nc_matmul(
            ps[:qr, :nf],
            stationary=qt[: c.d, qcol : qcol + qr],
            moving=B.k[: c.d, ki, :nf],
            accumulate=False,
        )
        nisa.tensor_scalar_reduce(
            B.s[slot][:qr, ki * K_TILE : ki * K_TILE + nf],
            data=ps[:qr, :nf],
            op0=nl.multiply,
            operand0=c.scale,
            reduce_op=nl.maximum,
            reduce_res=B.pmax[slot][:qr, ki : ki + 1],
        )


def _qk(c: _Ctx, B: _Bufs, g: int) -> None:
    nisa.memset(B.pmax[g % 2][: c.qr(g)], value=_F32_MIN)
    for lt in range(-(-c.n_k_tiles * K_TILE // LARGE_TILE)):
        _qk_large(c, B, g, lt)


def _update_max(c: _Ctx, B: _Bufs, g: int) -> None:
    """Section max (negated) of group g; across sections the running max and ``corr = exp(max_old - max_new)``
    (``run_max`` holds the negated max)."""
    qr, slot = c.qr(g), g % 2
    smax, pmx, corr = B.col["sec_max"][slot][:qr], B.col["prev_max"][slot][:qr], B.col["corr"][slot][:qr]
    run = B.run_max[:qr, g : g + 1]
    nisa.tensor_reduce(smax, nl.maximum, B.pmax[slot][:qr, : c.n_k_tiles], axis=1, negate=True)
    if c.n_sec == 1 or c.si == 0:
        nisa.tensor_copy(run, smax)
        return
    nisa.activation(pmx, nl.copy, run, bias=B.zero[:qr], scale=-1.0)  # + max_old
    nisa.tensor_tensor(run, run, smax, nl.minimum)  # - max_new
    nisa.activation(corr, nl.exp, pmx, bias=run, scale=1.0)


def _exp(c: _Ctx, B: _Bufs, g: int) -> None:
    """``P = exp(scale * S - max)`` (bf16) per 512-key tile with its row sum (ScalarE), then P^T by DMA."""
    qr, slot = c.qr(g), g % 2
    nisa.memset(B.psum_part[slot][:qr], value=0.0)
    for ki in range(c.n_k_tiles):
        k0 = ki * K_TILE
        nf = min(c.n_keys - k0, K_TILE)
        nisa.activation_reduce(
            B.p[:qr, k0 : k0 + nf],
            nl.exp,
            B.s[slot][:qr, k0 : k0 + nf],
            reduce_op=nl.add,
            reduce_res=B.psum_part[slot][:qr, ki : ki + 1],
            bias=B.run_max[:qr, g : g + 1],
        )
    for q0, k0, n in transpose_pieces(qr, c.n_keys):
        t0, nb = k0 // PMAX, n // PMAX
        nisa.dma_transpose(
            dst=B.pt[slot][:PMAX, t0 : t0 + nb, q0 : q0 + HWDGE_ROWS],
            src=B.p[q0 : q0 + HWDGE_ROWS, k0 : k0 + n].reshape_dim(1, (nb, PMAX)),
            axes=(2, 1, 0),
        )


def _pv_large(c: _Ctx, B: _Bufs, g: int, lt: int) -> None:
    """PV of group g over large tile ``lt``: 16 matmuls of 128 keys accumulated in PSUM bank ``lt % 4``,
    then copied (first large tile) or added (VectorE) into the fp32 accumulator."""
    qr, slot = c.qr(g), g % 2
    ps = B.o_ps[lt % 4]
    first = True
    per = LARGE_TILE // PMAX
    for j in range(per):
        vi = lt * per + j
        np_ = min(c.n_keys - vi * PMAX, PMAX)
        if np_ <= 0:
            break
        nisa.nc_matmul(
            ps[:qr, : c.d],
            stationary=B.pt[slot][:np_, vi, :qr],
            moving=B.v[:np_, vi, : c.d],
            accumulate=not first,
        )
        first = False
    if first:
        return
    acc = B.o_sec[slot][:qr, : c.d]
    if lt == 0:
        nisa.tensor_copy(acc, ps[:qr, : c.d], engine=nisa.vector_engine)
    else:
        nisa.tensor_tensor(acc, acc, ps[:qr, : c.d], nl.add)


def _n_large(c: _Ctx) -> int:
    return -(-c.n_k_tiles * K_TILE // LARGE_TILE)


def _pv(c: _Ctx, B: _Bufs, g: int) -> None:
    for lt in range(_n_large(c)):
        _pv_large(c, B, g, lt)


def _fused_pv_qk(c: _Ctx, B: _Bufs, g: int) -> None:
    """The peer's steady stage: group g's PV interleaved per large tile with group g+2's QK^T and max."""
    nisa.memset(B.pmax[g % 2][: c.qr(g + 2)], value=_F32_MIN)
    for lt in range(_n_large(c)):
        _pv_large(c, B, g, lt)
        _qk_large(c, B, g + 2, lt)


def _write_back(c: _Ctx, B: _Bufs, g: int, out: Any, part: Any) -> None:
    """Row sums, the flash merge through the fp32 partial output in HBM, and on the last section
    ``out = o / rowsum`` (bf16) stored to ``out[q, b, :]``."""
    qr, slot, d = c.qr(g), g % 2, c.d
    q0 = g * Q_GRP
    ssum, corr = B.col["sec_sum"][slot][:qr], B.col["corr"][slot][:qr]
    run, rec = B.run_sum[:qr, g : g + 1], B.recip[:qr, g : g + 1]
    last = c.si == c.n_sec - 1
    nisa.tensor_reduce(ssum, nl.add, B.psum_part[slot][:qr, : c.n_k_tiles], axis=1)
    src = B.o_sec[slot][:qr, :d]
    if c.n_sec == 1:
        nisa.reciprocal(rec, ssum)
    else:
        if c.si == 0:
            nisa.tensor_copy(run, ssum)
        else:
            nisa.tensor_scalar(run, run, nl.multiply, corr, op1=nl.add, operand1=ssum)
            prev = B.o_prev[slot][:qr, :d]
            nisa.dma_copy(dst=prev, src=part[c.b, q0 : q0 + qr, :])
            acc = B.o_acc[slot][:qr, :d]
            nisa.scalar_tensor_tensor(acc, prev, nl.multiply, corr, nl.add, src)
            src = acc
        if last:
            nisa.reciprocal(rec, run)
        else:
            nisa.dma_copy(dst=part[c.b, q0 : q0 + qr, :], src=src)
            return
    o = B.o_out[slot][:qr, :d]
    nisa.tensor_scalar(o, src, nl.multiply, rec, engine=nisa.vector_engine)
    nisa.dma_copy(dst=out[q0 : q0 + qr, c.b, :], src=o)


def run_group_pipeline(
    n: int,
    *,
    load_q: Callable[[int], None],
    qk: Callable[[int], None],
    update_max: Callable[[int], None],
    exp: Callable[[int], None],
    pv: Callable[[int], None],
    fused_pv_qk: Callable[[int], None],
    write_back: Callable[[int], None],
) -> None:
    """Issue one section's ``n`` query groups in the two-stage software-pipeline order that the peer's
    kernel shares with AWS's ``attention_cte`` (also used by ``perf/attention_cte_harness.py``): groups
    0 and 1 are loaded, scored and max-reduced first (with group 0's exp); then per group ``g`` the next
    group's q load, ``g + 1``'s exp, ``g``'s PV fused with ``g + 2``'s QK^T, ``g``'s write-back and
    ``g + 2``'s max; then the last two groups drain. ``fused_pv_qk(g)`` does ``g``'s PV and ``g + 2``'s
    QK^T."""
    if n == 1:
        load_q(0)
        qk(0)
        update_max(0)
        exp(0)
        pv(0)
        write_back(0)
        return
    for g in (0, 1):
        load_q(g)
        qk(g)
        update_max(g)
        if g == 0:
            exp(0)
    for g in range(n - 2):
        load_q(g + 2)
        exp(g + 1)
        fused_pv_qk(g)
        write_back(g)
        update_max(g + 2)
    pv(n - 2)
    write_back(n - 2)
    exp(n - 1)
    pv(n - 1)
    write_back(n - 1)


def _section(c: _Ctx, B: _Bufs, q: Any, k: Any, v: Any, out: Any, part: Any) -> None:
    """Load the section's K and V, then the groups through the peer's two-stage pipeline."""
    for ki in range(c.n_k_tiles):
        k0 = c.off + ki * K_TILE
        nf = min(k.shape[2] - k0, K_TILE)
        nisa.dma_copy(dst=B.k[: c.d, ki, :nf], src=k[c.b, :, k0 : k0 + nf])
    for vi in range(-(-c.n_keys // PMAX)):
        k0 = c.off + vi * PMAX
        np_ = min(v.shape[1] - k0, PMAX)
        nisa.dma_copy(dst=B.v[:np_, vi, : c.d], src=v[c.b, k0 : k0 + np_, :])
    run_group_pipeline(
        c.n_grps,
        load_q=lambda g: _load_q(c, B, q, g),
        qk=lambda g: _qk(c, B, g),
        update_max=lambda g: _update_max(c, B, g),
        exp=lambda g: _exp(c, B, g),
        pv=lambda g: _pv(c, B, g),
        fused_pv_qk=lambda g: _fused_pv_qk(c, B, g),
        write_back=lambda g: _write_back(c, B, g, out, part),
    )


@nki.jit
def peer_attention_kernel(q, k, v, scale, actual_seqlen_k):
    """Flash attention with the peer's structure (module docstring).

    q ``[B, d, Lq]``, k ``[B, d, Lk]`` (D-major), v ``[B, Lk, d]``; 2-byte dtype, ``d <= 128``; attends the
    first ``actual_seqlen_k`` (compile-time int, ``1 <= actual_seqlen_k <= Lk``) keys. ``scale``:
    compile-time float. Returns out ``[Lq, B, d]`` in q's dtype.
    """
    bsz, d, lq = q.shape
    lk = k.shape[2]
    if tuple(k.shape[:2]) != (bsz, d) or tuple(v.shape) != (bsz, lk, d):
        raise ValueError(f"peer_attention_kernel: k {k.shape} must be [B, d, Lk], v {v.shape} [B, Lk, d]")
    if d > PMAX or not 1 <= int(actual_seqlen_k) <= lk:
        raise ValueError(f"peer_attention_kernel: need d <= {PMAX}, 1 <= actual_seqlen_k <= Lk={lk}")
    if q.dtype == nl.float32:
        raise ValueError("peer_attention_kernel: 2-byte dtypes only (dma_transpose moves 2-byte elements)")
    lk_act = int(actual_seqlen_k)
    sec_len, n_sec = peer_sections(lk_act)
    n_grps = -(-lq // Q_GRP)
    out = nl.ndarray((lq, bsz, d), dtype=q.dtype, buffer=nl.shared_hbm)
    part = nl.ndarray((bsz, lq, d), dtype=nl.float32, buffer=nl.hbm) if n_sec > 1 else None
    n_kt = -(-sec_len // K_TILE)
    B = _Bufs(d, n_kt, -(-sec_len // PMAX), n_grps, q.dtype)
    nisa.memset(B.zero, value=0.0)
    nisa.memset(
        B.p, value=0.0
    )  # query-tail slices of the P^T DMAs read rows past the group: keep them defined
    for b in range(bsz):
        for si in range(n_sec):
            _section(_Ctx(b, lq, lk_act, d, float(scale), si, sec_len, n_sec, n_grps), B, q, k, v, out, part)
    return out


LAYOUT_ROWS = 4 * PMAX
"""Rows of one HBM->SBUF transpose tile of :func:`dmajor_layout_kernel`."""


def row_tiles(n: int) -> list[tuple[int, int]]:
    """Row tiles ``(r0, r)`` of a length-``n`` sequence (pure, ``n >= 16``): :data:`LAYOUT_ROWS` rows
    each, the last one shorter; a last tile of fewer than 16 rows is moved back to start at ``n - 16`` (it
    overlaps the previous tile and rewrites identical values), so every tile has >= 16 rows."""
    if n < HWDGE_ROWS:
        raise ValueError(f"row_tiles: n must be >= {HWDGE_ROWS}, got {n}")
    out = [(r0, min(LAYOUT_ROWS, n - r0)) for r0 in range(0, n, LAYOUT_ROWS)]
    if out[-1][1] < HWDGE_ROWS:
        out[-1] = (n - HWDGE_ROWS, HWDGE_ROWS)
    return out


@nki.jit
def dmajor_layout_kernel(q, k, v):
    """The layout changes the peer's XLA graph makes before each attention call (``_attend``:
    ``q.permute(1, 2, 0)``, ``k.permute(1, 2, 0)``, ``v.permute(1, 0, 2)``, each ``.contiguous()``), done by
    the DMA: q ``[Lq, H, d]`` -> ``[H, d, Lq]`` and k ``[Lk, H, d]`` -> ``[H, d, Lk]`` by HBM->SBUF
    ``dma_transpose`` of 128-row tiles (hardware-DGE 3-D form ``[16, n/16, d]``) stored back to HBM; v
    ``[Lk, H, d]`` -> ``[H, Lk, d]`` by HBM->HBM ``dma_copy`` per head (``d``-element runs). 2-byte dtypes,
    ``d <= 128``, lengths multiples of 16. Returns ``(qT, kT, vh)``.
    """
    lq, h, d = q.shape
    lk = k.shape[0]
    if min(lq, lk) < HWDGE_ROWS or d > PMAX:
        raise ValueError(f"dmajor_layout_kernel: lengths must be >= 16 and d <= 128, got {lq} {lk} {d}")
    qT = nl.ndarray((h, d, lq), dtype=q.dtype, buffer=nl.shared_hbm)
    kT = nl.ndarray((h, d, lk), dtype=k.dtype, buffer=nl.shared_hbm)
    vh = nl.ndarray((h, lk, d), dtype=v.dtype, buffer=nl.shared_hbm)
    tiles = [nl.ndarray((d, 4 * PMAX), dtype=q.dtype, buffer=nl.sbuf) for _ in range(2)]
    i = 0
    for src, dst, n in ((q, qT, lq), (k, kT, lk)):
        for hh in range(h):
            for r0, r in row_tiles(n):
                t = tiles[i % 2]
                i += 1
                r16 = (r // HWDGE_ROWS) * HWDGE_ROWS
                if r16:
                    nc = r16 // HWDGE_ROWS
                    view = src[r0 : r0 + r16, hh, :].reshape_dim(0, (nc, HWDGE_ROWS)).permute((1, 0, 2))
                    nisa.dma_transpose(
                        dst=t[:d, :r16].reshape_dim(1, (nc, HWDGE_ROWS)), src=view, axes=(2, 1, 0)
                    )
                if r16 < r:  # a < 16-row tail: transpose the sequence's last 16 rows (2-D, 16 source rows)
                    a = r0 + r - HWDGE_ROWS
                    nisa.dma_transpose(
                        dst=t[:d, r - HWDGE_ROWS : r], src=src[a : a + HWDGE_ROWS, hh, :], axes=(1, 0)
                    )
                nisa.dma_copy(dst=dst[hh, :, r0 : r0 + r], src=t[:d, :r])
    for hh in range(h):
        nisa.dma_copy(dst=vh[hh], src=v[:, hh, :])
    return qT, kT, vh
