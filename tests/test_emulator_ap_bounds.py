"""An ``.ap`` view that leaves its storage is refused when an instruction accesses it, not when it is built.

NKI 0.6 builds access patterns at specialization time as metadata (aws-neuron-sdk
``nki/deep-dives/nki-aps.rst``: view primitives "produce a new NkiTensor" whose pattern "is handed to the ISA
instruction that consumes the tensor"); only an instruction touches memory.  nki-library's
``output_projection_tkg`` builds a matmul operand for a padding tile of its last PSUM bank and then skips the
matmul (``if h_2_idx < cfg.h_2_size``); such a view must not be refused.  Every instruction that accesses one
still is, in full-arithmetic and in trace-only runs, and so is a slice of it that still leaves the storage.
"""

from __future__ import annotations

import numpy as np
import pytest

from nki_kernels import emulator as emu
from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import language as nl
from nki_kernels.emulator import run
from tests.emulator_helpers import to_hbm

pytestmark = pytest.mark.emulator
OOB = r"\[out-of-bounds\] ap pattern \[\[8, 4\], \[1, 8\]\] offset 4 addresses elements \[4, 35\]"
ONE = r"\[out-of-bounds\] ap pattern \[\[8, 1\], \[1, 1\]\] offset 40 addresses elements \[40, 40\]"


def _tile(x):
    t = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(t, x)
    return t


def test_an_unused_out_of_bounds_view_is_legal_and_a_slice_inside_reads_right():
    x = np.arange(32, dtype=np.float32).reshape(4, 8)

    def k(a):
        t = _tile(a)
        bad = t.ap([[8, 4], [1, 8]], offset=4)  # columns 4..11 of an 8-column tile: never accessed whole
        inside = bad[:, 0:4]  # columns 4..7: inside the tile
        d = nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(d, inside)
        return to_hbm(d)

    got, _ = run(k, x)
    np.testing.assert_array_equal(got, x[:, 4:8])


def _access(how):
    def k(a):
        t = _tile(a)
        bad = t.ap([[8, 4], [1, 8]], offset=4)
        d = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        if how == "tensor_copy src":
            nisa.tensor_copy(d, bad)
        elif how == "tensor_copy dst":
            nisa.tensor_copy(bad, d)
        elif how == "tensor_tensor":
            nisa.tensor_tensor(d, t, bad, op=nl.add)
        elif how == "tensor_scalar":
            nisa.tensor_scalar(d, bad, nl.multiply, 2.0)
        elif how == "dma_copy":
            nisa.dma_copy(to_hbm(d), bad)
        elif how == "matmul stationary":
            p = nl.ndarray((8, 8), nl.float32, buffer=nl.psum)
            nisa.nc_matmul(p, bad, t)
        elif how == "slice still outside":
            nisa.tensor_copy(d[:, 2:8], bad[:, 2:8])
        elif how in ("register_load", "register_store"):
            one = t.ap([[8, 1], [1, 1]], offset=40)  # element 40 of a 32-element tile
            reg = nisa.register_alloc(0)
            if how == "register_load":
                nisa.register_load(reg, one)
            else:
                nisa.register_store(one, reg)
        return to_hbm(d)

    return k


@pytest.mark.parametrize("trace_only", [False, True])
@pytest.mark.parametrize(
    "how",
    [
        "tensor_copy src",
        "tensor_copy dst",
        "tensor_tensor",
        "tensor_scalar",
        "dma_copy",
        "matmul stationary",
        "slice still outside",
        "register_load",
        "register_store",
    ],
)
def test_an_instruction_accessing_an_out_of_bounds_view_is_refused(how, trace_only):
    x = emu.TensorSpec((4, 8), "float32") if trace_only else np.zeros((4, 8), np.float32)
    msg = ONE if how.startswith("register") else OOB
    with pytest.raises(emu.OutOfBoundsError, match=msg):
        run(_access(how), x, trace_only=trace_only)
