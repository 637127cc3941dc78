"""P^T and PV stage of the flash attention kernels (:mod:`nki_kernels.attention`,
:mod:`nki_kernels.attention_block_table`), standalone NKI 0.6 API, and the queue that software-pipelines it.

A *unit* is one TensorE-transposed key chunk or one DMA-transposed group of chunks (see
:func:`nki_kernels.attention_tiles.pair_plan`), a list of ``(ci, c0, kc, slot, col)``: chunk index, first key,
keys, slot in ``p_sb`` / ``pT_sb`` (``-1 - n`` for the n-th TensorE chunk of a ``_flash_rows`` call: P in
``p_pe[n % 2]``, P^T in ``pT_pe[n % 3]``, transposed through ``pT_ps[n % 2]``), alpha column.
"""

from __future__ import annotations

from typing import Any

from nki_kernels._nki import nisa, nl
from nki_kernels.hw_limits import HWDGE_ROWS, PMAX


def _pow2_pieces(n: int) -> list[tuple[int, int]]:
    """Split ``[0, n)`` into ``(start, size)`` pieces of at most 16 rows, sizes in {1, 2, 4, 8, 16}."""
    out = []
    r = 0
    while r < n:
        a = HWDGE_ROWS
        while a > n - r:
            a //= 2
        out.append((r, a))
        r += a
    return out


def _pe_transpose_p(pT_sb, pT_ps, p_sb, qr, kc, nv):
    """P^T of one chunk on TensorE: per 128-key block ``nc_transpose`` into PSUM ``pT_ps``, evicted to SBUF
    ``pT_sb`` by one VectorE ``tensor_copy`` of the first ``nv`` full blocks (issued as soon as their
    transposes are) and one ScalarE copy of the other full blocks; a partial last block (< 128 keys) is
    evicted on its own by ScalarE."""
    nfull = kc // PMAX
    nv = min(nv, nfull)
    for t in range(nfull):
        nisa.nc_transpose(pT_ps[:PMAX, t, :qr], p_sb[:qr, t * PMAX : (t + 1) * PMAX])
        if t == nv - 1:
            nisa.tensor_copy(pT_sb[:, :nv, :qr], pT_ps[:, :nv, :qr], engine=nisa.vector_engine)
    if nv < nfull:
        nisa.activation(pT_sb[:, nv:nfull, :qr], nl.copy, pT_ps[:, nv:nfull, :qr])
    kr = kc - nfull * PMAX
    if kr:
        nisa.nc_transpose(pT_ps[:kr, nfull, :qr], p_sb[:qr, nfull * PMAX : kc])
        nisa.activation(pT_sb[:kr, nfull, :qr], nl.copy, pT_ps[:kr, nfull, :qr])


