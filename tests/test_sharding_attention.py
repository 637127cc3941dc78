"""Sharded attention on gloo equals the unsharded fp32 reference; dead or stuck ranks fail loudly.

Tolerance: 1e-5 absolute in fp32. Every rank runs the same fp32 softmax over the same keys in the same
order as the unsharded reference; sharding only moves query rows and heads between ranks, so the only
possible difference is summation order inside the attention backend at different shapes: a few fp32
ulps of outputs of magnitude <= ~4, i.e. ~1e-6; 1e-5 leaves a 10x margin. Measured: 0.0 (bitwise equal
to the unsharded fp32 reference) on the reference backend; ~6e-7 against a naive float64 attention
(printed by the 8-rank test with ``-s``).

Multi-process tests are few and tiny (the CI machine has 2 cores): 8 ranks x 12 heads once, 2 and 4
ranks once each, and three failure cases (raise, hard exit, hang) with a 3 s group timeout.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from reference.attention import attention as reference_attention
from sharding.attention import (
    build_groups,
    local_heads,
    local_tokens,
    query_shard_tokens,
    sharded_attention,
    token_splits,
)
from sharding.launch import LaunchError, launch
from sharding.plan import AttentionShape, plan
from tests.numerics import worst_of

TOL = 1e-5
D = 16
BATCH = 2
TIMEOUT_S = 20.0


def _inputs(heads: int, lq: int, lk: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, lq, heads, D, generator=g)
    k = torch.randn(BATCH, lk, heads, D, generator=g)
    v = torch.randn(BATCH, lk, heads, D, generator=g)
    return q, k, v


def _rank_cases(
    rank: int, world: int, heads: int, cases: list[tuple[int, int, int]], backend: str = "reference"
) -> list[dict]:
    """Run every (tp, lq, lk) case on this rank; return the local outputs and the slices they cover."""
    out = []
    for i, (tp, lq, lk) in enumerate(cases):
        p = plan(heads, world, tp=tp, shape=AttentionShape(lq, lk, D, 4))
        groups = build_groups(p, timeout_s=TIMEOUT_S)
        q, k, v = _inputs(heads, lq, lk, seed=i)
        qs, ks = local_tokens(lq, p, rank), local_tokens(lk, p, rank)
        o, lse = sharded_attention(
            q[:, qs].contiguous(),
            k[:, ks].contiguous(),
            v[:, ks].contiguous(),
            groups,
            num_queries=lq,
            num_keys=lk,
            return_lse=True,
            backend=backend,
        )
        out.append({"out": o, "lse": lse, "start": qs.start, "stop": qs.stop, "heads": local_heads(p, rank)})
    return out


def _fp64_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Naive float64 softmax attention (independent of every backend), ``[B, L, H, D]`` layout."""
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / D**0.5
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), v.double())


def _check(results: list[list[dict]], heads: int, cases: list[tuple[int, int, int]]) -> tuple[float, float]:
    """Assert every rank's output equals the unsharded fp32 reference; return (max diff fp32, fp64)."""
    worst = worst64 = 0.0
    for i, (_, lq, lk) in enumerate(cases):
        q, k, v = _inputs(heads, lq, lk, seed=i)
        ref_out, ref_lse = reference_attention(q, k, v, return_lse=True)
        ref64 = _fp64_attention(q, k, v)
        covered = torch.zeros(lq, dtype=torch.bool)
        for rank_res in results:
            r = rank_res[i]
            sl = slice(r["start"], r["stop"])
            assert r["out"].shape == (BATCH, sl.stop - sl.start, heads, D)
            assert r["out"].dtype == torch.float32
            if sl.stop == sl.start:
                continue
            err = (r["out"] - ref_out[:, sl]).abs().max().item()
            lse_err = (r["lse"] - ref_lse[:, sl]).abs().max().item()
            assert err <= TOL and lse_err <= TOL, (cases[i], err, lse_err)
            assert not covered[sl].any()
            covered[sl] = True
            worst = worst_of(worst, err)
            worst64 = worst_of(worst64, (r["out"].double() - ref64[:, sl]).abs().max().item())
        assert covered.all(), "token shards must cover every query exactly once"
    return worst, worst64


