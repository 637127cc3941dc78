"""The FP8-linear model option (rolling_forcing/fp8.py, off by default) and the PSNR half of the FP8 gate
(perf/fp8_psnr.py: its functions on the tiny and micro presets with the reference backend; its rows and
their reader) and the FP8 KV cache's tensor gate (perf/fp8_gate.kv_gate)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from perf.fp8_psnr import kv_cache_gate, psnr, psnr_gate
from reference.linear import linear_fp8, quantize_weight_fp8
from rolling_forcing.cache import RollingKVCache
from rolling_forcing.config import PipelineConfig, get_preset
from rolling_forcing.decode import PreviewDecoder
from rolling_forcing.fp8 import KV_FP8, Fp8Linear, kv_fp8_roundtrip, use_fp8_linears
from rolling_forcing.model import CausalWanModel
from rolling_forcing.pipeline import RollingForcingPipeline


def _tiny():
    mcfg = get_preset("tiny")
    return mcfg, CausalWanModel(mcfg).init_random(0).eval()


def test_use_fp8_linears_replaces_the_block_linears_only() -> None:
    mcfg, model = _tiny()
    names = use_fp8_linears(model, backend="reference", min_features=64)
    # per block: self q/k/v/o, cross q/k/v/o, FFN up/down (dim 192, ffn 384); embeddings and head stay
    assert len(names) == mcfg.num_layers * 10
    assert all(n.startswith("blocks.") for n in names)
    assert isinstance(model.blocks[0].ffn[0], Fp8Linear) and isinstance(model.head.head, nn.Linear)
    assert use_fp8_linears(_tiny()[1], min_features=1000) == []
    with pytest.raises(ValueError, match="min_features must be a positive int"):
        use_fp8_linears(model, min_features=0)
    with pytest.raises(ValueError, match="model.blocks"):
        use_fp8_linears(nn.Linear(3, 3))


def test_fp8_linear_module_is_the_op() -> None:
    lin = nn.Linear(300, 260)
    m = Fp8Linear(lin, backend="reference")
    x = torch.randn(2, 5, 300)
    wq, ws = quantize_weight_fp8(lin.weight.detach().t())
    assert torch.equal(m(x), linear_fp8(x, wq, ws, lin.bias.detach()))
    with pytest.raises(TypeError, match="nn.Linear"):
        Fp8Linear(nn.Conv1d(1, 1, 1))


def test_psnr() -> None:
    a = torch.zeros(1, 2, 3, 4, 4)
    assert psnr(a, a) == math.inf
    assert psnr(a + 0.02, a) == pytest.approx(10 * math.log10(4 / 0.02**2))
    with pytest.raises(ValueError, match="same shape"):
        psnr(a, a[:, :1])


def test_psnr_gate_plumbing_on_micro() -> None:
    """Random micro-preset weights (not a quality figure): nothing converted -> identical videos (inf
    dB); all block linears in FP8 -> a finite PSNR, the bf16 model untouched."""
    mcfg = get_preset("micro")
    model = CausalWanModel(mcfg).init_random(0).eval()
    pcfg = PipelineConfig(positions="relative")
    text = torch.randn(1, mcfg.text_len, mcfg.text_dim, generator=torch.Generator().manual_seed(1))
    dec = PreviewDecoder(mcfg.out_channels)
    same = psnr_gate(model, mcfg, pcfg, text, dec, num_blocks=5, backend="reference", min_features=10_000)
    assert same.replaced == () and same.psnr_db == math.inf and same.passed and same.blocks == 5
    g = psnr_gate(model, mcfg, pcfg, text, dec, num_blocks=5, backend="reference", min_features=64)
    assert len(g.replaced) == 10 and 0 < g.psnr_db < math.inf and g.frames == 1 + 4 * 3 * 5 - 4
    assert all(isinstance(b.ffn[0], nn.Linear) for b in model.blocks)


# ---------------------------------------------------------------------------------------- FP8 KV cache


def test_kv_fp8_roundtrip() -> None:
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(2, 7, 3, 64, generator=g) * torch.logspace(-4, 3, 64)).to(torch.bfloat16)
    x[0, 0, 0] = 0
    y = kv_fp8_roundtrip(x)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert torch.equal(kv_fp8_roundtrip(y), y), "a stored value reads back unchanged"
    assert (y[0, 0, 0] == 0).all()
    # per token and head: the absmax survives (up to the bf16 rounding of 240 * scale), every element within
    # half an e4m3 step (2**-4 relative in the normal range, 2**-10 of the scale below it) + the bf16 rounding
    xf, yf = x.float(), y.float()
    scale = xf.abs().amax(-1, keepdim=True).clamp_min(2.0**-96) / 240
    step = torch.maximum(xf.abs() * 2.0**-4, scale * 2.0**-10) + yf.abs() * 2.0**-8
    assert ((yf - xf).abs() <= step).all()


def test_kv_cache_option_rules() -> None:
    mcfg = get_preset("micro")
    pcfg = PipelineConfig(positions="relative", dtype="float32")
    with pytest.raises(ValueError, match="kv_dtype must be None or 'float8_e4m3'"):
        RollingKVCache(mcfg, pcfg, 1, kv_dtype="int8")
    c16, c8 = RollingKVCache(mcfg, pcfg, 1), RollingKVCache(mcfg, pcfg, 1, kv_dtype=KV_FP8)
    assert c16.device_nbytes == c16.nbytes == c8.nbytes
    assert c8.device_nbytes == round(c8.nbytes / 4 * (1 + 4 / mcfg.head_dim))
    model = CausalWanModel(mcfg).init_random(0).eval()
    with pytest.raises(ValueError, match="kv_dtype must be None"):
        RollingForcingPipeline(model, mcfg, pcfg, kv_dtype="fp8")


@pytest.mark.parametrize("merged", [True, False])
def test_fp8_kv_cache_stores_e4m3_values(merged: bool) -> None:
    """Both write paths (the merged forward's and the two-pass cache writes) store what an FP8 cache reads
    back: every cached token and head is a fixed point of the round trip, and the stream differs from the
    one with the plain cache."""
    mcfg = get_preset("micro")
    pcfg = PipelineConfig(positions="relative", dtype="float32")
    model = CausalWanModel(mcfg).init_random(0).eval()
    text = torch.randn(1, mcfg.text_len, mcfg.text_dim, generator=torch.Generator().manual_seed(1))
    pipe = RollingForcingPipeline(model, mcfg, pcfg, backend="reference", kv_dtype=KV_FP8, merged=merged)
    gen = torch.Generator().manual_seed(0)
    written = 0
    for chunk in pipe.stream(text, 7, generator=gen):
        if chunk.block == 2:
            assert pipe.state is not None
            for layer in pipe.state.cache.layers:
                for t in (layer.k, layer.v):
                    assert torch.equal(kv_fp8_roundtrip(t), t)
                    written += int((t != 0).any(-1).sum())
    assert written > 0
    dec = PreviewDecoder(mcfg.out_channels)
    g = kv_cache_gate(model, mcfg, pcfg, text, dec, num_blocks=6, backend="reference", merged=merged)
    assert 0 < g.psnr_db < math.inf


def _row(gate: str, db: float, run_id: str, passed: bool):
    from perf.runner import BenchRow

    extra = {"psnr_db": db, "passed": passed, "threshold_db": 35.0, "bf16_vs_fp32_db": 44.0, "run_id": run_id}
    return BenchRow(gate, "demo", {"prompt": "p"}, "measured", extra=extra)


def test_latest_gates_reads_the_newest_run(tmp_path) -> None:
    from perf.fp8_psnr import latest_gates
    from perf.runner import append_rows

    path = tmp_path / "fp8_psnr.jsonl"
    assert latest_gates(path) == {}
    append_rows([_row("fp8_linears", 40.0, "2026-01-01T00:00:00", True)], path)
    new = [_row("fp8_linears", d, "2026-02-01T00:00:00", d >= 35) for d in (33.0, 36.0)]
    append_rows([*new, _row("fp8_kv_cache", 45.0, "2026-02-01T00:00:00", True)], path)
    g = latest_gates(path)
    assert g["fp8_linears"]["psnr_db_min"] == 33.0 and g["fp8_linears"]["psnr_db_max"] == 36.0
    assert g["fp8_linears"]["prompts"] == 2 and g["fp8_linears"]["passed"] is False  # one prompt fails
    assert g["fp8_kv_cache"]["passed"] is True and g["fp8_kv_cache"]["prompts"] == 1


def test_demo_rows_on_a_short_stream() -> None:
    """The command's rows on the shipped demo model (one prompt, 1 s): each gate's PSNR is the PSNR of the
    two decoded videos, recomputed here from the streams."""
    from perf.fp8_psnr import demo_rows, stream_video
    from rolling_forcing.demo import load_demo

    prompt = "a yellow triangle bouncing on a navy background"
    rows = demo_rows(seconds=1.0, prompts=(prompt,), gates=("fp8_linears", "fp8_kv_cache"))
    assert [r.op for r in rows] == ["fp8_linears", "fp8_kv_cache"] and all(r.kind == "measured" for r in rows)
    demo = load_demo()
    m16 = demo.model.to(torch.bfloat16)
    p16 = PipelineConfig(dtype="bfloat16")
    emb = demo.text_encoder.encode(prompt).to(torch.bfloat16)
    n = rows[0].config["blocks"]
    ref = stream_video(m16, demo.model_cfg, p16, emb, demo.decoder, n)
    kv = stream_video(m16, demo.model_cfg, p16, emb, demo.decoder, n, kv_dtype=KV_FP8)
    assert rows[1].extra["psnr_db"] == round(psnr(kv, ref), 2)
    assert rows[0].extra["layers_converted"] == 10 * demo.model_cfg.num_layers
    assert math.isfinite(rows[0].extra["psnr_db"]) and rows[0].extra["bf16_vs_fp32_db"] > 30
