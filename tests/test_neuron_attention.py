"""``neuron`` tier: the attention ops (attention with and without lse, attention_segments,
attention_block_table) on a Neuron device through the real ``nki`` (``backend="neuron"``) against
:mod:`reference.attention`.

Skipped with the reason where there is no device / real nki / torch_xla (tests/neuron_helpers.py).
Tolerance: ``tests/numerics.py`` (2 x the reference's own error in the dtype + the dtype's floor; the
floors cover a different summation order, e.g. flash-style merges over key chunks).
"""

from __future__ import annotations

import pytest
import torch

from nki_kernels import ops
from reference.attention import attention, attention_block_table, attention_segments
from tests.neuron_helpers import check_against_reference, randn

pytestmark = pytest.mark.neuron

DTYPES = [torch.bfloat16, torch.float32]
FPF = 1560
"""Wan2.1-1.3B tokens per latent frame at 480x832 (30 x 52 patches): 12 x 128 + 24, so every tile loop
has a tail."""

# (B, Lq, Lk, H, D, scale): small with tails; several 2048-key chunks plus a tail (the DMA-transposed P^T
# path); Wan-like: one frame of queries against a 3-frame block of keys, all 12 heads of 128.
SHAPES = {
    "small": (1, 130, 200, 2, 64, None),
    "multi_chunk": (2, 161, 2637, 1, 64, 0.2),
    "wan_frame_vs_block": (1, FPF, 3 * FPF, 12, 128, None),
}


def _qkv(b: int, lq: int, lk: int, h: int, d: int, seed: int) -> list[torch.Tensor]:
    return [randn((b, n, h, d), seed + i) for i, n in enumerate((lq, lk, lk))]


@pytest.mark.parametrize("return_lse", [True, False], ids=["lse", "no_lse"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_attention(neuron_device, shape: str, dtype: torch.dtype, return_lse: bool) -> None:
    b, lq, lk, h, d, scale = SHAPES[shape]
    check_against_reference(
        lambda q, k, v: attention(q, k, v, scale=scale, return_lse=return_lse),
        lambda q, k, v: ops.attention(q, k, v, scale=scale, return_lse=return_lse, backend="neuron"),
        _qkv(b, lq, lk, h, d, seed=10),
        dtype,
        neuron_device,
        f"attention {shape} lse={return_lse}",
        out_dtypes=[dtype, torch.float32] if return_lse else None,
    )


# (B, Lq, S, H, D, segments): keys read in place from a cache-sized buffer. Wan-like: a window frame
# attending the sink frame, a 2-frame cached run and its own frame, out of a 6-frame buffer.
SEGMENTS = {
    "small": (2, 37, 300, 3, 64, [(0, 40), (100, 77), (250, 50)]),
    "wan_sink_cache_own": (1, FPF, 6 * FPF, 12, 128, [(0, FPF), (2 * FPF, 2 * FPF), (5 * FPF, FPF)]),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", list(SEGMENTS), ids=list(SEGMENTS))
def test_attention_segments(neuron_device, shape: str, dtype: torch.dtype) -> None:
    b, lq, s, h, d, segs = SEGMENTS[shape]
    check_against_reference(
        lambda q, k, v: attention_segments(q, k, v, segs, return_lse=True),
        lambda q, k, v: ops.attention_segments(q, k, v, segs, return_lse=True, backend="neuron"),
        _qkv(b, lq, s, h, d, seed=20),
        dtype,
        neuron_device,
        f"attention_segments {shape}",
        out_dtypes=[dtype, torch.float32],
    )


# (B, H, D, T, blocks per source, q_groups, table [G, NB, 2]): every group has at least one key block
# (a group without keys gives -inf lse, compared exactly by the emulator tests, not by a tolerance).
BLOCK_TABLES = {
    # T = 150 (a 128-row tile + 22): ring-wrapped run with an empty entry; sink copy + fresh blocks
    "small_ring": (
        2, 2, 32, 150, (5, 3, 2), [37, 200],
        [[[0, 3], [0, 4], [-1, 0], [0, 0], [0, 1]], [[-1, 2], [2, 1], [1, 0], [1, 2], [-1, 0]]],
    ),
    # Wan-like merged forward with 1-frame blocks: update group and window group, sources = KV buffer of
    # 6 blocks, the forward's own 2 blocks, 1 sink copy; 4 entries per group
    "wan_merged": (
        1, 4, 128, FPF, (6, 2, 1), [FPF, FPF],
        [[[2, 0], [0, 3], [0, 4], [1, 0]], [[2, 0], [0, 5], [1, 0], [1, 1]]],
    ),
}  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", list(BLOCK_TABLES), ids=list(BLOCK_TABLES))
def test_attention_block_table(neuron_device, shape: str, dtype: torch.dtype) -> None:
    b, h, d, t, blocks, groups, table_list = BLOCK_TABLES[shape]
    n = len(blocks)
    table = torch.tensor(table_list, dtype=torch.int32)
    table_d = table.to(neuron_device)
    tensors = [randn((b, sum(groups), h, d), 30)]
    tensors += [randn((b, nb * t, h, d), 31 + i) for i, nb in enumerate(blocks)]  # k sources
    tensors += [randn((b, nb * t, h, d), 41 + i) for i, nb in enumerate(blocks)]  # v sources

    def ref(q, *kv):
        return attention_block_table(q, list(kv[:n]), list(kv[n:]), table, groups, t, return_lse=True)

    def op(q, *kv):
        return ops.attention_block_table(
            q, list(kv[:n]), list(kv[n:]), table_d, groups, t, return_lse=True, backend="neuron"
        )

    check_against_reference(
        ref, op, tensors, dtype, neuron_device, f"attention_block_table {shape}",
        out_dtypes=[dtype, torch.float32],
    )  # fmt: skip
