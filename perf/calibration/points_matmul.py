"""Published trn2 matmul points: the AWS agentic profiling examples (4096^3 bf16, mixed tiles,
back-to-back matmuls, VectorE evictions) and the Neuron SDK tutorial's fp32 matmuls.  Types and sources:
:mod:`perf.calibration.point_defs`; every point: :data:`perf.calibration.points.POINTS`.
"""

from __future__ import annotations

from perf.calibration.point_defs import (
    AGENTIC,
    AGENTIC_TE,
    AGENTIC_TP,
    MB_BF16,
    SDK,
    Point,
)
from perf.calibration.point_defs import bf16_arg as _bf
from perf.calibration.point_defs import f32_arg as _f32
from perf.calibration.point_defs import kernel_run as _run
from perf.calibration.point_defs import run_pair as _pair

__all__ = ["MATMUL_POINTS"]

_MM4096 = (_bf((4096, 4096)), _bf((4096, 4096)))
_SDK_ARGS = (_f32((8192, 4096)), _f32((8192, 8192)))
_MIXED_FLOPS = 512 * (2 * 128 * 32 * 512 + 2 * 128 * 128 * 64 + 2 * 32 * 128 * 512 + 2 * 128 * 128 * 512)
_FULL_MM_FLOPS = 2 * 128 * 128 * 512


