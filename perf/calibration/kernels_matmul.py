"""Matmul calibration kernels: re-implementations (NKI 0.6 API) of published trn2 matmul kernels.

Every kernel computes ``result[M, N] = lhsT[K, M].T @ rhs[K, N]`` with 128 x 128 stationary and
128 x 512 moving tiles, fp32 PSUM accumulation.  They are written from the public *descriptions* of the
published kernels (see ``docs/calibration.md`` for sources and the measured times) so that the cost model
can be checked against the published trn2 measurements; none is a production kernel.

* :func:`agentic_v0_kernel`, :func:`agentic_v1_kernel`, :func:`agentic_v2_kernel`: the naive / blocked /
  row-load bf16 matmuls of the AWS ``neuron-agentic-development`` profile-querying example (V0-V2).
* :func:`mixed_tiles_kernel`: 4 sections of back-to-back ``nc_matmul`` with M=32, N=64, K=32 and full
  tiles (the TE-inefficiency investigation of the same repository).
* :func:`sdk_tiled_kernel`, :func:`sdk_hoisted_kernel`, :func:`sdk_blocked_mn_kernel`,
  :func:`sdk_blocked_mnk_kernel`: the fp32 versions of the Neuron SDK "kernel optimization" tutorial.
* :func:`agentic_transpose_kernel`: the 2048^3 bf16 tiled matmul of the same repository's
  redundant-TE-transposes investigation, V0 (``A[M, K]`` transposed tile by tile on TensorE) and V1
  (``lhsT`` given pre-transposed).

Layouts: ``lhsT`` ``[K, M]`` and ``rhs`` ``[K, N]`` row-major HBM, same dtype (bf16 for the agentic set,
fp32 for the SDK set); result ``[M, N]`` in ``shared_hbm``.  Limits are checked by the kernels' own
asserts-as-errors (multiples of the tile / block sizes).
"""

from __future__ import annotations

from typing import Any

from nki_kernels._nki import nisa, nl

__all__ = [
    "TILE_K",
    "TILE_M",
    "TILE_N",
    "agentic_v0_kernel",
    "agentic_v1_kernel",
    "agentic_v2_kernel",
    "agentic_transpose_kernel",
    "mixed_tiles_kernel",
    "sdk_tiled_kernel",
    "sdk_hoisted_kernel",
    "sdk_blocked_mn_kernel",
    "sdk_blocked_mnk_kernel",
    "v0_lhst_groups",
]

TILE_M = 128
"""Stationary free size (``nl.tile_size.gemm_stationary_fmax``)."""
TILE_K = 128
"""Contraction tile = partitions (``nl.tile_size.pmax``)."""
TILE_N = 512
"""Moving free size (``nl.tile_size.gemm_moving_fmax``)."""


def _dims(lhsT: Any, rhs: Any, bm: int = TILE_M, bn: int = TILE_N, bk: int = TILE_K) -> tuple[int, int, int]:
    K, M = lhsT.shape
    K2, N = rhs.shape
    if K != K2:
        raise ValueError(f"lhsT{list(lhsT.shape)} and rhs{list(rhs.shape)} must share the contraction dim K")
    for name, v, b in (("M", M, bm), ("N", N, bn), ("K", K, bk)):
        if v % b:
            raise ValueError(f"{name}={v} must be a multiple of {b}")
    return K, M, N


def v0_lhst_groups(n_tiles: int, loads: int) -> list[int]:
    """First n-index of each group of n-iterations that shares one load of an lhsT tile (pure).

    ``n_tiles`` n-iterations split into ``loads`` groups as evenly as possible, larger groups first:
    ``v0_lhst_groups(8, 3) == [0, 3, 6]``.  ``loads`` is clamped to ``[1, n_tiles]``.
    """
    if n_tiles < 1:
        raise ValueError(f"v0_lhst_groups: n_tiles must be >= 1, got {n_tiles}")
    g = max(1, min(loads, n_tiles))
    base, extra = divmod(n_tiles, g)
    starts, s = [], 0
    for i in range(g):
        starts.append(s)
        s += base + (1 if i < extra else 0)
    return starts


