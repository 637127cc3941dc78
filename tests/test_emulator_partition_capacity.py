"""On-chip capacity per partition actually used (nki_kernels/emulator/placement.py, docs/emulator.md).

A tile ``[p, ...]`` occupies its bytes on its own ``p`` partitions only; an unplaced tile may start at any
partition the engines accept for its size (``p > 64``: 0; ``33..64``: 0/64; ``<= 32``: 0/32/64/96).  So
tiles on few partitions that do not fit stacked on partition 0 fit side by side (accepted, values checked),
while a set that overflows some partition under every placement is still refused, as is a single tile whose
bytes per partition exceed the budget.  :func:`min_peak` is checked against a brute force over every start
partition of every tile with a 128-entry per-partition load (an independent reference).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from nki_kernels import emulator as emu
from nki_kernels.emulator import HwConfig, TensorSpec, run
from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import language as nl
from nki_kernels.emulator.placement import min_peak

pytestmark = pytest.mark.emulator

BUDGET = 64 * 1024
HW = HwConfig(sbuf_bytes_per_partition=BUDGET)


def _tiles_kernel(x, parts_list, free):
    """x: HBM [128, free] fp32.  One SBUF tile [p, free] fp32 per entry of ``parts_list``, all live at once
    (each loaded from x's first p rows, then summed row-wise into the first tile's rows by one read each).
    Returns out [parts_list[0], free] = x[:p0] * len(parts_list) restricted to the common rows."""
    p0 = parts_list[0]
    tiles = []
    for i, p in enumerate(parts_list):
        t = nl.ndarray((p, free), nl.float32, buffer=nl.sbuf, name=f"t{i}")
        nisa.dma_copy(t, x[0:p, :])
        tiles.append(t)
    acc = nl.ndarray((p0, free), nl.float32, buffer=nl.sbuf, name="acc")
    nisa.memset(acc, 0.0)
    for t in tiles:  # every tile is read after every tile was written: all live together
        q = min(p0, t.shape[0])
        nisa.tensor_tensor(acc[0:q, :], acc[0:q, :], t[0:q, :], nl.add)
    out = nl.ndarray((p0, free), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(out, acc)
    return out


def test_small_partition_tiles_fit_side_by_side_and_compute():
    # 6 tiles of [32, 4096] fp32 = 16 KiB/partition each + acc 16 KiB: 112 KiB if stacked on partition 0
    # (over 64 KiB), 2 tiles + acc = 48 KiB on the fullest quadrant when spread.
    free = 4096
    x = np.random.default_rng(1).standard_normal((128, free)).astype(np.float32)
    out, _ = run(_tiles_kernel, x, [32] * 6, free, hw=HW)
    ref = np.zeros((32, free), np.float32)
    for _ in range(6):
        ref = ref + x[:32]  # the same fp32 additions in the same order
    np.testing.assert_array_equal(out, ref)
    run(_tiles_kernel, TensorSpec((128, free), "float32"), [32] * 6, free, hw=HW, trace_only=True)


def test_small_partition_tiles_that_overflow_every_placement_are_refused():
    # [32, 4096] fp32 tiles of 16 KiB/partition, acc one of them: 16 tiles (15 + acc) fill the 4 quadrants
    # with 4 each = 64 KiB, exactly the budget; 17 (16 + acc) put 5 on some quadrant: 80 KiB.
    with pytest.raises(
        emu.SbufCapacityError, match=r"\[sbuf-capacity\] program 0: live SBUF peaks at 81920 B/part"
    ):
        run(_tiles_kernel, TensorSpec((128, 4096), "float32"), [32] * 16, 4096, hw=HW, trace_only=True)
    run(_tiles_kernel, TensorSpec((128, 4096), "float32"), [32] * 15, 4096, hw=HW, trace_only=True)


def test_ninety_six_partition_tile_leaves_the_last_quadrant_free():
    # t0 [96, 6144] 24 KiB + acc [96, 6144] 24 KiB on quadrants 0-2 (48 KiB); t1 [32, 6144] 24 KiB fits on
    # quadrant 3 only.  With t0 on 128 partitions (it and acc then cover every quadrant) t1 cannot fit
    # anywhere: 72 KiB on its quadrant.
    x = np.random.default_rng(2).standard_normal((128, 6144)).astype(np.float32)
    out, _ = run(_tiles_kernel, x, [96, 32], 6144, hw=HW)
    ref = np.zeros((96, 6144), np.float32)
    ref = ref + x[:96]
    ref[:32] = ref[:32] + x[:32]
    np.testing.assert_array_equal(out, ref)
    with pytest.raises(emu.SbufCapacityError, match=r"peaks at 73728 B/partition"):
        run(_tiles_kernel, TensorSpec((128, 6144), "float32"), [128, 32], 6144, hw=HW, trace_only=True)


def test_one_tile_over_the_per_partition_budget_is_refused_at_allocation():
    def k():
        nl.ndarray((1, BUDGET // 4 + 1), nl.float32, buffer=nl.sbuf)

    with pytest.raises(emu.SbufCapacityError, match=r"needs 65540 B/partition, over the 65536"):
        run(k, hw=HW, trace_only=True)


def _brute(tiles):
    """Smallest max per-partition load over every legal start of every unplaced tile (128 partitions)."""
    choices = []
    for parts, _, start in tiles:
        if start is not None:
            choices.append((start,))
        elif parts > 64:
            choices.append((0,))
        elif parts > 32:
            choices.append((0, 64))
        else:
            choices.append((0, 32, 64, 96))
    best = None
    for starts in itertools.product(*choices):
        load = np.zeros(128, np.int64)
        for (parts, nbytes, _), s in zip(tiles, starts):
            load[s : s + parts] += nbytes
        m = int(load.max())
        best = m if best is None else min(best, m)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_min_peak_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 7))
    tiles = []
    for _ in range(n):
        parts = int(rng.choice([1, 7, 16, 32, 33, 40, 64, 65, 96, 128]))
        nbytes = int(rng.integers(1, 50)) * 100
        start = None
        if rng.random() < 0.15 and parts <= 32:
            start = int(rng.choice([0, 32, 64, 96]))
        tiles.append((parts, nbytes, start))
    peak, exact = min_peak(tiles, budget=0)  # budget 0: search for the true minimum
    assert exact
    assert peak == _brute(tiles)
