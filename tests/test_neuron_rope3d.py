"""``neuron`` tier: the RoPE ops (rope3d, its frame-positions form, rope3d_positions, rope3d_tables) on a
Neuron device through the real ``nki`` (``backend="neuron"``) against :mod:`reference.rope3d`.

Skipped with the reason where there is no device / real nki / torch_xla (tests/neuron_helpers.py).
Tolerance: ``tests/numerics.py`` (2 x the reference's own error in the dtype + the dtype's floor).
"""

from __future__ import annotations

import pytest
import torch

from nki_kernels import ops
from reference.rope3d import rope3d, rope3d_tables, rope_tables
from tests.neuron_helpers import check_against_reference, randn

pytestmark = pytest.mark.neuron

DTYPES = [torch.bfloat16, torch.float32]

# (B, grid (F, Hp, Wp), H, D): one small, one with a 128-row tail (189 tokens) and odd H, and Wan2.1-1.3B
# at 480x832 (30 x 52 latent patches = 1,560 tokens per frame, 12 heads of 128) over a 15-frame window.
SHAPES = {
    "small": (1, (2, 3, 5), 2, 64),
    "tail": (2, (3, 7, 9), 3, 128),
    "wan_window": (1, (15, 30, 52), 12, 128),
}


def _qk(b: int, grid: tuple[int, int, int], h: int, d: int, seed: int) -> list[torch.Tensor]:
    n = grid[0] * grid[1] * grid[2]
    return [randn((b, n, h, d), seed), randn((b, n, h, d), seed + 1)]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_rope3d_start_frame(neuron_device, shape: str, dtype: torch.dtype) -> None:
    b, grid, h, d = SHAPES[shape]
    check_against_reference(
        lambda q, k: rope3d(q, k, grid, 7),
        lambda q, k: ops.rope3d(q, k, grid, 7, backend="neuron"),
        _qk(b, grid, h, d, seed=1),
        dtype,
        neuron_device,
        f"rope3d {shape} start_frame=7",
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_rope3d_frame_positions(neuron_device, shape: str, dtype: torch.dtype) -> None:
    b, grid, h, d = SHAPES[shape]
    pos = [0, *range(40, 40 + grid[0] - 1)]  # sink frame at 0, then a later run (relative positions)
    check_against_reference(
        lambda q, k: rope3d(q, k, grid, 0, pos),
        lambda q, k: ops.rope3d(q, k, grid, frame_positions=pos, backend="neuron"),
        _qk(b, grid, h, d, seed=2),
        dtype,
        neuron_device,
        f"rope3d {shape} frame_positions",
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_rope3d_positions_tensor(neuron_device, shape: str, dtype: torch.dtype) -> None:
    b, grid, h, d = SHAPES[shape]
    pos = list(range(3, 3 + grid[0]))
    pos_t = torch.tensor(pos, dtype=torch.int64).to(neuron_device)
    check_against_reference(
        lambda q, k: rope3d(q, k, grid, 0, pos),
        lambda q, k: ops.rope3d_positions(q, k, grid, pos_t, backend="neuron"),
        _qk(b, grid, h, d, seed=3),
        dtype,
        neuron_device,
        f"rope3d_positions {shape}",
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_rope3d_tables(neuron_device, shape: str, dtype: torch.dtype) -> None:
    b, grid, h, d = SHAPES[shape]
    cos, sin = rope_tables(grid, d, 5, dtype=torch.float32)  # the kernels' table dtype
    cos_d, sin_d = cos.to(neuron_device), sin.to(neuron_device)
    check_against_reference(
        lambda q, k: rope3d_tables(q, k, cos, sin),
        lambda q, k: ops.rope3d_tables(q, k, cos_d, sin_d, backend="neuron"),
        _qk(b, grid, h, d, seed=4),
        dtype,
        neuron_device,
        f"rope3d_tables {shape}",
    )


@pytest.mark.parametrize("kernel", ["rope3d_kernel", "rope3d_naive_kernel"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", ["small", "tail"])
def test_rope_kernels_direct_launch(neuron_device, shape: str, dtype: torch.dtype, kernel: str) -> None:
    """Both RoPE kernels launched directly with every argument on the device (no ops glue, no host
    arrays): ``rope3d_naive_kernel`` (the benchmark's comparison point) is reachable only this way, and a
    failure here but not in the ops tests (or the reverse) separates kernel from glue."""
    import nki_kernels.rope3d as rope_mod
    from nki_kernels._nki import launch

    b, grid, h, d = SHAPES[shape]
    cos, sin = rope_tables(grid, d, 2, dtype=torch.float32)
    cos_d, sin_d = cos.to(neuron_device), sin.to(neuron_device)
    check_against_reference(
        lambda q, k: rope3d_tables(q, k, cos, sin),
        lambda q, k: launch(getattr(rope_mod, kernel), q, k, cos_d, sin_d)[0],
        _qk(b, grid, h, d, seed=5),
        dtype,
        neuron_device,
        f"{kernel} {shape} (direct launch)",
    )
