"""``perf.attention_guard``: the guard quantity it records (``log l`` against the first key chunk's max)
against a hand computation, one short instrumented stream (tiny preset, emulator vs reference), and the
``--model wan-layer`` sweep (one Wan2.1-1.3B layer, small key count) against an independent recomputation."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from perf.attention_guard import (
    _log_l,
    _parse_layers,
    _wan_attention,
    main,
    measure,
    measure_wan_layer,
    tile_guard_stats,
    trips,
    wan_tokens,
)
from tests.numerics import FP32_MATMUL_ATOL


def test_log_l_is_the_guards_quantity() -> None:
    # one query, one head, D = 1, scale 1: scores = k; first chunk (2 keys) max 1.0
    q = torch.ones(1, 1, 1, 1)
    k = torch.tensor([0.0, 1.0, 3.0, -2.0]).view(1, 4, 1, 1)
    high, low, chunks = _log_l(q, k, 1.0, 2)
    want = math.log(math.exp(0 - 1) + math.exp(0) + math.exp(3 - 1) + math.exp(-3))
    assert high == pytest.approx(want, rel=1e-12) and low == pytest.approx(want, rel=1e-12) and chunks == 2
    k[0, 3, 0, 0] = 80.0  # a later key 79 nats above the first chunk's max: past ln(1e30) = 69.08
    assert _log_l(q, k, 1.0, 2)[0] > 69.08
    # two queries in one tile: the second's scores are 50 below the first's, so against the tile's
    # maximum its log l is about -50 (below ln(1e-18) = -41.4)
    q2 = torch.tensor([1.0, -1.0]).view(1, 2, 1, 1)
    k2 = torch.tensor([50.0, 0.0, 0.0, 0.0]).view(1, 4, 1, 1)
    low2 = _log_l(q2, k2, 1.0, 2)[1]
    want2 = math.log(math.exp(-50) + 3.0) - 50.0
    assert low2 == pytest.approx(want2, rel=1e-9) and low2 < -41.4


@pytest.mark.emulator
def test_short_tiny_stream_counts_static_passes() -> None:
    row = measure("tiny", blocks=5)
    assert row.kind == "measured" and row.variant == "static_offset"
    e = row.extra
    assert e["static_passes"] > 0 and e["running_max_passes"] == 0
    assert e["attention_calls_watched"] > 0 and e["guard_log_l_max"] < e["guard_log_l_limit"]
    assert e["frames"] > 0


# ---------------------------------------------------------------------------------- --model wan-layer
LN_MAX, LN_MIN = math.log(1e30), math.log(1e-18)  # the kernels' GUARD_L_MAX / GUARD_L_MIN


def test_tile_guard_stats_by_hand() -> None:
    # two rows, first chunk = 2 keys; row 1's scores sit 50 below row 0's best first-chunk score
    s = torch.tensor([[0.0, 1.0, 3.0, -2.0], [-50.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    lse0 = math.log(math.exp(0) + math.exp(1) + math.exp(3) + math.exp(-2))
    lse1 = math.log(math.exp(-50) + 3.0)
    row_max, tile_max, tile_min = tile_guard_stats(s, 2, per_tile=True)
    assert row_max == pytest.approx(max(lse0 - 1.0, lse1 - 0.0), rel=1e-12)
    assert tile_max == pytest.approx(lse0 - 1.0, rel=1e-12) and tile_min == pytest.approx(
        lse1 - 1.0, rel=1e-12
    )
    assert math.isnan(tile_guard_stats(s, 2, per_tile=False)[1])
    # the kernel's rules: fp32 (row offset) only the upper bound, bf16 (tile offset) both
    far_below = tile_guard_stats(
        torch.tensor([[50.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64), 1, True
    )
    assert far_below[2] == pytest.approx(math.log(3.0) - 50.0) and far_below[2] < LN_MIN
    assert trips(far_below, "bfloat16") and not trips(far_below, "float32")
    later = tile_guard_stats(torch.tensor([[0.0, 80.0]], dtype=torch.float64), 1, True)
    assert later[0] > LN_MAX and trips(later, "float32") and trips(later, "bfloat16")
    with pytest.raises(ValueError, match="s must be"):
        tile_guard_stats(torch.zeros(4, dtype=torch.float64), 2, True)


def test_wan_init_is_xavier_uniform_with_unit_norms() -> None:
    attn = _wan_attention(0, None, 0)
    bound = math.sqrt(6.0 / (1536 + 1536))  # xavier-uniform of a 1536 x 1536 weight
    for lin in (attn.q, attn.k):
        w = lin.weight.detach()
        assert float(w.abs().max()) <= bound and float(w.std()) == pytest.approx(
            bound / math.sqrt(3), rel=0.01
        )
        assert float(lin.bias.detach().abs().max()) == 0.0
    assert torch.equal(attn.norm_q.weight, torch.ones(1536)) and torch.equal(
        attn.norm_k.weight, torch.ones(1536)
    )


def _recomputed(
    gain: float, frames: int, q_frames: tuple[int, int]
) -> dict[int, list[tuple[float, float, float]]]:
    """Per head, the bf16 guard stats of every 128-query tile of ``q_frames``, computed independently:
    norm weights set to ``gain`` in the module, RoPE by ``ops.rope3d`` (angles from the grid), float64."""
    import copy

    from nki_kernels import ops

    attn = copy.deepcopy(_wan_attention(0, None, 0))
    with torch.no_grad():
        attn.norm_q.weight.fill_(gain)
        attn.norm_k.weight.fill_(gain)
        x = wan_tokens(0, frames)
        q = attn.norm_q(attn.q(x)).view(1, -1, 12, 128)
        k = attn.norm_k(attn.k(x)).view(1, -1, 12, 128)
    qr, kr = ops.rope3d(q, k, (frames, 30, 52), backend="reference")
    lo, hi = q_frames[0] * 1560, q_frames[1] * 1560
    out: dict[int, list[tuple[float, float, float]]] = {}
    for h in range(12):
        s = torch.einsum("qd,kd->qk", qr[0, lo:hi, h].double(), kr[0, :, h].double()) / math.sqrt(128)
        for t0 in range(0, hi - lo, 128):
            st = s[t0 : t0 + 128]
            lse, first = torch.logsumexp(st, -1), st[:, :1024].amax(-1)
            d = lse - first.max()
            out.setdefault(h, []).append((float((lse - first).max()), float(d.max()), float(d.min())))
    return out


def test_wan_layer_sweep_against_an_independent_recomputation() -> None:
    # 2 frames (3,120 keys), queries = frame 1 (1,560 = 13 tiles, all sampled); gains 1, 4 and 20
    gains = (1.0, 4.0, 20.0)
    rows = measure_wan_layer(gains, "bfloat16", tiles=13, frames=2, groups=(("q", 1, 2),))
    assert [r.config["qk_gain"] for r in rows] == list(gains) and len({r.extra["run_id"] for r in rows}) == 1
    tripping = []
    for r in rows:
        g = r.config["qk_gain"]
        want = _recomputed(g, 2, (1, 2))
        # score error: the fp32 matmul baseline (FP32_MATMUL_ATOL, unit-scale inputs) x scale x gain^2; a
        # stat differences two 1-Lipschitz reductions (2x), plus the rows' 2-decimal rounding
        tol = 2 * FP32_MATMUL_ATOL * 128**-0.5 * g * g + 0.005
        per_head = [max(st[0] for st in want[h]) for h in range(12)]
        assert r.extra["guard_log_l_max_per_head"] == pytest.approx(per_head, abs=tol)
        assert r.extra["tile_log_l_min"] == pytest.approx(
            min(st[2] for v in want.values() for st in v), abs=tol
        )
        assert r.extra["tile_log_l_max"] == pytest.approx(
            max(st[1] for v in want.values() for st in v), abs=tol
        )
        heads = sum(any(trips(st, "bfloat16") for st in want[h]) for h in range(12))
        assert r.extra["heads_tripping"] == heads and r.extra["tiles_sampled"] == 12 * 13
        tripping.append(heads)
    assert tripping[0] == 0 and tripping[-1] == 12  # gain 1 far from the bounds, gain 20 far past them
    onset = next(g for g, n in zip(gains, tripping, strict=True) if n)
    assert rows[0].extra["trip_onset_gain"] == onset
    assert rows[0].extra["trip_onset_bracket"] == [gains[gains.index(onset) - 1], onset]


def test_wan_layer_reads_a_checkpoints_layer(tmp_path: Any) -> None:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(5)
    names = ("q.weight", "q.bias", "k.weight", "k.bias", "norm_q.weight", "norm_k.weight")
    shapes = {"q.weight": (1536, 1536), "k.weight": (1536, 1536)}
    state = {f"blocks.1.self_attn.{n}": torch.randn(shapes.get(n, (1536,)), generator=g) for n in names}
    path = tmp_path / "layer.safetensors"
    save_file(state, str(path))
    attn = _wan_attention(0, str(path), 1)
    assert torch.equal(attn.q.weight, state["blocks.1.self_attn.q.weight"])
    assert torch.equal(attn.norm_k.weight, state["blocks.1.self_attn.norm_k.weight"])
    rows = measure_wan_layer(
        (1.0,), "float32", tiles=1, frames=2, groups=(("q", 1, 2),), checkpoint=str(path), layers=(1,)
    )
    assert rows[0].config["weights"] == "checkpoint" and rows[0].config["layer"] == 1
    with pytest.raises(ValueError, match="no tensor 'blocks.0.self_attn.q.weight'"):
        _wan_attention(0, str(path), 0)
    state["blocks.1.self_attn.k.bias"] = torch.zeros(12)
    save_file(state, str(path))
    with pytest.raises(
        ValueError, match=r"blocks.1.self_attn.k.bias is \(12,\), Wan2.1-1.3B needs \(1536,\)"
    ):
        _wan_attention(0, str(path), 1)
    assert _parse_layers("all", str(path)) == tuple(range(30)) and _parse_layers("0,5", str(path)) == (0, 5)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "wan-layer", "--layer", "3"], "--layer needs --checkpoint"),
        (["--model", "wan-layer", "--layer", "x"], "--layer must be an int"),
        (
            ["--model", "wan-layer", "--layer", "30", "--checkpoint", "c"],
            r"--layer indices must be in \[0, 30\)",
        ),
        (["--model", "wan-layer", "--qk-gain", "0"], "--qk-gain values must be finite and > 0"),
        (["--model", "wan-layer", "--tiles", "0"], "--tiles must be >= 1"),
        (["--model", "wan-layer", "--merged"], "apply to the stream models"),
        (["--qk-gain", "2"], "apply to --model wan-layer only"),
    ],
)
def test_cli_refuses_bad_wan_layer_arguments(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        main(argv)
