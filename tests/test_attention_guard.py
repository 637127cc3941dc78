"""``perf.attention_guard``: the guard quantity it records (``log l`` against the first key chunk's max)
against a hand computation, and one short instrumented stream (tiny preset, emulator vs reference)."""

from __future__ import annotations

import math

import pytest
import torch

from perf.attention_guard import _log_l, measure


def test_log_l_is_the_guards_quantity() -> None:
    # one query, one head, D = 1, scale 1: scores = k; first chunk (2 keys) max 1.0
    q = torch.ones(1, 1, 1, 1)
    k = torch.tensor([0.0, 1.0, 3.0, -2.0]).view(1, 4, 1, 1)
    high, low, chunks = _log_l(q, k, 1.0, 2)
    want = math.log(math.exp(0 - 1) + math.exp(0) + math.exp(3 - 1) + math.exp(-3))
    assert high == pytest.approx(want, rel=1e-12) and low == pytest.approx(want, rel=1e-12) and chunks == 2
    k[0, 3, 0, 0] = 80.0  # a later key 79 nats above the first chunk's max: past ln(1e30) = 69.08
    assert _log_l(q, k, 1.0, 2)[0] > 69.08
    # two queries in one tile: the second's scores are 50 below the first's, so against the tile's
    # maximum its log l is about -50 (below ln(1e-18) = -41.4)
    q2 = torch.tensor([1.0, -1.0]).view(1, 2, 1, 1)
    k2 = torch.tensor([50.0, 0.0, 0.0, 0.0]).view(1, 4, 1, 1)
    low2 = _log_l(q2, k2, 1.0, 2)[1]
    want2 = math.log(math.exp(-50) + 3.0) - 50.0
    assert low2 == pytest.approx(want2, rel=1e-9) and low2 < -41.4


@pytest.mark.emulator
def test_short_tiny_stream_counts_static_passes() -> None:
    row = measure("tiny", blocks=5)
    assert row.kind == "measured" and row.variant == "static_offset"
    e = row.extra
    assert e["static_passes"] > 0 and e["running_max_passes"] == 0
    assert e["attention_calls_watched"] > 0 and e["guard_log_l_max"] < e["guard_log_l_limit"]
    assert e["frames"] > 0
