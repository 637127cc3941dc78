"""Guard sensitivity of the end-to-end model (perf/e2e/guard.py, the ``guard_trips`` pricing of
perf/e2e/kernels.py, the report section perf/e2e/report_guard.py).

Pure arithmetic against hand-computed values from stub KernelCosts; the chunk's attention terms against
hand-derived tiny-preset shapes; the forced-trip trace against emulator runs on data whose every row trips
(the data of tests/test_attention_static_offset.py: a later key scoring >100 nats above the first chunk).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from perf.e2e.chunk import chunk_model
from perf.e2e.guard import GuardSensitivity, TripTerm, extra_s, guard_rows, guard_sensitivity, trip_terms
from perf.e2e.kernels import AnalyticKernels, KernelCost, TracedKernels
from perf.e2e.params import ENDS, E2EParams
from perf.e2e.report_guard import guard_headline_lines, guard_lines, measured_guard_lines
from perf.matmul_model import AnalyticMatmulProvider
from perf.runner import BenchRow
from rolling_forcing.config import PipelineConfig, get_preset

P = E2EParams()


def _terms() -> list[TripTerm]:
    return [
        TripTerm("attn_merged", "self_attention", 30, 10e-3, 30e-3, 3),
        TripTerm("cross_attn", "cross_attention", 30, 1e-3, 1.5e-3, 12),
    ]


def test_guard_rows_against_hand_computed_values() -> None:
    terms = _terms()
    # 10 % of the self-attention heads: 0.1 x 30 calls x 20 ms = 60 ms
    assert extra_s(terms, 0.1, ("self_attention",)) == pytest.approx(0.060, rel=1e-12)
    # every head of both: 30 x 20 ms + 30 x 0.5 ms = 615 ms
    assert extra_s(terms, 1.0) == pytest.approx(0.615, rel=1e-12)
    assert extra_s(terms, 0.0) == 0.0
    rows = {(r.label, r.scopes): r for r in guard_rows("merged", "pessimistic", 1.0, 12, terms)}
    r10 = rows[("10% of heads", ("self_attention",))]
    assert r10.chunk_s == pytest.approx(1.060, rel=1e-12) and r10.fps == pytest.approx(12 / 1.060, rel=1e-12)
    r100 = rows[("100% of heads", ("self_attention", "cross_attention"))]
    assert r100.chunk_s == pytest.approx(1.615, rel=1e-12)
    assert r100.fps == pytest.approx(12 / 1.615, rel=1e-12)
    assert rows[("0% of heads", ("self_attention",))].fps == pytest.approx(12.0, rel=1e-12)
    # one head per layer: 1 of the core's 3 -> a third of 600 ms
    one = rows[("1 head per layer (1 of the core's 3)", ("self_attention",))]
    assert one.fraction == pytest.approx(1 / 3) and one.chunk_s == pytest.approx(1.200, rel=1e-12)
    assert len(rows) == 7  # 3 fractions x 2 scopes + the one-head row


def test_guard_arithmetic_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="fraction must be a number in \\[0, 1\\]"):
        extra_s(_terms(), 1.5)
    with pytest.raises(ValueError, match="scopes must be drawn from"):
        extra_s(_terms(), 0.5, ("ffn",))
    with pytest.raises(ValueError, match="TripTerm.scope"):
        TripTerm("x", "ffn", 1, 0.0, 0.0, 1)
    with pytest.raises(ValueError, match="local_heads >= 1"):
        TripTerm("x", "self_attention", 1, 0.0, 0.0, 0)
    with pytest.raises(ValueError, match="base_chunk_s > 0"):
        guard_rows("merged", "optimistic", 0.0, 12, _terms())


# ------------------------------------------------------------------------------- the chunk's own terms
def _cost(t_opt: float, t_pess: float) -> KernelCost:
    """A schedule-priced cost with 10 / 20 us of fixed time inside (stripped by ``at``)."""
    return KernelCost(t_opt, time_high_s=t_pess, fixed_s=10e-6, fixed_high_s=20e-6, model="schedule")


@dataclass
class StubKernels:
    """Attention-group calls 1.0 / 1.5 ms (2.5 / 3.3 ms with every guard tripping), attention (the
    cross-attention) 0.2 / 0.3 ms (0.5 / 0.7 ms); optimistic / pessimistic; every call recorded."""

    groups_static: tuple[float, float] = (1.0e-3, 1.5e-3)
    name: str = "stub"
    calls: list[tuple[Any, ...]] = field(default_factory=list)

    def attention(
        self, lq: int, lk: int, heads: int, head_dim: int, static: bool = True, guard_trips: bool = False
    ) -> KernelCost:
        self.calls.append(("attention", lq, lk, heads, head_dim, guard_trips))
        return _cost(0.5e-3, 0.7e-3) if guard_trips else _cost(0.2e-3, 0.3e-3)

    def attention_groups(
        self,
        lqs: tuple[int, ...],
        blocks: int,
        block_tokens: int,
        heads: int,
        head_dim: int,
        static: bool = True,
        guard_trips: bool = False,
    ) -> KernelCost:
        self.calls.append(("groups", lqs, blocks, block_tokens, heads, head_dim, guard_trips))
        return _cost(2.5e-3, 3.3e-3) if guard_trips else _cost(*self.groups_static)

    def rope(self, tokens: int, heads: int, head_dim: int) -> KernelCost:
        return _cost(20e-6, 30e-6)

    def kv_write(self, tokens: int, heads: int, head_dim: int) -> KernelCost:
        return _cost(20e-6, 30e-6)


def _tiny_chunks(kernels: Any) -> tuple[Any, PipelineConfig, dict[tuple[str, str], Any]]:
    m, pipe = get_preset("tiny"), PipelineConfig(dtype="bfloat16")
    kw = {"vae": None, "kernels": kernels, "matmul": AnalyticMatmulProvider(), "params": P}
    chunks = {(("merged", e)): chunk_model(m, pipe, cores=8, variant="merged", end=e, **kw) for e in ENDS}
    return m, pipe, chunks


def test_trip_terms_of_the_tiny_merged_chunk_against_hand_values() -> None:
    stub = StubKernels()
    m, pipe, chunks = _tiny_chunks(stub)
    g = guard_sensitivity(m, pipe, chunks, stub, P, variants=("merged",))
    assert g.note == ""
    # tiny: 12 heads on 8 cores = TP4 x SP2 (3 local heads); 16 tokens per frame, blocks of 3 frames =
    # 48 tokens; update 48 and denoise 15 x 16 = 240 queries over SP2 -> (24, 120); keys 21 x 16 = 336 =
    # 7 blocks; cross-attention: 18 frames x 16 = 288 tokens / 8 cores = 36 queries, all 12 heads, 16 keys
    assert ("groups", (24, 120), 7, 48, 3, 16, True) in stub.calls
    assert ("attention", 36, 16, 12, 16, True) in stub.calls
    for end, (s_self, t_self, s_x, t_x, fixed) in {
        "optimistic": (1.0e-3, 2.5e-3, 0.2e-3, 0.5e-3, 10e-6),
        "pessimistic": (1.5e-3, 3.3e-3, 0.3e-3, 0.7e-3, 20e-6),
    }.items():
        terms = {t.component: t for t in g.terms[("merged", end)]}
        a, x = terms["attn_merged"], terms["cross_attn"]
        assert (a.calls, x.calls, a.local_heads, x.local_heads) == (2, 2, 3, 12)  # 2 layers, 1 forward
        assert a.static_s == pytest.approx(s_self - fixed) and a.tripped_s == pytest.approx(t_self - fixed)
        assert x.static_s == pytest.approx(s_x - fixed) and x.tripped_s == pytest.approx(t_x - fixed)
        base = chunks[("merged", end)].chunk_s
        for f in (0.0, 0.1, 1.0):
            want_self = f * 2 * (t_self - s_self)
            assert g.row("merged", end, f, ("self_attention",)).chunk_s == pytest.approx(base + want_self)
            want_both = want_self + f * 2 * (t_x - s_x)
            row = g.row("merged", end, f, ("self_attention", "cross_attention"))
            assert row.chunk_s == pytest.approx(base + want_both)
            assert row.fps == pytest.approx(12 / (base + want_both))  # 3 latent frames x 4 = 12 frames


def test_guard_pricing_refuses_a_price_that_is_not_the_chunks() -> None:
    m, pipe, chunks = _tiny_chunks(StubKernels())
    drifted = StubKernels(groups_static=(1.1e-3, 1.5e-3))  # the optimistic static price moved
    with pytest.raises(ValueError, match="attn_merged priced .* the chunk's component"):
        trip_terms(m, pipe, chunks[("merged", "optimistic")], drifted, P)
    g = guard_sensitivity(m, pipe, chunks, drifted, P, variants=("merged",))
    assert g.rows == [] and "shapes drifted" in g.note
    g = guard_sensitivity(m, pipe, chunks, AnalyticKernels(P), P, variants=("merged",))
    assert g.rows == [] and "has no guard_trips flag" in g.note
    assert guard_headline_lines(g) == [f"  guard trips: not priced ({g.note})"]
    assert guard_lines(g)[1].startswith("Not priced: guard pricing: kernel provider 'analytic' has no")


# ------------------------------------------------------------- the forced trip against real tripping data
LQ, LK, H, D = 256, 2600, 2, 128
BF = ml_dtypes.bfloat16


def _tripping(heads_tripping: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q, k, v ``[1, L, H, D]`` bf16: for the first ``heads_tripping`` heads every query scores key 1,500
    (in the second 1,024-key chunk) 8 x 150 / sqrt(128) = 106 nats above the O(1) scores of the first
    chunk, so exp against the first chunk's offset overflows (l = inf) in every row of those heads."""
    g = np.random.default_rng(3)
    q, k, v = (g.standard_normal((1, n, H, D)).astype(np.float32) for n in (LQ, LK, LK))
    q[:, :, :heads_tripping, 0] = 8.0
    q[:, :, heads_tripping:, 0] = 0.0
    k[:, 1500, :, :] = 0.0
    k[:, 1500, :, 0] = 150.0
    return q.astype(BF), k.astype(BF), v.astype(BF)


