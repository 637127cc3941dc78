"""``neuron`` tier: the KV-cache writes (kv_cache_write, kv_cache_write_at, kv_cache_slide) on a Neuron
device through the real ``nki`` (``backend="neuron"``) against :mod:`reference.kv_cache`.

Skipped with the reason where there is no device / real nki / torch_xla (tests/neuron_helpers.py).
Tolerance: none. The kernels only move bytes (no arithmetic, no rounding), so the caches must equal the
reference's bit for bit, as in the emulator tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from nki_kernels import ops
from reference.kv_cache import kv_cache_slide, kv_cache_write
from tests.neuron_helpers import randn

pytestmark = pytest.mark.neuron

DTYPES = [torch.bfloat16, torch.float32]
FPF = 1560  # Wan2.1-1.3B tokens per latent frame at 480x832

# (B, S, T, H, D): S not a multiple of T; Wan-like = 3-frame blocks (4,680 tokens) in a 6-block buffer,
# 12 heads of 128 (one layer's K or V cache: 28,080 x 1,536 values).
SHAPES = {
    "small": (2, 7 * 10 + 3, 10, 3, 16),
    "tail_rows": (1, 5 * 150, 150, 2, 64),
    "wan_layer": (1, 6 * 3 * FPF, 3 * FPF, 12, 128),
}


def _run(shape: str, dtype: torch.dtype, device: Any, ref: Callable, op: Callable, seed: int) -> None:
    b, s, t, h, d = SHAPES[shape]
    ck, cv, k, v = (randn((b, n, h, d), seed + i).to(dtype) for i, n in enumerate((s, s, t, t)))
    ek, ev = ck.clone(), cv.clone()
    ref(ek, ev, k, v)
    dk, dv = ck.to(device), cv.to(device)
    op(dk, dv, k.to(device), v.to(device))
    for name, got, want in (("cache_k", dk.cpu(), ek), ("cache_v", dv.cpu(), ev)):
        assert got.dtype == want.dtype and got.shape == want.shape
        diff = (got != want).any(dim=(0, 2, 3)).nonzero().flatten()
        assert diff.numel() == 0, f"{name} {shape} {dtype}: {diff.numel()} tokens differ, first {diff[:5]}"


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_kv_cache_write(neuron_device, shape: str, dtype: torch.dtype) -> None:
    slot = SHAPES[shape][1] // SHAPES[shape][2] - 1  # the last whole slot
    _run(
        shape, dtype, neuron_device,
        lambda ck, cv, k, v: kv_cache_write(ck, cv, k, v, slot),
        lambda ck, cv, k, v: ops.kv_cache_write(ck, cv, k, v, slot, backend="neuron"),
        seed=50,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_kv_cache_write_at(neuron_device, shape: str, dtype: torch.dtype) -> None:
    slot = 1
    slot_t = torch.tensor(slot, dtype=torch.int64).to(neuron_device)
    _run(
        shape, dtype, neuron_device,
        lambda ck, cv, k, v: kv_cache_write(ck, cv, k, v, slot),
        lambda ck, cv, k, v: ops.kv_cache_write_at(ck, cv, k, v, slot_t, backend="neuron"),
        seed=60,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_kv_cache_slide(neuron_device, shape: str, dtype: torch.dtype) -> None:
    sink = SHAPES[shape][2]  # one sink block; the rest moves left by T (overlapping source and destination)
    _run(
        shape, dtype, neuron_device,
        lambda ck, cv, k, v: kv_cache_slide(ck, cv, k, v, sink),
        lambda ck, cv, k, v: ops.kv_cache_slide(ck, cv, k, v, sink, backend="neuron"),
        seed=70,
    )  # fmt: skip
