"""The compact KV-cache layout of the sharded stream (``kv_cache="sp_compact"``, ``sharding.kv_shard``): a
ring one slot shorter and the text k/v token-sharded over all ranks give the same stream, bit for bit.

Reference: the same sharded stream with the full ring (``kv_cache="sp_sharded"``, itself equal to the
unsharded pipeline: tests/test_sharding_pipeline.py) on the same weights, prompts and seed. Tolerance:
none (``torch.equal``): the compact layout changes which buffer holds a block between forwards, never an
operation on its values (every forward runs on the same whole-key-range buffer, its text k/v gathered back
whole), so any difference is a wrong block read. The streams are chosen so that the block a compact write
evicts is one the same forward still reads: 12 blocks (block s >= 8 is written into the slot of block
s - 6, which the update of s reads), a re-caching prompt switch at window 13 with the ring full (the
re-cache of block 2 evicts block 8, which the re-cache of 8 then writes back after reading block 2), both
position modes, merged and two-pass forwards, TP1xSP2 and TP2xSP2 with 45-token blocks (uneven shares).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rolling_forcing.cache import RollingKVCache, text_share_range
from rolling_forcing.config import PipelineConfig
from rolling_forcing.schedule import slot_of
from sharding.kv_shard import CompactRing, compact_slot
from sharding.pipeline import ShardedRollingForcingPipeline
from tests.pipeline_helpers import TINY, text_embeds, tiny_model
from tests.pipeline_helpers import one_thread as one_thread  # autouse: one intra-op thread

P = PipelineConfig()
ODD = dataclasses.replace(TINY, name="tiny-odd", latent_height=6, latent_width=10)  # 45-token blocks
NB = 12
SWITCH = {13: (text_embeds(98), True)}  # start block 9: the sink and blocks 2..8 are re-cached


def _stream(model, cfg, layout: str, **kw: object) -> tuple[torch.Tensor, list]:
    sharded = ShardedRollingForcingPipeline(model, cfg, P, timeout_s=60.0, kv_cache=layout, **kw)  # type: ignore[arg-type]
    for w, (emb, recache) in SWITCH.items():
        sharded.set_prompt(emb, recache, window=w)
    chunks = list(
        sharded.stream(
            text_embeds(cfg=cfg), NB, generator=torch.Generator().manual_seed(7), return_latents=True
        )
    )
    assert sharded.last_results is not None
    return torch.cat([c.latents for c in chunks], dim=1), sharded.last_results


def _check_allocations(cfg, results: list, full: list, tp: int, sp: int) -> None:
    """Each rank holds ``buffer_slots - 1`` slots of its block share and ``1 / world`` of the text k/v;
    it gathers the same whole-key-range layer as the full ring and one whole text k/v layer."""
    t, hd, world = P.tokens_per_block(cfg), cfg.head_dim, tp * sp
    for r, f in zip(results, full):
        s = r["rank"] // tp
        t_s = t // sp + (s < t % sp)
        assert r["cache_shape"] == (1, (P.buffer_slots - 1) * t_s, cfg.num_heads // tp, hd)
        assert r["kv_bytes"] * P.buffer_slots == f["kv_bytes"] * (P.buffer_slots - 1)
        assert r["kv_gather_bytes"] == f["kv_gather_bytes"] > 0  # the forward still sees every slot
        n_text = -(-cfg.text_len // world) if r["rank"] < cfg.text_len % world else cfg.text_len // world
        assert r["text_kv_bytes"] == cfg.num_layers * 2 * n_text * cfg.dim * 4
        assert f["text_kv_bytes"] == cfg.num_layers * 2 * cfg.text_len * cfg.dim * 4
        assert r["text_gather_bytes"] == 2 * cfg.text_len * cfg.dim * 4 and f["text_gather_bytes"] == 0


@pytest.mark.distributed
def test_compact_merged_stream_equals_the_full_ring() -> None:
    """TP1xSP2, merged, absolute positions, 12 blocks with a re-caching switch at a full ring."""
    model = tiny_model(TINY)
    ref, full = _stream(model, TINY, "sp_sharded", cores=2, positions="absolute")
    got, res = _stream(model, TINY, "sp_compact", cores=2, positions="absolute")
    assert torch.equal(got, ref)
    assert float((ref[:, :3] - ref[:, -3:]).abs().max()) > 1e-2  # a non-trivial stream
    # the switch re-cached the sink and the 7 ring blocks 2..8 (one update-only forward each)
    assert all(r["forwards"]["recache"] == 8 for r in res)
    _check_allocations(TINY, res, full, 1, 2)


@pytest.mark.distributed
def test_compact_two_pass_relative_odd_stream_equals_the_full_ring() -> None:
    """TP2xSP2 on 45-token blocks (23 + 22 token shares), two-pass, relative positions (every cached block
    read as a roped copy), the same switch."""
    model = tiny_model(ODD, 3)
    kw = {"cores": 4, "tp": 2, "positions": "relative", "merged": False}
    ref, full = _stream(model, ODD, "sp_sharded", **kw)
    got, res = _stream(model, ODD, "sp_compact", **kw)
    assert torch.equal(got, ref)
    _check_allocations(ODD, res, full, 2, 2)


def test_compact_ring_slots_and_reads() -> None:
    """The compact ring's slot rule, and its refusal to hand out a block it evicted."""
    assert [compact_slot(P, b) for b in range(9)] == [0, 1, 2, 3, 4, 5, 6, 1, 2]
    assert [slot_of(P, b) for b in range(9)] == [0, 1, 2, 3, 4, 5, 6, 7, 1]
    ring = CompactRing(P)
    assert ring.slots == P.buffer_slots - 1 == 7
    for b in range(8):  # the update of block b reads blocks max(0, b - 6) .. b (b written by itself)
        ring.begin(range(max(0, b - 6), b + 1), (b,))
        ring.commit()
    assert sorted(ring.held.values()) == [0, 2, 3, 4, 5, 6, 7]  # block 7 took block 1's slot
    ring.begin([0, 7], ())  # the merged forward's placement: each held block at its schedule slot
    assert sorted(zip(ring.dst, ring.src)) == sorted(
        (slot_of(P, b), compact_slot(P, b)) for b in ring.held.values()
    )
    with pytest.raises(RuntimeError, match=r"reads \[1\] too"):
        ring.begin([1, 2], ())
    with pytest.raises(ValueError, match="block must be >= 0"):
        compact_slot(P, -1)


