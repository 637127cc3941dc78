"""``dma_transpose`` per DGE mode, from the NKI 0.6 docstring and the trn2 architecture guide.

* docstring ("DMA Direct Transpose Constraints"): dge_mode unknown or hwdge; *if hwdge*, the hardware-DGE
  rules (2-D ``src.shape[0] == 16``; 3-/4-D ``src.shape[0]`` in {1,2,4,8,16} and
  ``(src.shape[0]*src.shape[-2]) % 16 == 0``; 2-byte dtype); unknown = the compiler chooses;
* trn2 architecture guide ("DMA Transpose"): "bit-accurate transposition for both 2-byte and 4-byte data
  types", HBM->SBUF and SBUF->SBUF;
* default permutation: 2-D (1, 0), 3-D (2, 1, 0), 4-D (3, 1, 2, 0).
"""

from __future__ import annotations

import numpy as np
import pytest

from nki_kernels import emulator as emu
from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import language as nl
from nki_kernels.emulator import run
from nki_kernels.emulator.isa._dma import direct_transpose_lowering

pytestmark = pytest.mark.emulator


def _transpose_kernel(dst_shape, axes=None, dge=None, via_sbuf=False):
    def k(x):
        dst = nl.ndarray(dst_shape, x.dtype, buffer=nl.sbuf)
        src = x
        if via_sbuf:
            src = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=src, src=x)
        kw = {} if dge is None else {"dge_mode": dge}
        nisa.dma_transpose(dst, src, axes=axes, **kw)
        out = nl.ndarray(dst_shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=dst)
        return out

    return k


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32 if a.itemsize == 4 else np.uint16)


@pytest.mark.parametrize("via_sbuf", [False, True])
def test_unknown_mode_transposes_4_byte_and_hwdge_illegal_shapes_bit_exactly(via_sbuf: bool) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 24)).astype(np.float32)
    x[3, 5], x[7, 1] = np.nan, -np.inf  # bit-accurate: NaN/Inf pass through
    out, tr = run(_transpose_kernel((24, 40), via_sbuf=via_sbuf), x)  # fp32, 40 rows: not hwdge-legal
    np.testing.assert_array_equal(_bits(np.asarray(out)), _bits(np.ascontiguousarray(x.T)))
    assert tr.count(op="dma_transpose") == 1
    # 2-byte with a hwdge-illegal shape: also legal under unknown
    y = rng.standard_normal((128, 64)).astype(np.float16)
    out2, _ = run(_transpose_kernel((64, 128), via_sbuf=via_sbuf), y)
    np.testing.assert_array_equal(np.asarray(out2), y.T)


def test_hwdge_forced_applies_the_hardware_dge_rules() -> None:
    x = np.zeros((40, 24), np.float16)
    with pytest.raises(
        emu.DmaTransposeError, match=r"\[dma-transpose-hwdge\] a 2-D .*== 16, got src\[40, 24\]"
    ):
        run(_transpose_kernel((24, 40), dge=nisa.dge_mode.hwdge), x)
    with pytest.raises(emu.DtypeError, match=r"\[dma-transpose-dtype\] .*2-byte dtype, got float32"):
        run(_transpose_kernel((24, 16), dge=nisa.dge_mode.hwdge), np.zeros((16, 24), np.float32))
    ok, _ = run(
        _transpose_kernel((24, 16), dge=nisa.dge_mode.hwdge), np.arange(384, dtype=np.float16).reshape(16, 24)
    )
    np.testing.assert_array_equal(np.asarray(ok), np.arange(384, dtype=np.float16).reshape(16, 24).T)


def test_lowering_choice_table() -> None:
    """hwdge where its rules hold; else, under unknown, the plain DMA transpose for 2-/4-byte dtypes; where
    neither is legal the error names both rules."""
    assert direct_transpose_lowering((16, 64), "bfloat16", hwdge_forced=False) == "hwdge"
    assert direct_transpose_lowering((4, 8, 64), "bfloat16", hwdge_forced=True) == "hwdge"
    assert direct_transpose_lowering((128, 64), "bfloat16", hwdge_forced=False) == "dma"
    assert direct_transpose_lowering((16, 64), "float32", hwdge_forced=False) == "dma"
    assert direct_transpose_lowering((128, 64), "bfloat16", hwdge_forced=False, hwdge_shape=False) == "hwdge"
    with pytest.raises(
        emu.DtypeError, match=r"no lowering is legal .*hardware DGE: .*DMA transpose: .*2- or 4-byte"
    ):
        direct_transpose_lowering((16, 64), "float8_e4m3", hwdge_forced=False)
    with pytest.raises(emu.DmaTransposeError, match=r"\[dma-transpose-hwdge\] a 3-D"):
        direct_transpose_lowering((3, 8, 64), "bfloat16", hwdge_forced=True)


def test_default_axes_per_rank_follow_the_docstring() -> None:
    rng = np.random.default_rng(1)
    x4 = rng.standard_normal((2, 3, 4, 8)).astype(np.float16)
    out4, _ = run(_transpose_kernel((8, 3, 4, 2)), x4)  # axes=None on a 4-D src: (3, 1, 2, 0)
    np.testing.assert_array_equal(np.asarray(out4), np.transpose(x4, (3, 1, 2, 0)))
    x3 = rng.standard_normal((4, 2, 8)).astype(np.float16)
    out3, _ = run(_transpose_kernel((8, 2, 4)), x3)
    np.testing.assert_array_equal(np.asarray(out3), np.transpose(x3, (2, 1, 0)))
    with pytest.raises(emu.DmaTransposeError, match=r"\[dma-transpose-shape\].*\(3, 1, 2, 0\)"):
        run(_transpose_kernel((8, 4, 3, 2)), x4)  # the reversed-dims shape is not the default any more


def test_gather_transpose_stays_2_byte() -> None:
    def k():
        src = nl.ndarray((64, 32), "float32", buffer=nl.shared_hbm)
        idx = nl.ndarray((16, 1), "uint32", buffer=nl.sbuf)
        nisa.memset(idx, 0)
        dst = nl.ndarray((32, 16), "float32", buffer=nl.sbuf)
        nisa.dma_transpose(dst, src.ap([[32, 16], [1, 32]], vector_offset=idx, indirect_dim=0), axes=(1, 0))

    with pytest.raises(emu.DtypeError, match=r"indirect \(gather\) dma_transpose needs a 2-byte dtype"):
        run(k)
