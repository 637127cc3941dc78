"""NkiTensor views (indexing, view methods, .ap access patterns) against numpy indexing of the same data."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nki_kernels import emulator as emu
from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import language as nl
from nki_kernels.emulator import run

pytestmark = pytest.mark.emulator
SETTINGS = settings(max_examples=20, deadline=None)


def hbm_out(view):
    """DMA a view (any memory) into a fresh row-major shared_hbm tensor of its shape."""
    o = nl.ndarray(view.shape, view.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(o, view)
    return o


@st.composite
def slice_for(draw, n):
    start = draw(st.integers(0, n - 1))
    stop = draw(st.integers(start + 1, n))
    step = draw(st.integers(1, 3))
    neg = draw(st.booleans())
    if neg:
        return slice(start - n, stop - n if stop < n else None, step)
    return slice(start, stop, step)


@SETTINGS
@given(data=st.data(), a=st.integers(1, 6), b=st.integers(1, 7), c=st.integers(1, 9))
def test_hbm_slicing_matches_numpy(data, a, b, c):
    x = np.arange(a * b * c, dtype=np.float32).reshape(a, b, c)
    key = tuple(data.draw(slice_for(n)) for n in (a, b, c))
    i = data.draw(st.integers(-a, a - 1))
    got, _ = run(lambda t: (hbm_out(t[key]), hbm_out(t[i, ..., key[2]])), x)
    np.testing.assert_array_equal(got[0], x[key])
    np.testing.assert_array_equal(got[1], x[i, ..., key[2]])


def test_onchip_int_index_keeps_partition_dim_and_2d():
    x = np.arange(4 * 6, dtype=np.float32).reshape(4, 6)

    def k(t):
        s = nl.load(t)
        assert s[2].shape == (1, 6)
        assert s[2, 3].shape == (1, 1)
        assert s[:, 3].shape == (4, 1)
        assert t[2].shape == (6,)  # HBM: int drops the dim
        return hbm_out(s[2]), hbm_out(s[:, nl.ds(1, 3)])

    (r, d), _ = run(k, x)
    np.testing.assert_array_equal(r, x[2:3])
    np.testing.assert_array_equal(d, x[:, 1:4])


def test_view_methods_match_numpy():
    x = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5)

    def k(t):
        return (
            hbm_out(t.permute((3, 1, 0, 2))),
            hbm_out(t.slice(3, 1, 5, 2)),
            hbm_out(t.select(1, 2)),
            hbm_out(t.flatten_dims(2, 3)),
            hbm_out(t.reshape_dim(3, (5, 1)).squeeze_dim(4)),
            hbm_out(t[:, 0:1].broadcast(1, 3)),
            hbm_out(t.reshape((6, 20))),
            hbm_out(t.expand_dim(1)),
            hbm_out(t.rearrange(("a", "b", "c", "d"), ("a", ("b", "c"), "d"))),
            hbm_out(t.rearrange(("a", "b", ("c1", "c2"), "d"), ("c2", "a", "b", "c1", "d"), {"c1": 2})),
        )

    outs, _ = run(k, x)
    wants = [
        x.transpose(3, 1, 0, 2), x[..., 1:5:2], x[:, 2], x.reshape(2, 3, 20), x,
        np.broadcast_to(x[:, 0:1], (2, 3, 4, 5)), x.reshape(6, 20), x[:, None],
        x.reshape(2, 12, 5), x.reshape(2, 3, 2, 2, 5).transpose(3, 0, 1, 2, 4),
    ]  # fmt: skip
    for g, w in zip(outs, wants):
        np.testing.assert_array_equal(g, w)


def test_transposed_hbm_store_via_permute_and_ap():
    """Write a [q, d] SBUF tile into an output laid out [d, S] (transposed store, as flash attention
    with transposed output does): once through a permuted HBM view, once through .ap()."""
    q = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)  # [q=8, d=4]

    def k(src):
        t = nl.load(src)
        o1 = nl.ndarray((4, 16), nl.float32, buffer=nl.shared_hbm)  # [d, S]
        nisa.dma_copy(o1[:, 8:16].permute((1, 0)), t)
        o2 = nl.ndarray((4, 16), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(o2.ap([[1, 8], [16, 4]], offset=8), t)
        nisa.dma_copy(o1[:, 0:8].permute((1, 0)), t)
        nisa.dma_copy(o2.ap([[1, 8], [16, 4]], offset=0), t)
        return o1, o2

    (o1, o2), tr = run(k, q)
    want = np.concatenate([q.T, q.T], axis=1)
    np.testing.assert_array_equal(o1, want)
    np.testing.assert_array_equal(o2, want)
    # element-wise scatter on the HBM side: one 4-byte descriptor per element
    recs = [r for r, _ in tr.select(op="dma_copy") if r.direction == "sbuf->hbm"]
    assert all(r.descriptors == ((4, 32),) for r in recs)


def test_ap_on_sbuf_stride0_broadcast_and_get_pattern():
    x = np.arange(4 * 3, dtype=np.float32).reshape(4, 3)

    def k(t):
        s = nl.load(t)
        assert s.get_pattern() == [[3, 4], [1, 3]]
        b = s.ap([[3, 4], [0, 5]], offset=1)  # column 1 repeated 5 times per partition
        d = nl.ndarray((4, 5), nl.float32)
        nisa.tensor_copy(d, b)
        return hbm_out(d)

    got, _ = run(k, x)
    np.testing.assert_array_equal(got, np.repeat(x[:, 1:2], 5, axis=1))


def test_scalar_offset_dma_kv_cache_slot_write():
    """Ring-slot write: cache [slots, T, D]; write a block into slot idx read at run time."""
    cache = np.zeros((4, 2, 3), np.float32)
    block = np.arange(6, dtype=np.float32).reshape(2, 3) + 1

    def k(c, blk, slot):
        idx = nl.ndarray((1, 1), nl.int32)
        nisa.dma_copy(idx, slot)
        t = nl.load(blk)
        dst = c.ap([[3, 2], [1, 3]], offset=0, scalar_offset=idx, indirect_dim=0)
        assert dst.is_indirect()
        nisa.dma_copy(dst, t)
        back = nl.ndarray((2, 3), nl.float32)
        nisa.dma_copy(back, c.ap([[3, 2], [1, 3]], offset=0, scalar_offset=idx, indirect_dim=0))
        return hbm_out(back)

    got, tr = run(k, cache, block, np.array([[2]], np.int32))
    np.testing.assert_array_equal(cache[2], block)
    assert not cache[[0, 1, 3]].any()
    np.testing.assert_array_equal(got, block)
    assert any(dict(r.meta).get("indirect") == "scalar" for r, _ in tr.select(op="dma_copy"))


def test_vector_offset_gather_rows_and_skip():
    table = np.arange(6 * 4, dtype=np.float32).reshape(6, 4)

    def k(tab, rows, mode):
        idx = nl.ndarray((3, 1), nl.int32)
        nisa.dma_copy(idx, rows)
        d = nl.ndarray((3, 4), nl.float32)
        nisa.memset(d, -1.0)
        nisa.dma_copy(d, tab.ap([[4, 3], [1, 4]], offset=0, vector_offset=idx, indirect_dim=0), oob_mode=mode)
        return hbm_out(d)

    got, _ = run(k, table, np.array([[5], [0], [3]], np.int32), nisa.oob_mode.error)
    np.testing.assert_array_equal(got, table[[5, 0, 3]])
    got, _ = run(k, table, np.array([[5], [9], [3]], np.int32), nisa.oob_mode.skip)
    np.testing.assert_array_equal(got, np.stack([table[5], -np.ones(4, np.float32), table[3]]))
    with pytest.raises(emu.OutOfBoundsError, match="vector_offset rows"):
        run(k, table, np.array([[5], [9], [3]], np.int32), nisa.oob_mode.error)


def test_runtime_select_with_tensor_index():
    x = np.arange(5 * 4, dtype=np.float32).reshape(5, 4)

    def k(t, row):
        idx = nl.ndarray((1, 1), nl.int32)
        nisa.dma_copy(idx, row)
        v = t.select(0, idx)  # runtime select of one row, dim dropped
        s = nl.ndarray((1, 4), nl.float32)
        nisa.dma_copy(s, v)
        return hbm_out(s)

    got, _ = run(k, x, np.array([[3]], np.int32))
    np.testing.assert_array_equal(got[0], x[3])


def test_view_dtype_reinterprets_bits():
    x = np.array([[1.0, -2.0]], dtype=np.float32)

    def k(t):
        return hbm_out(t.view(nl.bfloat16)), hbm_out(t.view(nl.int32))

    (b, i), _ = run(k, x)
    np.testing.assert_array_equal(b.view(np.uint16), x.view(np.uint16))
    np.testing.assert_array_equal(i, x.view(np.int32))
    assert b.dtype == np.dtype(ml_dtypes.bfloat16) and b.shape == (1, 4)


def test_dma_shapes_may_differ_with_equal_counts():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)

    def k(t):
        s = nl.ndarray((6, 4), nl.float32)
        nisa.dma_copy(s, t)
        return hbm_out(s)

    got, _ = run(k, x)
    np.testing.assert_array_equal(got, x.reshape(6, 4))
