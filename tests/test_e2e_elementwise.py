"""The chunk model charges the DiT block's elementwise work as the project's fused kernels
(perf/e2e/elementwise.py): which kernel calls stand for which component, at Wan's fp32-residual dtypes,
priced by cost model v2 from their own traces; a provider without fused kernels keeps the separate passes."""

from __future__ import annotations

import math

import pytest

from nki_kernels import elementwise as ew
from nki_kernels.elementwise_fused import gate_residual_adaln_kernel
from nki_kernels.emulator import TensorSpec, run
from nki_kernels.emulator.cost import profile_range
from perf.e2e import AnalyticKernels, E2EParams, Forward, TracedKernels, forward_components
from perf.e2e.elementwise import (
    FUSED,
    PAIRS,
    FusedCall,
    compulsory_bytes,
    elementwise_plan,
    frames_touched,
    fused_calls,
    separate_pass,
)
from perf.matmul_model import AnalyticMatmulProvider
from rolling_forcing.config import get_preset

pytestmark = pytest.mark.emulator

WAN = get_preset("wan2.1-1.3b")
TPF = math.prod(WAN.grid_hw)  # 1,560 tokens per latent frame at 480x832


class _Fused:
    """Analytic attention / RoPE / KV write plus the traced fused elementwise kernels."""

    name = "fused"

    def __init__(self) -> None:
        self.analytic, self.traced = AnalyticKernels(E2EParams()), TracedKernels(E2EParams())

    def attention(self, *args):  # noqa: ANN002, ANN201
        return self.analytic.attention(*args)

    def rope(self, *args):  # noqa: ANN002, ANN201
        return self.analytic.rope(*args)

    def kv_write(self, *args):  # noqa: ANN002, ANN201
        return self.analytic.kv_write(*args)

    def elementwise(self, *args):  # noqa: ANN002, ANN201
        return self.traced.elementwise(*args)


def _components(kernels, end: str = "pessimistic"):
    p = E2EParams()
    fwd = Forward("merged", 18 * TPF, (("update", 3 * TPF, 7 * 3 * TPF), ("denoise", 15 * TPF, 7 * 3 * TPF)))
    cs = forward_components(
        WAN, fwd, tp=4, sp=2, comm_s=0.0, collectives=0, kernels=kernels,
        matmul=AnalyticMatmulProvider(), params=p, point=p.at(end),
    )  # fmt: skip
    return {c.name: c for c in cs}


def test_frames_touched_is_the_worst_alignment() -> None:
    assert frames_touched(3510, 1560) == 4  # starts on a frame's last token: 1 + 1560 + 1560 + 389
    assert (
        frames_touched(1560, 1560) == 2 and frames_touched(1561, 1560) == 2 and frames_touched(1, 1560) == 1
    )
    assert frames_touched(3, 1) == 3 and frames_touched(28080, 1560) == 19
    with pytest.raises(ValueError, match="tokens >= 1"):
        frames_touched(0, 1560)


def test_component_to_kernel_table_follows_wans_dtypes() -> None:
    """fp32 residual stream in, bf16 branch inputs out; q and k normalised by two calls; the ungated
    cross residual and the affine norm3 with one row; GELU over the FFN width."""
    n, d, f = 3510, 1536, 8960
    calls = {name: fused_calls(name, n, d, f, TPF) for name in FUSED}
    adaln = FusedCall("adaln_norm_modulate", n, d, 4, "float32", "", "bfloat16")
    gate = FusedCall("gate_residual", n, d, 4, "float32", "bfloat16")
    assert calls["adaln_norm1_mod"] == calls["adaln_norm2_mod"] == [adaln]
    assert calls["gate_residual_sa"] == calls["gate_residual_ffn"] == [gate]
    assert calls["norm3_affine"] == [FusedCall("adaln_norm_modulate", n, d, 1, "float32", "", "bfloat16")]
    assert calls["residual_cross"] == [FusedCall("gate_residual", n, d, 1, "float32", "bfloat16")]
    assert calls["rmsnorm_qk"] == [FusedCall("rms_norm", n, d)] * 2
    assert calls["rmsnorm_cross_q"] == [FusedCall("rms_norm", n, d)]
    assert calls["gelu_tanh"] == [FusedCall("gelu_tanh", n, f)]
    pair = [FusedCall("gate_residual_adaln", n, d, 4, "float32", "bfloat16", "bfloat16")]
    assert all(fused_calls(name, n, d, f, TPF) == pair for name in PAIRS)
    with pytest.raises(ValueError, match="must be one of"):  # no bf16 pair kernel
        fused_calls("residual_cross+adaln_norm2_mod", n, d, f, TPF, "bfloat16")
    with pytest.raises(ValueError, match="must be one of"):
        fused_calls("layernorm", n, d, f, TPF)


