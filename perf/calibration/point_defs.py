"""Types of the calibration points (:class:`Source`, :class:`KernelRun`, :class:`Point`), the public
sources they cite, and the helpers the point tables use (:mod:`perf.calibration.points_matmul`,
:mod:`perf.calibration.points_small`; all points: :data:`perf.calibration.points.POINTS`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "AGENTIC",
    "AGENTIC_DMA",
    "AGENTIC_TE",
    "AGENTIC_TP",
    "CS149",
    "CS149_PROFILE",
    "CS149_PROF_FD1K",
    "CS149_PROF_FD2K",
    "CS149_PROF_TRANSPOSE",
    "F32",
    "MB_BF16",
    "SDK",
    "KernelRun",
    "Point",
    "Source",
    "bf16_arg",
    "f32_arg",
    "kernel_run",
    "run_pair",
    "us_from_gbps",
]

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
        """The GitHub URL of the file at ``commit``; for a device measurement (``repo`` starting with
        ``device:``, :func:`perf.neuron_points.device_points`) the rows file it was read from."""
        if self.repo.startswith("device:"):
            return self.path
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
        dge_mode: the descriptor-generation mode of the published run's DMAs where the source states
            it (``"none"``: compiled with ``--disable-dge``, static descriptors prebuilt in HBM); the
            point is then modelled with ``default_dge_mode`` set to it.  ``None``: the model's default.
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
    dge_mode: str | None = None

    def __post_init__(self) -> None:
        if self.dge_mode not in (None, "hwdge", "swdge", "none"):
            raise ValueError(
                f"Point {self.name}: dge_mode must be None, 'hwdge', 'swdge' or 'none', got {self.dge_mode!r}"
            )
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
AGENTIC_TP = Source(
    "aws-neuron/neuron-agentic-development",
    "skills/neuron-nki-profile-querying/references/investigations/redundant_te_transposes.md",
    "1598b0609adba24e476dd0b36fd0f6b6c4dddbf1",
    "worked example: 2048^3 bf16 tiled matmul, V0 with an nc_transpose per A tile vs V1 pre-transposed "
    "(bounds table: total_time and TE active)",
)
_RISHIC3 = "ef7e4ef89d99abee0fb9d74144a26d8db8fad39d"
_PROFILE_NOTE = (
    "neuron-profile view --output-format summary-text on trn2.3xlarge (compiler 2.21.18209), compiled "
    "with --disable-dge (part1/run_benchmark.py of the same commit; static DMA packets only); "
    "chenhzhu/asst4-trainium2 @ e30a10f5 publishes the same kernel's summary in part1/{}"
)
CS149_PROF_TRANSPOSE = Source(
    "rishic3/asst4-trainium2",
    "part1/profile_view_transpose_1024.txt",
    _RISHIC3,
    _PROFILE_NOTE.format("transpose_1024_perf.txt"),
)
CS149_PROF_FD1K = Source(
    "rishic3/asst4-trainium2",
    "part1/profile_view_stream_256k_fd1k.txt",
    _RISHIC3,
    _PROFILE_NOTE.format("profile_1k.txt"),
)
CS149_PROF_FD2K = Source(
    "rishic3/asst4-trainium2",
    "part1/profile_view_stream_256k_fd2k.txt",
    _RISHIC3,
    _PROFILE_NOTE.format("profile_2k.txt"),
)


def bf16_arg(shape: tuple[int, ...]) -> tuple[tuple[int, ...], str]:
    """A bf16 HBM input of ``shape`` for :class:`KernelRun` ``args``."""
    return (shape, MB_BF16)


def f32_arg(shape: tuple[int, ...]) -> tuple[tuple[int, ...], str]:
    """An fp32 HBM input of ``shape`` for :class:`KernelRun` ``args``."""
    return (shape, F32)


def kernel_run(
    kernel: str, *args: tuple[tuple[int, ...], str], count: int = 1, sbuf_check: bool = True, **kw: Any
) -> KernelRun:
    """A :class:`KernelRun` (keyword arguments sorted)."""
    return KernelRun(kernel, tuple(args), tuple(sorted(kw.items())), count, sbuf_check)


def run_pair(kernel: str, args: tuple, lo: int, hi: int, **kw: Any) -> tuple[KernelRun, KernelRun]:
    """Two runs of ``kernel`` with ``reps = count = lo`` and ``hi`` (slope / intercept points)."""
    return (
        kernel_run(kernel, *args, count=lo, reps=lo, **kw),
        kernel_run(kernel, *args, count=hi, reps=hi, **kw),
    )


def us_from_gbps(nbytes: int, gbps_lo: float, gbps_hi: float | None = None) -> tuple[float, float]:
    """Published GB/s -> microseconds for ``nbytes`` (the slower rate gives the longer time)."""
    hi_rate = gbps_hi if gbps_hi is not None else gbps_lo
    return (nbytes / (hi_rate * 1e3), nbytes / (gbps_lo * 1e3))
