"""The block-table kernel's K/V as a chunk stream (:class:`BlockTableStream`, standalone NKI 0.6 API) for the
streaming static pass (:mod:`nki_kernels.attention_stream`).

Key position ``j`` of a group belongs to entry ``n = j // T`` (row ``j - n*T`` of the block the entry names,
:mod:`nki_kernels.attention_block_table`). A 1024-key chunk ``[c0, c0 + kc)`` meets one or more entries; per
entry piece and per source, the rows are moved by runtime-offset ``dma_copy`` (``scalar_offset`` = the
entry's token offset for that source, ``oob_mode=skip``: exactly one source moves data, none for an empty
entry) straight to their chunk positions: V into the slot's ``[128, 8, D + 1]`` tile (key ``j`` at partition
``j % 128``, tile ``(j - c0) // 128``; rows of empty entries stay zero, column D = the group's valid
column), K into a staging tile of the same layout. :meth:`BlockTableStream.finish` (issued a chunk later)
transposes the staging on TensorE (``nc_transpose`` per 128 keys into one PSUM bank) and evicts K^T with
one VectorE copy: no SBUF->SBUF DMA transposes (their price is unmeasured, 12.5-50 % of copy speed), and the
DMAs are plain copies of 2*D-byte rows."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nki_kernels._nki import nisa, nl
from nki_kernels.attention_stream import NB, KvStream
from nki_kernels.attention_tiles import KC_TWO_BYTE
from nki_kernels.hw_limits import PMAX


def chunk_pieces(c0: int, kc: int, t: int) -> list[tuple[int, int, int, int, int, int]]:
    """The entry pieces of chunk ``[c0, c0 + kc)`` (``c0`` a multiple of 128) for blocks of ``t`` keys:
    ``(entry, tile, p0, rows, ntiles, row)``: rows ``[row, row + rows * max(ntiles, 1))`` of the entry's
    block go to chunk-local tile ``tile`` (partitions ``p0 .. p0 + rows``) when ``ntiles == 0``, else to
    ``ntiles`` full 128-row tiles from ``tile`` on (``p0 == 0``, ``rows == 128``)."""
    out = []
    for e in range(c0 // t, (c0 + kc - 1) // t + 1):
        j, end = max(c0, e * t), min(c0 + kc, (e + 1) * t)
        while j < end:
            tg, p = divmod(j, PMAX)
            if p == 0 and end - j >= PMAX:
                nt = (end - j) // PMAX
                out.append((e, tg - c0 // PMAX, 0, PMAX, nt, j - e * t))
                j += nt * PMAX
            else:
                n = min(PMAX - p, end - j)
                out.append((e, tg - c0 // PMAX, p, n, 0, j - e * t))
                j += n
    return out


class BlockTableStream(KvStream):
    """K/V of one (b, h, group) of the block table, ``lk = NB * T`` key positions (module docstring).

    ``offs`` = the group's ``(k_tok, v_tok, vcol)`` from
    :func:`nki_kernels.attention_block_table._offset_tiles`; ``resident`` loads the whole group's K^T / V
    (the guard's recompute: ``nki_kernels.attention_block_table._load_group`` into tiles of its own)."""

    def __init__(
        self, k_sources: list, v_sources: list, offs: Any, b: int, h: int, t: int, d: int, dt: Any,
        resident: Callable[[], tuple[Any, Any]],
    ) -> None:  # fmt: skip
        super().__init__(offs[0][0].shape[1] * t, d, dt)
        self.k_sources, self.v_sources, self.offs, self.b, self.h, self.t = (
            k_sources,
            v_sources,
            offs,
            b,
            h,
            t,
        )
        self._resident = resident
        self.kT_ps = nl.ndarray((d, KC_TWO_BYTE), dtype=dt, buffer=nl.psum)

    def slot(self) -> dict[str, Any]:
        k_st = nl.ndarray((PMAX, NB, self.d), dtype=self.dt, buffer=nl.sbuf)
        nisa.memset(k_st, 0.0, engine=nisa.gpsimd_engine)  # an all-empty group transposes it: keep finite
        return {
            "kT": nl.ndarray((self.d, KC_TWO_BYTE), dtype=self.dt, buffer=nl.sbuf),
            "v": nl.ndarray((PMAX, NB, self.d + 1), dtype=self.dt, buffer=nl.sbuf),
            "k_st": k_st,
        }

    def issue(self, chunk: tuple[int, int], slot: dict[str, Any]) -> None:
        c0, kc = chunk
        d, v, k_st = self.d, slot["v"], slot["k_st"]
        k_tok, v_tok, vcol = self.offs
        nbk = (kc + PMAX - 1) // PMAX
        nisa.memset(v[:, :, :d], 0.0, engine=nisa.gpsimd_engine)  # rows of empty entries stay zero
        t0 = c0 // PMAX
        nisa.tensor_copy(v[:, :nbk, d : d + 1], vcol[:, t0 : t0 + nbk], engine=nisa.gpsimd_engine)
        for e, tile, p0, rows, nt, row in chunk_pieces(c0, kc, self.t):
            for s, (kb, vb) in enumerate(zip(self.k_sources, self.v_sources)):
                _, S, H, _ = kb.shape
                hd = H * d
                at = self.b * S * hd + self.h * d + row * hd
                for buf, tok, dst in ((vb, v_tok[s], v), (kb, k_tok[s], k_st)):
                    if nt:
                        src = buf.ap([[hd, PMAX], [PMAX * hd, nt], [1, d]], offset=at,
                                     scalar_offset=tok[0:1, e : e + 1], indirect_dim=1)  # fmt: skip
                        nisa.dma_copy(dst=dst[:, tile : tile + nt, :d], src=src, oob_mode=nisa.oob_mode.skip)
                    else:
                        src = buf.ap([[hd, rows], [1, d]], offset=at, scalar_offset=tok[0:1, e : e + 1],
                                     indirect_dim=1)  # fmt: skip
                        nisa.dma_copy(dst=dst[p0 : p0 + rows, tile, :d], src=src, oob_mode=nisa.oob_mode.skip)

    def finish(self, chunk: tuple[int, int], slot: dict[str, Any]) -> None:
        """K^T of the chunk: a TensorE transpose per 128 staged keys into ``kT_ps``, one VectorE copy out."""
        _, kc = chunk
        d, k_st, ps = self.d, slot["k_st"], self.kT_ps
        for u in range((kc + PMAX - 1) // PMAX):
            rows = min(PMAX, kc - u * PMAX)
            nisa.nc_transpose(ps[:d, u * PMAX : u * PMAX + rows], k_st[:rows, u, :d])
        nisa.tensor_copy(slot["kT"][:d, :kc], ps[:d, :kc], engine=nisa.vector_engine)

    def resident(self) -> tuple[Any, Any]:
        return self._resident()