def test_plan_covers_every_component_once_per_layer() -> None:
    """Each of the 9 components is charged exactly once per layer, alone or inside a pair; pairs only fuse a
    residual with the norm that reads its result (the FFN residual with the next layer's norm1)."""
    for layers in (1, 2, 30):
        for pairs in (False, True):
            plan = elementwise_plan(layers, pairs)
            cover = {name: 0 for name in FUSED}
            for name, calls, _ in plan:
                for part in PAIRS.get(name, (name,)):
                    cover[part] += calls
            assert cover == {name: layers for name in FUSED}, (layers, pairs)
    assert {n for n, _, _ in elementwise_plan(30, False)} == set(FUSED)
    once = [(n, c) for n, c, per_layer in elementwise_plan(30, True) if not per_layer]
    assert once == [("adaln_norm1_mod", 1), ("gate_residual_ffn", 1)]
    assert ("gate_residual_ffn+adaln_norm1_mod", 29, True) in elementwise_plan(30, True)
    with pytest.raises(ValueError, match="num_layers"):
        elementwise_plan(0, True)


def test_chunk_charges_the_fused_kernels_instead_of_the_separate_passes() -> None:
    """Each elementwise component's time is its kernels' own v2 schedule (traced here independently) at
    the end, its launches the kernel calls, its calls the plan's; without ``elementwise`` the 9 separate
    passes of the unfused accounting."""
    fused, plain = _components(_Fused()), _components(AnalyticKernels(E2EParams()))
    n, d, f, L = math.ceil(18 * TPF / 8), WAN.dim, WAN.ffn_dim, WAN.num_layers
    p = E2EParams()
    for name in FUSED:
        elems, rb, wb, ops, eng = separate_pass(name, n, d, f)
        hz = p.vector_hz if eng == "vector" else p.scalar_hz
        sep = max(elems * (rb + wb) / p.hbm_Bps_per_core, elems * ops / (p.lanes * hz))
        assert plain[name].time_s == pytest.approx(sep, rel=1e-12) and plain[name].launches == 1
        assert plain[name].calls == L and plain[name].hbm_bytes == elems * (rb + wb)
    for name, calls, per_layer in elementwise_plan(L, True):
        c = fused[name]
        assert (c.calls, c.per_layer, c.group) == (calls, per_layer, "elementwise")
        assert "traced fused" in c.source and c.hbm_bytes == compulsory_bytes(name, n, d, f)
    ew_names = {c for c in fused if fused[c].group == "elementwise"}
    assert ew_names == {nm for nm, _, _ in elementwise_plan(L, True)}  # the separate ones are gone
    # independently: the residual + norm pair over 4 equal frames of 3,510 -> 3,512 tokens, pessimistic end
    x, y = TensorSpec((3512, d), "float32"), TensorSpec((3512, d), "bfloat16")
    rows = TensorSpec((4, d), "float32")
    _, tr = run(
        gate_residual_adaln_kernel,
        x,
        y,
        rows,
        rows,
        rows,
        1e-6,
        "bfloat16",
        trace_only=True,
        keep_events=True,
    )
    _, hi = profile_range(tr, schedule=True)
    pair = fused["gate_residual_sa+norm3_affine"]
    assert pair.time_s == pytest.approx((hi.latency_ns - hi.fixed_ns) * 1e-9, rel=1e-12)
    assert pair.hbm_bytes == 3510 * d * 12  # fp32 x in and out, bf16 y in, bf16 branch out
    # and the first layer's norm1 alone: adaLN fp32 -> bf16
    _, tr = run(
        ew.adaln_norm_modulate_kernel, x, rows, rows, 1e-6, "bfloat16", trace_only=True, keep_events=True
    )
    _, hi = profile_range(tr, schedule=True)
    assert fused["adaln_norm1_mod"].time_s == pytest.approx((hi.latency_ns - hi.fixed_ns) * 1e-9, rel=1e-12)
    # q and k: two rms_norm calls, twice one call's time
    assert fused["rmsnorm_qk"].launches == 2 and fused["rmsnorm_cross_q"].launches == 1
    assert fused["rmsnorm_qk"].time_s == pytest.approx(2 * fused["rmsnorm_cross_q"].time_s, rel=1e-12)
    # the fp32-residual gate reads fp32 x and bf16 y: its trace moves the 10 B / element the budget charges
    gate = TracedKernels(E2EParams()).elementwise("gate_residual_ffn", n, d, f, TPF)[0]
    assert gate.hbm_bytes == 3512 * d * 10 + 4 * d * 4


