"""Small calibration kernels (NKI 0.6 API): the CS149 assignment-4 part-1 kernels and micro-kernels that
isolate one hardware quantity each.

CS149 (Stanford, assignment 4 on trn2; written there in the legacy ``neuronxcc.nki`` API, re-written
here against NKI 0.6):

* :func:`vector_add_tiled_kernel`: ``out = a + b`` for 1-D fp32 vectors, ``row_chunk`` elements per
  iteration on ``row_chunk`` partitions: 2 loads ``[row_chunk, 1]``, a VectorE ``tensor_scalar`` add
  (``b`` as the per-partition scalar operand), 1 store.
* :func:`vector_add_stream_kernel`: the vectors viewed as ``[128, n / 128]``; per ``[128, free_dim]``
  tile 2 loads, a VectorE ``tensor_tensor`` add, 1 store.
* :func:`matrix_transpose_kernel`: per 128x128 tile: load, ``nc_transpose`` on TensorE into PSUM,
  PSUM -> SBUF copy, store to the transposed position.  The copy runs on ScalarE: the published profile
  of the default compile shows the [128,128] fp32 PSUM -> SBUF copy on ScalarE.

Micro-kernels (``reps`` repetitions of one pattern; the calibration harness takes the difference of
two ``reps`` so fixed costs cancel):

* :func:`matmul_chain_kernel`: back-to-back bf16 128x128x512 ``nc_matmul``.
* :func:`psum_evict_kernel`: PSUM -> SBUF copies (``[128,512]`` fp32 -> bf16 on VectorE, or
  ``[128,128]`` fp32 on ScalarE).
* :func:`pe_transpose_kernel`: fp32 128x128 ``nc_transpose`` on TensorE.
* :func:`dma_pairs_kernel`: tiny ``[1, 1]`` fp32 load + store pairs (per-DMA issue cost and the fixed
  per-kernel time as the intercept).
* :func:`dma_pattern_kernel`: queued HBM <-> SBUF copies of given tile shapes (DMA throughput by
  descriptor size).

Layouts: HBM inputs row-major; outputs in ``shared_hbm``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nki_kernels._nki import nisa, nl

__all__ = [
    "PMAX",
    "DmaCopySpec",
    "vector_add_tiled_kernel",
    "vector_add_stream_kernel",
    "matrix_transpose_kernel",
    "matmul_chain_kernel",
    "psum_evict_kernel",
    "pe_transpose_kernel",
    "dma_pairs_kernel",
    "dma_pattern_kernel",
]

PMAX = 128
"""Partitions (``nl.tile_size.pmax``)."""


def _check_reps(name: str, reps: int) -> None:
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"{name}: reps must be an int >= 1, got {reps!r}")


def vector_add_tiled_kernel(a_vec: Any, b_vec: Any, row_chunk: int = 128) -> Any:
    """``out[n] = a[n] + b[n]`` (1-D fp32 HBM vectors, ``n`` a multiple of ``row_chunk`` <= 128)."""
    (n,) = a_vec.shape
    if tuple(b_vec.shape) != (n,):
        raise ValueError(f"vector_add_tiled: b_vec shape {b_vec.shape} must equal a_vec shape {a_vec.shape}")
    if not 1 <= row_chunk <= PMAX or n % row_chunk:
        raise ValueError(f"vector_add_tiled: row_chunk must be in [1, 128] and divide n={n}, got {row_chunk}")
    out = nl.ndarray((n,), dtype=a_vec.dtype, buffer=nl.shared_hbm)
    for m in range(n // row_chunk):
        sl = slice(m * row_chunk, (m + 1) * row_chunk)
        a_t = nl.ndarray((row_chunk, 1), dtype=a_vec.dtype, buffer=nl.sbuf)
        b_t = nl.ndarray((row_chunk, 1), dtype=b_vec.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=a_t, src=a_vec[sl])
        nisa.dma_copy(dst=b_t, src=b_vec[sl])
        res = nl.ndarray((row_chunk, 1), dtype=a_vec.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=res, data=a_t, op0=nl.add, operand0=b_t)
        nisa.dma_copy(dst=out[sl], src=res)
    return out


def vector_add_stream_kernel(a_vec: Any, b_vec: Any, free_dim: int = 200) -> Any:
    """``out = a + b`` with the 1-D vectors viewed as ``[128, n/128]`` (partition p holds elements
    ``p*n/128 ...``), processed in ``[128, free_dim]`` tiles; ``n`` a multiple of ``128 * free_dim``."""
    (n,) = a_vec.shape
    if tuple(b_vec.shape) != (n,):
        raise ValueError(f"vector_add_stream: b_vec shape {b_vec.shape} must equal a_vec shape {a_vec.shape}")
    if free_dim < 1 or n % (PMAX * free_dim):
        raise ValueError(f"vector_add_stream: n={n} must be a multiple of 128 * free_dim ({free_dim})")
    cols = n // PMAX
    a2 = a_vec.reshape((PMAX, cols))
    b2 = b_vec.reshape((PMAX, cols))
    out = nl.ndarray((PMAX, cols), dtype=a_vec.dtype, buffer=nl.shared_hbm)
    for m in range(cols // free_dim):
        c = slice(m * free_dim, (m + 1) * free_dim)
        a_t = nl.ndarray((PMAX, free_dim), dtype=a_vec.dtype, buffer=nl.sbuf)
        b_t = nl.ndarray((PMAX, free_dim), dtype=b_vec.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=a_t, src=a2[:, c])
        nisa.dma_copy(dst=b_t, src=b2[:, c])
        res = nl.ndarray((PMAX, free_dim), dtype=a_vec.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=res, data1=a_t, data2=b_t, op=nl.add)
        nisa.dma_copy(dst=out[:, c], src=res)
    return out


def matrix_transpose_kernel(a: Any, copy_engine: str = "scalar") -> Any:
    """``out[N, M] = a[M, N].T`` (fp32, M and N multiples of 128), tile by tile through TensorE.

    ``copy_engine``: ``"scalar"`` (what the published profile shows) or ``"vector"`` for the PSUM -> SBUF
    copy."""
    M, N = a.shape
    if M % PMAX or N % PMAX:
        raise ValueError(f"matrix_transpose: both dims must be multiples of 128, got {list(a.shape)}")
    engines = {"scalar": nisa.scalar_engine, "vector": nisa.vector_engine}
    if copy_engine not in engines:
        raise ValueError(f"matrix_transpose: copy_engine must be 'scalar' or 'vector', got {copy_engine!r}")
    out = nl.ndarray((N, M), dtype=a.dtype, buffer=nl.shared_hbm)
    for i in range(M // PMAX):
        for j in range(N // PMAX):
            t = nl.ndarray((PMAX, PMAX), dtype=a.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=a[i * PMAX : (i + 1) * PMAX, j * PMAX : (j + 1) * PMAX])
            tp = nl.ndarray((PMAX, PMAX), dtype=a.dtype, buffer=nl.psum)
            nisa.nc_transpose(dst=tp, data=t)
            ts = nl.ndarray((PMAX, PMAX), dtype=a.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=ts, src=tp, engine=engines[copy_engine])
            nisa.dma_copy(dst=out[j * PMAX : (j + 1) * PMAX, i * PMAX : (i + 1) * PMAX], src=ts)
    return out


def matmul_chain_kernel(lhsT: Any, rhs: Any, reps: int = 1) -> Any:
    """``reps`` back-to-back ``nc_matmul`` of the resident ``lhsT [128,128]`` x ``rhs [128,512]`` tiles
    accumulating in one PSUM bank; out ``[128, 512]`` = ``reps * lhsT.T @ rhs`` (dtype of the inputs)."""
    _check_reps("matmul_chain", reps)
    if tuple(lhsT.shape) != (PMAX, PMAX) or tuple(rhs.shape) != (PMAX, 512):
        raise ValueError(
            f"matmul_chain: lhsT must be [128,128], rhs [128,512], got {lhsT.shape}, {rhs.shape}"
        )
    out = nl.ndarray((PMAX, 512), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    st = nl.ndarray((PMAX, PMAX), dtype=lhsT.dtype, buffer=nl.sbuf)
    mv = nl.ndarray((PMAX, 512), dtype=rhs.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=st, src=lhsT)
    nisa.dma_copy(dst=mv, src=rhs)
    acc = nl.ndarray((PMAX, 512), dtype=nl.float32, buffer=nl.psum)
    for r in range(reps):
        nisa.nc_matmul(dst=acc, stationary=st, moving=mv, accumulate=r > 0)
    sb = nl.ndarray((PMAX, 512), dtype=lhsT.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=sb, src=acc)
    nisa.dma_copy(dst=out, src=sb)
    return out


def psum_evict_kernel(x: Any, reps: int = 1, engine: str = "vector", out_dtype: Any = None) -> Any:
    """``x [128, F]`` fp32 is loaded and moved into PSUM once (ScalarE copy), then copied PSUM -> SBUF
    ``reps`` times on ``engine`` (``"vector"`` or ``"scalar"``) casting to ``out_dtype`` (default fp32);
    out ``[128, F]`` = ``x`` cast.  F <= 512 (one PSUM bank)."""
    _check_reps("psum_evict", reps)
    p, f = x.shape
    if p != PMAX or not 1 <= f <= 512:
        raise ValueError(f"psum_evict: x must be [128, F<=512], got {list(x.shape)}")
    engines = {"scalar": nisa.scalar_engine, "vector": nisa.vector_engine}
    if engine not in engines:
        raise ValueError(f"psum_evict: engine must be 'vector' or 'scalar', got {engine!r}")
    odt = out_dtype if out_dtype is not None else x.dtype
    out = nl.ndarray((p, f), dtype=odt, buffer=nl.shared_hbm)
    xs = nl.ndarray((p, f), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=xs, src=x)
    ps = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.psum)
    nisa.tensor_copy(dst=ps, src=xs, engine=nisa.scalar_engine)
    sb = nl.ndarray((p, f), dtype=odt, buffer=nl.sbuf)
    for _ in range(reps):
        nisa.tensor_copy(dst=sb, src=ps, engine=engines[engine])
    nisa.dma_copy(dst=out, src=sb)
    return out


def pe_transpose_kernel(x: Any, reps: int = 1) -> Any:
    """``reps`` TensorE ``nc_transpose`` of the resident ``x [128, 128]`` (fp32) into one PSUM tile, one
    ScalarE copy out; out = ``x.T``."""
    _check_reps("pe_transpose", reps)
    if tuple(x.shape) != (PMAX, PMAX):
        raise ValueError(f"pe_transpose: x must be [128, 128], got {list(x.shape)}")
    out = nl.ndarray((PMAX, PMAX), dtype=x.dtype, buffer=nl.shared_hbm)
    xs = nl.ndarray((PMAX, PMAX), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=xs, src=x)
    tp = nl.ndarray((PMAX, PMAX), dtype=x.dtype, buffer=nl.psum)
    for _ in range(reps):
        nisa.nc_transpose(dst=tp, data=xs)
    sb = nl.ndarray((PMAX, PMAX), dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=sb, src=tp, engine=nisa.scalar_engine)
    nisa.dma_copy(dst=out, src=sb)
    return out


def dma_pairs_kernel(x: Any, reps: int = 1) -> Any:
    """``reps`` independent pairs (load ``x[i]`` into a ``[1, 1]`` SBUF tile, store it to ``out[i]``);
    ``x`` 1-D with at least ``reps`` elements; out ``[reps]`` = ``x[:reps]``."""
    _check_reps("dma_pairs", reps)
    (n,) = x.shape
    if n < reps:
        raise ValueError(f"dma_pairs: x needs at least reps={reps} elements, got {n}")
    out = nl.ndarray((reps,), dtype=x.dtype, buffer=nl.shared_hbm)
    for i in range(reps):
        t = nl.ndarray((1, 1), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[i : i + 1])
        nisa.dma_copy(dst=out[i : i + 1], src=t)
    return out


DmaCopySpec = tuple[str, int, int]
"""``(direction, count, free)`` of :func:`dma_pattern_kernel`: ``direction`` ``"load"`` or ``"store"``,
``count`` copies per repetition, each ``[128, free]`` elements."""


def dma_pattern_kernel(x: Any, pattern: Sequence[DmaCopySpec], reps: int = 1) -> Any:
    """``reps`` repetitions of the queued copies in ``pattern`` between HBM ``x [128, W]`` and SBUF.

    Each load copies the next ``[128, free]`` column block of ``x`` (wrapping around) into a fresh SBUF
    tile; each store copies the most recently loaded tile whose width is at least ``free`` (its first
    ``free`` columns) into the next column block of the ``[128, W]`` output.  One descriptor per partition
    of ``free * itemsize`` bytes (rows of ``x`` are longer than ``free``).  Every store needs an earlier
    load in the same repetition with ``free`` at least as large.  The output is meaningful only where a
    store wrote it (tests compare those blocks)."""
    _check_reps("dma_pattern", reps)
    p, w = x.shape
    if p != PMAX:
        raise ValueError(f"dma_pattern: x must have 128 rows, got {list(x.shape)}")
    for d, c, f in pattern:
        if d not in ("load", "store") or c < 1 or not 1 <= f <= w:
            raise ValueError(
                f"dma_pattern: bad pattern entry {(d, c, f)} "
                f"(direction load|store, count >= 1, 1 <= free <= {w})"
            )
    out = nl.ndarray((p, w), dtype=x.dtype, buffer=nl.shared_hbm)
    col_in = col_out = 0
    for _ in range(reps):
        loaded: list[Any] = []
        for d, c, f in pattern:
            for _ in range(c):
                if d == "load":
                    if col_in + f > w:
                        col_in = 0
                    t = nl.ndarray((p, f), dtype=x.dtype, buffer=nl.sbuf)
                    nisa.dma_copy(dst=t, src=x[:, col_in : col_in + f])
                    col_in += f
                    loaded.append(t)
                else:
                    src = next((t for t in reversed(loaded) if t.shape[1] >= f), None)
                    if src is None:
                        raise ValueError(
                            f"dma_pattern: store of free={f} has no earlier load at least that wide"
                        )
                    if col_out + f > w:
                        col_out = 0
                    nisa.dma_copy(dst=out[:, col_out : col_out + f], src=src[:, 0:f])
                    col_out += f
    return out
