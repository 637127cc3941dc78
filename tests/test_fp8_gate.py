"""The FP8 linear gate (perf/fp8_gate.py) and the linear_fp8 bench row (perf/bench_fp8.py), on small
shapes."""

from __future__ import annotations

import math

import pytest
import torch

from perf.fp8_gate import GateConfig, LinearGate, block_linears, format_gate, gate, linear_gate

SMALL = GateConfig(tokens=96, text_tokens=40, dim=128, ffn_dim=256, heads=2, text_dim=64)


def test_block_linears_cover_the_wan_block() -> None:
    rows = block_linears(SMALL)
    names = [n for n, _, _ in rows]
    attn = [f"{a}_{p}" for a in ("self", "cross") for p in "qkvo"]
    assert names == [*attn, "ffn_up", "ffn_down"]
    shapes = {n: (tuple(x.shape), tuple(w.shape)) for n, x, w in rows}
    assert shapes["ffn_down"] == ((96, 256), (256, 128)) and shapes["cross_k"] == ((40, 128), (128, 128))
    # xavier_uniform: |w| <= sqrt(6 / (fan_in + fan_out)), and the variance of U(-a, a) = a^2 / 3
    _, _, w = rows[8]
    a = math.sqrt(6 / (128 + 256))
    assert float(w.abs().max()) <= a and abs(float(w.var()) / (a * a / 3) - 1) < 0.05
    # the FFN down input is a tanh-GELU output: bounded below by the GELU's minimum (~ -0.17)
    assert float(rows[9][1].min()) > -0.2


def test_gate_errors_have_the_expected_sizes() -> None:
    """bf16 rounds x and w with 8-bit mantissas (relative RMS ~ 2**-8 / sqrt(3) each), e4m3 with 4-bit
    ones (~ 2**-4 / sqrt(3)): the output errors sit within a factor ~2 of sqrt(2) x those."""
    rows = gate(SMALL)
    e_bf16 = math.sqrt(2) * 2**-8 / math.sqrt(3)
    e_fp8 = math.sqrt(2) * 2**-4 / math.sqrt(3)
    for r in rows:
        assert e_bf16 / 2 < r.err_bf16 < 2 * e_bf16, r
        assert e_fp8 / 2 < r.err_fp8 < 2 * e_fp8, r
        assert r.bound == SMALL.factor * r.err_bf16 + SMALL.floor
        assert r.passed == (r.err_fp8 <= r.bound)


def test_linear_gate_on_exact_inputs() -> None:
    """Inputs that e4m3 holds exactly with unit scales (small integers, and 240 in every row and column:
    absmax 240 -> scale 1) give an fp8 path equal to the bf16 path: the gate measures quantisation, not
    noise of its own."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-8, 9, (16, 32), generator=g).float()
    x[:, 0] = 240
    w = torch.randint(-8, 9, (32, 8), generator=g).float()
    w[0] = 240
    r = linear_gate("exact", x, w, SMALL)
    assert r.err_fp8 == 0 and r.passed and 0 <= r.err_bf16 < 2**-8


def test_linear_gate_fails_when_fp8_error_is_large() -> None:
    r = LinearGate("x", 1, 1, 1, err_bf16=1e-3, err_fp8=0.05, bound=2e-3 + 2**-7)
    assert not r.passed and r.ratio == pytest.approx(50)
    assert "FAIL" in format_gate((r,), SMALL)


def test_gate_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="multiple of heads"):
        GateConfig(dim=100, heads=3)
    with pytest.raises(ValueError, match="tokens must be a positive int"):
        GateConfig(tokens=0)
    with pytest.raises(ValueError, match="factor > 0"):
        GateConfig(floor=-1.0)


@pytest.mark.slow
@pytest.mark.emulator
def test_bench_row_runs_and_compares_with_bf16() -> None:
    from perf.bench_fp8 import linear_fp8_cases

    ((op, var, cfg, fn),) = linear_fp8_cases(quick=True)
    assert (op, var, cfg["K"], cfg["N"]) == ("linear_fp8", "ffn_up", 1536, 8960)
    ex = fn()["extra"]
    for end in ("low", "high"):
        assert ex[f"speedup_vs_bf16_{end}"] == pytest.approx(
            ex[f"bf16_linear_us_{end}"] / ex[f"latency_us_{end}"], rel=0.01
        )
    assert set(ex["gate"]) == {"ffn_up"} and ex["gate_passed"] == ex["gate"]["ffn_up"]["pass"]


def test_kv_gate_measures_the_cache_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    """The KV tensor gate: the bf16 error is bf16-sized, the FP8 cache's is larger but e4m3-sized; with the
    round trip replaced by the identity the FP8 path IS the bf16 path (error exactly 0), so the gate
    measures the cache and nothing else."""
    import rolling_forcing.fp8 as fp8mod
    from perf.fp8_gate import kv_gate

    cfg = GateConfig(tokens=96, text_tokens=8, dim=128, ffn_dim=256, heads=2, text_dim=32)
    r = kv_gate.__wrapped__(cfg)
    assert r.name == "kv_cache" and r.bound == pytest.approx(2 * r.err_bf16 + 2.0**-7)
    assert 2.0**-12 < r.err_bf16 < 2.0**-7  # bf16: 8-bit significand
    assert r.err_bf16 < r.err_fp8 < 2.0**-3  # e4m3: 4-bit significand
    monkeypatch.setattr(fp8mod, "kv_fp8_roundtrip", lambda t: t)
    assert kv_gate.__wrapped__(cfg).err_fp8 == 0.0