def test_bf16_residual_stream_uses_the_same_dtype_kernels() -> None:
    """The causal repos' block (rolling_forcing/model.py): x, y and the branch input all bf16, so the bf16
    kernels and 2-byte residual traffic; a third dtype is refused."""
    n, d, f = 3510, 1536, 8960
    bf = "bfloat16"
    assert fused_calls("adaln_norm1_mod", n, d, f, TPF, bf) == [FusedCall("adaln_norm_modulate", n, d, 4, bf)]
    assert fused_calls("gate_residual_ffn", n, d, f, TPF, bf) == [FusedCall("gate_residual", n, d, 4, bf)]
    assert fused_calls("gelu_tanh", n, d, f, TPF, bf) == fused_calls("gelu_tanh", n, d, f, TPF)
    assert separate_pass("gate_residual_sa", n, d, f, bf)[1:3] == (4, 2)
    assert separate_pass("gate_residual_sa", n, d, f)[1:3] == (6, 4)
    assert separate_pass("adaln_norm2_mod", n, d, f, bf)[1:3] == (2, 2)
    for fn in (fused_calls, separate_pass):
        with pytest.raises(ValueError, match="residual must be one of"):
            fn("gelu_tanh", n, d, f, *((TPF,) if fn is fused_calls else ()), "float16")


def test_layer_table_sums_its_rows() -> None:
    """``python -m perf.e2e.elementwise_table``: one row per plan item and a per-forward row that adds
    them (to the rounding of the rows at 0.1 µs)."""
    from perf.e2e.elementwise_table import layer_table

    rows = layer_table("float32", tokens=300)
    plan = elementwise_plan(WAN.num_layers, True)
    assert len(rows) == 2 + len(plan) + 1
    body = [r.split("|") for r in rows[2:-1]]
    assert [b[1].strip() for b in body] == [nm for nm, _, _ in plan]
    assert [int(b[4]) for b in body] == [c for _, c, _ in plan]
    lo = sum(float(b[3].split(" - ")[0]) * int(b[4]) for b in body) / 1e3
    total = rows[-1].split("|")
    assert float(total[3].split("**")[1].split(" - ")[0]) == pytest.approx(lo, abs=0.05 * 60 / 1e3 + 0.005)
    assert f"({sum(int(b[4]) * int(b[5]) for b in body)} calls)" in total[3]
