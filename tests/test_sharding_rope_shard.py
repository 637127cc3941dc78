"""Each rank of the sharded stream ropes q and k of its OWN token shard (all heads) before the TP
all-to-all (``sharding.rank_attention.RankAttention._rope_shard``): the ranks' shards put back together are
the unsharded RoPE of the whole forward, bitwise, and the keys of the block the forward writes travel as
the cache stores them (unroped for the sink / relative mode)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from nki_kernels import ops
from sharding.attention import local_tokens
from sharding.plan import plan
from sharding.rank_attention import RankAttention

GRID = (3, 5, 7)  # 105 tokens: not divisible by 4 ranks, shards cut through frames
HEADS, HD = 4, 16


def _rank(rank: int, backend: str) -> RankAttention:
    ra: Any = RankAttention()
    ra.plan = plan(HEADS, 4, tp=2)  # TP2 x SP2
    ra.rank, ra.backend = rank, backend
    ra.model = SimpleNamespace(cfg=SimpleNamespace(head_dim=HD))
    return ra


@pytest.mark.parametrize("backend", ["reference", "emulator"])
@pytest.mark.parametrize("store_roped", [True, False, torch.tensor(True), torch.tensor(False)])
def test_rank_shards_roped_before_all_to_all_equal_unsharded_rope(backend: str, store_roped: Any) -> None:
    g = torch.Generator().manual_seed(3)
    n = GRID[0] * GRID[1] * GRID[2]
    q, k = (torch.randn(1, n, HEADS, HD, generator=g).bfloat16() for _ in range(2))
    positions = [4, 9, 10]
    want_q, want_k = ops.rope3d(q, k, GRID, frame_positions=positions, backend=backend)
    end = 40  # the written block: keys [0, 40) as the cache stores them (crosses rank 0's shard of 27)
    flag = bool(store_roped)
    want_sent = torch.cat([(want_k if flag else k)[:, :end], want_k[:, end:]], dim=1)
    got_q, got_k, got_sent = [], [], []
    for r in range(4):
        ra = _rank(r, backend)
        tables = ra._tables(GRID, positions=torch.tensor(positions))
        sl = local_tokens(n, ra.plan, r)
        qr, kr = ra._rope_shard(q[:, sl], k[:, sl], tables)
        assert qr is not None
        got_q.append(qr)
        got_k.append(kr)
        got_sent.append(ra._rope_shard(None, k[:, sl], tables, (end, store_roped))[1])
    assert torch.equal(torch.cat(got_q, dim=1), want_q)
    assert torch.equal(torch.cat(got_k, dim=1), want_k)
    assert torch.equal(torch.cat(got_sent, dim=1), want_sent)


def test_rope_shard_refuses_a_k_that_is_not_the_rank_token_shard() -> None:
    ra = _rank(1, "reference")
    tables = ra._tables(GRID, 2)
    k = torch.zeros(1, 10, HEADS, HD)
    with pytest.raises(ValueError, match="k holds 10 tokens, its token shard is"):
        ra._rope_shard(k, k, tables)
