"""nki_kernels.hw_limits against the limits the emulator enforces (its ``nl.tile_size`` and DMA rules).

The kernels size tiles with these ints; if one drifted from the target the emulator checks, a kernel would be
planned against a limit the hardware model does not have."""

from __future__ import annotations

import pytest

from nki_kernels import hw_limits
from nki_kernels.emulator import language as nl
from nki_kernels.emulator.isa._dma import hwdge_transpose_violation


@pytest.mark.parametrize(
    ("name", "field"),
    [
        ("PMAX", "pmax"),
        ("PSUM_BANK_FMAX", "psum_bank_fmax"),
        ("GEMM_STATIONARY_FMAX", "gemm_stationary_fmax"),
        ("GEMM_MOVING_FMAX", "gemm_moving_fmax"),
    ],
)
def test_constant_is_its_tile_size_field(name: str, field: str) -> None:
    assert getattr(hw_limits, name) == getattr(nl.tile_size, field)


def test_psum_bank_fmax_is_one_bank_of_fp32() -> None:
    assert nl.tile_size.psum_bank_fmax_bytes == hw_limits.PSUM_BANK_FMAX * 4


def test_hwdge_rows_is_the_2d_dma_transpose_row_count() -> None:
    rows = hw_limits.HWDGE_ROWS
    assert hwdge_transpose_violation((rows, 64), "bfloat16") is None
    for bad in (rows - 1, rows + 1, 2 * rows):
        assert hwdge_transpose_violation((bad, 64), "bfloat16") is not None


def test_all_lists_every_constant() -> None:
    public = {n for n in vars(hw_limits) if n.isupper()}
    assert set(hw_limits.__all__) == public
