"""Measured CPU wall time of the cost model v2's dependency-aware schedule on a synthetic event log.

``python -m perf.bench_cost_schedule [--events N]`` builds an attention-like event stream from the
event-log contract (per step: a DMA load, a matmul into a PSUM bank, a ScalarE exp reading PSUM, a
VectorE reduce, a store every 8 steps; rotating buffers) and times :func:`schedule_events` on it.
Printed figures: events, **measured** wall seconds, events/s, and the **modelled** makespan.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from nki_kernels.emulator.cost import Trn2CostParams, schedule_events
from nki_kernels.emulator.trace import TraceRecord


class Region(NamedTuple):
    space: str
    buf: int
    p0: int
    p1: int
    b0: int
    b1: int


def _rec(
    op: str, engine: str, n: int, dtypes: tuple[str, ...], bufs: tuple[str, ...], **kw: Any
) -> TraceRecord:
    return TraceRecord(op, engine, tuple((128, n) for _ in dtypes), dtypes, bufs, 128, n, **kw)


def synthetic_events(n_events: int) -> Iterator[tuple[TraceRecord, tuple[Region, ...], tuple[Region, ...]]]:
    """``n_events`` events of the attention-like stream (module docstring), program order."""
    load = _rec("dma_copy", "dma", 512, ("bfloat16",) * 2, ("sbuf", "hbm"), bytes_read=131072,
                bytes_written=131072, descriptors=((1024, 128),), direction="hbm->sbuf")  # fmt: skip
    store = _rec("dma_copy", "dma", 512, ("bfloat16",) * 2, ("hbm", "sbuf"), bytes_read=131072,
                 bytes_written=131072, descriptors=((1024, 128),), direction="sbuf->hbm")  # fmt: skip
    mm = TraceRecord("nc_matmul", "tensor", ((128, 512), (128, 128), (128, 512)),
                     ("float32", "bfloat16", "bfloat16"), ("psum", "sbuf", "sbuf"), 128, 512,
                     flops=2 * 128 * 128 * 512, meta=(("K", 128), ("M", 128), ("N", 512)))  # fmt: skip
    act = _rec("activation", "scalar", 512, ("bfloat16", "float32"), ("sbuf", "psum"))
    red = _rec("tensor_reduce", "vector", 512, ("float32", "bfloat16"), ("sbuf", "sbuf"))
    q = Region("sbuf", 1, 0, 128, 0, 256)
    i = k = 0
    while True:
        kv = Region("sbuf", 10 + k % 4, 0, 128, 0, 1024)
        bank = Region("psum", 100 + k % 8, 0, 128, 0, 2048)
        p = Region("sbuf", 200 + k % 3, 0, 128, 0, 1024)
        m = Region("sbuf", 300 + k % 2, 0, 128, 4 * (k % 64), 4 * (k % 64) + 4)
        for ev in (
            (load, (Region("hbm", 0, 0, 0, k * 131072, (k + 1) * 131072),), (kv,)),
            (mm, (q, kv), (bank,)),
            (act, (bank,), (p,)),
            (red, (p,), (m,)),
            *(
                ((store, (p,), (Region("hbm", 1, 0, 0, k * 131072, (k + 1) * 131072),)),)
                if k % 8 == 7
                else ()
            ),
        ):
            if i == n_events:
                return
            yield ev
            i += 1
        k += 1


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m perf.bench_cost_schedule", description=__doc__.split("\n")[0]
    )
    ap.add_argument(
        "--events", type=int, default=1_500_000, help="events in the synthetic log (default 1.5 M)"
    )
    a = ap.parse_args(argv)
    if a.events < 1:
        ap.error(f"--events must be >= 1, got {a.events}")
    events = list(synthetic_events(a.events))
    t0 = time.perf_counter()
    r = schedule_events(events, Trn2CostParams())
    wall = time.perf_counter() - t0
    print(f"events {r.events:,}  measured wall {wall:.2f} s  ({r.events / wall:,.0f} events/s, CPU)")
    print(f"modelled makespan {r.makespan_ns / 1e3:,.1f} us  critical path {r.critical_engines}  "
          f"dependencies {r.dependencies:,} (cross-engine {r.cross_engine_dependencies:,})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
