"""The FP8-linear model option (rolling_forcing/fp8.py, off by default) and the PSNR half of the FP8 gate
(perf/fp8_psnr.py, pending the demo model), on the tiny and micro presets with the reference backend."""

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
