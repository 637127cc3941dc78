"""Emulator limits and edge values at their exact boundary.

* Allocation: 128 partitions allowed, 129 rejected. The rule tests in tests/test_emulator_rules.py use 256
  or 200 partitions; a limit loosened by one (129 accepted) passes those.
* Values the random-data tests never produce: NaN and inf cast to integers, sign-sensitive binary ops
  (abs_max / abs_min) and the logical ops on operands where they differ from their neighbours.
Expected values are written out by hand from the NKI 0.6 semantics.
"""

from __future__ import annotations

import numpy as np
import pytest

from nki_kernels import emulator as emu
from nki_kernels.emulator import HwConfig, run
from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import language as nl
from tests.emulator_helpers import to_hbm, to_sbuf

pytestmark = pytest.mark.emulator


@pytest.mark.parametrize("buffer", ["sbuf", "psum"])
def test_129_partitions_rejected_at_allocation(buffer: str) -> None:
    def k():
        nl.ndarray((129, 4), nl.float32, buffer=getattr(nl, buffer))

    with pytest.raises(
        emu.PartitionLimitError, match=r"\[partition-limit\].*\[129, 4\].*128-partition limit"
    ):
        run(k)


@pytest.mark.parametrize("buffer", ["sbuf", "psum"])
def test_128_partitions_allowed_at_allocation(buffer: str) -> None:
    def k():
        t = nl.ndarray((128, 4), nl.float32, buffer=getattr(nl, buffer))
        return t.shape

    assert tuple(run(k)[0]) == (128, 4)


def test_partition_limit_follows_hw_config() -> None:
    # the limit is the configured pmax, not a literal: 64 partitions accept 64 and reject 65
    hw = HwConfig(pmax=64)

    def ok():
        return nl.ndarray((64, 2), nl.float32, buffer=nl.sbuf).shape

    def over():
        nl.ndarray((65, 2), nl.float32, buffer=nl.sbuf)

    assert tuple(run(ok, hw=hw)[0]) == (64, 2)
    with pytest.raises(emu.PartitionLimitError, match=r"\[65, 2\].*64-partition limit"):
        run(over, hw=hw)


def test_non_finite_float_to_int_cast_is_zero_or_saturates() -> None:
    # NKI 0.6 simulator semantics: NaN -> 0, +-inf saturate, halves round to even
    a = np.array([[np.nan, np.inf, -np.inf, 2.5, -2.5, np.nan]], dtype=np.float32)

    def k(x):
        d = nl.ndarray(x.shape, nl.int8)
        nisa.tensor_copy(d, to_sbuf(x))
        return to_hbm(d)

    got, _ = run(k, a)
    np.testing.assert_array_equal(got, np.array([[0, 127, -128, 2, -2, 0]], dtype=np.int8))


@pytest.mark.parametrize(
    ("op", "want"),
    [
        ("abs_max", [3.0, 4.0, 1.0, 0.25, 2.0]),
        ("abs_min", [1.0, 2.0, 0.5, 0.0, 0.0]),
        ("logical_xor", [0.0, 0.0, 0.0, 1.0, 1.0]),
        ("logical_or", [1.0, 1.0, 1.0, 1.0, 1.0]),
        ("logical_and", [1.0, 1.0, 1.0, 0.0, 0.0]),
    ],
)
def test_sign_and_logic_sensitive_binary_ops(op: str, want: list[float]) -> None:
    # negative a, negative b, both nonzero, one zero: each op differs from a plausible wrong neighbour here
    a = np.array([[-3.0, 2.0, -1.0, 0.0, -2.0]], dtype=np.float32)
    b = np.array([[1.0, -4.0, 0.5, -0.25, 0.0]], dtype=np.float32)

    def k(x, y):
        d = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(d, to_sbuf(x), to_sbuf(y), getattr(nl, op))
        return to_hbm(d)

    got, _ = run(k, a, b)
    np.testing.assert_array_equal(got, np.array([want], dtype=np.float32))


def test_repeated_identical_instructions_each_count() -> None:
    # the trace aggregates identical records with a count: 5 identical copies are 5 instructions
    a = np.ones((4, 8), dtype=np.float32)

    def k(x):
        t = to_sbuf(x)
        d = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        for _ in range(5):
            nisa.tensor_copy(d, t)
        return to_hbm(d)

    _, tr = run(k, a)
    assert tr.count(op="tensor_copy") == 5
    assert tr.num_instructions == 5 + 2  # + the two DMAs
    assert tr.num_instructions == sum(n for _, n in tr.entries())


def test_psum_tile_width_is_one_bank_of_fp32() -> None:
    # nl.tile_size.psum_fmax: fp32 elements per partition in one PSUM bank (2 KiB -> 512), following HwConfig
    def k():
        return (nl.tile_size.psum_fmax,)

    assert run(k)[0][0] == 512
    assert run(k, hw=HwConfig(psum_bank_bytes=1024))[0][0] == 256


def test_loop_ranges_cover_exactly_their_bounds() -> None:
    # affine/sequential ranges honour start, stop and step; fori_loop runs lower..upper-1 with its step
    seen: dict[str, list[int]] = {"affine": [], "seq": [], "fori": [], "fori2": []}

    def k():
        for i in nl.affine_range(1, 9, 3):
            seen["affine"].append(i)
        for i in nl.sequential_range(4):
            seen["seq"].append(i)
        nl.fori_loop(2, 5, lambda r: seen["fori"].append(int(r.value)))
        nl.fori_loop(0, 7, lambda r: seen["fori2"].append(int(r.value)), step=3)
        return ()

    run(k)
    assert seen == {"affine": [1, 4, 7], "seq": [0, 1, 2, 3], "fori": [2, 3, 4], "fori2": [0, 3, 6]}