def _profiled(kernel: Any, *args: Any, **kw: Any) -> tuple[float, float]:
    from nki_kernels.emulator import run
    from nki_kernels.emulator.cost import profile_range

    _, tr = run(kernel, *args, keep_events=True, **kw)
    lo, hi = profile_range(tr, schedule=True)
    return lo.latency_ns * 1e-9, hi.latency_ns * 1e-9


@pytest.mark.emulator
def test_every_guard_tripping_prices_a_run_whose_every_row_trips() -> None:
    from nki_kernels.attention import attention_kernel
    from nki_kernels.attention_block_table import attention_block_table_kernel

    tk = TracedKernels(P)
    scale = 1.0 / math.sqrt(D)
    q, k, v = _tripping(H)
    want = _profiled(attention_kernel, q, k, v, scale, False)
    got = tk.attention(LQ, LK, H, D, guard_trips=True)
    assert "every guard tripping" in got.source
    assert (got.time_s, got.time_high_s) == pytest.approx(want, rel=1e-12)
    static = tk.attention(LQ, LK, H, D)
    assert static.time_s < got.time_s  # the data run did recompute
    table = np.array([[[0, b] for b in range(4)]] * 2, dtype=np.int32)  # 2 groups over 4 blocks of 650
    want_bt = _profiled(attention_block_table_kernel, q, [k], [v], table, (128, 128), 650, scale, False)
    got_bt = tk.attention_groups((128, 128), 4, 650, H, D, guard_trips=True)
    assert (got_bt.time_s, got_bt.time_high_s) == pytest.approx(want_bt, rel=1e-12)
    # one of the two heads tripping lies between the static call and every head tripping
    half = _profiled(attention_kernel, *_tripping(1), scale, False)
    assert static.time_s < half[0] < got.time_s
    assert static.time_high_s is not None and got.time_high_s is not None
    assert static.time_high_s < half[1] < got.time_high_s


