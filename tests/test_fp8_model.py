"""The FP8-linear model option (rolling_forcing/fp8.py, off by default) and the PSNR half of the FP8 gate
(perf/fp8_psnr.py, pending the demo model), on the tiny and micro presets with the reference backend."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from perf.fp8_psnr import psnr, psnr_gate
from reference.linear import linear_fp8, quantize_weight_fp8
from rolling_forcing.config import PipelineConfig, get_preset
from rolling_forcing.decode import PreviewDecoder
from rolling_forcing.fp8 import Fp8Linear, use_fp8_linears
from rolling_forcing.model import CausalWanModel


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
