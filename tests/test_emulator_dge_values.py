"""``dge_mode`` given as its integer value (NKI 0.6 ``nki.isa.dge_mode``: unknown 0, swdge 1, hwdge 2, none 3;
nki-library's mlp_tkg / moe_tkg pass ``dge_mode=0`` and ``dge_mode=3``): the value means its member, so the
documented rules of that member apply -- ``dma_copy`` with ``hwdge`` (2) needs equal dtypes, a direct
``dma_transpose`` accepts only unknown (0) or hwdge (2), so ``none`` (3) is refused there -- and anything
that is no member nor member value is refused."""

from __future__ import annotations

import numpy as np
import pytest

from nki_kernels import emulator as emu
from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import language as nl
from nki_kernels.emulator import run

pytestmark = pytest.mark.emulator


def _copy(dge, dst_dtype=nl.float32):
    def k(x):
        t = nl.ndarray(x.shape, dst_dtype, buffer=nl.sbuf)
        nisa.dma_copy(t, x, dge_mode=dge)
        o = nl.ndarray(x.shape, dst_dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(o, t)
        return o

    return k


def _transpose(dge):
    def k(x):
        t = nl.ndarray((x.shape[1], x.shape[0]), x.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(t, x, dge_mode=dge)
        o = nl.ndarray(t.shape, t.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(o, t)
        return o

    return k


@pytest.mark.parametrize("dge", [0, 1, 2, 3])
def test_dma_copy_takes_every_member_value(dge):
    x = np.arange(64, dtype=np.float32).reshape(8, 8) - 20
    got, _ = run(_copy(dge), x)
    np.testing.assert_array_equal(got, x)


def test_the_value_of_hwdge_brings_its_equal_dtype_rule():
    x = np.zeros((8, 8), np.float32)
    with pytest.raises(
        emu.DtypeError, match=r"\[dma-dtype\] dma_copy with dge_mode=hwdge needs equal dtypes"
    ):
        run(_copy(2, nl.bfloat16), x)
    run(_copy(0, nl.bfloat16), x)  # unknown (0) converts through fp32


def test_direct_transpose_takes_unknown_and_hwdge_values_and_refuses_none():
    x = np.arange(16 * 24, dtype=np.float16).reshape(16, 24)
    for dge in (0, 2):
        got, _ = run(_transpose(dge), x)
        np.testing.assert_array_equal(got, x.T)
    with pytest.raises(emu.DmaTransposeError, match=r"\[dma-transpose-dge\] .* got none"):
        run(_transpose(3), x)


@pytest.mark.parametrize("bad", [4, -1, True, "hwdge", 2.0])
def test_anything_else_is_refused(bad):
    x = np.zeros((16, 24), np.float16)
    msg = r"dge_mode must be an nisa.dge_mode member or its value \(0-3\)"
    with pytest.raises(TypeError, match=f"dma_copy: {msg}"):
        run(_copy(bad, nl.float16), x)
    with pytest.raises(TypeError, match=f"dma_transpose: {msg}"):
        run(_transpose(bad), x)
