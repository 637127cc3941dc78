"""Analytical trn2 (NeuronCore-v3) cost model: turns an emulator :class:`~.trace.Trace` into a *modelled*
:class:`KernelProfile`.

Every figure this module produces is **modelled** (a formula over the trace, calibrated against published
trn2 measurements), never a measurement.  Section numbers (``§N``) refer to
``shared/docs/trn2_cost_model.md``; ``docs/cost_model.md`` explains the formulas, the calibration points
and what is not modelled.

Model in one paragraph: each compute engine (TensorE, VectorE, ScalarE, GpSimdE) executes its
instructions back to back; an instruction costs a documented number of engine cycles (§4.1) at the
engine's clock (§2.1).  DMA time is the largest of four throughput terms: the busiest of the 16 DMA
engines (each descriptor costs ``run_bytes / (BW_engine * eff(run_bytes))``, ``eff`` interpolated through
the published efficiency curve, §3), the hardware descriptor generators' issue time (0.6 us per DMA
instruction over 2 DGE blocks), the queue occupancy (the 1.3 us fixed latency of every DMA amortised over
16 queues in flight) and the HBM bandwidth cap.  Engines overlap perfectly: the modelled latency is the
busiest engine plus a non-overlap term of exposed DMA latency (the first load before compute can start,
the last store after it ends).  The serial bound is the sum of all engine times plus that term.

Trace ``meta`` keys read (all optional): ``K``, ``M``, ``N`` (``nc_matmul``), ``is_transpose``,
``reduce`` (a reducing ``activation``; also inferred from a third ``[P, 1]`` operand), ``alu`` or ``op``
(ALU op name, or a tuple of names), ``contiguous`` (innermost dimension contiguous; default true),
``dge_mode`` (``"hwdge"``, ``"swdge"``, ``"none"``; default :attr:`Trn2CostParams.default_dge_mode`, or
``"swdge"`` when ``indirect`` is present).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .trace import Trace, TraceRecord

__all__ = [
    "DMA_EFFICIENCY_POINTS",
    "COMPUTE_ENGINES",
    "Trn2CostParams",
    "KernelProfile",
    "dma_efficiency",
    "split_descriptors",
    "instruction_cycles",
    "instruction_ns",
    "dma_record_cost",
    "DmaRecordCost",
    "profile",
]

COMPUTE_ENGINES = ("tensor", "vector", "scalar", "gpsimd")

#: Published trn2 DMA throughput relative to the 32 KiB plateau, by contiguous bytes per partition
#: (= per descriptor) of a 128-partition DMA (§3, read off SDK ``nki-dma-intro-1.jpg``).
DMA_EFFICIENCY_POINTS: tuple[tuple[int, float], ...] = (
    (32, 0.014),
    (64, 0.026),
    (128, 0.05),
    (256, 0.10),
    (512, 0.21),
    (1024, 0.42),
    (2048, 0.81),
    (4096, 0.97),
    (8192, 0.98),
    (16384, 0.99),
    (32768, 1.00),
)

_LOW_PRECISION = frozenset({"bfloat16", "float16"})
_FAST_TT_OPS = frozenset({"add", "subtract", "multiply", "sub", "mul"})
_FAST_REDUCE_OPS = frozenset({"add", "max", "maximum"})
_DIRECTIONS = ("hbm->sbuf", "sbuf->hbm", "hbm->hbm", "sbuf->sbuf")


def _p(default: Any, source: str) -> Any:
    """A dataclass field whose metadata names its source (section of trn2_cost_model.md)."""
    return field(default=default, metadata={"source": source})


@dataclass(frozen=True)
class Trn2CostParams:
    """Parameters of the trn2 cost model for one physical NeuronCore-v3.

    Every field carries its source in ``dataclasses.fields(...)[i].metadata["source"]`` (see
    :meth:`sources`); sections refer to ``shared/docs/trn2_cost_model.md``.  Defaults are §7's suggested
    values unless the source says "calibrated".  Units: clocks in GHz, times in ns, bandwidths in GB/s
    (= bytes/ns), sizes in bytes.
    """

    # --- TensorE -----------------------------------------------------------------------------------
    tensor_clock_ghz: float = _p(2.4, "§2.1 TensorE 2.4 GHz; §7")
    pe_rows: int = _p(128, "§2.1 128x128 PE array; §7")
    pe_cols: int = _p(128, "§2.1 128x128 PE array; §7")
    matmul_min_cycles: int = _p(64, "§4.1 nc_matmul max(min(64, N_stat), N_mov); §7 max(64, N_mov)")
    matmul_fp32_factor: float = _p(4.0, "§2.1 FP32 matmul ~4x BF16; §4.1; §7")
    matmul_overhead_cycles: int = _p(
        10,
        "calibrated: §4.2/§5.1 [meas] 2,048 back-to-back full matmuls at 77.2 TF (98%), ~217 ns each "
        "vs 512 cycles = 213 ns; 512/0.982 - 512 ~ 10 cycles per instruction",
    )
    load_stationary_divisor: int = _p(
        4, "§4.1 LoadStationary up to 4x faster than MultiplyMoving; §7 N_stat/4"
    )
    load_stationary_overlapped: bool = _p(True, "§4.1/§7 LoadStationary loads in the background")
    transpose_min_cycles: int = _p(64, "§4.1 nc_transpose on TensorE max(P, min(64, F)); §4.2 64-128 cycles")
    # --- ScalarE -----------------------------------------------------------------------------------
    scalar_clock_ghz: float = _p(1.2, "§2.1 ScalarE 1.2 GHz, 128 elements/cycle; §7")
    scalar_min_ii_cycles: int = _p(64, "§4.1 activation max(MIN_II, N), MIN_II ~64 (v2 constant); §7")
    scalar_accumulate_cycles: int = _p(64, "§4.1 activation_reduce adds a MIN_II to read the accumulator; §7")
    # --- VectorE -----------------------------------------------------------------------------------
    vector_clock_ghz: float = _p(0.96, "§2.1 VectorE 0.96 GHz; §7")
    vector_min_ii_cycles: int = _p(64, "§4.1 max(64, N) for tensor_scalar/tensor_copy/tensor_tensor; §7")
    vector_perf_mode: bool = _p(True, "§2.1 v3 performance mode, detected automatically in hardware")
    vector_perf_sbuf_factor: float = _p(
        4.0, "§2.1 4x for tensor_copy/tensor_scalar, BF16/FP16 SBUF->SBUF, innermost contiguous"
    )
    vector_perf_other_factor: float = _p(
        2.0, "§2.1 2x when not contiguous, one operand in PSUM, or tensor_tensor with BF16 SBUF inputs"
    )
    vector_reciprocal_factor: float = _p(8.0, "§4.1 reciprocal max(64, 8N)")
    # --- GpSimdE -----------------------------------------------------------------------------------
    gpsimd_clock_ghz: float = _p(1.2, "§2.1 GpSimdE 1.2 GHz; §7")
    gpsimd_start_cycles: int = _p(150, "§4.1 GpSimd ~150 start + N (v2 constant); §7")
    # --- per-instruction overheads on Vector/Scalar/GpSimd -------------------------------------------
    small_instruction_elems: int = _p(128, "§4.1 rule of thumb: >=128 elements per partition to be efficient")
    small_instruction_overhead_cycles: int = _p(
        100, "§4.1 ~100 cycles static overhead for dependent instructions with N << 128 (v2); §7"
    )
    access_start_cycles: int = _p(
        0,
        "§2.2/§4.2 ~60-cycle SBUF/PSUM access start when not pipelined; 0 = assume pipelined streams "
        "(set 60 for a dependent-chain bound)",
    )
    # --- DMA -----------------------------------------------------------------------------------------
    dma_engines: int = _p(16, "§3 16 DMA engines per core; §7")
    dma_queues: int = _p(16, "§3 16 queues per engine (a transfer uses one queue ID on all engines)")
    partitions_per_dma_engine: int = _p(8, "§3 each engine serves 8 SBUF partitions (128/16); §7")
    dma_engine_gbps: float = _p(
        23.0,
        "§3 23 B/ns per engine (Trn2 table; single-engine 32 KiB in 1,416 ns); 27.2 theoretical; §7, §8",
    )
    dma_efficiency_points: tuple[tuple[int, float], ...] = _p(
        DMA_EFFICIENCY_POINTS, "§3 throughput vs bytes per partition, relative to the 32 KiB plateau"
    )
    max_descriptor_bytes: int = _p(
        32768,
        "no documented maximum found; chosen = the largest published curve point (§3, 32 KiB = 100%) so "
        "longer runs are charged as 32 KiB descriptors at plateau",
    )
    dma_latency_ns: float = _p(1300.0, "§3 ~1,300 ns fixed cross-engine latency per transfer; §7")
    hwdge_issue_ns: float = _p(600.0, "§3 hwdge ~600 ns per DMA instruction; §7")
    hwdge_blocks: int = _p(2, "§3 two hardware DGE blocks per v3 core")
    swdge_issue_ns: float = _p(
        600.0, "§3 swdge builds descriptors on GpSimd (time unpublished; assumed equal to hwdge issue)"
    )
    default_dge_mode: str = _p(
        "hwdge", "§3/NKI 0.6 dge_mode default 'unknown' (compiler's choice); hwdge assumed (pessimistic)"
    )
    dma_transpose_hbm_efficiency: float = _p(0.9, "§3 DMA transpose HBM->SBUF up to ~90% of copy throughput")
    dma_transpose_sbuf_efficiency: float = _p(0.5, "§3 DMA transpose SBUF->SBUF up to ~50%")
    # --- HBM ------------------------------------------------------------------------------------------
    hbm_stack_gbps: float = _p(725.0, "§1 2.9 TB/s over 4 stacks = ~725 GB/s per stack; §7 HBM cap")
    cores_per_hbm_stack: int = _p(2, "§1 each HBM stack is shared by 2 physical cores")

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or f.name in ("dma_efficiency_points", "default_dge_mode"):
                continue
            if f.name in (
                "matmul_overhead_cycles",
                "small_instruction_overhead_cycles",
                "access_start_cycles",
            ):
                if v < 0:
                    raise ValueError(f"Trn2CostParams.{f.name} must be >= 0, got {v}")
            elif not v > 0:
                raise ValueError(f"Trn2CostParams.{f.name} must be > 0, got {v}")
        pts = self.dma_efficiency_points
        if len(pts) < 2:
            raise ValueError(
                "Trn2CostParams.dma_efficiency_points needs at least 2 (bytes, efficiency) points"
            )
        sizes = [s for s, _ in pts]
        if sizes != sorted(sizes) or len(set(sizes)) != len(sizes) or sizes[0] <= 0:
            raise ValueError(
                f"Trn2CostParams.dma_efficiency_points sizes must be positive and strictly increasing, got {sizes}"
            )
        if any(not 0.0 < e <= 1.0 for _, e in pts):
            raise ValueError("Trn2CostParams.dma_efficiency_points efficiencies must lie in (0, 1]")
        if self.default_dge_mode not in ("hwdge", "swdge", "none"):
            raise ValueError(
                f"Trn2CostParams.default_dge_mode must be 'hwdge', 'swdge' or 'none', got {self.default_dge_mode!r}"
            )
        for name in ("dma_transpose_hbm_efficiency", "dma_transpose_sbuf_efficiency"):
            if getattr(self, name) > 1.0:
                raise ValueError(f"Trn2CostParams.{name} must be in (0, 1], got {getattr(self, name)}")

    # --- derived figures ----------------------------------------------------------------------------
    @property
    def peak_bf16_flops(self) -> float:
        """Dense BF16 TensorE peak of one core in FLOP/s: rows*cols*2*clock = 78.6e12 (§1, §2.1)."""
        return self.pe_rows * self.pe_cols * 2 * self.tensor_clock_ghz * 1e9

    @property
    def dma_peak_gbps(self) -> float:
        """Plateau DMA bandwidth of one core: engines x per-engine rate = 368 GB/s (§3)."""
        return self.dma_engines * self.dma_engine_gbps

    def hbm_cap_gbps(self, cores: int) -> float:
        """HBM bandwidth available to each of ``cores`` cores packed pairwise on stacks (§1)."""
        return self.hbm_stack_gbps / min(max(cores, 1), self.cores_per_hbm_stack)

    def clock_ghz(self, engine: str) -> float:
        return {
            "tensor": self.tensor_clock_ghz,
            "vector": self.vector_clock_ghz,
            "scalar": self.scalar_clock_ghz,
            "gpsimd": self.gpsimd_clock_ghz,
        }[engine]

    @classmethod
    def sources(cls) -> dict[str, str]:
        """``{field name: source}`` for every parameter."""
        return {f.name: f.metadata["source"] for f in fields(cls)}


# ---------------------------------------------------------------------------------------------------
# DMA pieces
# ---------------------------------------------------------------------------------------------------


def dma_efficiency(run_bytes: float, params: Trn2CostParams | None = None) -> float:
    """Fraction of the per-engine plateau bandwidth achieved by descriptors of ``run_bytes`` bytes.

    Piecewise linear in ``log2(run_bytes)`` through :attr:`Trn2CostParams.dma_efficiency_points` (§3).
    Below the first point the per-descriptor *time* is held constant (efficiency proportional to size:
    the overhead-bound regime); above the last point the efficiency stays at the last value.
    """
    if run_bytes <= 0:
        raise ValueError(f"dma_efficiency: run_bytes must be > 0, got {run_bytes}")
    pts = (params or _DEFAULT).dma_efficiency_points
    s0, e0 = pts[0]
    if run_bytes <= s0:
        return e0 * run_bytes / s0
    if run_bytes >= pts[-1][0]:
        return pts[-1][1]
    x = math.log2(run_bytes)
    for (sa, ea), (sb, eb) in zip(pts, pts[1:]):
        if sa <= run_bytes <= sb:
            t = (x - math.log2(sa)) / (math.log2(sb) - math.log2(sa))
            return ea + t * (eb - ea)
    raise AssertionError("unreachable")  # pragma: no cover


def split_descriptors(
    descriptors: tuple[tuple[int, int], ...], max_bytes: int
) -> tuple[tuple[int, int], ...]:
    """Split runs longer than ``max_bytes`` into ``max_bytes`` chunks plus a remainder.

    ``descriptors`` is a histogram ``((run_bytes, count), ...)``; the result is a histogram sorted by size.
    """
    if max_bytes <= 0:
        raise ValueError(f"split_descriptors: max_bytes must be > 0, got {max_bytes}")
    out: Counter[int] = Counter()
    for size, count in descriptors:
        if size <= 0 or count < 0:
            raise ValueError(f"split_descriptors: bad descriptor entry (run_bytes={size}, count={count})")
        full, rem = divmod(size, max_bytes)
        if full:
            out[max_bytes] += full * count
        if rem:
            out[rem] += count
    return tuple(sorted((s, c) for s, c in out.items() if c))


@dataclass(frozen=True)
class DmaRecordCost:
    """Modelled cost of one DMA instruction (one issue of a DMA trace record)."""

    descriptors: tuple[tuple[int, int], ...]  # charged histogram after splitting
    data_ns: float  # sum of descriptor times (engine-ns), before spreading over engines
    engines_used: int
    issue_ns: float  # hwdge issue time (on the DGE blocks)
    swdge_ns: float  # descriptor generation on GpSimd
    hbm_read: int
    hbm_written: int
    bytes_moved: int


def _on_chip_bytes(rec: TraceRecord) -> int:
    if rec.direction == "hbm->sbuf":
        return rec.bytes_written
    if rec.direction in ("sbuf->hbm", "sbuf->sbuf"):
        return rec.bytes_read
    return 0


def dma_record_cost(rec: TraceRecord, params: Trn2CostParams | None = None) -> DmaRecordCost:
    """Cost of one DMA instruction.

    Descriptors longer than ``max_descriptor_bytes``, or than the bytes one SBUF partition receives
    (a descriptor cannot span partitions), are split first.  A record without descriptors is charged one
    descriptor per partition.  Each descriptor of ``s`` bytes costs ``s / (dma_engine_gbps * eff(s))``
    ns on its DMA engine; ``dma_transpose`` divides throughput by the documented transpose efficiency.
    """
    p = params or _DEFAULT
    if rec.engine != "dma":
        raise ValueError(f"dma_record_cost: record engine must be 'dma', got {rec.engine!r} (op {rec.op})")
    if rec.direction not in _DIRECTIONS:
        raise ValueError(f"dma_record_cost: direction must be one of {_DIRECTIONS}, got {rec.direction!r}")
    moved = max(rec.bytes_read, rec.bytes_written)
    descs = rec.descriptors
    if not descs and moved > 0:
        parts = max(rec.partitions, 1)
        per, rem = divmod(moved, parts)
        descs = ((per, parts),) if per else ()
        if rem:
            descs = (*descs, (rem, 1))
    cap = p.max_descriptor_bytes
    on_chip = _on_chip_bytes(rec)
    if rec.partitions > 0 and on_chip > 0:
        cap = min(cap, max(1, -(-on_chip // rec.partitions)))
    descs = split_descriptors(descs, cap) if descs else ()
    data = sum(c * s / (p.dma_engine_gbps * dma_efficiency(s, p)) for s, c in descs)
    if rec.op == "dma_transpose":
        data /= (
            p.dma_transpose_sbuf_efficiency
            if rec.direction == "sbuf->sbuf"
            else p.dma_transpose_hbm_efficiency
        )
    if rec.partitions > 0:
        used = min(p.dma_engines, -(-rec.partitions // p.partitions_per_dma_engine))
    else:
        used = p.dma_engines
    meta = rec.meta_dict()
    # indirect (runtime-indexed) DMAs need software DGE: "the only mode with gather/scatter" (§3)
    default_mode = "swdge" if meta.get("indirect") is not None else p.default_dge_mode
    mode = str(meta.get("dge_mode", default_mode)).removeprefix("dge_mode.")
    if mode not in ("hwdge", "swdge", "none", "unknown"):
        raise ValueError(f"dma_record_cost: meta dge_mode must be hwdge/swdge/none, got {mode!r}")
    if mode == "unknown":
        mode = p.default_dge_mode
    hbm_r = rec.bytes_read if rec.direction in ("hbm->sbuf", "hbm->hbm") else 0
    hbm_w = rec.bytes_written if rec.direction in ("sbuf->hbm", "hbm->hbm") else 0
    return DmaRecordCost(
        descriptors=descs,
        data_ns=data,
        engines_used=used,
        issue_ns=p.hwdge_issue_ns if mode == "hwdge" else 0.0,
        swdge_ns=p.swdge_issue_ns if mode == "swdge" else 0.0,
        hbm_read=hbm_r,
        hbm_written=hbm_w,
        bytes_moved=moved,
    )


# ---------------------------------------------------------------------------------------------------
# Compute instructions
# ---------------------------------------------------------------------------------------------------


def _free(shape: tuple[int, ...]) -> int:
    return math.prod(shape[1:]) if len(shape) > 1 else 1


def _meta_flag(meta: dict[str, object], *keys: str) -> bool:
    return any(bool(meta.get(k)) for k in keys)


def _alu_names(meta: dict[str, object]) -> tuple[str, ...]:
    """ALU op names from ``meta["alu"]`` (emulator) or ``meta["op"]``: a name or a tuple of names."""
    raw = meta.get("alu", meta.get("op", ""))
    items = raw if isinstance(raw, (tuple, list)) else (raw,)
    names = []
    for op in items:
        if op is None:
            continue
        name = getattr(op, "__name__", None) or str(op)
        names.append(name.rsplit(".", 1)[-1].lower())
    return tuple(names)


def _alu(meta: dict[str, object]) -> str:
    names = _alu_names(meta)
    return names[0] if len(names) == 1 else ""


def _matmul_dims(rec: TraceRecord) -> tuple[int, int, int]:
    meta = rec.meta_dict()
    if all(k in meta for k in ("K", "M", "N")):
        return int(str(meta["K"])), int(str(meta["M"])), int(str(meta["N"]))
    if len(rec.shapes) >= 3:
        stat, mov = rec.shapes[1], rec.shapes[2]
        return stat[0], _free(stat), _free(mov)
    raise ValueError(f"nc_matmul record needs meta K, M, N or shapes (dst, stationary, moving); got {rec}")


def _is_transpose(rec: TraceRecord) -> bool:
    return rec.op in ("nc_transpose", "transpose") or _meta_flag(rec.meta_dict(), "is_transpose")


def _tensor_cycles(rec: TraceRecord, p: Trn2CostParams) -> float:
    if _is_transpose(rec):
        src = rec.shapes[1] if len(rec.shapes) > 1 else (rec.partitions, rec.free_elems)
        parts, free = src[0], _free(src)
        return max(parts, min(p.transpose_min_cycles, free)) + p.matmul_overhead_cycles
    _, m, n = _matmul_dims(rec)
    srcs = rec.dtypes[1:] if len(rec.dtypes) > 1 else rec.dtypes
    factor = p.matmul_fp32_factor if any(d == "float32" for d in srcs) else 1.0
    moving = max(min(p.matmul_min_cycles, m), n) * factor
    load_stat = m / p.load_stationary_divisor
    body = max(moving, load_stat) if p.load_stationary_overlapped else moving + load_stat
    return body + p.matmul_overhead_cycles


def _vector_cycles(rec: TraceRecord, n: int, p: Trn2CostParams) -> float:
    meta = rec.meta_dict()
    alu = _alu(meta)
    src_bufs = rec.buffers[1:]
    psum = "psum" in rec.buffers
    low = bool(rec.dtypes) and all(d in _LOW_PRECISION for d in rec.dtypes)
    contiguous = bool(meta.get("contiguous", True))
    floor = p.vector_min_ii_cycles
    op = rec.op
    if op == "tensor_reduce":
        cyc = n / 2 if low and alu in _FAST_REDUCE_OPS else n
        return float(cyc)
    if op == "memset":
        cyc = n / 2 if rec.dtypes and rec.dtypes[0] in _LOW_PRECISION else n
        return max(floor, cyc)
    if op == "reciprocal" or "reciprocal" in _alu_names(meta):
        return max(floor, p.vector_reciprocal_factor * n)
    if op == "tensor_tensor":
        src_low = all(d in _LOW_PRECISION for d in rec.dtypes[1:])
        sbuf_srcs = all(b == "sbuf" for b in src_bufs)
        fast = "psum" in src_bufs or (src_low and sbuf_srcs and (alu in _FAST_TT_OPS or alu == ""))
        cyc = n if fast else 2 * n
        if p.vector_perf_mode and src_low and sbuf_srcs:
            cyc /= p.vector_perf_other_factor
        return max(floor, cyc)
    cyc = float(n)
    if p.vector_perf_mode and op in ("tensor_copy", "tensor_scalar"):
        if psum:
            cyc /= p.vector_perf_other_factor
        elif low and contiguous:
            cyc /= p.vector_perf_sbuf_factor
        elif low:
            cyc /= p.vector_perf_other_factor
    return max(floor, cyc)


def instruction_cycles(rec: TraceRecord, params: Trn2CostParams | None = None) -> float:
    """Engine cycles of one compute instruction (§4.1 formulas, v3 clocks applied by the caller).

    TensorE ``nc_matmul``: ``max(min(64, M), N) * (4 if fp32 operands) + overhead`` with LoadStationary
    ``M/4`` overlapped; transposes ``max(P, min(64, F)) + overhead``.  ScalarE: ``max(MIN_II, N)`` (+
    accumulator read for reducing activations).  VectorE: per-op formulas with the v3 performance-mode
    factors.  GpSimdE: ``start + N``.  Vector/Scalar/GpSimd add the static overhead when ``N`` is below
    ``small_instruction_elems`` and the access start.  ``N`` = elements per partition streamed.
    """
    p = params or _DEFAULT
    if rec.engine == "tensor":
        return _tensor_cycles(rec, p)
    if rec.engine not in ("vector", "scalar", "gpsimd"):
        raise ValueError(f"instruction_cycles: engine must be a compute engine, got {rec.engine!r}")
    n = rec.free_elems
    if len(rec.shapes) > 1:
        n = max(n, _free(rec.shapes[1]))
    if rec.engine == "scalar":
        cyc = float(max(p.scalar_min_ii_cycles, n))
        reduces = rec.op.endswith("_reduce") or _meta_flag(
            rec.meta_dict(), "reduce", "reduce_res", "has_reduce"
        )
        # the emulator records a reducing activation as shapes (dst, data, reduce_res[P, 1])
        if reduces or (rec.op == "activation" and len(rec.shapes) >= 3 and _free(rec.shapes[-1]) == 1):
            cyc += p.scalar_accumulate_cycles
    elif rec.engine == "gpsimd":
        cyc = float(p.gpsimd_start_cycles + n)
    else:
        cyc = _vector_cycles(rec, n, p)
    if n < p.small_instruction_elems:
        cyc += p.small_instruction_overhead_cycles
    return cyc + p.access_start_cycles


def instruction_ns(rec: TraceRecord, params: Trn2CostParams | None = None) -> float:
    """Modelled time of one compute instruction in ns: cycles / engine clock."""
    p = params or _DEFAULT
    return instruction_cycles(rec, p) / p.clock_ghz(rec.engine)


# ---------------------------------------------------------------------------------------------------
# Profile
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelProfile:
    """Modelled trn2 profile of one kernel launch.  All times in ns, all figures **modelled**.

    ``engine_busy_ns`` holds ``tensor``, ``vector``, ``scalar``, ``gpsimd`` and ``dma`` (the DMA time, the
    largest of ``dma_data_ns``, ``dma_issue_ns``, ``dma_queue_ns``, ``hbm_ns``), for the busiest core of
    each engine.  ``latency_ns`` = max over cores of (max engine time + ``non_overlap_ns``);
    ``serial_ns`` = the same with the engine times summed.  Byte counts and FLOPs are totals over cores.
    """

    kernel_name: str
    cores: int
    engine_busy_ns: dict[str, float]
    instructions: dict[str, int]
    dma_data_ns: float
    dma_issue_ns: float
    dma_queue_ns: float
    hbm_ns: float
    non_overlap_ns: float
    latency_ns: float
    serial_ns: float
    per_core_latency_ns: tuple[float, ...]
    bottleneck: str
    dma_bytes: int
    dma_bytes_read: int
    dma_bytes_written: int
    hbm_bytes_read: int
    hbm_bytes_written: int
    num_dma: int
    num_descriptors: int
    descriptor_histogram: dict[int, int]
    trace_descriptors: int
    flops: int
    tensor_flops: int
    peak_flops_per_core: float
    tensore_util: float
    tensore_busy_frac: float
    tensore_active_util: float
    dma_bound_ns: float
    notes: tuple[str, ...] = ()
    kind: str = "modelled"

    @property
    def hbm_bytes(self) -> int:
        return self.hbm_bytes_read + self.hbm_bytes_written

    @property
    def latency_us(self) -> float:
        return self.latency_ns / 1e3

    @property
    def dma_ns(self) -> float:
        return self.engine_busy_ns["dma"]

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["per_core_latency_ns"] = list(self.per_core_latency_ns)
        d["notes"] = list(self.notes)
        d["descriptor_histogram"] = {str(k): v for k, v in self.descriptor_histogram.items()}
        d["hbm_bytes"] = self.hbm_bytes
        return d

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.as_dict(), **kwargs)

    def table(self) -> str:
        """Aligned text table of the profile (every figure modelled)."""
        lat = self.latency_ns or 1.0
        rows = [("engine", "busy_us", "instr", "of_latency")]
        for eng in (*COMPUTE_ENGINES, "dma"):
            rows.append(
                (
                    eng,
                    f"{self.engine_busy_ns[eng] / 1e3:.3f}",
                    str(self.instructions.get(eng, 0)),
                    f"{100 * self.engine_busy_ns[eng] / lat:.1f}%",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [
            f"kernel {self.kernel_name or '?'}: MODELLED trn2 profile (cost model), cores={self.cores}",
            *(
                "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                for r in rows
            ),
        ]
        kv = [
            ("latency_us", f"{self.latency_ns / 1e3:.3f}  (bottleneck {self.bottleneck})"),
            ("non_overlap_us", f"{self.non_overlap_ns / 1e3:.3f}"),
            ("serial_us", f"{self.serial_ns / 1e3:.3f}"),
            (
                "dma terms_us",
                f"data {self.dma_data_ns / 1e3:.3f}  issue {self.dma_issue_ns / 1e3:.3f}  "
                f"queue {self.dma_queue_ns / 1e3:.3f}  hbm {self.hbm_ns / 1e3:.3f}",
            ),
            ("dma_bound_us", f"{self.dma_bound_ns / 1e3:.3f}"),
            ("dma_bytes", f"{self.dma_bytes:,}  (hbm {self.hbm_bytes:,})"),
            ("dma / descriptors", f"{self.num_dma:,} / {self.num_descriptors:,}"),
            ("flops", f"{self.flops:,}  (tensor {self.tensor_flops:,})"),
            (
                "tensore_util",
                f"{100 * self.tensore_util:.1f}%  (busy {100 * self.tensore_busy_frac:.1f}%, "
                f"active {100 * self.tensore_active_util:.1f}%)",
            ),
        ]
        kv += [("note", n) for n in self.notes]
        kw = max(len(k) for k, _ in kv)
        lines += [f"{k.ljust(kw)}  {v}" for k, v in kv]
        return "\n".join(lines)


@dataclass
class _Core:
    busy: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COMPUTE_ENGINES, 0.0))
    dma_engine_ns: list[float] = field(default_factory=list)
    issue_ns: float = 0.0
    num_dma: int = 0
    hbm_bytes: int = 0
    has_load: bool = False
    has_store: bool = False


def profile(trace: Trace, params: Trn2CostParams | None = None, cores: int = 1) -> KernelProfile:
    """Model ``trace`` on trn2 and return its :class:`KernelProfile` (all figures modelled).

    ``cores`` physical NeuronCores run the launch; logical program ``pid`` runs on core ``pid % cores``
    (so ``kernel[2]`` under LNC=2 with ``cores=2`` puts one program on each core; with ``cores=1`` both
    programs share one core's engines).  Engines of one core overlap perfectly; cores run in parallel and
    share HBM stacks pairwise (``hbm_cap_gbps(cores)``).
    """
    p = params or _DEFAULT
    if not isinstance(trace, Trace):
        raise TypeError(f"profile: trace must be a Trace, got {type(trace).__name__}")
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
        raise ValueError(f"profile: cores must be an int >= 1, got {cores!r}")
    per_core = [_Core(dma_engine_ns=[0.0] * p.dma_engines) for _ in range(cores)]
    instr: Counter[str] = Counter()
    hist: Counter[int] = Counter()
    flops = tensor_flops = 0
    dma_r = dma_w = hbm_r = hbm_w = moved = 0
    trace_desc = 0
    for rec, n in trace.entries():
        if n <= 0:
            continue
        core = per_core[rec.program_id % cores]
        instr[rec.engine] += n
        flops += rec.flops * n
        if rec.engine == "dma":
            c = dma_record_cost(rec, p)
            for e in range(c.engines_used):
                core.dma_engine_ns[e] += n * c.data_ns / c.engines_used
            core.issue_ns += n * c.issue_ns
            core.busy["gpsimd"] += n * c.swdge_ns
            core.num_dma += n
            core.hbm_bytes += n * (c.hbm_read + c.hbm_written)
            core.has_load |= rec.direction in ("hbm->sbuf", "hbm->hbm")
            core.has_store |= rec.direction in ("sbuf->hbm", "hbm->hbm")
            for s, k in c.descriptors:
                hist[s] += n * k
            trace_desc += n * rec.num_descriptors
            dma_r += n * rec.bytes_read
            dma_w += n * rec.bytes_written
            hbm_r += n * c.hbm_read
            hbm_w += n * c.hbm_written
            moved += n * c.bytes_moved
            continue
        core.busy[rec.engine] += n * instruction_ns(rec, p)
        if rec.engine == "tensor" and not _is_transpose(rec):
            f = rec.flops
            if f <= 0:
                kk, mm, nn = _matmul_dims(rec)
                f = 2 * kk * mm * nn
                flops += f * n
            tensor_flops += f * n

    hbm_cap = p.hbm_cap_gbps(cores)
    busy_max: dict[str, float] = dict.fromkeys((*COMPUTE_ENGINES, "dma"), 0.0)
    lat_list: list[float] = []
    serial = 0.0
    terms = {"data": 0.0, "issue": 0.0, "queue": 0.0, "hbm": 0.0, "non_overlap": 0.0}
    crit = (-1.0, "none")
    for core in per_core:
        data = max(core.dma_engine_ns)
        issue = core.issue_ns / p.hwdge_blocks
        queue = core.num_dma * p.dma_latency_ns / p.dma_queues
        hbm = core.hbm_bytes / hbm_cap
        dma = max(data, issue, queue, hbm)
        exposed = 0.0
        if core.num_dma:
            exposed = p.dma_latency_ns * (2 if core.has_load and core.has_store else 1)
        times = {**core.busy, "dma": dma}
        top = max(times, key=lambda k: times[k])
        lat = times[top] + exposed
        lat_list.append(lat)
        serial = max(serial, sum(times.values()) + exposed)
        for name, v in times.items():
            busy_max[name] = max(busy_max[name], v)
        for name, v in (
            ("data", data),
            ("issue", issue),
            ("queue", queue),
            ("hbm", hbm),
            ("non_overlap", exposed),
        ):
            terms[name] = max(terms[name], v)
        if lat > crit[0]:
            crit = (lat, top if times[top] > 0 else "none")
    latency = max(lat_list)
    peak = p.peak_bf16_flops
    tensor_busy = busy_max["tensor"]
    dma_bound = max(moved / (cores * p.dma_peak_gbps), (hbm_r + hbm_w) / (cores * hbm_cap))
    notes: list[str] = []
    if crit[1] == "dma" and busy_max["tensor"] > 0:
        notes.append(
            "DMA-bound kernel with matmuls: hardware throttles TensorE after idle gaps (§4.3); not modelled, "
            "real TensorE time may be longer"
        )
    if busy_max["vector"] > 0.5 * latency and busy_max["gpsimd"] > 0.5 * latency:
        notes.append("VectorE and GpSimdE both >50% busy: they share the SBUF bus on v3 (§2.1); not modelled")
    return KernelProfile(
        kernel_name=trace.kernel_name,
        cores=cores,
        engine_busy_ns=busy_max,
        instructions={e: instr.get(e, 0) for e in (*COMPUTE_ENGINES, "dma")},
        dma_data_ns=terms["data"],
        dma_issue_ns=terms["issue"],
        dma_queue_ns=terms["queue"],
        hbm_ns=terms["hbm"],
        non_overlap_ns=terms["non_overlap"],
        latency_ns=latency,
        serial_ns=serial,
        per_core_latency_ns=tuple(lat_list),
        bottleneck=crit[1],
        dma_bytes=moved,
        dma_bytes_read=dma_r,
        dma_bytes_written=dma_w,
        hbm_bytes_read=hbm_r,
        hbm_bytes_written=hbm_w,
        num_dma=instr.get("dma", 0),
        num_descriptors=sum(hist.values()),
        descriptor_histogram=dict(sorted(hist.items())),
        trace_descriptors=trace_desc,
        flops=flops,
        tensor_flops=tensor_flops,
        peak_flops_per_core=peak,
        tensore_util=tensor_flops / (peak * cores * latency * 1e-9) if latency > 0 else 0.0,
        tensore_busy_frac=tensor_busy / latency if latency > 0 else 0.0,
        tensore_active_util=tensor_flops / (peak * tensor_busy * 1e-9 * cores) if tensor_busy > 0 else 0.0,
        dma_bound_ns=dma_bound,
        notes=tuple(notes),
    )


_DEFAULT = Trn2CostParams()
