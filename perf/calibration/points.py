"""The published trn2 calibration points: what was measured, where it is published, and which
re-implemented kernel (and which difference of runs) the model is compared on.

Every ``measured`` figure here is a **published trn2 measurement** (public source in
:attr:`Point.source`), never a figure measured on this machine.  Every kernel is this project's own
re-implementation (:mod:`perf.calibration.kernels_matmul`, :mod:`perf.calibration.kernels_small`).

Methods (how the modelled figure is formed from the model's latency, so fixed costs cancel where the
published figure excludes them):

* ``"latency"``: the modelled latency of one run.
* ``"slope"``: ``(lat(run_b) - lat(run_a)) / (count_b - count_a) * units``: the marginal time of one unit
  of repeated work (an instruction, or the published amount of DMA traffic).
* ``"intercept"``: ``lat(run_a) - count_a * slope``: the modelled time of a kernel with no work at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["Source", "KernelRun", "Point", "POINTS", "point_names"]

MB_BF16 = "bfloat16"
F32 = "float32"


@dataclass(frozen=True)
class Source:
    """Public source of a measurement: GitHub ``repo``, ``path`` and ``commit`` (and what was read)."""

    repo: str
    path: str
    commit: str
    note: str = ""

    @property
    def url(self) -> str:
        return f"https://github.com/{self.repo}/blob/{self.commit}/{self.path}"

    def short(self) -> str:
        """``repo@commit8:file-name`` (the full path is in :attr:`url`)."""
        return f"{self.repo}@{self.commit[:8]}:{self.path.rsplit('/', 1)[-1]}"


@dataclass(frozen=True)
class KernelRun:
    """One trace-only run: ``kernel`` (a name in :data:`perf.calibration.harness.KERNELS`), HBM input
    ``args`` as ``(shape, dtype)`` pairs, keyword ``kwargs`` as sorted ``(name, value)`` pairs, ``count``
    (the amount of repeated work, for slope/intercept points) and ``sbuf_check`` (False: trace with the
    emulator's SBUF capacity check off; see the point's note)."""

    kernel: str
    args: tuple[tuple[tuple[int, ...], str], ...]
    kwargs: tuple[tuple[str, Any], ...] = ()
    count: int = 1
    sbuf_check: bool = True


@dataclass(frozen=True)
class Point:
    """One calibration point.

    Attributes:
        name: identifier (row variant).
        kernel: display name of the published kernel.
        source: public source of the measured figure.
        shape: problem shape as published.
        measured_us: ``(lo, hi)`` published trn2 figure in microseconds (``lo == hi`` for a single value;
            derived from a published rate where ``published`` says so).
        published: the figure exactly as published (units of the source).
        quantity: what the published figure measures (kernel total, engine-active time, ...).
        method: ``"latency"``, ``"slope"`` or ``"intercept"`` (module docstring).
        runs: one run (latency) or two runs with different ``count`` (slope, intercept).
        units: slope multiplier (how many counted units the published figure covers).
        how: how the kernel was re-implemented / what differs from the published one.
        group: ``"A"`` (AWS agentic profiling docs), ``"S"`` (SDK tutorial), ``"C"`` (CS149),
            ``"D"`` (DMA throughput), ``"I"`` (per-instruction / fixed costs).
    """

    name: str
    kernel: str
    source: Source
    shape: str
    measured_us: tuple[float, float]
    published: str
    quantity: str
    method: str
    runs: tuple[KernelRun, ...]
    units: float = 1.0
    how: str = ""
    group: str = ""

    def __post_init__(self) -> None:
        lo, hi = self.measured_us
        if not 0 < lo <= hi:
            raise ValueError(
                f"Point {self.name}: measured_us must satisfy 0 < lo <= hi, got {self.measured_us}"
            )
        want = 1 if self.method == "latency" else 2
        if self.method not in ("latency", "slope", "intercept"):
            raise ValueError(
                f"Point {self.name}: method must be latency|slope|intercept, got {self.method!r}"
            )
        if len(self.runs) != want:
            raise ValueError(
                f"Point {self.name}: method {self.method} needs {want} run(s), got {len(self.runs)}"
            )
        if want == 2 and self.runs[0].count == self.runs[1].count:
            raise ValueError(f"Point {self.name}: the two runs need different counts")

    @property
    def measured_mid_us(self) -> float:
        """Geometric middle of the published range (the value itself for a single figure)."""
        lo, hi = self.measured_us
        return math.sqrt(lo * hi)


# ---------------------------------------------------------------------------------------------- sources
AGENTIC = Source(
    "aws-neuron/neuron-agentic-development",
    "skills/neuron-nki-profile-querying/references/example-bounds-analysis.md",
    "c79373205a829e504c5c1d86ef7a3d7d6080e603",
    "V0/V1/V2 bounds and engine-active tables (trn2, dma_ddr_bandwidth 435 GB/s, TE peak 78.6 TF)",
)
AGENTIC_TE = Source(
    "aws-neuron/neuron-agentic-development",
    "skills/neuron-nki-profile-querying/references/investigations/te_inefficiency.md",
    "1598b0609adba24e476dd0b36fd0f6b6c4dddbf1",
    "worked example: 2,048 matmuls, mixed tiles 30.8 TF vs all-full 77.2 TF (TE-active rate)",
)
AGENTIC_DMA = Source(
    "aws-neuron/neuron-agentic-development",
    "skills/neuron-nki-profile-querying/references/investigations/dma_efficiency.md",
    "1598b0609adba24e476dd0b36fd0f6b6c4dddbf1",
    "worked example dge_mixed: 128x512 vs 128x2048 bf16 tiles, achieved_bw 259 vs 354 GB/s",
)
SDK = Source(
    "aws-neuron/aws-neuron-sdk",
    "nki/guides/tutorials/kernel-optimization.rst",
    "81ce03ae",
    "times read off the profile screenshots nki/img/how-to/v{2,3,4,5}-full.png of the same commit",
)
CS149 = Source(
    "xaviergonzalez/asst4-trainium2",
    "writeup.md",
    "d1552616",
    "nki.benchmark p99 nc_latency (NCL(99)); kernels in part1/kernels.py (legacy neuronxcc.nki)",
)
CS149_PROFILE = Source(
    "chengli2003/asst4-trainium2",
    "part1/transpose_1024.ntff",
    "b006a759b8bd644736018b7733182bbaf1e915b8",
    "neuron-profile dumps published with the same CS149 assignment kernels (vector_add, transpose)",
)


def _bf(shape: tuple[int, ...]) -> tuple[tuple[int, ...], str]:
    return (shape, MB_BF16)


def _f32(shape: tuple[int, ...]) -> tuple[tuple[int, ...], str]:
    return (shape, F32)


def _run(
    kernel: str, *args: tuple[tuple[int, ...], str], count: int = 1, sbuf_check: bool = True, **kw: Any
) -> KernelRun:
    return KernelRun(kernel, tuple(args), tuple(sorted(kw.items())), count, sbuf_check)


def _pair(kernel: str, args: tuple, lo: int, hi: int, **kw: Any) -> tuple[KernelRun, KernelRun]:
    return (_run(kernel, *args, count=lo, reps=lo, **kw), _run(kernel, *args, count=hi, reps=hi, **kw))


def _us(nbytes: int, gbps_lo: float, gbps_hi: float | None = None) -> tuple[float, float]:
    """Published GB/s -> microseconds for ``nbytes`` (the slower rate gives the longer time)."""
    hi_rate = gbps_hi if gbps_hi is not None else gbps_lo
    return (nbytes / (hi_rate * 1e3), nbytes / (gbps_lo * 1e3))


_MM4096 = (_bf((4096, 4096)), _bf((4096, 4096)))
_SDK_ARGS = (_f32((8192, 4096)), _f32((8192, 8192)))
_VEC = (_f32((25600,)), _f32((25600,)))
_MIXED_FLOPS = 512 * (2 * 128 * 32 * 512 + 2 * 128 * 128 * 64 + 2 * 32 * 128 * 512 + 2 * 128 * 128 * 512)
_FULL_MM_FLOPS = 2 * 128 * 128 * 512


def _dma_point(name: str, desc: str, src: Source, x: tuple, pattern: tuple, reps: int, nbytes: int,
               rate: tuple[float, float], published: str, how: str) -> Point:  # fmt: skip
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
    )


POINTS: tuple[Point, ...] = (
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
        CS149_PROFILE,
        "any kernel",
        (12.4, 13.3),
        "12.4-13.3 us per kernel, all engines idle",
        "fixed time per kernel launch",
        "intercept",
        _pair("dma_pairs", (_f32((256,)),), 128, 256),
        how="intercept at zero work of the latency of reps tiny load+store pairs",
        group="I",
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
        CS149_PROFILE,
        _f32((128, 512)),
        (("load", 1, 128), ("store", 1, 128)),
        64,
        64 * 2 * 128 * 128 * 4,
        (299.0, 299.0),
        "299 GB/s",
        "64 x (load + store of a [128,128] fp32 tile) = the transpose kernel's DMA traffic",
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
)
"""Every calibration point, in table order."""


def point_names() -> tuple[str, ...]:
    return tuple(p.name for p in POINTS)