@pytest.mark.emulator
def test_static_flag_prices_the_running_max_kernel() -> None:
    from nki_kernels.attention import attention_kernel

    tk = TracedKernels(P)
    q, k, v = _tripping(0)  # no row trips: a data run of the running max equals its trace
    want = _profiled(attention_kernel, q, k, v, 1.0 / math.sqrt(D), False, static=False)
    got = tk.attention(LQ, LK, H, D, static=False)
    assert (got.time_s, got.time_high_s) == pytest.approx(want, rel=1e-12)
    assert got.time_s != tk.attention(LQ, LK, H, D).time_s
    with pytest.raises(ValueError, match="guard_trips=True needs static=True"):
        tk.attention(LQ, LK, H, D, static=False, guard_trips=True)
    with pytest.raises(TypeError, match="static must be a bool"):
        tk.attention_groups((128,), 4, 650, H, D, static=1)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------- the report
def _row(variant: str, config: dict[str, Any], extra: dict[str, Any]) -> BenchRow:
    return BenchRow("attention_guard", variant, config, "measured", extra=extra)


def test_report_section_shows_the_priced_rows_and_the_measured_statistics() -> None:
    g = GuardSensitivity()
    for end, base in (("pessimistic", 1.0), ("optimistic", 0.8)):
        g.terms[("merged", end)] = _terms()
        g.rows += guard_rows("merged", end, base, 12, _terms())
    stream = _row(
        "static_offset",
        {"model": "demo", "latent": "32x32"},
        {"static_passes": 1128, "running_max_passes": 0, "guard_log_l_max": 18.7, "tile_log_l_min": -13.1},
    )
    sweep = [
        _row(
            "wan_layer",
            {"weights": "wan_init", "layer": 0, "dtype": "bfloat16", "qk_gain": gn, "keys": 32760},
            {
                "heads_tripping": n,
                "heads": 12,
                "guard_log_l_max": 8.6,
                "tile_log_l_min": -45.0 if n else 4.6,  # the tripping rows: below ln(1e-18)
                "tile_log_l_max": 7.1,
                "tiles_sampled": 384,
                "trip_onset_bracket": [3.5, 3.75],
                "run_id": run,
            },
        )
        for gn, n, run in ((1.0, 0, "b"), (3.75, 2, "b"), (5.0, 12, "b"), (2.0, 7, "a"))  # "a": older
    ]
    text = "\n".join(guard_lines(g, [stream, *sweep]))
    # 10 % self-attention: 1.060 s pessimistic, 0.860 s optimistic -> 11.32-13.95 fps
    assert "| 10% | 11.32-13.95 fps (1,060.00-860.00 ms) | 11.30-13.93 fps (1,061.50-861.50 ms) |" in text
    assert "1 head per layer (1 of the core's 3) | 10.00-12.00 fps (1,200.00-1,000.00 ms) | - |" in text
    assert "0 guard trips in 1,128 static passes" in text
    assert "trips begin between q/k-norm gain 3.5 and 3.75 (the lower bound first), every head from 5" in text
    assert "Heads tripping per gain: 1: 0, 3.75: 2, 5: 12" in text  # the older sweep's row left out
    assert "--model wan-layer --checkpoint PATH --layer all" in text
    assert measured_guard_lines([])[-1].startswith("Not measured")
