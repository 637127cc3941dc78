"""Parameters of the trn2 cost model v2 (:class:`Trn2CostParams`), each with its public source.

A field's metadata holds ``source`` (a key of :data:`.sources.SOURCES` plus the figure, or "fitted to
points X, Y" naming calibration points of ``perf/calibration``) and, for a parameter no measurement
pins, ``range = (optimistic, pessimistic)``: the value giving the lowest and the highest modelled
latency.  :meth:`Trn2CostParams.low` / :meth:`Trn2CostParams.high` set every ranged field to one end;
``cost.profile_range`` evaluates a trace at both.  Units: clocks in GHz, times in ns, bandwidths in
GB/s (= bytes/ns), sizes in bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

__all__ = [
    "DMA_DESCRIPTOR_NS",
    "DMA_DESCRIPTOR_NS_HIGH",
    "DMA_EFFICIENCY_POINTS",
    "DMA_QUEUED_GBPS_POINTS",
    "DMA_QUEUED_GBPS_POINTS_HIGH",
    "Trn2CostParams",
    "small_descriptor_gbps",
    "small_queued_points",
]

#: Published trn2 throughput of ONE 128-partition DMA relative to the 32 KiB plateau, by contiguous
#: bytes per partition (DMA-OV figure nki-dma-intro-1.jpg, y axis unlabelled).  v2 does not charge
#: it per descriptor (that made queued small-descriptor DMAs 1.5-3.9x too slow); kept for reference and
#: for :func:`~.dma.dma_efficiency`.
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

#: Per-descriptor time of one of the 16 queued DMA engines beyond its bytes at DMA-BW's 23 B/ns (ns):
#: the measured queued throughput at 512 B (CS149 profile summaries, 298.7-302.5 GB/s: 27.25 ns per
#: descriptor and engine) and at 4 KiB (NAD-DMA, 354 GB/s: 185.1 ns) give a descriptor time
#: t(s) = t0 + s / b with b = 22.7 B/ns (DMA-BW: 23) and t0 = 4.7 ns.  It sets the queued throughput
#: at 256 B (:func:`small_descriptor_gbps`, :func:`small_queued_points`); the leave-one-source-out
#: re-fit checks it (``perf.calibration --loso``, knob ``dma_descriptor_ns``; docs/calibration.md).
DMA_DESCRIPTOR_NS = 4.7
DMA_ENGINE_BYTES_PER_NS = 23.0


def small_descriptor_gbps(size: int, descriptor_ns: float = DMA_DESCRIPTOR_NS) -> float:
    """Queued per-core throughput (GB/s) of ``size``-byte descriptors on 16 engines, each descriptor
    taking ``descriptor_ns + size / 23 B/ns`` (the rule of the table's 256 B entry)."""
    if size <= 0 or descriptor_ns < 0:
        raise ValueError(
            f"small_descriptor_gbps: size must be > 0 and descriptor_ns >= 0, got {size}, {descriptor_ns}"
        )
    return 16 * size / (descriptor_ns + size / DMA_ENGINE_BYTES_PER_NS)


def small_queued_points(descriptor_ns: float = DMA_DESCRIPTOR_NS) -> tuple[tuple[int, float], ...]:
    """The queued table below 512 B from a per-descriptor time: 256 B by :func:`small_descriptor_gbps`;
    below 256 B that figure scaled by the single-DMA curve's shape (DMA_EFFICIENCY_POINTS: 128 B = 256 B
    x 0.05 / 0.10, ...), because DMA-BW states that below 256 B per partition transfers are 'severely
    overhead-bound' at 'a small fraction of peak', which a per-descriptor time fitted at 512 B-4 KiB
    does not give (it would put 128 B at 54 % of peak).  Values rounded to 0.1 GB/s."""
    at256 = small_descriptor_gbps(256, descriptor_ns)
    eff = dict(DMA_EFFICIENCY_POINTS)
    return tuple((s, round(at256 * eff[s] / eff[256], 1)) for s in (32, 64, 128)) + ((256, round(at256, 1)),)


#: Per-core DMA throughput (GB/s) with several 128-partition DMAs queued, by descriptor bytes.
#: 512 B 299 (CS149 transpose profile, DMA-active time), 1 KiB 259 and 4 KiB 354 GB/s (NAD-DMA) are
#: measured; 2 KiB 244 is fitted to calibration point dma_2K_1K (NAD-BOUNDS V2: 2 KiB loads + 1 KiB
#: stores at 245.8 GB/s).  256 B: the per-descriptor time DMA_DESCRIPTOR_NS (derived from the 512 B
#: and 4 KiB measurements) gives 258.7 GB/s; below 256 B that figure scaled by the single-DMA curve's
#: shape (:func:`small_queued_points`: 128 B 129.4, 64 B 67.3, 32 B 36.2; DMA-BW: 'severely
#: overhead-bound' below 256 B).  (Until the leave-one-source-out re-derivation, 256 B was 50 GB/s
#: fitted to dma_256B_1K_mix, whose V1 DMAs are issue-bound: 2,304 DMAs x ~0.51 us is about its
#: DMA-active time, so that fit read the issue cost as a small-transfer rate; the curve's shape then
#: scaled 50 GB/s down to 7 GB/s at 32 B.)  Above 4 KiB the published single-DMA curve's shape (DMA-OV)
#: scales the 4 KiB point (32 KiB = 354 / 0.97).  The measured points are not monotonic (they come
#: from different kernels); the model follows them.
DMA_QUEUED_GBPS_POINTS: tuple[tuple[int, float], ...] = (
    *small_queued_points(),
    (512, 299.0),
    (1024, 259.0),
    (2048, 244.0),
    (4096, 354.0),
    (8192, 357.6),
    (16384, 361.3),
    (32768, 365.0),
)

#: The per-descriptor time no source holds for another: the 29-point leave-one-source-out re-fit
#: (docs/calibration.md) puts it at 23.2 ns on every point, 6.5 ns without the CS149 benchmark figures
#: (whose 4-8 B descriptors want slower tiny transfers) and 60.8 ns without the agentic repository (whose
#: 256 B loads want faster ones).  The table's pessimistic end takes the slowest re-fit (61 ns: 256 B at
#: 57.0 GB/s, close to the old 50 GB/s); the nominal and optimistic end the 4.7 ns derived from the two
#: measured rates.
DMA_DESCRIPTOR_NS_HIGH = 61.0
DMA_QUEUED_GBPS_POINTS_HIGH: tuple[tuple[int, float], ...] = (
    *small_queued_points(DMA_DESCRIPTOR_NS_HIGH),
    *DMA_QUEUED_GBPS_POINTS[4:],
)


def _p(default: Any, source: str, rng: tuple[Any, Any] | None = None) -> Any:
    """A field whose metadata names its source and, when unmeasured, its (optimistic, pessimistic) range."""
    meta: dict[str, Any] = {"source": source}
    if rng is not None:
        meta["range"] = rng
    return field(default=default, metadata=meta)


_NONNEG = frozenset(
    {
        "matmul_overhead_cycles",
        "matmul_small_tile_cycles",
        "small_instruction_overhead_cycles",
        "access_start_cycles",
        "scalar_psum_access_cycles",
        "vector_psum_access_cycles",
        "dma_completion_ns",
        "sync_ns",
        "tensor_throttle_gap_ns",
        "dge_none_issue_ns",
    }
)
_FRACTIONS = ("dma_transpose_hbm_efficiency", "dma_transpose_sbuf_efficiency")


@dataclass(frozen=True)
class Trn2CostParams:
    """Parameters of the trn2 cost model v2 for one physical NeuronCore-v3 (see module docstring).

    ``sources()`` lists every field's source; ``ranges()`` the unmeasured ones with their
    ``(optimistic, pessimistic)`` ends; ``low()`` / ``high()`` return the defaults with every ranged
    field at that end (``end("low"|"high")`` does the same from any instance).
    """

    # --- fixed time per kernel ------------------------------------------------------------------------
    kernel_fixed_ns: float = _p(
        12_850.0,
        "CS149 profiles: 12.4-13.3 us per kernel with every engine idle (measured spread -> range)",
        (12_400.0, 13_300.0),
    )
    sync_ns: float = _p(
        33.0,
        "unmeasured as a latency; bounded by CS149-PROF: on engines that run no compute in the profiled "
        "kernels every instruction is a semaphore/sync one (EXPLORER: EVENT_SEMAPHORE, increment or "
        "wait) and takes 26-33 ns of engine time (stream fd1k, both students: TensorE 69 in 2.24 us, "
        "ScalarE 63 in 1.94 us, GpSimd 67 in 1.76 us; transpose: GpSimd 191 in 5.79 us), 40-53 ns on the "
        "Sync engine (DMA triggers too). Nominal = one such instruction per cross-engine dependency "
        "(33 ns), pessimistic = two (the producer's increment and the consumer's wait, 66 ns), "
        "optimistic = 0 (both folded into the engines' own instructions); was 50 (0..100) from the "
        "~60-cycle access start (V2-ARCH). The calibration points do not pin it below 100 ns (geometric "
        "SD x1.176-1.177 from 0 to 100 ns) and disfavour 200 ns (x1.196: agentic_tp_v0 1.36 -> 1.68)",
        (0.0, 66.0),
    )
    engine_in_order: bool = _p(
        True,
        "unmeasured: each engine runs its instructions in NKI program order (nominal, the pessimistic end); "
        "the optimistic end lets an instruction fill an earlier idle gap of its engine once its inputs "
        "are ready (a compiler scheduler reordering independent work)",
        (False, True),
    )
    # --- TensorE --------------------------------------------------------------------------------------
    tensor_clock_ghz: float = _p(2.4, "TRN2-ARCH: TensorE 2.4 GHz")
    pe_rows: int = _p(128, "TRN2-ARCH: 128x128 PE array")
    pe_cols: int = _p(128, "TRN2-ARCH: 128x128 PE array")
    matmul_min_cycles: int = _p(64, "ISA: nc_matmul max(min(64, N_stat), N_mov)")
    matmul_fp32_factor: float = _p(4.0, "TRN2-ARCH: FP32 matmul ~4x BF16")
    matmul_overhead_cycles: int = _p(
        10,
        "fitted to NAD-TE: 2,048 back-to-back full bf16 matmuls at 77.2 TF, ~217 ns each vs 512 cycles "
        "= 213 ns -> 10 cycles per instruction",
    )
    matmul_small_tile_cycles: int = _p(
        160,
        "fitted to calibration point mixed_tiles (NAD-TE: 4 x 512 matmuls with M=32 / N=64 / K=32 / full "
        "tiles at 30.8 TF): extra cycles of a matmul with K, M or N below 128",
    )
    load_stationary_divisor: int = _p(4, "ISA: LoadStationary up to 4x faster than MultiplyMoving")
    load_stationary_overlapped: bool = _p(True, "ISA: LoadStationary loads in the background")
    transpose_min_cycles: int = _p(64, "ISA: nc_transpose on TensorE max(P, min(64, F))")
    transpose_fp32_factor: float = _p(
        4.0, "CS149 profiles: fp32 128x128 nc_transpose ~219 ns = (128*4 + 10) / 2.4 GHz"
    )
    fp8_double_row_flops: float = _p(
        2.0, "TRN2-ARCH: FP8 double-row [128,2,128]x[128,2,512] does 2x the FLOPs in the same cycles"
    )
    tensor_throttle_factor: float = _p(
        2.7,
        "NAD-BOUNDS: DMA-starved TensorE active time 4,806 us (V0) vs 1,781 us fed (V2) = 2.7x for "
        "matmuls that wait for their inputs",
    )
    tensor_throttle_gap_ns: float = _p(
        500.0,
        "unmeasured: TensorE idle gap after which the next instruction runs throttled (NAD-BOUNDS: "
        "'throttled transiently after idle gaps')",
        (2_000.0, 100.0),
    )
    # --- ScalarE --------------------------------------------------------------------------------------
    scalar_clock_ghz: float = _p(1.2, "TRN2-ARCH: ScalarE 1.2 GHz, 128 elements/cycle")
    scalar_min_ii_cycles: int = _p(64, "ISA: activation max(MIN_II, N), MIN_II ~64 (v2 constant)")
    scalar_accumulate_cycles: int = _p(64, "ISA: activation_reduce adds a MIN_II to read the accumulator")
    scalar_psum_access_cycles: int = _p(
        137, "fitted to CS149 profiles: [128,128] fp32 PSUM->SBUF on ScalarE ~221 ns = (128 + 137) / 1.2 GHz"
    )
    # --- VectorE --------------------------------------------------------------------------------------
    vector_clock_ghz: float = _p(0.96, "TRN2-ARCH: VectorE 0.96 GHz")
    vector_min_ii_cycles: int = _p(64, "ISA: max(64, N) for tensor_scalar/tensor_copy/tensor_tensor")
    vector_perf_mode: bool = _p(True, "TRN2-ARCH: v3 performance mode, detected automatically")
    vector_perf_sbuf_factor: float = _p(
        4.0, "TRN2-ARCH: 4x for tensor_copy/tensor_scalar, BF16/FP16 SBUF->SBUF, innermost contiguous"
    )
    vector_perf_other_factor: float = _p(
        2.0, "TRN2-ARCH: 2x when not contiguous, a (2-byte) PSUM operand, or tensor_tensor with BF16 inputs"
    )
    vector_psum_access_cycles: int = _p(
        141,
        "fitted to NAD-BOUNDS: [128,512] fp32->bf16 PSUM->SBUF on VectorE 672-688 ns = (512 + 141) / "
        "0.96 GHz (an fp32 PSUM source gets no performance-mode factor)",
    )
    vector_reciprocal_factor: float = _p(8.0, "ISA: reciprocal max(64, 8N)")
    vector_fp8_perf_mode: bool = _p(
        True,
        "unmeasured: FP8 operands get the BF16 performance-mode factors (TRN2-ARCH documents BF16/FP16 "
        "only); pessimistic end: FP8 at the 4-byte rate",
        (True, False),
    )
    vector_gpsimd_contention: float = _p(
        1.5,
        "unmeasured: slow-down of VectorE/GpSimd instructions while the other runs (TRN2-ARCH: they share "
        "the SBUF bus and VectorE's performance mode uses it)",
        (1.0, 2.0),
    )
    # --- GpSimdE --------------------------------------------------------------------------------------
    gpsimd_clock_ghz: float = _p(1.2, "TRN2-ARCH: GpSimdE 1.2 GHz")
    gpsimd_start_cycles: int = _p(150, "ISA: GpSimd ~150 start + N (v2 constant)")
    # --- per-instruction overheads on Vector/Scalar/GpSimd --------------------------------------------
    small_instruction_elems: int = _p(128, "PERF / ISA: >=128 elements per partition to be efficient")
    small_instruction_overhead_cycles: int = _p(
        100, "ISA / V2-ARCH: ~100 cycles static overhead for instructions with N << 128"
    )
    access_start_cycles: int = _p(
        0, "V2-ARCH: ~60-cycle SBUF/PSUM access start when not pipelined; 0 = pipelined streams"
    )
    # --- DMA ------------------------------------------------------------------------------------------
    dma_engines: int = _p(16, "DMA-OV: 16 DMA engines per core")
    partitions_per_dma_engine: int = _p(8, "DMA-OV: each engine serves 8 SBUF partitions (128/16)")
    dma_engine_gbps: float = _p(23.0, "DMA-BW: 23 B/ns per engine on Trn2 (plateau, single engine)")
    dma_efficiency_points: tuple[tuple[int, float], ...] = _p(
        DMA_EFFICIENCY_POINTS, "DMA-OV figure: single-DMA throughput vs bytes per partition"
    )
    dma_queued_gbps_points: tuple[tuple[int, float], ...] = _p(
        DMA_QUEUED_GBPS_POINTS,
        "NAD-DMA / NAD-BOUNDS / CS149 profiles measured queued throughput; 256 B and below from the "
        "per-descriptor time DMA_DESCRIPTOR_NS = 4.7 ns derived from the 512 B and 4 KiB measurements "
        "(see DMA_QUEUED_GBPS_POINTS); not held across sources (leave-one-source-out re-fits 6.5-61 ns), "
        "so ranged: pessimistic end the 61 ns re-fit (256 B at 57 GB/s)",
        (DMA_QUEUED_GBPS_POINTS, DMA_QUEUED_GBPS_POINTS_HIGH),
    )
    max_descriptor_bytes: int = _p(
        32768, "no documented maximum; the largest published curve point (DMA-OV, 32 KiB = plateau)"
    )
    dma_issue_ns: float = _p(
        510.0,
        "fitted to every calibration point of a default-compiled kernel (perf.calibration --loso, 29 "
        "points: the re-fit 511 ns and 508-511 ns with any one source held out with the 256 B rate as a "
        "knob; 490 ns and 427-513 ns with the per-descriptor time as the knob; was 486 fitted to CS149 "
        "ROW_CHUNK=1 alone); DGE: ~600 ns per hardware-DGE instruction (hwdge, and the compiler's choice "
        "for 'unknown'). AGENTIC-TP's 2,112 listed DMAs in 608-802 us contradict it (compiled count "
        "unpublished)",
    )
    dma_issue_lanes: int = _p(
        1,
        "fitted to CS149 ROW_CHUNK=1 and NAD-BOUNDS V0 (16,640 DMAs, DMA active 7,906 us): DMA "
        "instructions are issued one after another",
    )
    swdge_issue_ns: float = _p(
        510.0,
        "unmeasured: swdge builds descriptors on GpSimd (DGE); from the hwdge figure to twice it",
        (510.0, 1020.0),
    )
    dge_none_issue_ns: float = _p(
        230.0,
        "fitted to the CS149 profile points compiled --disable-dge (static descriptors prebuilt in HBM, "
        "DGE 'none'): the full re-fit 225-230 ns, 210-230 ns with another source held out, unpinned "
        "without them; range from 200 ns up to the hwdge figure",
        (200.0, 510.0),
    )
    dma_completion_ns: float = _p(
        0.0,
        "unmeasured beyond the issue cost: DMA-BW's ~1.3 us cross-engine latency minus the 0.51 us "
        "issue; nominal fitted to CS149 vector_add_stream FREE_DIM=200",
        (0.0, 800.0),
    )
    default_dge_mode: str = _p("hwdge", "DGE: NKI 0.6 dge_mode 'unknown' = compiler's choice; hwdge assumed")
    dma_transpose_hbm_efficiency: float = _p(
        0.64,
        "unmeasured: TRN2-ARCH 'HBM->SBUF up to ~90% of copy throughput'; range 90%..45%",
        (0.9, 0.45),
    )
    dma_transpose_sbuf_efficiency: float = _p(
        0.25,
        "unmeasured (no public trn2 timing): TRN2-ARCH 'SBUF->SBUF up to ~50%'; range 50%..12.5%, "
        "nominal the geometric middle",
        (0.5, 0.125),
    )
    # --- HBM ------------------------------------------------------------------------------------------
    hbm_stack_gbps: float = _p(725.0, "HW: 2.9 TB/s over 4 stacks = ~725 GB/s per stack")
    cores_per_hbm_stack: int = _p(2, "HW: each HBM stack is shared by 2 physical cores")

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (bool, str, tuple)):
                continue
            if f.name in _NONNEG:
                if v < 0:
                    raise ValueError(f"Trn2CostParams.{f.name} must be >= 0, got {v}")
            elif not v > 0:
                raise ValueError(f"Trn2CostParams.{f.name} must be > 0, got {v}")
        for name in ("dma_efficiency_points", "dma_queued_gbps_points"):
            pts = getattr(self, name)
            if len(pts) < 2:
                raise ValueError(f"Trn2CostParams.{name} needs at least 2 (bytes, value) points")
            sizes = [s for s, _ in pts]
            if sizes != sorted(sizes) or len(set(sizes)) != len(sizes) or sizes[0] <= 0:
                raise ValueError(
                    f"Trn2CostParams.{name} sizes must be positive and strictly increasing, got {sizes}"
                )
            if any(not v > 0 for _, v in pts):
                raise ValueError(f"Trn2CostParams.{name} values must be > 0")
        if any(e > 1.0 for _, e in self.dma_efficiency_points):
            raise ValueError("Trn2CostParams.dma_efficiency_points efficiencies must lie in (0, 1]")
        if self.default_dge_mode not in ("hwdge", "swdge", "none"):
            raise ValueError(
                "Trn2CostParams.default_dge_mode must be 'hwdge', 'swdge' or 'none', "
                f"got {self.default_dge_mode!r}"
            )
        for name in _FRACTIONS:
            if getattr(self, name) > 1.0:
                raise ValueError(f"Trn2CostParams.{name} must be in (0, 1], got {getattr(self, name)}")
        if self.vector_gpsimd_contention < 1.0 or self.tensor_throttle_factor < 1.0:
            raise ValueError(
                "Trn2CostParams.vector_gpsimd_contention and tensor_throttle_factor must be >= 1 "
                f"(slow-downs), got {self.vector_gpsimd_contention}, {self.tensor_throttle_factor}"
            )

    # --- ranges ---------------------------------------------------------------------------------------
    @classmethod
    def ranges(cls) -> dict[str, tuple[Any, Any]]:
        """``{field: (optimistic, pessimistic)}`` for every parameter no measurement pins."""
        return {f.name: f.metadata["range"] for f in fields(cls) if "range" in f.metadata}

    def end(self, which: str) -> Trn2CostParams:
        """This instance with every ranged field at its ``"low"`` (optimistic) or ``"high"`` end."""
        if which not in ("low", "high"):
            raise ValueError(f"Trn2CostParams.end: which must be 'low' or 'high', got {which!r}")
        i = 0 if which == "low" else 1
        return replace(self, **{k: v[i] for k, v in self.ranges().items()})

    @classmethod
    def low(cls) -> Trn2CostParams:
        """Defaults with every unmeasured parameter at its optimistic end (lowest modelled latency)."""
        return cls().end("low")

    @classmethod
    def high(cls) -> Trn2CostParams:
        """Defaults with every unmeasured parameter at its pessimistic end (highest modelled latency)."""
        return cls().end("high")

    @classmethod
    def sources(cls) -> dict[str, str]:
        """``{field name: source}`` for every parameter."""
        return {f.name: f.metadata["source"] for f in fields(cls)}

    # --- derived figures ------------------------------------------------------------------------------
    @property
    def peak_bf16_flops(self) -> float:
        """Dense BF16 TensorE peak of one core in FLOP/s: rows*cols*2*clock = 78.6e12 (HW)."""
        return self.pe_rows * self.pe_cols * 2 * self.tensor_clock_ghz * 1e9

    @property
    def dma_peak_gbps(self) -> float:
        """Plateau DMA bandwidth of one core: engines x per-engine rate = 368 GB/s (DMA-BW)."""
        return self.dma_engines * self.dma_engine_gbps

    def hbm_cap_gbps(self, cores: int) -> float:
        """HBM bandwidth available to each of ``cores`` cores packed pairwise on stacks (HW)."""
        return self.hbm_stack_gbps / min(max(cores, 1), self.cores_per_hbm_stack)

    def clock_ghz(self, engine: str) -> float:
        return {
            "tensor": self.tensor_clock_ghz,
            "vector": self.vector_clock_ghz,
            "scalar": self.scalar_clock_ghz,
            "gpsimd": self.gpsimd_clock_ghz,
        }[engine]


DEFAULT = Trn2CostParams()
