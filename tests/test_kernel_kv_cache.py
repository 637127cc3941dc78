"""KV-cache kernels (nki_kernels.kv_cache) on the NKI emulator against reference.kv_cache (torch indexing)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nki_kernels.emulator import TensorSpec, run
from nki_kernels.kv_cache import (
    kv_cache_slide_emulated,
    kv_cache_slide_kernel,
    kv_cache_write_emulated,
    kv_cache_write_kernel,
)
from reference.kv_cache import kv_cache_slide, kv_cache_write

pytestmark = pytest.mark.emulator

DTYPES = st.sampled_from([torch.bfloat16, torch.float32])


def _tensors(b: int, s: int, t: int, h: int, d: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, h, d, generator=g).to(dtype) for n in (s, s, t, t)]


@settings(max_examples=8, deadline=None)
@given(
    b=st.integers(1, 3),
    t=st.integers(1, 40),
    nslots=st.integers(1, 5),
    extra=st.integers(0, 7),
    h=st.integers(1, 3),
    d=st.sampled_from([4, 16, 64]),
    dtype=DTYPES,
    data=st.data(),
)
def test_kv_cache_write_matches_reference(b, t, nslots, extra, h, d, dtype, data) -> None:
    s = nslots * t + extra  # S need not be a multiple of T
    slot = data.draw(st.integers(0, nslots - 1))
    ck, cv, k, v = _tensors(b, s, t, h, d, dtype, seed=t * 7 + s)
    ek, ev = ck.clone(), cv.clone()
    kv_cache_write(ek, ev, k, v, slot)
    kv_cache_write_emulated(ck, cv, k, v, slot)
    assert torch.equal(ck, ek) and torch.equal(cv, ev)


@settings(max_examples=8, deadline=None)
@given(
    b=st.integers(1, 2),
    t=st.integers(1, 30),
    sink=st.integers(0, 20),
    rest=st.integers(0, 90),
    h=st.integers(1, 2),
    d=st.sampled_from([4, 32]),
    dtype=DTYPES,
)
def test_kv_cache_slide_matches_reference(b, t, sink, rest, h, d, dtype) -> None:
    s = sink + t + rest  # rest tokens move left by t (overlapping ranges when rest > t)
    ck, cv, k, v = _tensors(b, s, t, h, d, dtype, seed=s)
    ek, ev = ck.clone(), cv.clone()
    kv_cache_slide(ek, ev, k, v, sink)
    kv_cache_slide_emulated(ck, cv, k, v, sink)
    assert torch.equal(ck, ek) and torch.equal(cv, ev)


def test_kv_cache_lnc2_matches_reference() -> None:
    ck, cv, k, v = _tensors(2, 50, 10, 2, 8, torch.bfloat16, seed=0)
    ek, ev = ck.clone(), cv.clone()
    kv_cache_write(ek, ev, k, v, 3)
    kv_cache_write_emulated(ck, cv, k, v, 3, lnc=2)
    assert torch.equal(ck, ek) and torch.equal(cv, ev)
    kv_cache_slide(ek, ev, k, v, 5)
    kv_cache_slide_emulated(ck, cv, k, v, 5, lnc=2)
    assert torch.equal(ck, ek) and torch.equal(cv, ev)


def test_kv_cache_rejects_bad_input() -> None:
    ck, cv, k, v = _tensors(1, 20, 5, 2, 4, torch.float32, seed=1)
    with pytest.raises(ValueError, match="slot"):
        kv_cache_write_emulated(ck, cv, k, v, 4)
    with pytest.raises(ValueError, match="slot"):
        kv_cache_write_emulated(ck, cv, k, v, -1)
    with pytest.raises(ValueError, match="sink_tokens"):
        kv_cache_slide_emulated(ck, cv, k, v, 16)
    with pytest.raises(TypeError, match="dtype"):
        kv_cache_write_emulated(ck, cv, k.double(), v, 0)
    with pytest.raises(ValueError, match="k shape"):
        kv_cache_write_emulated(ck, cv, torch.randn(1, 5, 3, 4), torch.randn(1, 5, 3, 4), 0)


def test_kv_cache_write_runtime_slot_out_of_range_raises_in_kernel() -> None:
    """The slot is a runtime value: the kernel itself refuses an out-of-range slot (oob_mode=error)."""
    import numpy as np

    from nki_kernels.emulator import OutOfBoundsError

    ck, cv, k, v = (x.numpy() for x in _tensors(1, 20, 5, 2, 4, torch.float32, seed=2))
    with pytest.raises(OutOfBoundsError):
        run(kv_cache_write_kernel, ck, cv, k, v, np.array([[4]], dtype=np.int32))


def test_kv_cache_write_trace_touches_only_the_block() -> None:
    """Wan shape: one compiled kernel for every slot; HBM bytes = exactly T*H*D*2 read + written per cache."""
    s, t, h, d = 37440, 4680, 12, 128
    c, n = TensorSpec((1, s, h, d), "bfloat16"), TensorSpec((1, t, h, d), "bfloat16")
    _, tr = run(kv_cache_write_kernel, c, c, n, n, TensorSpec((1, 1), "int32"), trace_only=True)
    hbm = [(r, m) for r, m in tr.select(op="dma_copy") if r.direction == "hbm->hbm"]
    assert sum(r.bytes_written * m for r, m in hbm) == 2 * t * h * d * 2
    assert sum(r.bytes_read * m for r, m in hbm) == 2 * t * h * d * 2
    assert all(dict(r.meta).get("indirect") == "scalar" for r, _ in hbm)  # runtime slot offset
    _, tr2 = run(kv_cache_slide_kernel, c, c, n, n, t, trace_only=True)
    moved = sum(r.bytes_written * m for r, m in tr2.select(op="dma_copy"))
    assert moved == 2 * (s - t) * h * d * 2  # shift (S - sink - T) + new block T, k and v
    assert min(tr2.descriptor_histogram()) >= 2048
