"""Analytical trn2 (NeuronCore-v3) cost model v2: turns an emulator :class:`~..trace.Trace` into a
*modelled* :class:`KernelProfile`.

Every figure is **modelled** (formulas over the trace, parameters from public documents or fitted to
published trn2 measurements), never a measurement.  ``docs/cost_model.md`` explains the model.  Modules,
one seam each:

* :mod:`.params` -- :class:`Trn2CostParams` (every field sourced; unmeasured ones are ranges);
* :mod:`.dma` -- DMA pricing (descriptors, queued throughput, issue per DGE mode);
* :mod:`.compute` -- compute-instruction pricing per engine;
* :mod:`.schedule` -- the dependency-aware schedule over the event log;
* :mod:`.profile` -- :func:`profile`, :func:`profile_range`, :class:`KernelProfile`.
"""

from .compute import instruction_cycles, instruction_ns, is_double_row, matmul_dims
from .dma import DmaRecordCost, dma_efficiency, dma_record_cost, queued_gbps, split_descriptors
from .params import DMA_EFFICIENCY_POINTS, DMA_QUEUED_GBPS_POINTS, Trn2CostParams
from .profile import COMPUTE_ENGINES, NO_EVENTS_NOTE, KernelProfile, profile, profile_range
from .schedule import ScheduleResult, schedule_events
from .sources import SOURCES

__all__ = [
    "COMPUTE_ENGINES",
    "DMA_EFFICIENCY_POINTS",
    "DMA_QUEUED_GBPS_POINTS",
    "NO_EVENTS_NOTE",
    "SOURCES",
    "DmaRecordCost",
    "KernelProfile",
    "ScheduleResult",
    "Trn2CostParams",
    "dma_efficiency",
    "dma_record_cost",
    "instruction_cycles",
    "instruction_ns",
    "is_double_row",
    "matmul_dims",
    "profile",
    "profile_range",
    "queued_gbps",
    "schedule_events",
    "split_descriptors",
]
