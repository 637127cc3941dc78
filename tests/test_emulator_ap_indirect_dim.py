"""``NkiTensor.ap(scalar_offset=/vector_offset=, indirect_dim=d)`` scales the runtime offset by the stride of
dimension ``d`` of the tensor ``.ap`` is called on (NKI 0.6 ``nki.language.NkiTensor.ap`` docstring:
"indirect_dim: dimension in ``self.shape`` whose stride scales the indirect scalar/vector offset";
aws-neuron-sdk ``nki/deep-dives/nki-aps.rst``: ``offset + scalar_offset * prod(A.shape[indirect_dim+1:])``).
A reshaped view therefore brings its own shape: nki-library's ``indexed_flatten`` reads a ``(N,)`` tensor
reshaped to ``(1, N)`` with ``indirect_dim=1``, and its ``TensorView`` reshapes the base tensor to create a
dimension with the stride a dynamic select needs.  Expected values are numpy indexing of the same data."""

from __future__ import annotations

import numpy as np
import pytest

from nki_kernels import emulator as emu
from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import language as nl
from nki_kernels.emulator import run
from tests.emulator_helpers import to_hbm

pytestmark = pytest.mark.emulator


def _index(v):
    idx = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(idx, v)
    return idx


def test_indirect_dim_1_of_a_reshaped_1d_tensor_steps_by_one_element():
    """indexed_flatten's read: (N,) reshaped to (1, N), indirect_dim=1 -> offset + s elements."""
    x = np.arange(16, dtype=np.int32) * 10

    def k(vec, start):
        s = _index(start)
        t = nl.ndarray((1, 5), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(
            t, vec.reshape((1, 16)).ap([[16, 1], [1, 5]], offset=2, scalar_offset=s, indirect_dim=1)
        )
        return to_hbm(t)

    got, _ = run(k, x, np.array([[7]], np.int32))
    np.testing.assert_array_equal(got[0], x[2 + 7 : 2 + 7 + 5])


def test_indirect_dim_0_of_a_reshaped_view_uses_the_view_stride():
    """(4, 8) viewed as (2, 16): index 1 along dim 0 moves 16 elements (rows 2-3), not 8 (row 1)."""
    x = np.arange(32, dtype=np.float32).reshape(4, 8)

    def k(a, i):
        s = _index(i)
        t = nl.ndarray((1, 16), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(t, a.reshape((2, 16)).ap([[16, 1], [1, 16]], offset=0, scalar_offset=s, indirect_dim=0))
        return to_hbm(t)

    got, _ = run(k, x, np.array([[1]], np.int32))
    np.testing.assert_array_equal(got[0], x[2:4].reshape(-1))


def test_vector_offset_on_a_reshaped_view_gathers_rows_of_the_view():
    """(8, 4) viewed as (4, 8): row indices count in rows of 8 elements."""
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    rows = np.array([[3], [0], [2]], np.int32)

    def k(a, r):
        idx = nl.ndarray((3, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(idx, r)
        t = nl.ndarray((3, 8), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(t, a.reshape((4, 8)).ap([[8, 3], [1, 8]], offset=0, vector_offset=idx, indirect_dim=0))
        return to_hbm(t)

    got, _ = run(k, x, rows)
    np.testing.assert_array_equal(got, x.reshape(4, 8)[rows[:, 0]])


def test_indirect_dim_outside_the_tensor_shape_is_refused():
    def k(vec):
        s = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.memset(s, 0)
        vec.reshape((1, 16)).ap([[16, 1], [1, 5]], offset=0, scalar_offset=s, indirect_dim=2)

    with pytest.raises(
        emu.ViewError, match=r"\[ap\] indirect_dim 2 out of range for the tensor's shape \[1, 16\]"
    ):
        run(k, emu.TensorSpec((16,), "int32"), trace_only=True)


def test_a_runtime_offset_past_the_storage_is_still_refused():
    """The view's stride decides the step; the storage still bounds the access (oob_mode=error)."""
    x = np.arange(16, dtype=np.int32)

    def k(vec, start):
        s = _index(start)
        t = nl.ndarray((1, 5), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(
            t, vec.reshape((1, 16)).ap([[16, 1], [1, 5]], offset=2, scalar_offset=s, indirect_dim=1)
        )
        return to_hbm(t)

    with pytest.raises(emu.OutOfBoundsError, match=r"runtime index 10 \(x1 elements\)"):
        run(k, x, np.array([[10]], np.int32))
