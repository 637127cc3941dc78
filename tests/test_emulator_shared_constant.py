"""``nl.shared_constant``: a numpy array or the path of a ``.npy`` file (NKI 0.6
``nki.language.shared_constant`` docstring; nki-library's rotational top-k passes a path), read back from
shared HBM equal to the array; anything else refused naming the rule."""

from __future__ import annotations

import numpy as np
import pytest

from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import language as nl
from nki_kernels.emulator import run

pytestmark = pytest.mark.emulator


def _kernel(constant):
    """A kernel embedding ``constant`` (a host value, not a kernel input) and returning it from HBM."""

    def k(x):
        return _copy_out(nl.shared_constant(constant))

    return k


def _copy_out(c):
    t = nl.ndarray(c.shape, c.dtype, buffer=nl.sbuf)
    nisa.dma_copy(t, c)
    o = nl.ndarray(c.shape, c.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(o, t)
    return o


@pytest.mark.parametrize("as_path", [False, True])
def test_constant_from_an_array_or_an_npy_path(tmp_path, as_path):
    a = (np.arange(12, dtype=np.int32) * 7 - 30).reshape(3, 4)
    path = tmp_path / "c.npy"
    np.save(path, a)
    got, _ = run(_kernel(str(path) if as_path else a), np.zeros(1, np.float32))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, a)


def test_a_path_that_is_no_npy_file_is_refused(tmp_path):
    txt = tmp_path / "c.txt"
    txt.write_text("1 2 3")
    for bad in (str(txt), str(tmp_path / "missing.npy")):
        with pytest.raises(
            ValueError, match=r"shared_constant: constant must be a numpy array or the path of"
        ):
            run(_kernel(bad), np.zeros(1, np.float32))
