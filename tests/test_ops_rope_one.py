"""nki_kernels.ops.rope3d_tables_one (RoPE of one tensor with caller-built tables) and its kernel
nki_kernels.rope3d.rope3d_one_kernel, against reference.rope3d (complex128)."""

from __future__ import annotations

import pytest
import torch

from nki_kernels import ops
from nki_kernels.rope3d import rope3d_one_tables_emulated, rope3d_tables_emulated
from reference.rope3d import rope3d as ref_rope3d
from reference.rope3d import rope3d_tables_one as ref_one
from reference.rope3d import rope_tables
from tests.numerics import assert_within, reference_error
from tests.ops_helpers import BF16, F32, rnd
from tests.ops_helpers import clean_backend_env as clean_backend_env  # autouse


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_reference_one_bitwise_equals_rope3d_keys(dtype: torch.dtype) -> None:
    """With float64 tables the one-tensor reference is bitwise rope3d's k (angles built independently)."""
    grid, fp = (3, 4, 5), [0, 7, 8]
    q, k = rnd(2, 60, 3, 16, dtype=dtype, seed=1), rnd(2, 60, 3, 16, dtype=dtype, seed=2)
    cos, sin = rope_tables(grid, 16, frame_positions=fp, dtype=torch.float64)
    got = ops.rope3d_tables_one(k, cos, sin, backend="reference")
    assert got.dtype == dtype and got.shape == k.shape
    assert torch.equal(got, ref_rope3d(q, k, grid, 0, fp)[1])


# L = 2*14*83 = 2324 tokens: a full super-tile (m=16 at H=2, D=64), a remainder (m=2) and a 20-token tail
GRID = (2, 14, 83)


@pytest.mark.emulator
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_one_kernel_within_reference_error_on_every_tiling_path(dtype: torch.dtype) -> None:
    n = GRID[0] * GRID[1] * GRID[2]
    x = torch.randn(1, n, 2, 64, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    fp = [3, 11]
    cos, sin = rope_tables(GRID, 64, frame_positions=fp, dtype=torch.float32)
    ref_err, base = reference_error(ref_rope3d, [x, x, GRID], dtype, frame_positions=fp)
    got = ops.rope3d_tables_one(x.to(dtype), cos, sin, backend="emulator")
    assert got.dtype == dtype and got.shape == x.shape
    assert_within(got, base[1], dtype, ref_err, what=f"rope3d_tables_one emulator {dtype}")


@pytest.mark.emulator
def test_one_kernel_bitwise_equals_pair_kernel_keys_and_lnc2() -> None:
    """12 heads x D=128: compute chunks shorter than the super-tile (5 + 3 tokens of m = 8)."""
    q, k = rnd(1, 1100, 12, 128, dtype=BF16, seed=6), rnd(1, 1100, 12, 128, dtype=BF16, seed=7)
    cos, sin = rope_tables((1, 20, 55), 128, start_frame=4, dtype=torch.float32)
    want = rope3d_tables_emulated(q, k, cos, sin)[1]
    assert torch.equal(rope3d_one_tables_emulated(k, cos, sin), want)
    assert torch.equal(rope3d_one_tables_emulated(k, cos, sin, lnc=2), want)
    assert torch.equal(ops.rope3d_tables_one(k, cos, sin, backend="emulator"), want)


def test_rope3d_tables_one_rejects_bad_input() -> None:
    x = rnd(1, 12, 2, 8)
    cos, sin = rope_tables((1, 3, 4), 8)
    with pytest.raises(ValueError, match=r"x must have rank 4 \(\[B, L, H, D\]\)"):
        ops.rope3d_tables_one(x[0], cos, sin)
    with pytest.raises(ValueError, match="x head_dim D=7 must be even"):
        ops.rope3d_tables_one(rnd(1, 12, 2, 7), cos[:, :3].contiguous(), sin[:, :3].contiguous())
    with pytest.raises(ValueError, match="cos has 11 rows"):
        ops.rope3d_tables_one(x, cos[1:].contiguous(), sin)
    with pytest.raises(ValueError, match="sin must be"):
        ops.rope3d_tables_one(x, cos, sin[:, :3].contiguous())
    with pytest.raises(TypeError, match="sin must be torch.float32 or torch.float64"):
        ops.rope3d_tables_one(x, cos, sin.bfloat16())
    with pytest.raises(TypeError, match="sin dtype"):
        ops.rope3d_tables_one(x, cos, sin.double())
    with pytest.raises(ValueError, match="cos must be contiguous"):
        ops.rope3d_tables_one(x, cos.t().contiguous().t(), sin)
    with pytest.raises(ValueError, match="x must be"):
        ref_one(x[0], cos, sin)
    with pytest.raises(ValueError, match="even"):
        rope3d_one_tables_emulated(rnd(1, 12, 2, 7), cos[:, :3].contiguous(), sin[:, :3].contiguous())


# ------------------------------------------------------------------------ rope3d_positions_one


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_positions_one_reference_bitwise_equals_rope3d_keys(dtype: torch.dtype) -> None:
    grid, fp = (3, 4, 5), [2, 9, 10]
    q, k = rnd(2, 60, 3, 16, dtype=dtype, seed=3), rnd(2, 60, 3, 16, dtype=dtype, seed=4)
    got = ops.rope3d_positions_one(k, grid, torch.tensor(fp), backend="reference")
    assert torch.equal(got, ref_rope3d(q, k, grid, 0, fp)[1])


@pytest.mark.emulator
def test_positions_one_kernel_bitwise_equals_rope3d_positions_keys() -> None:
    """The sharded stream's roped copies: the one-tensor op gives rope3d_positions' k bit for bit."""
    grid, fp = (2, 14, 83), torch.tensor([0, 5])
    q, k = rnd(1, 2324, 2, 64, dtype=BF16, seed=8), rnd(1, 2324, 2, 64, dtype=BF16, seed=9)
    want = ops.rope3d_positions(q, k, grid, fp, backend="emulator")[1]
    assert torch.equal(ops.rope3d_positions_one(k, grid, fp, backend="emulator"), want)


def test_rope3d_positions_one_rejects_bad_input() -> None:
    x = rnd(1, 12, 2, 8)
    with pytest.raises(ValueError, match="grid"):
        ops.rope3d_positions_one(x, (1, 3, 5), torch.tensor([0]))
    with pytest.raises(ValueError, match="frame_positions"):
        ops.rope3d_positions_one(x, (1, 3, 4), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"frame_positions\[0\] must be >= 0"):
        ops.rope3d_positions_one(x, (1, 3, 4), torch.tensor([-1]))
    with pytest.raises(TypeError, match="x must be torch.bfloat16 or torch.float32"):
        ops.rope3d_positions_one(x.double(), (1, 3, 4), torch.tensor([0]))
