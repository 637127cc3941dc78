"""Published trn2 points of small kernels: the CS149 assignment's vector adds and transposes (benchmark
and profile figures), per-instruction and fixed costs, and queued DMA throughput by descriptor size.
Types and sources: :mod:`perf.calibration.point_defs`; every point: :data:`perf.calibration.points.POINTS`.
"""

from __future__ import annotations

from perf.calibration.point_defs import (
    AGENTIC,
    AGENTIC_DMA,
    CS149,
    CS149_PROF_FD1K,
    CS149_PROF_FD2K,
    CS149_PROF_TRANSPOSE,
    CS149_PROFILE,
    Point,
    Source,
)
from perf.calibration.point_defs import bf16_arg as _bf
from perf.calibration.point_defs import f32_arg as _f32
from perf.calibration.point_defs import kernel_run as _run
from perf.calibration.point_defs import run_pair as _pair
from perf.calibration.point_defs import us_from_gbps as _us

__all__ = ["SMALL_POINTS"]

_VEC = (_f32((25600,)), _f32((25600,)))


def _dma_point(name: str, desc: str, src: Source, x: tuple, pattern: tuple, reps: int, nbytes: int,
               rate: tuple[float, float], published: str, how: str,
               dge_mode: str | None = None) -> Point:  # fmt: skip
    return Point(
        name=name,
        kernel=f"queued DMAs, {desc}",
        source=src,
        shape=f"{reps} x (" + " + ".join(f"{c} {d} [128,{f}]" for d, c, f in pattern) + f") {x[1]}",
        measured_us=_us(nbytes, *rate),
        published=published,
        quantity=f"DMA-active time of {nbytes:,} B (bytes / published achieved GB/s)",
        method="slope",
        runs=_pair("dma_pattern", (x,), reps // 2, reps, pattern=pattern),
        units=reps,
        how=how,
        group="D",
        dge_mode=dge_mode,
    )


SMALL_POINTS: tuple[Point, ...] = (
    # ------------------------------------------------------------------ C: CS149 assignment 4 part 1
    Point(
        "cs149_tiled_rc1",
        "vector_add_tiled ROW_CHUNK=1",
        CS149,
        "n=25,600 fp32",
        (37318.0, 37318.0),
        "37,318 us (NCL p99)",
        "benchmark nc_latency (whole kernel)",
        "latency",
        (_run("vector_add_tiled", *_VEC, row_chunk=1),),
        how="per element: 2 loads [1,1], VectorE tensor_scalar add, 1 store",
        group="C",
    ),
    Point(
        "cs149_tiled_rc128",
        "vector_add_tiled ROW_CHUNK=128",
        CS149,
        "n=25,600 fp32",
        (378.0, 378.0),
        "378 us (NCL p99)",
        "benchmark nc_latency (whole kernel)",
        "latency",
        (_run("vector_add_tiled", *_VEC, row_chunk=128),),
        how="200 x: 2 loads [128,1], tensor_scalar add, store",
        group="C",
    ),
    Point(
        "cs149_stream_fd2",
        "vector_add_stream FREE_DIM=2",
        CS149,
        "n=25,600 fp32",
        (186.0, 186.0),
        "186 us (NCL p99)",
        "benchmark nc_latency (whole kernel)",
        "latency",
        (_run("vector_add_stream", *_VEC, free_dim=2),),
        how="100 x [128,2] tiles: 2 loads, VectorE tensor_tensor add, store",
        group="C",
    ),
    Point(
        "cs149_stream_fd200",
        "vector_add_stream FREE_DIM=200",
        CS149,
        "n=25,600 fp32",
        (15.0, 15.0),
        "15 us (NCL p99)",
        "benchmark nc_latency (whole kernel)",
        "latency",
        (_run("vector_add_stream", *_VEC, free_dim=200),),
        how="one [128,200] tile: 2 loads, tensor_tensor add, store",
        group="C",
    ),
    Point(
        "cs149_transpose",
        "matrix_transpose on PE, default compile",
        CS149,
        "1024x1024 fp32",
        (86.0, 86.0),
        "86 us",
        "benchmark nc_latency (whole kernel)",
        "latency",
        (_run("matrix_transpose", _f32((1024, 1024))),),
        how="64 x: load [128,128], nc_transpose (PE) into PSUM, ScalarE copy to SBUF, store",
        group="C",
    ),
    # ------------------------------------------------------------------ I: fixed and per-instruction costs
    Point(
        "fixed_idle",
        "per-kernel fixed time with every engine idle",
        CS149_PROF_TRANSPOSE,
        "any kernel",
        (12.41, 13.33),
        "total_time - total_active_time: 13.33 (transpose), 12.41 (stream fd1k), 12.80 (stream fd2k) us "
        "(rishic3); 13.17, 12.42, 12.77 us (chenhzhu)",
        "fixed time per kernel launch (profile time with every engine idle)",
        "intercept",
        _pair("dma_pairs", (_f32((256,)),), 128, 256),
        how="intercept at zero work of the latency of reps tiny load+store pairs (static descriptors, as "
        "the profiled kernels)",
        group="I",
        dge_mode="none",
    ),
    Point(
        "dma_issue",
        "DMA instruction of tiny payload",
        CS149_PROFILE,
        "[1,1] fp32",
        (0.41, 0.63),
        "0.41-0.63 us per DMA instruction",
        "per-DMA-instruction time (issue-bound queue)",
        "slope",
        _pair("dma_pairs", (_f32((256,)),), 128, 256),
        units=0.5,
        how="independent [1,1] load+store pairs; marginal time per pair / 2",
        group="I",
    ),
    Point(
        "pe_transpose_fp32",
        "nc_transpose fp32 128x128 on PE",
        CS149_PROFILE,
        "[128,128] fp32",
        (0.219, 0.219),
        "~219 ns",
        "per-instruction TensorE time",
        "slope",
        _pair("pe_transpose", (_f32((128, 128)),), 256, 512),
        how="resident tile, reps nc_transpose into one PSUM tile; marginal time per transpose",
        group="I",
    ),
    Point(
        "evict_scalar",
        "PSUM->SBUF copy [128,128] fp32 on ScalarE",
        CS149_PROFILE,
        "[128,128] fp32",
        (0.221, 0.221),
        "~221 ns",
        "per-instruction ScalarE time",
        "slope",
        _pair("psum_evict", (_f32((128, 128)),), 256, 512, engine="scalar"),
        how="one PSUM tile, reps ScalarE tensor_copy to one SBUF tile; marginal time per copy",
        group="I",
    ),
    # ------------------------------------------------------------------ D: DMA throughput by descriptor size
    _dma_point(
        "dma_512B",
        "512 B per partition (fp32 [128,128] tiles)",
        CS149_PROF_TRANSPOSE,
        _f32((128, 512)),
        (("load", 1, 128), ("store", 1, 128)),
        64,
        64 * 2 * 128 * 128 * 4,
        (8_454_144 / 28_298.78, 8_454_144 / 27_949.366),
        "dma_active_time 2.829878e-05 s for dma_transfer_total_bytes 8,454,144 (rishic3; chenhzhu "
        "2.7949366e-05 s): 298.7-302.5 GB/s",
        "64 x (load + store of a [128,128] fp32 tile) = the transpose kernel's DMA traffic (its profile's "
        "129th transfer, 64 KiB, is not the kernel's); static descriptors (--disable-dge)",
        dge_mode="none",
    ),
    _dma_point(
        "dma_256B_1K_mix",
        "256 B + 1 KiB mix (V0/V1 loads, 1 KiB stores)",
        AGENTIC,
        _bf((128, 2048)),
        (("load", 4, 128), ("load", 4, 512), ("store", 1, 512)),
        256,
        201_326_592,
        (152.0, 153.0),
        "151.9 GB/s (V1); V0 1,207,697,408 B / 7,906 us = 152.8 GB/s",
        "V1's DMA traffic: per rep 4 lhsT [128,128] + 4 rhs [128,512] bf16 loads and 1 [128,512] store",
    ),
    _dma_point(
        "dma_1K",
        "1 KiB per partition (bf16 [128,512] tiles)",
        AGENTIC_DMA,
        _bf((128, 8192)),
        (("load", 1, 512), ("store", 1, 512)),
        16,
        16 * 2 * 128 * 512 * 2,
        (259.0, 259.0),
        "259 GB/s (memory_bound 16 us)",
        "16 x (load + store of [128,512] bf16) from [128,8192]; the published kernel's 8 small DMA "
        "transposes (shapes unpublished, few bytes) are left out",
    ),
    _dma_point(
        "dma_2K_1K",
        "2 KiB loads + 1 KiB stores (V2)",
        AGENTIC,
        _bf((128, 4096)),
        (("load", 5, 1024), ("store", 2, 512)),
        128,
        201_326_592,
        (245.8, 245.8),
        "245.8 GB/s (V2: 201 MB in 819 us DMA-active)",
        "V2's DMA traffic: per rep 5 [128,1024] bf16 row loads and 2 [128,512] stores",
    ),
    _dma_point(
        "dma_4K",
        "4 KiB per partition (bf16 [128,2048] tiles)",
        AGENTIC_DMA,
        _bf((128, 32768)),
        (("load", 1, 2048), ("store", 1, 2048)),
        16,
        16 * 2 * 128 * 2048 * 2,
        (354.0, 354.0),
        "354 GB/s (memory_bound 47 us)",
        "16 x (load + store of [128,2048] bf16) from [128,32768]",
    ),
    # ------------------------------------------------------------------ C: CS149 profiles (--disable-dge)
    Point(
        "cs149p_transpose",
        "matrix_transpose on PE, profiled (--disable-dge)",
        CS149_PROF_TRANSPOSE,
        "1024x1024 fp32",
        (46.470761, 46.85326),
        "total_time 4.685326e-05 s (rishic3), 4.6470761e-05 s (chenhzhu); 129 DMA transfers, DMA active "
        "28.3 us, TE active 16.3 us, ScalarE active 16.1 us",
        "neuron-profile total_time (whole kernel, including the fixed idle time)",
        "latency",
        (_run("matrix_transpose", _f32((1024, 1024))),),
        how="the kernel of cs149_transpose (both students' kernels.py: per 128x128 tile load, nc_transpose "
        "into PSUM, tensor_copy to SBUF, store; the profile shows the copies on ScalarE), modelled with "
        "static descriptors (dge none)",
        group="C",
        dge_mode="none",
    ),
    Point(
        "cs149p_stream_fd1k",
        "vector_add_stream FREE_DIM=1000, profiled (--disable-dge)",
        CS149_PROF_FD1K,
        "n=256,000 fp32",
        (26.416626, 27.85829),
        "total_time 2.785829e-05 s (rishic3), 2.6416626e-05 s (chenhzhu), 2.6e-5 s (xaviergonzalez "
        "writeup); dma_transfer_count 6, 3,072,000 B",
        "neuron-profile total_time (whole kernel, including the fixed idle time)",
        "latency",
        (_run("vector_add_stream", _f32((256_000,)), _f32((256_000,)), free_dim=1000),),
        how="2 x [128,1000] tiles: 2 loads, VectorE tensor_tensor add, store (4,000 B descriptors)",
        group="C",
        dge_mode="none",
    ),
    Point(
        "cs149p_stream_fd2k",
        "vector_add_stream FREE_DIM=2000, profiled (--disable-dge)",
        CS149_PROF_FD2K,
        "n=256,000 fp32",
        (28.358289, 28.904955),
        "total_time 2.8358289e-05 s (rishic3), 2.8904955e-05 s (chenhzhu), 2.8e-5 s (xaviergonzalez "
        "writeup); dma_transfer_count 3, 3,072,000 B",
        "neuron-profile total_time (whole kernel, including the fixed idle time)",
        "latency",
        (_run("vector_add_stream", _f32((256_000,)), _f32((256_000,)), free_dim=2000),),
        how="one [128,2000] tile: 2 loads, VectorE tensor_tensor add, store (8,000 B descriptors)",
        group="C",
        dge_mode="none",
    ),
)
"""Groups C (CS149 benchmark and profile figures), I (fixed / per-instruction) and D (DMA throughput)."""
