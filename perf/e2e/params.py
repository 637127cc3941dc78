"""End-to-end parameters: :class:`E2EParams` (frozen, every field sourced) and its two ends.

Every measured parameter is a number; every parameter no public measurement pins is a :class:`Range`
(``low``, ``high``).  A model is evaluated at one :data:`END` at a time: ``"optimistic"`` takes every
range at its cheaper end and the optimistic collective model, ``"pessimistic"`` the dearer end and the
conservative collective model.  :meth:`E2EParams.at` resolves the ranges of one end into an
:class:`EndPoint` of plain numbers.  Every figure derived from them is *modelled*.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["ENDS", "KERNEL_FIXED_LOW_S", "Range", "E2EParams", "EndPoint", "kernel_fixed_range"]

ENDS = ("optimistic", "pessimistic")
"""The two ends every headline figure is given at (optimistic = low cost = high fps)."""


@dataclass(frozen=True)
class Range:
    """An unmeasured parameter: ``low <= high`` (both >= 0) and the public source of each end."""

    low: float
    high: float
    source: str

    def __post_init__(self) -> None:
        if not (0 <= self.low <= self.high):
            raise ValueError(f"Range needs 0 <= low <= high, got low={self.low!r} high={self.high!r}")

    def at(self, end: str) -> float:
        """``low`` at the optimistic end, ``high`` at the pessimistic end."""
        _check_end(end)
        return self.low if end == "optimistic" else self.high


def _check_end(end: str) -> None:
    if end not in ENDS:
        raise ValueError(f"end must be one of {ENDS}, got {end!r}")


KERNEL_FIXED_LOW_S = 2e-6
"""Optimistic fixed time of one kernel call inside a NEFF (DMA fixed latency + one hwdge issue)."""


def kernel_fixed_range() -> Range:
    """Default ``E2EParams.kernel_fixed_s``: low :data:`KERNEL_FIXED_LOW_S`, high the cost model v2's
    pessimistic ``kernel_fixed_ns`` (``nki_kernels.emulator.cost.Trn2CostParams.high()``), in seconds."""
    from nki_kernels.emulator.cost import Trn2CostParams

    high = Trn2CostParams.high().kernel_fixed_ns * 1e-9
    return Range(
        KERNEL_FIXED_LOW_S,
        high,
        "low: DMA fixed latency + hwdge issue (Neuron docs); high: cost model v2 "
        "Trn2CostParams.high().kernel_fixed_ns (trn2 profiles, CS149)",
    )


@dataclass(frozen=True)
class E2EParams:
    """End-to-end assumptions.  Sources (public; all trn2 = NeuronCore-v3):

    * ``peak_flops_per_core`` 78.6e12 = 128 x 128 x 2 x 2.4 GHz, the dense bf16 TensorE rate of one
      NeuronCore-v3 (AWS Neuron docs, ``nki/guides/architecture/trainium2_arch.rst``); MFU is quoted
      against ``cores x`` that and against the chip's published 667 TF (``trainium2.rst``).
    * ``hbm_Bps_per_core`` 2.9 TB/s / 8 (``trainium2.rst``: 2.9 TB/s per chip, 8 cores streaming).
    * ``vector_hz`` 0.96 GHz, ``scalar_hz`` 1.2 GHz, ``gpsimd_hz`` 1.2 GHz, 128 ``lanes``, one element per
      lane per cycle (trn2 architecture guide; no performance mode: the safe default).
    * ``neff_launch_s`` 145 us (the "~150 us") per NEFF launch, *measured* on trn2 by the open Rolling
      Forcing port (github.com/yahavb/rolling_forcing
      ``.claude/skills/rolling-forcing-trn2-benchmark/SKILL.md`` and ``docs/PAPER_parallelism_neuron.md``
      @ 264f5a8: submit 71 + host barrier 43 + hardware barrier 31 us); a number, not a range.
    * ``kernel_fixed_s``: fixed time of one kernel call inside a NEFF in which no engine computes; the
      ONE figure the end-to-end model charges per kernel call (the cost model's own fixed time is
      stripped from every traced kernel, ``perf/e2e/kernels.py``).  RANGE: low 2 us = the documented DMA
      fixed latency (~1.3 us cross-engine, Neuron docs ``nki/deep-dives/nki-dma-bandwidth-guide.rst``) +
      one hwdge DMA issue (~0.6 us, ``nki-dge.rst``), i.e. one pipeline fill/drain; high = the cost
      model's pessimistic ``Trn2CostParams.high().kernel_fixed_ns`` (13.3 us: the idle time every
      published standalone trn2 kernel profile shows, 12.4-13.3 us; Stanford CS149 asst4 trn2 profiles,
      e.g. github.com/xaviergonzalez/asst4-trainium2 @ d1552616), read from the cost model, not re-typed.
      Inside a larger NEFF no one measured it.
    * ``collective_barrier_s``: the barrier between a collective and the compute around it (every rank
      waits for the slowest, engines drain, semaphores).  RANGE: low 2 us = one documented per-hop
      latency (1-2 us, Neuron docs ``neuron-runtime/explore/intranode-collective-comm.rst``); high
      31 us = the hardware barrier the Rolling Forcing port measured per NEFF (source above).
    * ``vector_gpsimd_contention``: fraction of the shorter of VectorE's and GpSimd's busy time that the
      shared SBUF port serialises inside a kernel where both engines work (trn2 architecture guide:
      "VectorE and GpSimdE can access SBUF at the same time ... they share a bus, and VectorE's
      performance mode uses it").  RANGE 0 (independent) .. 1 (fully serialised): no published timing.
      Applied only to kernels NOT priced by cost model v2's schedule (the analytic or bound fallback):
      the schedule charges the contention itself (``Trn2CostParams.vector_gpsimd_contention``), so
      adding this term on top counted it twice (``perf.e2e.components.contended_s``).
    * ``comm_models``: the ``sharding.plan.CommModel`` line used at each end (optimistic, pessimistic):
      collective bandwidth on trn2 is not measured publicly (see ``docs/sharding.md``).
    * ``peer_neffs_per_forward`` 370: NEFF launches per rank of one forward of the Rolling Forcing port
      (``docs/compilation_pattern.md`` of the same repository: "Sub-module compile + NKI eager: ~370
      NEFFs/rank, 7.8-8.6 fps"); used only to model that port's configuration.
    * the project's targets (one trn2 chip, Wan2.1-1.3B, 480x832): ``target_fps`` 20 with
      ``target_headroom`` 0.2 (chunk <= 80 % of its deadline) at the pessimistic end, ``target_fps_bf16``
      16 without FP8 (the published Rolling Forcing figure), HBM ``target_hbm_bytes`` 11 GB in bf16 and
      ``target_hbm_fp8_bytes`` 8 GB with the FP8 KV cache; the pessimistic-optimistic spread of the chunk
      at most ``target_spread`` 0.15 of the pessimistic chunk (how much rests on unmeasured parameters).
    """

    peak_flops_per_core: float = 128 * 128 * 2 * 2.4e9
    chip_peak_flops_published: float = 667e12
    hbm_Bps_per_core: float = 2.9e12 / 8
    vector_hz: float = 0.96e9
    scalar_hz: float = 1.2e9
    gpsimd_hz: float = 1.2e9
    lanes: int = 128
    neff_launch_s: float = (71 + 43 + 31) * 1e-6
    kernel_fixed_s: Range = field(default_factory=lambda: kernel_fixed_range())
    collective_barrier_s: Range = Range(
        2e-6, 31e-6, "low: 1-2 us per hop (Neuron runtime docs); high: 31 us hardware barrier (RF port)"
    )
    vector_gpsimd_contention: Range = Range(0.0, 1.0, "shared SBUF bus (trn2 architecture guide); unmeasured")
    comm_models: tuple[str, str] = ("optimistic", "conservative")
    peer_neffs_per_forward: int = 370
    target_fps: float = 20.0
    target_headroom: float = 0.2
    target_fps_bf16: float = 16.0
    target_hbm_bytes: float = 11e9
    target_hbm_fp8_bytes: float = 8e9
    target_spread: float = 0.15

    def __post_init__(self) -> None:
        for name in ("peak_flops_per_core", "hbm_Bps_per_core", "vector_hz", "scalar_hz", "gpsimd_hz"):
            if getattr(self, name) <= 0:
                raise ValueError(f"E2EParams.{name} must be > 0, got {getattr(self, name)!r}")
        if self.neff_launch_s < 0:
            raise ValueError(f"E2EParams.neff_launch_s must be >= 0, got {self.neff_launch_s!r}")
        if self.vector_gpsimd_contention.high > 1:
            raise ValueError("E2EParams.vector_gpsimd_contention must lie in [0, 1]")
        if self.peer_neffs_per_forward < 1:
            raise ValueError(
                f"E2EParams.peer_neffs_per_forward must be >= 1, got {self.peer_neffs_per_forward}"
            )

    def ranges(self) -> dict[str, Range]:
        """The unmeasured parameters by name."""
        return {k: v for k, v in self.__dict__.items() if isinstance(v, Range)}

    def at(self, end: str) -> EndPoint:
        """Plain numbers of ``end`` (one of :data:`ENDS`)."""
        _check_end(end)
        from sharding.plan import CommModel

        cname = self.comm_models[ENDS.index(end)]
        comm = CommModel.optimistic() if cname == "optimistic" else CommModel.conservative()
        return EndPoint(
            end=end,
            kernel_fixed_s=self.kernel_fixed_s.at(end),
            collective_barrier_s=self.collective_barrier_s.at(end),
            vector_gpsimd_contention=self.vector_gpsimd_contention.at(end),
            comm_model=comm,
        )


@dataclass(frozen=True)
class EndPoint:
    """The resolved values of one end: ranges as numbers, the collective model as an object."""

    end: str
    kernel_fixed_s: float
    collective_barrier_s: float
    vector_gpsimd_contention: float
    comm_model: Any
