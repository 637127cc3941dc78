"""Index maths and argument checks of the SP-sharded KV cache (``sharding.kv_shard``); the gather/keep
round trip is exercised by every sharded stream with SP > 1 (tests/test_sharding_pipeline.py,
tests/test_sharding_methods.py), which equal the unsharded stream bitwise."""

from __future__ import annotations

import pytest
import torch

from rolling_forcing.cache import RollingKVCache
from rolling_forcing.config import PipelineConfig
from sharding.kv_shard import check_kv_cache_layout, owned_block_tokens
from sharding.pipeline import ShardedRollingForcingPipeline
from sharding.plan import plan
from tests.pipeline_helpers import TINY, tiny_model


@pytest.mark.parametrize(("tp", "sp", "t"), [(1, 2, 48), (2, 2, 45), (4, 2, 45), (1, 4, 45), (2, 4, 7)])
def test_owned_block_tokens_partition_every_block(tp: int, sp: int, t: int) -> None:
    p = plan(12, tp * sp, tp=tp)
    ranges = {owned_block_tokens(p, t, r) for r in range(p.world_size)}
    assert len(ranges) == sp  # the ranks of one SP index (every head group) own the same tokens
    covered = sorted(i for a, b in ranges for i in range(a, b))
    assert covered == list(range(t))  # each token of a block is owned exactly once per head group
    sizes = sorted((b - a for a, b in ranges), reverse=True)
    assert sizes[0] - sizes[-1] <= 1 and sizes[0] == -(-t // sp)  # near-equal, busiest = ceil(T / sp)
    for r in range(p.world_size):  # SP index s owns the s-th range, whatever the head group
        assert owned_block_tokens(p, t, r) == owned_block_tokens(p, t, (r // tp) * tp)


def test_bad_arguments_name_the_rule() -> None:
    with pytest.raises(ValueError, match="fewer than sp=4"):
        owned_block_tokens(plan(12, 4, tp=1), 3, 0)
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        check_kv_cache_layout("sharded")
    with pytest.raises(ValueError, match="kv_cache must be one of"):  # before any rank is spawned
        ShardedRollingForcingPipeline(tiny_model(), TINY, PipelineConfig(), cores=2, kv_cache="ring")
    for bad in ((5, 3), (0, 49), (-1, 4), (2, 2)):
        with pytest.raises(ValueError, match="block_tokens"):
            RollingKVCache(TINY, PipelineConfig(), 1, block_tokens=bad)


def test_a_cache_share_keeps_its_tokens_of_every_slot() -> None:
    p = PipelineConfig()
    c = RollingKVCache(TINY, p, 1, num_heads=6, block_tokens=(20, 45))
    assert c.block_tokens == (20, 45)
    assert c.layers[0].k.shape == (1, p.buffer_slots * 25, 6, TINY.head_dim)
    assert c.layers[0].tokens_per_block == 25 and c.layers[0].num_slots == p.buffer_slots
    assert c.nbytes == TINY.num_layers * 2 * p.buffer_slots * 25 * 6 * TINY.head_dim * 4
    assert torch.equal(c.layers[0].k, torch.zeros_like(c.layers[0].k))