def _pv_update(pv_ps, o_acc, pT_sb, v_sb, alpha, blk0, c0, kc, qr, dv, first):
    """``PV = sum_t P^T[blk0 + t]^T V[c0/128 + t]`` (one PSUM accumulation group over the chunk's 128-key
    blocks); returns the o update (``o = PV`` for the first chunk, else ``o = o * alpha + PV``, VectorE, fp32)
    as a function for the caller to issue now or later."""
    for t in range((kc + PMAX - 1) // PMAX):
        kr = min(PMAX, kc - t * PMAX)
        kt = (c0 + t * PMAX) // PMAX
        nisa.nc_matmul(
            pv_ps[:qr, :dv],
            stationary=pT_sb[:kr, blk0 + t, :qr],
            moving=v_sb[:kr, kt, :dv],
            accumulate=t > 0,
        )

    def update() -> None:
        if first:
            nisa.tensor_copy(o_acc[:qr], pv_ps[:qr, :dv], engine=nisa.vector_engine)
        else:
            nisa.scalar_tensor_tensor(o_acc[:qr], o_acc[:qr], nl.multiply, alpha, nl.add, pv_ps[:qr, :dv])

    return update


def _transpose_p_dma(pT_sb, p_sb, qr, nd):
    """P^T of a full chunk by SBUF->SBUF DMA in hardware-DGE-legal pieces: for each group of at most 16 query
    partitions (sizes in {1, 2, 4, 8, 16}), ``p_sb[q0:q0+A, nd blocks, 128 k] -> pT_sb[128 k, nd, q0:q0+A]``
    (3-D, permutation (2, 1, 0); ``(A * nd) % 16 == 0`` as nd = 16)."""
    for q0, a in _pow2_pieces(qr):
        nisa.dma_transpose(
            dst=pT_sb[:PMAX, :nd, q0 : q0 + a],
            src=p_sb[q0 : q0 + a, : nd * PMAX].reshape_dim(1, (nd, PMAX)),
            axes=(2, 1, 0),
        )


def _issue_p_transpose(unit, pT_sb, pT_pe, pT_ps, p_sb, p_pe, qr, nbc, nv_of):
    """P^T of one unit (:func:`nki_kernels.attention._flash_rows`): the n-th TensorE chunk ``[(ci, c0, kc,
    -1 - n, col)]`` (P in ``p_pe[n % 2]``, P^T to ``pT_pe[n % 3]`` through ``pT_ps[n % 2]``, ``nv_of(full
    blocks, n)`` of them evicted by VectorE) by :func:`_pe_transpose_p`, or
    a DMA group (slots >= 0 of ``p_sb``, in chunk order, P^T to ``pT_sb``) by :func:`_transpose_p_dma`."""
    slot = unit[0][3]
    if slot < 0:
        n = -1 - slot
        nv = nv_of(unit[0][2] // PMAX, n)
        _pe_transpose_p(pT_pe[n % len(pT_pe)], pT_ps[n % len(pT_ps)], p_pe[n % len(p_pe)], qr, unit[0][2], nv)
    else:
        _transpose_p_dma(pT_sb, p_sb, qr, len(unit) * nbc)


def _issue_pv(unit, aset, deferred, pv_ps, o_acc, pT_sb, pT_pe, v_sb, alpha, qr, dv, nbc):
    """PV matmuls and o updates of one unit's chunks (after :func:`_issue_p_transpose`), in chunk order; chunk
    ``ci`` accumulates in ``pv_ps[ci % 2]`` (the next chunk's PV does not wait for this chunk's o update).

    A TensorE unit's o update is appended to ``deferred`` (``(pv buffer, alpha set, issue)``, issued by
    :meth:`PvQueue.issue_deferred` after the next chunk's row max); a DMA group's are issued at once, after
    any deferred ones (the o updates keep the chunk order). Deferred updates reading the PSUM buffer a chunk's
    matmuls are about to overwrite are issued first."""
    defer = len(unit) == 1 and unit[0][3] < 0
    for ci, c0, kc, slot, col in unit:
        b = ci % 2
        _flush_deferred(deferred, lambda e, b=b: e[0] == b)
        src = pT_pe[(-1 - slot) % len(pT_pe)] if slot < 0 else pT_sb
        upd = _pv_update(
            pv_ps[b], o_acc, src, v_sb, alpha[:qr, col : col + 1], max(slot, 0) * nbc, c0, kc, qr, dv, ci == 0
        )
        if defer:
            deferred.append((b, aset, upd))
        else:
            _flush_deferred(deferred, lambda e: True)
            upd()


def _flush_deferred(deferred, pred) -> None:
    """Issue the deferred o updates up to the last one matching ``pred(entry)`` (in order)."""
    n = 1 + max((i for i, e in enumerate(deferred) if pred(e)), default=-1)
    for _, _, upd in deferred[:n]:
        upd()
    del deferred[:n]


PE_PV_DELAY = 2
"""Key chunks a TensorE-transposed chunk's PV matmuls wait after its transposes are issued: per chunk c the
program issues ``QK(c)``, max / exp of c, ``P^T(c-1)`` with its evictions, then ``PV(c-3)``. With a delay of 1
(``PV(c-2)``) the in-order engines form a loop-carried chain ScalarE eviction -> PV -> QK -> VectorE max ->
ScalarE exp -> eviction over two chunks (~4.2 us, above two VectorE-bound chunk periods); over three chunks it
has slack. Needs three ``pT_pe`` tiles (P^T of c-3, c-2 and c-1 are live)."""

DMA_PV_DELAY = 2
"""Key chunks a DMA-transposed group's PV matmuls (and every later unit's, the o updates keep the chunk order)
wait after its transposes are issued, so the in-order TensorE / VectorE queues keep working on the next
chunks' scores while the DMA runs (modelled; see docs/kernels/attention.md)."""

ALPHA_SETS = DMA_PV_DELAY + 3
"""Sets of alpha columns (one column per chunk of a unit): a unit's set is reused only after its PV and its
(possibly deferred) o update."""


class PvQueue:
    """Units whose P^T is issued and whose PV matmuls / o updates are not, in chunk order (the o updates must
    keep it: ``o = o * alpha + PV`` is not associative in fp32). Holds the tiles of one query tile's PV stage.

    ``push`` records a unit with the chunk index from which its PV may be issued; ``issue_ready(ci)`` issues
    the units due by chunk ``ci``; ``flush_until(pred)`` issues every unit up to the last one matching
    ``pred(alpha_set, unit)`` (a P^T tile about to be rewritten); ``flush_alpha(set)`` also issues the
    deferred o updates reading that alpha set. A TensorE unit's o update is deferred (``deferred``, a list
    shared by the queues of consecutive tiles) until ``issue_deferred``, so VectorE reduces the next chunk's
    max first.
    """

    def __init__(self, pv_ps, o_acc, pT_sb, pT_pe, v_sb, alpha, qr, dv, nbc, deferred=None):
        self._args = (pv_ps, o_acc, pT_sb, pT_pe, v_sb, alpha, qr, dv, nbc)
        self._q: list[tuple[int, int, list[tuple[int, int, int, int, int]]]] = []
        # deferred o updates (pv buffer, alpha set, issue), shared by the queues of consecutive tiles
        self._deferred: list[Any] = [] if deferred is None else deferred

    def push(self, ready_ci: int, alpha_set: int, unit: list[tuple[int, int, int, int, int]]) -> None:
        self._q.append((ready_ci, alpha_set, unit))

    def _issue(self, n: int) -> None:
        for _, st, u in self._q[:n]:
            _issue_pv(u, st, self._deferred, *self._args)
        del self._q[:n]

    def pending(self) -> int:
        """Units queued and not issued."""
        return len(self._q)

    def issue_ready(self, ci: int) -> None:
        n = 0
        while n < len(self._q) and self._q[n][0] <= ci:
            n += 1
        self._issue(n)

    def issue_deferred(self) -> None:
        """Issue every deferred o update (of any queue sharing the list)."""
        _flush_deferred(self._deferred, lambda e: True)

    def flush_until(self, pred: Any) -> None:
        self._issue(1 + max((i for i, (_, st, u) in enumerate(self._q) if pred(st, u)), default=-1))

    def flush_alpha(self, aset: int) -> None:
        """Before alpha set ``aset`` is rewritten: issue the units and deferred o updates that read it."""
        self.flush_until(lambda st, u: st == aset)
        _flush_deferred(self._deferred, lambda e: e[1] == aset)


def free_p_tile(queues, slot, npt):
    """Before the P^T tile of ``slot`` is rewritten (``-1 - n``: the n-th TensorE chunk's ``pT_pe[n % npt]``;
    ``>= 0``: the DMA group tile ``pT_sb``): issue, on every queue of ``queues``, the queued units up to the
    last one still reading that tile."""

    def same_tile(st: int, u: list) -> bool:
        s = u[0][3]
        return (s < 0 and (-1 - s) % npt == (-1 - slot) % npt) if slot < 0 else s >= 0

    for qu in queues:
        qu.flush_until(same_tile)


def _transpose_unit(unit, queues, ci, alpha_set, w, qr, nbc, nv_of):
    """Issue the P^T of ``unit`` (completed by chunk ``ci - 1``) and queue its PV on ``queues[0]``: due at
    chunk ``ci`` + :data:`PE_PV_DELAY` for a TensorE chunk, + :data:`DMA_PV_DELAY` for a DMA group. A unit
    queued on any of ``queues`` still reading the same P^T tile (``pT_pe[n % 3]`` or ``pT_sb``) is issued
    first."""
    slot = unit[0][3]
    free_p_tile(queues, slot, len(w["pT_pe"]))
    _issue_p_transpose(unit, w["pT_sb"], w["pT_pe"], w["pT_ps"], w["p_sb"], w["p_pe"], qr, nbc, nv_of)
    queues[0].push(ci + (PE_PV_DELAY if slot < 0 else DMA_PV_DELAY), alpha_set, list(unit))


class _Tail:
    """A finished query tile whose last P^T / PV / o updates and store are still to issue: they are
    interleaved with the next tile's first chunks (the in-order engines do not drain at tile boundaries)."""

    def __init__(self, queue, done, aset, q0, qr, o_acc, nm, nchunks):
        self.queue, self.done, self.aset = queue, done, aset
        self.q0, self.qr, self.o_acc, self.nm, self.nchunks = q0, qr, o_acc, nm, nchunks