def _evict_store(result: Any, acc: Any, m0: int, n0: int, dtype: Any) -> None:
    """PSUM tile -> SBUF (VectorE copy, cast to ``dtype``) -> HBM ``result[m0:, n0:]``."""
    p, f = acc.shape
    sb = nl.ndarray((p, f), dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=sb, src=acc)
    nisa.dma_copy(dst=result[m0 : m0 + p, n0 : n0 + f], src=sb)


def agentic_v0_kernel(lhsT: Any, rhs: Any, lhst_loads: int = 3) -> Any:
    """V0, naive tiling: for every (m, n, k) load the rhs tile [128, 512] and multiply; bf16 out.

    As written, the published V0 loads both tiles per (m, n, k); its profile shows rhs loaded 32x (as
    written) but lhsT only 3x instead of N/512 = 8x: the compiler kept lhsT tiles across n-iterations.
    This re-implementation models what was measured: the lhsT tile of (m, k) is loaded at the first n of
    each of ``lhst_loads`` groups of n-iterations (:func:`v0_lhst_groups`) and reused by the rest of the
    group, so the traffic matches the published 1,207,697,408 B within 0.03 %.
    """
    K, M, N = _dims(lhsT, rhs)
    result = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    starts = set(v0_lhst_groups(N // TILE_N, lhst_loads))
    for m in range(M // TILE_M):
        lhst_tiles: list[Any] = []
        for n in range(N // TILE_N):
            if n in starts:
                lhst_tiles = []
            acc = nl.ndarray((TILE_M, TILE_N), dtype=nl.float32, buffer=nl.psum)
            for k in range(K // TILE_K):
                if n in starts:
                    lt = nl.ndarray((TILE_K, TILE_M), dtype=lhsT.dtype, buffer=nl.sbuf)
                    nisa.dma_copy(
                        dst=lt, src=lhsT[k * TILE_K : (k + 1) * TILE_K, m * TILE_M : (m + 1) * TILE_M]
                    )
                    lhst_tiles.append(lt)
                rt = nl.ndarray((TILE_K, TILE_N), dtype=rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=rt, src=rhs[k * TILE_K : (k + 1) * TILE_K, n * TILE_N : (n + 1) * TILE_N])
                nisa.nc_matmul(dst=acc, stationary=lhst_tiles[k], moving=rt, accumulate=k > 0)
            _evict_store(result, acc, m * TILE_M, n * TILE_N, lhsT.dtype)
    return result


def _blocked(lhsT: Any, rhs: Any, bm: int, bn: int, row_loads: bool) -> Any:
    """V1 (per-tile loads) / V2 (row loads) body: lhsT block loaded once per M block, rhs block once per
    (M block, N block); every output tile accumulates over all of K in one PSUM bank."""
    block_m, block_n = bm * TILE_M, bn * TILE_N
    K, M, N = _dims(lhsT, rhs, block_m, block_n)
    nk = K // TILE_K
    result = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)

    def stat(tiles: list[Any], i: int, k: int) -> Any:
        return tiles[k][:, i * TILE_M : (i + 1) * TILE_M] if row_loads else tiles[i][k]

    def mov(tiles: list[Any], j: int, k: int) -> Any:
        return tiles[k][:, j * TILE_N : (j + 1) * TILE_N] if row_loads else tiles[j][k]

    for mb in range(M // block_m):
        m0 = mb * block_m
        lhst_tiles: list[Any] = []
        if row_loads:
            for k in range(nk):
                row = nl.ndarray((TILE_K, block_m), dtype=lhsT.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=row, src=lhsT[k * TILE_K : (k + 1) * TILE_K, m0 : m0 + block_m])
                lhst_tiles.append(row)
        else:
            for i in range(bm):
                col = []
                for k in range(nk):
                    t = nl.ndarray((TILE_K, TILE_M), dtype=lhsT.dtype, buffer=nl.sbuf)
                    c0 = m0 + i * TILE_M
                    nisa.dma_copy(dst=t, src=lhsT[k * TILE_K : (k + 1) * TILE_K, c0 : c0 + TILE_M])
                    col.append(t)
                lhst_tiles.append(col)
        for nb in range(N // block_n):
            n0 = nb * block_n
            rhs_tiles: list[Any] = []
            if row_loads:
                for k in range(nk):
                    row = nl.ndarray((TILE_K, block_n), dtype=rhs.dtype, buffer=nl.sbuf)
                    nisa.dma_copy(dst=row, src=rhs[k * TILE_K : (k + 1) * TILE_K, n0 : n0 + block_n])
                    rhs_tiles.append(row)
            else:
                for j in range(bn):
                    col = []
                    for k in range(nk):
                        t = nl.ndarray((TILE_K, TILE_N), dtype=rhs.dtype, buffer=nl.sbuf)
                        c0 = n0 + j * TILE_N
                        nisa.dma_copy(dst=t, src=rhs[k * TILE_K : (k + 1) * TILE_K, c0 : c0 + TILE_N])
                        col.append(t)
                    rhs_tiles.append(col)
            for i in range(bm):
                for j in range(bn):
                    acc = nl.ndarray((TILE_M, TILE_N), dtype=nl.float32, buffer=nl.psum)
                    for k in range(nk):
                        nisa.nc_matmul(
                            dst=acc, stationary=stat(lhst_tiles, i, k), moving=mov(rhs_tiles, j, k),
                            accumulate=k > 0,
                        )  # fmt: skip
                    _evict_store(result, acc, m0 + i * TILE_M, n0 + j * TILE_N, lhsT.dtype)
            rhs_tiles = []
    return result


def agentic_v1_kernel(lhsT: Any, rhs: Any, bm: int = 8, bn: int = 2) -> Any:
    """V1: blocked over M (``bm`` tiles) and N (``bn`` tiles), one DMA per [128,128] lhsT tile and per
    [128,512] rhs tile (256 B and 1 KiB per partition in bf16).  Traffic: lhsT 1x, rhs ``M/(128 bm)`` x."""
    return _blocked(lhsT, rhs, bm, bn, row_loads=False)


def agentic_v2_kernel(lhsT: Any, rhs: Any, bm: int = 8, bn: int = 2) -> Any:
    """V2: as V1 but one DMA per K tile loads a whole block row: lhsT ``[128, 128 bm]`` and rhs
    ``[128, 512 bn]`` (2 KiB per partition each at bm=8, bn=2 in bf16); matmuls slice the rows in SBUF."""
    return _blocked(lhsT, rhs, bm, bn, row_loads=True)


MIXED_SECTIONS: tuple[tuple[str, int, int, int], ...] = (
    ("M32", 128, 32, 512),
    ("N64", 128, 128, 64),
    ("K32", 32, 128, 512),
    ("full", 128, 128, 512),
)
"""(name, K, M, N) of the four sections of :func:`mixed_tiles_kernel`."""


def mixed_tiles_kernel(lhsT: Any, rhs: Any, reps: int = 512, sections: str = "mixed") -> Any:
    """``reps`` back-to-back ``nc_matmul`` per section on one resident stationary [128,128] and moving
    [128,512] tile (bf16): sections M=32, N=64, K=32 and full (``sections="mixed"``, 4 x reps matmuls) or
    all full tiles (``sections="full"``, 4 x reps full matmuls).  Each section accumulates into its own
    PSUM tile, which is evicted (fp32 -> bf16 on VectorE) and stored to its block of the ``[512, 512]``
    output: rows 128 s .. 128 s + M, columns 0 .. N of section s (the rest of the output is unused)."""
    if sections not in ("mixed", "full"):
        raise ValueError(f"mixed_tiles_kernel: sections must be 'mixed' or 'full', got {sections!r}")
    if reps < 1:
        raise ValueError(f"mixed_tiles_kernel: reps must be >= 1, got {reps}")
    _dims(lhsT, rhs)
    if tuple(lhsT.shape) != (TILE_K, TILE_M) or tuple(rhs.shape) != (TILE_K, TILE_N):
        raise ValueError(
            f"mixed_tiles_kernel: lhsT must be [128,128] and rhs [128,512], got {lhsT.shape}, {rhs.shape}"
        )
    secs = MIXED_SECTIONS if sections == "mixed" else tuple(("full", 128, 128, 512) for _ in range(4))
    result = nl.ndarray((4 * TILE_M, TILE_N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    stat = nl.ndarray((TILE_K, TILE_M), dtype=lhsT.dtype, buffer=nl.sbuf)
    movt = nl.ndarray((TILE_K, TILE_N), dtype=rhs.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=stat, src=lhsT)
    nisa.dma_copy(dst=movt, src=rhs)
    for s, (_, k, m, n) in enumerate(secs):
        acc = nl.ndarray((m, n), dtype=nl.float32, buffer=nl.psum)
        for r in range(reps):
            nisa.nc_matmul(dst=acc, stationary=stat[0:k, 0:m], moving=movt[0:k, 0:n], accumulate=r > 0)
        _evict_store(result, acc, s * TILE_M, 0, lhsT.dtype)
    return result


def sdk_tiled_kernel(lhsT: Any, rhs: Any) -> Any:
    """SDK tutorial "tiled": loads of the lhsT [128,128] and rhs [128,512] tiles for every (m, n, k);
    result dtype = input dtype (fp32 in the tutorial), eviction on VectorE."""
    K, M, N = _dims(lhsT, rhs)
    result = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m in range(M // TILE_M):
        for n in range(N // TILE_N):
            acc = nl.ndarray((TILE_M, TILE_N), dtype=nl.float32, buffer=nl.psum)
            for k in range(K // TILE_K):
                lt = nl.ndarray((TILE_K, TILE_M), dtype=lhsT.dtype, buffer=nl.sbuf)
                rt = nl.ndarray((TILE_K, TILE_N), dtype=rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=lt, src=lhsT[k * TILE_K : (k + 1) * TILE_K, m * TILE_M : (m + 1) * TILE_M])
                nisa.dma_copy(dst=rt, src=rhs[k * TILE_K : (k + 1) * TILE_K, n * TILE_N : (n + 1) * TILE_N])
                nisa.nc_matmul(dst=acc, stationary=lt, moving=rt, accumulate=k > 0)
            _evict_store(result, acc, m * TILE_M, n * TILE_N, lhsT.dtype)
    return result


def sdk_hoisted_kernel(lhsT: Any, rhs: Any) -> Any:
    """SDK tutorial "hoisted": the whole lhsT column (all K tiles) loaded once per m, the whole rhs column
    once per (m, n), then the K matmuls."""
    K, M, N = _dims(lhsT, rhs)
    nk = K // TILE_K
    result = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m in range(M // TILE_M):
        lhst_tiles = []
        for k in range(nk):
            lt = nl.ndarray((TILE_K, TILE_M), dtype=lhsT.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=lt, src=lhsT[k * TILE_K : (k + 1) * TILE_K, m * TILE_M : (m + 1) * TILE_M])
            lhst_tiles.append(lt)
        for n in range(N // TILE_N):
            rhs_tiles: list[Any] = []
            for k in range(nk):
                rt = nl.ndarray((TILE_K, TILE_N), dtype=rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=rt, src=rhs[k * TILE_K : (k + 1) * TILE_K, n * TILE_N : (n + 1) * TILE_N])
                rhs_tiles.append(rt)
            acc = nl.ndarray((TILE_M, TILE_N), dtype=nl.float32, buffer=nl.psum)
            for k in range(nk):
                nisa.nc_matmul(dst=acc, stationary=lhst_tiles[k], moving=rhs_tiles[k], accumulate=k > 0)
            _evict_store(result, acc, m * TILE_M, n * TILE_N, lhsT.dtype)
            rhs_tiles = []
    return result


def sdk_blocked_mn_kernel(lhsT: Any, rhs: Any, bm: int = 2, bn: int = 2) -> Any:
    """SDK tutorial "blocked M, N" (TILES_IN_BLOCK_M = N = 2): lhsT tiles of ``bm`` M tiles loaded once per
    M block, rhs tiles of ``bn`` N tiles once per (M block, N block), per-tile DMAs."""
    return _blocked(lhsT, rhs, bm, bn, row_loads=False)


def sdk_blocked_mnk_kernel(lhsT: Any, rhs: Any, bm: int = 16, bn: int = 2, bk: int = 8) -> Any:
    """SDK tutorial "blocked M, N, K" (16, 2, 8): per N block, fp32 SBUF accumulators for every output tile
    (memset 0); per K block the rhs rows [128, 512 bn] and, per M block, the lhsT rows [128, 128 bm] are
    loaded; each output tile's ``bk`` matmuls go to PSUM and are added into its SBUF accumulator
    (VectorE ``tensor_tensor``); finally the ``bn`` tiles of a row are packed (VectorE copies) and stored
    with one DMA of [128, 512 bn]."""
    block_m, block_n, block_k = bm * TILE_M, bn * TILE_N, bk * TILE_K
    K, M, N = _dims(lhsT, rhs, block_m, block_n, block_k)
    result = nl.ndarray((M, N), dtype=nl.float32, buffer=nl.shared_hbm)
    for nb in range(N // block_n):
        acc_sb = [
            [[nl.ndarray((TILE_M, TILE_N), dtype=lhsT.dtype, buffer=nl.sbuf) for _ in range(bn)]
             for _ in range(bm)]
            for _ in range(M // block_m)
        ]  # fmt: skip
        for blk in acc_sb:
            for row in blk:
                for t in row:
                    nisa.memset(dst=t, value=0.0)
        for kb in range(K // block_k):
            rhs_rows = []
            for r in range(bk):
                k0 = (kb * bk + r) * TILE_K
                row = nl.ndarray((TILE_K, block_n), dtype=rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=row, src=rhs[k0 : k0 + TILE_K, nb * block_n : (nb + 1) * block_n])
                rhs_rows.append(row)
            for mb in range(M // block_m):
                lhst_rows: list[Any] = []
                for r in range(bk):
                    k0 = (kb * bk + r) * TILE_K
                    row = nl.ndarray((TILE_K, block_m), dtype=lhsT.dtype, buffer=nl.sbuf)
                    nisa.dma_copy(dst=row, src=lhsT[k0 : k0 + TILE_K, mb * block_m : (mb + 1) * block_m])
                    lhst_rows.append(row)
                for j in range(bn):
                    for i in range(bm):
                        ps = nl.ndarray((TILE_M, TILE_N), dtype=nl.float32, buffer=nl.psum)
                        for r in range(bk):
                            nisa.nc_matmul(
                                dst=ps,
                                stationary=lhst_rows[r][:, i * TILE_M : (i + 1) * TILE_M],
                                moving=rhs_rows[r][:, j * TILE_N : (j + 1) * TILE_N],
                                accumulate=r > 0,
                            )
                        t = acc_sb[mb][i][j]
                        nisa.tensor_tensor(dst=t, data1=t, data2=ps, op=nl.add)
                lhst_rows = []
            rhs_rows = []
        for mb in range(M // block_m):
            for i in range(bm):
                packed = nl.ndarray((TILE_M, block_n), dtype=nl.float32, buffer=nl.sbuf)
                for j in range(bn):
                    nisa.tensor_copy(dst=packed[:, j * TILE_N : (j + 1) * TILE_N], src=acc_sb[mb][i][j])
                m0 = (mb * bm + i) * TILE_M
                nisa.dma_copy(dst=result[m0 : m0 + TILE_M, nb * block_n : (nb + 1) * block_n], src=packed)
        acc_sb = []
    return result


def agentic_transpose_kernel(
    lhs: Any, rhs: Any, transpose_lhs: bool = True, lhs_loads: int | None = None
) -> Any:
    """Tiled matmul with loads per (m, n, k) (loops m, n, k over 128 x 512 x 128 tiles), bf16.

    ``transpose_lhs=True`` (the investigation's V0): ``lhs`` is ``A[M, K]``; per (m, n, k) the ``A``
    tile ``[128 (m), 128 (k)]`` is loaded, transposed on TensorE (``nc_transpose`` into PSUM) and copied
    to SBUF as the stationary ``[128 (k), 128 (m)]`` tile.  ``transpose_lhs=False`` (V1): ``lhs`` is
    ``lhsT[K, M]`` and the stationary tile is loaded directly.  Then the rhs tile ``[128, 512]`` is
    loaded and multiplied into the (m, n) PSUM accumulator; after the K loop the accumulator is evicted
    (VectorE, fp32 -> input dtype) and stored.  Result ``[M, N]`` in ``shared_hbm``.

    ``lhs_loads`` (sensitivity only; ``None`` = as listed, one load per (m, n, k)): the ``lhs`` tile of
    (m, k) does not depend on n, so a compiler may keep it across n-iterations (as it kept 5 of 8 in the
    agentic V0 profile, :func:`agentic_v0_kernel`).  With ``lhs_loads`` in ``1 .. N/512`` the tile is loaded
    at the first n of each of ``lhs_loads`` groups of n-iterations (:func:`v0_lhst_groups`) and reused in
    the group; the transposes stay per (m, n, k) (the published 1,024 TRANSPOSE MATMULs)."""
    M, K = lhs.shape if transpose_lhs else lhs.shape[::-1]
    _dims(_Shape((K, M)), rhs)
    N = rhs.shape[1]
    n_tiles = N // TILE_N
    if lhs_loads is not None and (type(lhs_loads) is not int or not 1 <= lhs_loads <= n_tiles):
        raise ValueError(
            f"agentic_transpose_kernel: lhs_loads must be None or an int in 1..N/512 = {n_tiles}, "
            f"got {lhs_loads!r}"
        )
    starts = set(v0_lhst_groups(n_tiles, lhs_loads if lhs_loads is not None else n_tiles))
    result = nl.ndarray((M, N), dtype=lhs.dtype, buffer=nl.shared_hbm)
    for m in range(M // TILE_M):
        ms = slice(m * TILE_M, (m + 1) * TILE_M)
        held: list[Any] = []  # the lhs tiles of this m, per k, reused within a group of n-iterations
        for n in range(n_tiles):
            acc = nl.ndarray((TILE_M, TILE_N), dtype=nl.float32, buffer=nl.psum)
            for k in range(K // TILE_K):
                ks = slice(k * TILE_K, (k + 1) * TILE_K)
                if n in starts:
                    src = lhs[ms, ks] if transpose_lhs else lhs[ks, ms]
                    t = nl.ndarray(src.shape, dtype=lhs.dtype, buffer=nl.sbuf)
                    nisa.dma_copy(dst=t, src=src)
                    held[k : k + 1] = [t]
                if transpose_lhs:
                    lt = nl.ndarray((TILE_K, TILE_M), dtype=lhs.dtype, buffer=nl.sbuf)
                    tp = nl.ndarray((TILE_K, TILE_M), dtype=lhs.dtype, buffer=nl.psum)
                    nisa.nc_transpose(dst=tp, data=held[k])
                    nisa.tensor_copy(dst=lt, src=tp)
                else:
                    lt = held[k]
                rt = nl.ndarray((TILE_K, TILE_N), dtype=rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=rt, src=rhs[ks, n * TILE_N : (n + 1) * TILE_N])
                nisa.nc_matmul(dst=acc, stationary=lt, moving=rt, accumulate=k > 0)
            _evict_store(result, acc, m * TILE_M, n * TILE_N, lhs.dtype)
    return result


class _Shape:
    """A stand-in exposing only ``.shape`` (for :func:`_dims` on a transposed view's dimensions)."""

    def __init__(self, shape: tuple[int, int]) -> None:
        self.shape = shape