def test_token_splits_and_slices_cover_everything() -> None:
    # at 37 tokens the latency term dominates and the planner prefers pure SP: force TP4 x SP2
    p = plan(12, 8, tp=4, shape=AttentionShape(37, 37, D, 4))
    assert token_splits(37, 8) == (5, 5, 5, 5, 5, 4, 4, 4)
    assert token_splits(3, 8) == (1, 1, 1, 0, 0, 0, 0, 0)
    starts = [local_tokens(37, p, r).start for r in range(8)]
    assert starts == [0, 5, 10, 15, 20, 25, 29, 33]
    # TP4 x SP2: ranks 0-3 share query shard 0 (tokens 0..19), ranks 4-7 shard 1 (tokens 20..36)
    assert query_shard_tokens(37, p, 2) == slice(0, 20) and query_shard_tokens(37, p, 5) == slice(20, 37)
    assert [local_heads(p, r) for r in (0, 3, 4, 7)] == [slice(0, 3), slice(9, 12), slice(0, 3), slice(9, 12)]
    with pytest.raises(ValueError, match="rank must be in"):
        local_heads(p, 8)


@pytest.mark.distributed
def test_8_ranks_12_heads_tp4_sp2_matches_unsharded() -> None:
    # the chosen plan TP4 x SP2; 37 queries and 45 keys do not divide 8 ranks.
    cases = [(4, 37, 37), (4, 37, 45)]
    results = launch(_rank_cases, 8, 12, cases, timeout_s=TIMEOUT_S)
    worst, worst64 = _check(results, 12, cases)
    print(f"\n8 ranks TP4xSP2: max abs diff vs unsharded fp32 {worst:.3g}, vs fp64 {worst64:.3g}")


@pytest.mark.distributed
def test_4_ranks_every_factorisation_matches_unsharded() -> None:
    # Ulysses TP4xSP1, TP2xSP2 and pure SP TP1xSP4; 3 queries < 4 ranks leaves empty shards.
    cases = [(4, 29, 41), (2, 29, 41), (1, 29, 41), (2, 3, 5)]
    results = launch(_rank_cases, 4, 12, cases, timeout_s=TIMEOUT_S)
    _check(results, 12, cases)


@pytest.mark.distributed
def test_2_ranks_matches_unsharded() -> None:
    cases = [(2, 37, 37), (1, 37, 50)]
    results = launch(_rank_cases, 2, 12, cases, timeout_s=TIMEOUT_S)
    _check(results, 12, cases)


@pytest.mark.distributed
@pytest.mark.emulator
def test_2_ranks_on_the_emulated_kernel_matches_unsharded() -> None:
    # the NKI attention kernel (online softmax, tiled: a different summation order) on the emulator,
    # TP2 x SP1 and TP1 x SP2, against the unsharded fp32 reference; its own error is ~6e-7 here.
    cases = [(2, 19, 25), (1, 19, 25)]
    results = launch(_rank_cases, 2, 6, cases, "emulator", timeout_s=TIMEOUT_S)
    _check(results, 6, cases)


def _dies(rank: int, world: int, mode: str) -> int:
    p = plan(4, world, tp=2, shape=AttentionShape(8, 8, D, 4))
    groups = build_groups(p, timeout_s=3.0)
    if rank == 1:
        if mode == "raise":
            raise RuntimeError("rank 1 simulated failure")
        if mode == "exit":
            os._exit(3)
        time.sleep(60)  # "hang": never reaches the collective
    q, k, v = _inputs(4, 8, 8, seed=0)
    ts = local_tokens(8, p, rank)
    sharded_attention(
        q[:, ts].contiguous(), k[:, ts].contiguous(), v[:, ts].contiguous(), groups, num_queries=8
    )
    return rank


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("mode", "root", "match"),
    [
        ("raise", 1, r"^rank 1 raised: RuntimeError: rank 1 simulated failure"),
        ("exit", 1, r"^rank 1 exited with code 3"),
        # rank 1 never reaches the collective: rank 0 gives up after the 3 s group timeout
        ("hang", 0, r"^rank 0 raised: .*Timed out(.|\n)*ranks still running \(terminated\): \[1\]"),
    ],
)
def test_dead_or_stuck_rank_fails_with_clear_error(mode: str, root: int, match: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=match) as info:
        launch(_dies, 2, mode, timeout_s=3.0)
    elapsed = time.monotonic() - t0
    assert elapsed < 20.0, f"failure took {elapsed:.1f} s"
    assert info.value.rank == root


def test_bad_inputs_raise() -> None:
    p = plan(12, 1, shape=AttentionShape(5, 5, D, 4))
    with pytest.raises(RuntimeError, match="initialised torch.distributed"):
        build_groups(p)
