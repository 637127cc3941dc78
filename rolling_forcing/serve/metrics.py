"""Prometheus text exposition (format 0.0.4) of the server's counters, written by hand (no global
registry, no import-time state): a histogram, counters and gauges, rendered by :func:`render`.

Format reference: https://prometheus.io/docs/instrumenting/exposition_formats/ (text format 0.0.4).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# chunk cost buckets (seconds): the tiny preset's ~50 ms up to past the 750 ms deadline
CHUNK_BUCKETS: tuple[float, ...] = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    if math.isnan(x):
        return "NaN"
    return str(x) if isinstance(x, int) else repr(float(x))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


class Histogram:
    """Cumulative histogram with fixed upper bounds (thread-safe ``observe``)."""

    def __init__(self, buckets: Sequence[float] = CHUNK_BUCKETS) -> None:
        bs = tuple(float(b) for b in buckets)
        if not bs or any(b2 <= b1 for b1, b2 in zip(bs, bs[1:])):
            raise ValueError(f"buckets must be a non-empty increasing sequence, got {buckets}")
        self.buckets = bs
        self.counts = [0] * len(bs)
        self.count = 0
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self.count += 1
            self.sum += value
            for i, b in enumerate(self.buckets):
                if value <= b:
                    self.counts[i] += 1

    def copy(self) -> Histogram:
        """A snapshot (to render next to counters read at the same moment)."""
        h = Histogram(self.buckets)
        with self._lock:
            h.counts, h.count, h.sum = list(self.counts), self.count, self.sum
        return h

    def lines(self, name: str) -> list[str]:
        with self._lock:
            out = [f'{name}_bucket{{le="{_num(b)}"}} {c}' for b, c in zip(self.buckets, self.counts)]
            out += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {_num(self.sum)}"]
            out.append(f"{name}_count {self.count}")
        return out


def render(
    *,
    histograms: dict[str, tuple[str, Histogram]],
    counters: dict[str, tuple[str, list[tuple[dict[str, str], float]]]],
    gauges: dict[str, tuple[str, list[tuple[dict[str, str], float]]]],
) -> str:
    """The exposition text: per family ``# HELP``, ``# TYPE`` and its samples.

    ``histograms``: name -> (help, Histogram); ``counters`` / ``gauges``: name -> (help, [(labels, value)]).
    Counter names must end in ``_total``.
    """
    lines: list[str] = []
    for name, (help_, hist) in histograms.items():
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} histogram", *hist.lines(name)]
    for kind, fams in (("counter", counters), ("gauge", gauges)):
        for name, (help_, samples) in fams.items():
            if kind == "counter" and not name.endswith("_total"):
                raise ValueError(f"counter name must end in _total, got {name!r}")
            # text format 0.0.4: a counter's HELP and TYPE lines carry its sample name (with _total)
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
            lines += [f"{name}{_labels(lab)} {_num(v)}" for lab, v in samples]
    return "\n".join(lines) + "\n"


__all__ = ["CHUNK_BUCKETS", "CONTENT_TYPE", "Histogram", "render"]