MATMUL_POINTS: tuple[Point, ...] = (
    # ------------------------------------------------------------------ A: agentic bf16 4096^3 matmuls
    Point(
        "agentic_v0",
        "matmul V0 naive tiling (128x128x512 tiles, loads per (m,n,k))",
        AGENTIC,
        "4096^3 bf16",
        (8602.0, 8602.0),
        "total_time 8,602 us (DMA 7,906, TE 4,806, VectorE 176 us)",
        "kernel total (first to last DMA of the profile)",
        "latency",
        (_run("agentic_v0", *_MM4096),),
        how="rhs tile [128,512] loaded per (m,n,k) as written; lhsT tile loaded 3x "
        "(at the first n of 3 groups of n-iterations, reused within the group) to model the measured "
        "traffic 1,207,697,408 B (the compiler removed 5 of 8 lhsT reloads); model traffic "
        "1,207,959,552 B",
        group="A",
    ),
    Point(
        "agentic_v1",
        "matmul V1 blocked BM=8 BN=2, per-tile loads",
        AGENTIC,
        "4096^3 bf16",
        (2451.0, 2451.0),
        "total_time 2,451 us (DMA 1,325, TE 2,163, VectorE 174 us)",
        "kernel total (first to last DMA of the profile)",
        "latency",
        (_run("agentic_v1", *_MM4096),),
        how="lhsT [128,128] tiles once per M block, rhs [128,512] tiles once per (M block, N block); "
        "traffic 201,326,592 B (matches 151.9 GB/s x 1,325 us)",
        group="A",
    ),
    Point(
        "agentic_v2",
        "matmul V2 blocked BM=8 BN=2, [128,1024] row loads",
        AGENTIC,
        "4096^3 bf16",
        (1801.0, 1801.0),
        "total_time 1,801 us (DMA 819, TE 1,781, VectorE 172 us)",
        "kernel total (first to last DMA of the profile)",
        "latency",
        (_run("agentic_v2", *_MM4096),),
        how="one DMA per K tile loads the [128,1024] lhsT / rhs block row; matmuls slice the rows in SBUF",
        group="A",
    ),
    Point(
        "mixed_tiles",
        "2,048 nc_matmul, 4 x 512 with M=32 / N=64 / K=32 / full tiles",
        AGENTIC_TE,
        "bf16, 2,048 matmuls",
        (_MIXED_FLOPS / 30.85e6, _MIXED_FLOPS / 30.75e6),
        "30.8 TFLOPS achieved over TE-active time (39 %)",
        f"TensorE-active time = {_MIXED_FLOPS:,} FLOP / 30.8 TF (range: rounding of 30.8)",
        "slope",
        _pair("mixed_tiles", (_bf((128, 128)), _bf((128, 512))), 256, 512),
        units=512,
        how="one resident stationary/moving tile pair; per section reps matmuls on sliced views into one "
        "PSUM tile; modelled = marginal time of 512 reps per section",
        group="A",
    ),
    Point(
        "matmul_b2b",
        "nc_matmul bf16 128x128x512 back to back",
        AGENTIC_TE,
        "one instruction",
        (_FULL_MM_FLOPS / 77.25e6, _FULL_MM_FLOPS / 77.15e6),
        "77.2 TFLOPS with 2,048 full tiles (98 %)",
        "per-instruction TE time = 2*128*128*512 FLOP / 77.2 TF",
        "slope",
        _pair("matmul_chain", (_bf((128, 128)), _bf((128, 512))), 256, 512),
        how="resident tiles, reps matmuls accumulating in one PSUM bank; modelled = marginal time per matmul",
        group="I",
    ),
    Point(
        "evict_vector",
        "PSUM->SBUF copy [128,512] fp32->bf16 on VectorE",
        AGENTIC,
        "[128,512]",
        (0.672, 0.688),
        "VectorE active 172-176 us over 256 evictions (V0-V2)",
        "per-instruction VectorE time (engine-active / 256)",
        "slope",
        _pair("psum_evict", (_f32((128, 512)),), 256, 512, engine="vector", out_dtype=MB_BF16),
        how="one PSUM tile, reps VectorE tensor_copy to one bf16 SBUF tile; marginal time per copy",
        group="I",
    ),
    Point(
        "agentic_tp_v0",
        "matmul 2048^3, nc_transpose of every A tile (loads per (m,n,k))",
        AGENTIC_TP,
        "2048^3 bf16",
        (802.0, 802.0),
        "total_time 802 us (compute_bound / TE active 503 us; 1,024 TRANSPOSE + 1,024 REGULAR MATMULs)",
        "kernel total (first to last DMA of the profile)",
        "latency",
        (_run("agentic_transpose", _bf((2048, 2048)), _bf((2048, 2048)), transpose_lhs=True),),
        how="as published: per (m, n, k) load the A tile [128,128], nc_transpose into PSUM, copy to SBUF, "
        "load the rhs tile [128,512], matmul; per (m, n) the eviction and store the listing leaves out",
        group="A",
    ),
    Point(
        "agentic_tp_v1",
        "matmul 2048^3, pre-transposed lhsT (loads per (m,n,k))",
        AGENTIC_TP,
        "2048^3 bf16",
        (608.0, 608.0),
        "total_time 608 us (compute_bound / TE active 420 us; 1,024 REGULAR MATMULs)",
        "kernel total (first to last DMA of the profile)",
        "latency",
        (_run("agentic_transpose", _bf((2048, 2048)), _bf((2048, 2048)), transpose_lhs=False),),
        how="as V0 without the transposes: the lhsT tile [128,128] is loaded directly",
        group="A",
    ),
    # ------------------------------------------------------------------ S: SDK tutorial fp32 matmuls
    Point(
        "sdk_tiled",
        "SDK tutorial matmul, tiled (loads per (m,n,k))",
        SDK,
        "[4096,8192]@[8192,8192] fp32",
        (39895.0, 39895.0),
        "39,895 us (DMA active 99.93 %, TensorE 87.28 %)",
        "kernel total (profile)",
        "latency",
        (_run("sdk_tiled", *_SDK_ARGS),),
        how="as described: both tiles loaded per (m,n,k)",
        group="S",
    ),
    Point(
        "sdk_hoisted",
        "SDK tutorial matmul, hoisted loads",
        SDK,
        "[4096,8192]@[8192,8192] fp32",
        (28198.0, 28198.0),
        "28,198 us",
        "kernel total (profile)",
        "latency",
        (_run("sdk_hoisted", *_SDK_ARGS),),
        how="lhsT column (64 tiles) per m, rhs column per (m,n)",
        group="S",
    ),
    Point(
        "sdk_blocked_mn",
        "SDK tutorial matmul, blocked M,N (2,2)",
        SDK,
        "[4096,8192]@[8192,8192] fp32",
        (28414.0, 28414.0),
        "28,414 us",
        "kernel total (profile)",
        "latency",
        (_run("sdk_blocked_mn", *_SDK_ARGS, sbuf_check=False),),
        how="TILES_IN_BLOCK_M=N=2, per-tile DMAs; as written its rhs block (2 x 64 tiles of 2 KiB) "
        "alone needs 256 KiB per partition, more than the physical SBUF: the compiler must have "
        "re-ordered or spilled; traced with the emulator's capacity check off (no spill traffic modelled)",
        group="S",
    ),
    Point(
        "sdk_blocked_mnk",
        "SDK tutorial matmul, blocked M,N,K (16,2,8), SBUF accumulation",
        SDK,
        "[4096,8192]@[8192,8192] fp32",
        (28302.0, 28302.0),
        "28,302 us",
        "kernel total (profile)",
        "latency",
        (_run("sdk_blocked_mnk", *_SDK_ARGS, sbuf_check=False),),
        how="as described; its live tiles total 224 KiB per partition (the whole physical SBUF), which the "
        "emulator's Python-lifetime allocator (212,728 B budget) rejects: traced with the capacity check off",
        group="S",
    ),
)
"""Groups A (agentic matmuls, with the per-instruction matmul_b2b / evict_vector) and S (SDK)."""
