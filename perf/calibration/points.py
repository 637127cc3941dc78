"""The published trn2 calibration points: what was measured, where it is published, and which
re-implemented kernel (and which difference of runs) the model is compared on.

Every ``measured`` figure here is a **published trn2 measurement** (public source in
:attr:`Point.source`), never a figure measured on this machine.  Every kernel is this project's own
re-implementation (:mod:`perf.calibration.kernels_matmul`, :mod:`perf.calibration.kernels_small`).
The tables live in :mod:`perf.calibration.points_matmul` and :mod:`perf.calibration.points_small`, the
types and sources in :mod:`perf.calibration.point_defs`.

Methods (how the modelled figure is formed from the model's latency, so fixed costs cancel where the
published figure excludes them):

* ``"latency"``: the modelled latency of one run.
* ``"slope"``: ``(lat(run_b) - lat(run_a)) / (count_b - count_a) * units``: the marginal time of one unit
  of repeated work (an instruction, or the published amount of DMA traffic).
* ``"intercept"``: ``lat(run_a) - count_a * slope``: the modelled time of a kernel with no work at all.
"""

from __future__ import annotations

from perf.calibration.point_defs import KernelRun, Point, Source
from perf.calibration.points_matmul import MATMUL_POINTS
from perf.calibration.points_small import SMALL_POINTS

__all__ = ["Source", "KernelRun", "Point", "POINTS", "point_names"]

_ORDER = (
    "agentic_v0", "agentic_v1", "agentic_v2", "mixed_tiles", "matmul_b2b", "evict_vector",
    "sdk_tiled", "sdk_hoisted", "sdk_blocked_mn", "sdk_blocked_mnk",
    "cs149_tiled_rc1", "cs149_tiled_rc128", "cs149_stream_fd2", "cs149_stream_fd200", "cs149_transpose",
    "fixed_idle", "dma_issue", "pe_transpose_fp32", "evict_scalar",
    "dma_512B", "dma_256B_1K_mix", "dma_1K", "dma_2K_1K", "dma_4K",
)  # fmt: skip


def _ordered() -> tuple[Point, ...]:
    by = {p.name: p for p in (*MATMUL_POINTS, *SMALL_POINTS)}
    if len(by) != len(MATMUL_POINTS) + len(SMALL_POINTS):
        raise ValueError("calibration points: duplicate point names")
    rest = [n for n in by if n not in _ORDER]
    return tuple(by[n] for n in (*_ORDER, *rest))


POINTS: tuple[Point, ...] = _ordered()
"""Every calibration point, in table order (the original 24, then later additions in table order)."""


def point_names() -> tuple[str, ...]:
    return tuple(p.name for p in POINTS)
