"""Kernel profile of the trn2 cost model v2: schedule or bound model, and the low/high range.

``profile(trace)`` returns a :class:`KernelProfile` (every figure **modelled**):

* with an event log (``Trace(keep_events=True)``): ``latency = max(schedule makespan, HBM bound) +
  kernel_fixed_ns`` from the dependency-aware schedule (:mod:`.schedule`), ``model="schedule"``;
* without one: the **bound model** (``model="bound"``, and a note says so): ``latency = max engine time
  + exposed DMA + kernel_fixed_ns``.

Both report ``bound_ns`` (the max-engine bound: busiest engine + exposed DMA + fixed) and ``serial_ns``
(sum of engine times + exposed DMA + fixed, plus ``sync_ns`` per cross-engine dependency the schedule
found).  Engine times: compute engines sum their instruction
prices; DMA is ``max(data / 16 engines, issue / lanes, HBM bytes / cap)``; VectorE and GpSimd both busy
add ``(contention - 1) * min(vector, gpsimd)`` to each; a DMA-bound TensorE is charged up to
``tensor_throttle_factor`` x its time (capped at the DMA time).  ``profile_range`` evaluates the trace
with every unmeasured parameter at its optimistic and its pessimistic end.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from ..trace import Trace
from .compute import instruction_ns, is_transpose, tensor_flops_of
from .dma import dma_record_cost
from .params import DEFAULT, Trn2CostParams
from .schedule import ScheduleResult, schedule_events

__all__ = ["COMPUTE_ENGINES", "KernelProfile", "profile", "profile_range"]

COMPUTE_ENGINES = ("tensor", "vector", "scalar", "gpsimd")
NO_EVENTS_NOTE = (
    "no event log (trace recorded without keep_events): latency is the bound model (busiest engine + "
    "exposed DMA + fixed), not the dependency-aware schedule"
)


@dataclass(frozen=True)
class KernelProfile:
    """Modelled trn2 profile of one kernel launch.  All times in ns, all figures **modelled**.

    ``latency_ns``: the schedule's makespan (``model == "schedule"``) or the bound model's latency
    (``model == "bound"``), both including ``fixed_ns``.  ``bound_ns``: max-engine bound; ``serial_ns``:
    serial bound.  ``engine_busy_ns`` holds ``tensor``, ``vector``, ``scalar``, ``gpsimd``, ``dma`` for
    the busiest core.  ``critical_path_ns`` / ``critical_engines``: the schedule's critical path (empty
    for the bound model).  Byte counts and FLOPs are totals over cores.
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
    model: str = "bound"
    fixed_ns: float = 0.0
    bound_ns: float = 0.0
    schedule_ns: float | None = None
    critical_path_ns: dict[str, float] = field(default_factory=dict)
    critical_engines: tuple[str, ...] = ()
    dependencies: int = 0
    cross_engine_dependencies: int = 0
    throttled_tensor_instructions: int = 0

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
        d["critical_engines"] = list(self.critical_engines)
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
            f"kernel {self.kernel_name or '?'}: MODELLED trn2 profile (cost model v2, {self.model}), "
            f"cores={self.cores}",
            *(
                "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                for r in rows
            ),
        ]
        crit = "  ".join(f"{k} {v / 1e3:.3f}" for k, v in self.critical_path_ns.items())
        kv = [
            (
                "latency_us",
                f"{self.latency_ns / 1e3:.3f}  (model {self.model}, bottleneck {self.bottleneck})",
            ),
            ("bound_us", f"{self.bound_ns / 1e3:.3f}  (max engine + exposed DMA + fixed)"),
            ("serial_us", f"{self.serial_ns / 1e3:.3f}"),
            ("fixed_us", f"{self.fixed_ns / 1e3:.3f}"),
            ("critical path_us", crit or "-"),
            (
                "dma terms_us",
                f"data {self.dma_data_ns / 1e3:.3f}  issue {self.dma_issue_ns / 1e3:.3f}  "
                f"hbm {self.hbm_ns / 1e3:.3f}",
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
    data_ns: float = 0.0
    issue_ns: float = 0.0
    first_issue_ns: float = -1.0
    num_dma: int = 0
    hbm_bytes: int = 0
    has_load: bool = False
    has_store: bool = False


def profile(
    trace: Trace, params: Trn2CostParams | None = None, cores: int = 1, schedule: bool | None = None
) -> KernelProfile:
    """Model ``trace`` on trn2 and return its :class:`KernelProfile` (all figures modelled).

    ``cores`` physical NeuronCores run the launch; program ``pid`` runs on core ``pid % cores``; cores
    share HBM stacks pairwise (``hbm_cap_gbps(cores)``).  ``schedule``: ``None`` = use the event log when
    the trace has one (else the bound model, with a note), ``False`` = bound model, ``True`` = require
    the event log (``ValueError`` without one).
    """
    p = params or DEFAULT
    if not isinstance(trace, Trace):
        raise TypeError(f"profile: trace must be a Trace, got {type(trace).__name__}")
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
        raise ValueError(f"profile: cores must be an int >= 1, got {cores!r}")
    has_events = bool(getattr(trace, "events_available", False))
    if schedule and not has_events:
        raise ValueError("profile: schedule=True needs a trace recorded with keep_events=True")
    use_schedule = has_events if schedule is None else bool(schedule)
    per_core = [_Core() for _ in range(cores)]
    instr: Counter[str] = Counter()
    hist: Counter[int] = Counter()
    flops = tensor_flops = 0
    dma_r = dma_w = hbm_r = hbm_w = moved = trace_desc = 0
    dma_costs: dict[int, Any] = {}
    for rec, n in trace.entries():
        if n <= 0:
            continue
        core = per_core[rec.program_id % cores]
        instr[rec.engine] += n
        flops += rec.flops * n
        if rec.engine == "dma":
            c = dma_record_cost(rec, p)
            dma_costs[id(rec)] = c
            core.data_ns += n * c.data_ns / p.dma_engines
            if c.mode == "swdge":
                core.busy["gpsimd"] += n * c.issue_ns
            else:
                core.issue_ns += n * c.issue_ns
                if core.first_issue_ns < 0:
                    core.first_issue_ns = c.issue_ns
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
        if rec.engine == "tensor" and not is_transpose(rec):
            f = tensor_flops_of(rec)
            if rec.flops <= 0:
                flops += f * n
            tensor_flops += f * n

    hbm_cap = p.hbm_cap_gbps(cores)
    busy_max: dict[str, float] = dict.fromkeys((*COMPUTE_ENGINES, "dma"), 0.0)
    bound_list: list[float] = []
    hbm_list: list[float] = []
    serial = 0.0
    terms = {"data": 0.0, "issue": 0.0, "queue": 0.0, "hbm": 0.0, "non_overlap": 0.0}
    crit = (-1.0, "none")
    notes: list[str] = []
    for core in per_core:
        data = core.data_ns
        issue = core.issue_ns / p.dma_issue_lanes
        hbm = core.hbm_bytes / hbm_cap
        dma = max(data, issue, hbm)
        times = {**core.busy, "dma": dma}
        if times["vector"] > 0 and times["gpsimd"] > 0 and p.vector_gpsimd_contention > 1.0:
            extra = (p.vector_gpsimd_contention - 1.0) * min(times["vector"], times["gpsimd"])
            times["vector"] += extra
            times["gpsimd"] += extra
        if 0 < times["tensor"] < dma:
            times["tensor"] = min(times["tensor"] * p.tensor_throttle_factor, dma)
        exposed = 0.0
        if core.num_dma:
            first = max(core.first_issue_ns, 0.0) + p.dma_completion_ns
            exposed = first * (2 if core.has_load and core.has_store else 1)
        top = max(times, key=lambda k: times[k])
        bound_list.append(times[top] + exposed + p.kernel_fixed_ns)
        hbm_list.append(hbm)
        serial = max(serial, sum(times.values()) + exposed + p.kernel_fixed_ns)
        for name, v in times.items():
            busy_max[name] = max(busy_max[name], v)
        for name, v in (
            ("data", data),
            ("issue", issue),
            ("queue", core.num_dma * p.dma_completion_ns / 16),
            ("hbm", hbm),
            ("non_overlap", exposed),
        ):
            terms[name] = max(terms[name], v)
        if bound_list[-1] > crit[0]:
            crit = (bound_list[-1], top if times[top] > 0 else "none")
    bound = max(bound_list)
    sched: ScheduleResult | None = None
    if use_schedule:
        events = trace.iter_events()
        sched = schedule_events(events, p, cores, dma_cost=_cached_dma(dma_costs, p))
        per_core_lat = [max(m, h) + p.kernel_fixed_ns for m, h in zip(sched.per_core_makespan_ns, hbm_list)]
        latency = max(per_core_lat)
        # the serial bound also pays every cross-engine semaphore the schedule found
        serial = max(serial + sched.cross_engine_dependencies * p.sync_ns, latency)
        for eng in COMPUTE_ENGINES:
            busy_max[eng] = sched.engine_busy_ns[eng]
        bottleneck = sched.critical_engines[0] if sched.critical_engines else "none"
    else:
        per_core_lat = bound_list
        latency = bound
        bottleneck = crit[1]
        notes.append(NO_EVENTS_NOTE)
        if crit[1] == "dma" and busy_max["tensor"] > 0:
            notes.append(
                "DMA-bound kernel with matmuls: TensorE charged up to tensor_throttle_factor x its time "
                "(throttling after idle gaps), capped at the DMA time"
            )
    peak = p.peak_bf16_flops
    tensor_busy = busy_max["tensor"]
    dma_bound = max(moved / (cores * p.dma_peak_gbps), (hbm_r + hbm_w) / (cores * hbm_cap))
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
        per_core_latency_ns=tuple(per_core_lat),
        bottleneck=bottleneck,
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
        model="schedule" if sched is not None else "bound",
        fixed_ns=p.kernel_fixed_ns,
        bound_ns=bound,
        schedule_ns=sched.makespan_ns if sched is not None else None,
        critical_path_ns=dict(sched.critical_path_ns) if sched is not None else {},
        critical_engines=sched.critical_engines if sched is not None else (),
        dependencies=sched.dependencies if sched is not None else 0,
        cross_engine_dependencies=sched.cross_engine_dependencies if sched is not None else 0,
        throttled_tensor_instructions=sched.throttled_tensor_instructions if sched is not None else 0,
    )


def _cached_dma(cache: dict[int, Any], p: Trn2CostParams) -> Any:
    def price(rec: Any) -> Any:
        c = cache.get(id(rec))
        return c if c is not None else dma_record_cost(rec, p)

    return price


def profile_range(
    trace: Trace, params: Trn2CostParams | None = None, cores: int = 1, schedule: bool | None = None
) -> tuple[KernelProfile, KernelProfile]:
    """``(low, high)`` profiles of ``trace``: every unmeasured parameter (``Trn2CostParams.ranges()``) at
    its optimistic, then its pessimistic end (other fields from ``params``).  Expect ``low.latency_ns <=
    high.latency_ns``: in-order engines make the schedule monotone in every price; the gap filling of
    the optimistic end (``engine_in_order=False``) can in rare cases break that (a list-scheduling
    anomaly), so both figures are reported as computed."""
    base = params or DEFAULT
    return (
        profile(trace, base.end("low"), cores=cores, schedule=schedule),
        profile(trace, base.end("high"), cores=cores, schedule=schedule),
    )