def test_text_shares_partition_the_prompt() -> None:
    for tokens, count in ((16, 8), (13, 4), (3, 8), (512, 8)):
        ranges = [text_share_range(tokens, i, count) for i in range(count)]
        assert [i for a, b in ranges for i in range(a, b)] == list(range(tokens))
        sizes = [b - a for a, b in ranges]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    cache = RollingKVCache(TINY, P, 1)
    text = tiny_model(TINY).text_kv(text_embeds())
    cache.set_text(text)
    cache.share_text(1, 3)  # re-slices the installed text, and every later one
    a, b = text_share_range(TINY.text_len, 1, 3)
    assert all(
        torch.equal(k, tk[:, a:b]) and torch.equal(v, tv[:, a:b])
        for (k, v), (tk, tv) in zip(cache.text_kv(), text)
    )
    cache.set_text(text)
    assert cache.text_kv()[0][0].shape[1] == b - a
    with pytest.raises(RuntimeError, match="keeps text share"):
        cache.share_text(0, 3)
    with pytest.raises(ValueError, match="index must be an int in"):
        RollingKVCache(TINY, P, 1).share_text(3, 3)
    with pytest.raises(ValueError, match="num_slots must be an int in"):
        RollingKVCache(TINY, P, 1, num_slots=P.buffer_slots + 1)


def test_compact_layout_refused_where_it_does_not_apply() -> None:
    model = tiny_model(TINY)
    for kw, why in (
        ({"cores": 2, "tp": 2}, r"plan Ulysses TP2xSP1 \(sp=1\)"),
        ({"cores": 2, "method": "self-forcing"}, "not a sequential method"),
    ):
        with pytest.raises(ValueError, match=r"kv_cache='sp_compact' applies to .*sp > 1.*" + why):
            ShardedRollingForcingPipeline(model, TINY, P, kv_cache="sp_compact", **kw)  # type: ignore[arg-type]
    # compile= applies (tests/test_sharding_compact_compile.py runs it); the ring takes one block per forward
    pipe = ShardedRollingForcingPipeline(model, TINY, P, cores=2, kv_cache="sp_compact", compile=True)
    assert pipe.kv_cache == "sp_compact" and pipe.compile is True
    with pytest.raises(ValueError, match="writes at most one block"):
        CompactRing(P).begin([0], (0, 1))
