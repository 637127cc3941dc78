"""Emulator allocation limits at their exact boundary (issue 17): 128 partitions allowed, 129 rejected.

The rule tests in tests/test_emulator_rules.py use 256 or 200 partitions; a limit loosened by one (129
accepted) passes those, so here every on-chip buffer is allocated at 128 (must work) and 129 (must raise).
"""

from __future__ import annotations

import pytest

from nki_kernels import emulator as emu
from nki_kernels.emulator import HwConfig, run
from nki_kernels.emulator import language as nl

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
