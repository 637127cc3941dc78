"""Planner tests: balanced TP x SP plans, rejected alternatives with reasons, bad plans raise."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sharding.plan import AttentionShape, CommModel, is_legal_group_size, main, plan, plan_table

LEGAL_CORES = [1, 2, 4, 8, 16, 32, 64, 96, 128]


def _legal_brute(n: int) -> bool:
    # independent restatement of the Neuron rule: powers of two up to 16, or multiples of 32
    return n >= 1 and ((n <= 16 and n & (n - 1) == 0) or n % 32 == 0)


@pytest.mark.parametrize("n", range(0, 200))
def test_legal_group_sizes(n: int) -> None:
    assert is_legal_group_size(n) == _legal_brute(n)


@settings(max_examples=150, deadline=None)
@given(heads=st.integers(1, 64), cores=st.sampled_from(LEGAL_CORES))
def test_chosen_plan_is_balanced_and_cheapest(heads: int, cores: int) -> None:
    p = plan(heads, cores)
    assert p.tp * p.sp == cores
    assert heads % p.tp == 0 and p.heads_per_core * p.tp == heads
    assert _legal_brute(p.tp) and _legal_brute(p.sp)
    assert p.is_ulysses == (p.tp == cores)
    # brute force over every factorisation: none balanced and legal is cheaper
    for tp in range(1, cores + 1):
        if cores % tp or heads % tp or not (_legal_brute(tp) and _legal_brute(cores // tp)):
            continue
        other = plan(heads, cores, tp=tp)
        assert p.comm_time_s <= other.comm_time_s
    chosen = [a for a in p.alternatives if a.chosen]
    assert len(chosen) == 1 and chosen[0].tp == p.tp and chosen[0].reason == ""
    assert all(a.reason for a in p.alternatives if not a.chosen)


def test_wan_12_heads_on_8_cores_is_tp4_sp2() -> None:
    p = plan(12, 8)
    assert (p.tp, p.sp, p.heads_per_core) == (4, 2, 3)
    assert p.name == "TP4xSP2"
    by_name = {a.name: a for a in p.alternatives}
    assert "25%" in by_name["padded TP8"].reason and by_name["padded TP8"].attention_balance == 0.75
    assert "uneven" in by_name["uneven TP8"].reason and "2 heads" in by_name["uneven TP8"].reason
    assert "does not divide 12 heads" in by_name["Ulysses TP8xSP1"].reason
    assert "more modelled communication" in by_name["TP2xSP4"].reason
    assert "more modelled communication" in by_name["TP1xSP8"].reason
    assert "does not divide 8 cores" in by_name["TP3"].reason


def test_wan14b_40_heads_on_8_cores_is_ulysses() -> None:
    p = plan(40, 8)
    assert (p.tp, p.sp) == (8, 1) and p.is_ulysses


def test_comm_bytes_match_hand_count() -> None:
    # 12 heads, TP4 x SP2, Lq=23,400, Lk=32,760, D=128, bf16.
    p = plan(12, 8)
    chunk = math.ceil(23_400 / 8)
    a2a = 4 * chunk * 3 * 3 * 128 * 2  # q, k, v, out: 3 other head groups x 3 heads each
    gather = 2 * 1 * (32_760 // 2) * 3 * 128 * 2  # k and v: the other SP shard, 3 local heads
    assert p.comm.all_to_all_bytes == a2a
    assert p.comm.all_gather_bytes == gather
    m = CommModel()
    bw = m.intra_chip_bw_Bps
    expect = (
        2 * (m.fixed_latency_s + m.hop_latency_s)
        + a2a / bw
        + (m.fixed_latency_s + m.hop_latency_s)
        + gather / bw
    )
    assert p.comm_time_s == pytest.approx(expect, rel=1e-12)


def test_comm_bytes_of_the_busiest_rank_when_tokens_do_not_divide() -> None:
    # 23,401 queries on 8 ranks: rank 0 holds 2,926 tokens (the others 2,925); 32,761 keys on 2 SP shards:
    # the larger shard has 16,381. Bytes are the busiest rank's, so the larger shards count.
    p = plan(12, 8, tp=4, shape=AttentionShape(num_queries=23_401, num_keys=32_761))
    assert p.comm.all_to_all_bytes == 4 * 2926 * 3 * 3 * 128 * 2
    assert p.comm.all_gather_bytes == 2 * 1 * 16_381 * 3 * 128 * 2


def test_single_core_has_no_communication() -> None:
    p = plan(12, 1)
    assert (p.tp, p.sp) == (1, 1) and p.comm.total_bytes == 0 and p.comm_time_s == 0.0


@pytest.mark.parametrize(
    ("heads", "cores", "match"),
    [
        (12, 0, "num_cores must be >= 1"),
        (0, 8, "num_heads must be >= 1"),
        (12, 3, "illegal collective group size"),
        (12, 24, "no balanced plan covers 12 heads on 24 cores"),
        (7, 6, "no balanced plan"),
    ],
)
def test_bad_plans_raise_with_reason(heads: int, cores: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan(heads, cores)


def test_forced_tp_that_is_not_balanced_raises() -> None:
    with pytest.raises(ValueError, match="tp=8 is not a balanced plan.*does not divide 12 heads"):
        plan(12, 8, tp=8)
    with pytest.raises(TypeError, match="num_heads must be an int"):
        plan(12.0, 8)  # type: ignore[arg-type]


def test_sp_larger_than_queries_is_rejected() -> None:
    with pytest.raises(ValueError, match="exceeds 4 queries"):
        plan(1, 8, shape=AttentionShape(num_queries=4, num_keys=4))


def test_plan_table_and_cli(capsys: pytest.CaptureFixture[str]) -> None:
    text = plan_table(12, 8)
    assert "TP4xSP2" in text and "MODELLED" in text and "padded TP8" in text
    header = next(line for line in text.splitlines() if "plan" in line and "tp" in line)
    rows = [line for line in text.splitlines() if line.startswith("* ")]
    assert len(rows) == 1 and "TP4xSP2" in rows[0] and len(rows[0]) <= len(header) + 2
    assert main(["--heads", "12", "--cores", "8"]) == 0
    assert "TP4xSP2" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--heads", "12", "--cores", "3"])
    assert "illegal collective group size" in capsys.readouterr().err


LAYOUTS = [(12, 8, 4), (12, 8, 2), (12, 8, 1), (12, 4, 4), (12, 4, 2), (16, 16, 4), (40, 8, 8), (6, 2, 2)]


@pytest.mark.parametrize(("heads", "cores", "tp"), LAYOUTS)
def test_every_rank_of_several_layouts_matches_the_definition(heads: int, cores: int, tp: int) -> None:
    """Every rank's head group, query shard, groups, heads and token ranges against the layout written out
    from its definition (module docstring): the world is cut into TP groups of ``tp`` consecutive ranks;
    a rank's query shard is the index of its TP group, its head group its position inside it; an SP group
    collects the ranks at one position of every TP group. Tokens: contiguous near-equal shards per rank,
    the first ``n % world`` one token longer (enumerated here, not computed with a closed formula)."""
    from sharding.attention import local_heads, local_tokens, query_shard_tokens

    n_tok = 37
    p = plan(heads, cores, tp=tp, shape=AttentionShape(num_queries=n_tok, num_keys=n_tok))
    assert (p.tp, p.world_size) == (tp, cores)
    tp_groups = [list(range(cores))[i : i + tp] for i in range(0, cores, tp)]  # consecutive runs
    assert len(tp_groups) == p.sp
    per_core = heads // tp
    # token shards by dealing one token at a time to ranks in a cycle, then making them contiguous
    counts = [0] * cores
    for i in range(n_tok):
        counts[i % cores] += 1
    owner = [r for r in range(cores) for _ in range(counts[r])]  # owner[token] = rank
    for rank in range(cores):
        shard = next(i for i, grp in enumerate(tp_groups) if rank in grp)
        pos = tp_groups[shard].index(rank)
        assert p.query_shard(rank) == shard, (rank, p.name)
        assert p.head_group(rank) == pos, (rank, p.name)
        assert p.tp_group_ranks(shard) == tuple(tp_groups[shard])
        assert p.sp_group_ranks(pos) == tuple(grp[pos] for grp in tp_groups)
        assert local_heads(p, rank) == slice(pos * per_core, (pos + 1) * per_core)
        mine = [t for t in range(n_tok) if owner[t] == rank]
        lt = local_tokens(n_tok, p, rank)
        assert list(range(lt.start, lt.stop)) == mine, (rank, p.name)
        group_tokens = [t for t in range(n_tok) if owner[t] in tp_groups[shard]]
        qs = query_shard_tokens(n_tok, p, rank)
        assert list(range(qs.start, qs.stop)) == group_tokens, (rank, p.name)
    for bad in (-1, cores):
        with pytest.raises(ValueError, match="rank must be in"):
            p.query_shard(bad)
