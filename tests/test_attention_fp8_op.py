"""The FP8 attention option as an op (``ops.attention / attention_segments / attention_block_table(...,
fp8=True)``) and as a stream option (``RollingForcingPipeline(attn_fp8=True)``), and its decoded-video gate's
plumbing (``perf/fp8_psnr.attention_gate``): which backend computes what, and the errors where it cannot
apply. The numerics of the kernel are tests/test_attention_fp8.py."""

from __future__ import annotations

import math

import pytest
import torch

from nki_kernels import ops
from nki_kernels.attention import attention_emulated
from reference import attention_fp8 as ref8
from rolling_forcing.config import ModelConfig, PipelineConfig, get_preset
from rolling_forcing.decode import PreviewDecoder
from rolling_forcing.model import CausalWanModel
from rolling_forcing.pipeline import RollingForcingPipeline

BF = torch.bfloat16


def _t(x: object) -> torch.Tensor:
    assert isinstance(x, torch.Tensor)
    return x


def _rand(seed: int, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).to(BF) for s in shapes]


def test_reference_backend_is_the_fp8_reference() -> None:
    """fp8=True on the reference backend is reference.attention_fp8 bit for bit (any Lk, here one chunk),
    and differs from the bf16 op (the option is not silently dropped)."""
    q, k, v = _rand(1, (1, 150, 2, 32), (1, 300, 2, 32), (1, 300, 2, 32))
    out, lse = ops.attention(q, k, v, return_lse=True, fp8=True, backend="reference")
    r_out, r_lse = ref8.attention(q, k, v, return_lse=True)
    assert torch.equal(out, r_out) and torch.equal(lse, r_lse)
    assert not torch.equal(out, _t(ops.attention(q, k, v, backend="reference")))
    segs = [(10, 100), (200, 90)]
    o2 = ops.attention_segments(q, k, v, segs, fp8=True, backend="reference")
    assert torch.equal(_t(o2), _t(ref8.attention_segments(q, k, v, segs)))
    table = torch.tensor([[[0, 1], [-1, 0], [0, 0]]])
    o3 = ops.attention_block_table(q, [k], [v], table, [150], 100, fp8=True, backend="reference")
    assert torch.equal(_t(o3), _t(ref8.attention_block_table(q, [k], [v], table, [150], 100)))


@pytest.mark.emulator
def test_emulator_backend_runs_the_fp8_kernel() -> None:
    q, k, v = _rand(2, (1, 130, 1, 32), (1, 2100, 1, 32), (1, 2100, 1, 32))
    out = _t(ops.attention(q, k, v, fp8=True, backend="emulator"))
    assert torch.equal(out, _t(attention_emulated(q, k, v, fp8=True)))
    assert not torch.equal(out, _t(attention_emulated(q, k, v)))


def test_errors_name_the_rule() -> None:
    q, k, v = _rand(3, (1, 20, 1, 32), (1, 300, 1, 32), (1, 300, 1, 32))
    with pytest.raises(TypeError, match="fp8 must be a bool"):
        ops.attention(q, k, v, fp8=1, backend="reference")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="fp8=True needs bfloat16"):
        ops.attention(q.float(), k.float(), v.float(), fp8=True, backend="reference")
    with pytest.raises(ValueError, match=r"fp8=True on backend 'emulator' needs >= 2048 keys"):
        ops.attention(q, k, v, fp8=True, backend="emulator")
    with pytest.raises(ValueError, match=r"attention_segments: fp8=True .* got 300"):
        ops.attention_segments(q, k, v, [(0, 300)], fp8=True, backend="emulator")
    table = torch.tensor([[[0, 0], [0, 1], [0, 2]]])
    with pytest.raises(ValueError, match=r"attention_block_table: fp8=True .* got 300"):
        ops.attention_block_table(q, [k], [v], table, [20], 100, fp8=True, backend="emulator")
    qg = q.clone().requires_grad_(True)
    out = _t(ops.attention(qg, k, v, fp8=True, backend="reference"))
    with pytest.raises(RuntimeError, match="fp8=True is forward only"):
        out.sum().backward()


def _tiny() -> tuple[ModelConfig, CausalWanModel]:
    mcfg = get_preset("tiny")
    return mcfg, CausalWanModel(mcfg).init_random(0).eval().to(BF)


def test_pipeline_option_rules() -> None:
    mcfg, model = _tiny()
    pcfg = PipelineConfig(dtype="bfloat16", positions="relative")
    with pytest.raises(TypeError, match="attn_fp8 must be a bool"):
        RollingForcingPipeline(model, mcfg, pcfg, attn_fp8="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="attn_fp8=True applies to the merged forward"):
        RollingForcingPipeline(model, mcfg, pcfg, backend="reference", merged=False, attn_fp8=True)


def test_pipeline_option_reaches_the_self_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """attn_fp8=True: every merged self-attention call runs the FP8 reference (counted), the stream stays
    close to the bf16 one (random tiny weights: a plumbing check, not a quality figure)."""
    from perf.fp8_psnr import attention_gate

    mcfg, model = _tiny()
    pcfg = PipelineConfig(dtype="bfloat16", positions="relative")
    text = torch.randn(1, mcfg.text_len, mcfg.text_dim, generator=torch.Generator().manual_seed(1)).to(BF)
    calls = []
    real = ref8.attention_block_table

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(ref8, "attention_block_table", counted)
    dec = PreviewDecoder(mcfg.out_channels)
    g = attention_gate(model, mcfg, pcfg, text, dec, num_blocks=5, backend="reference")
    pipe = RollingForcingPipeline(model, mcfg, pcfg, backend="reference", positions="relative", attn_fp8=True)
    assert pipe.merged and pipe.attn_fp8
    forwards = len(calls)
    assert forwards > 0 and forwards % mcfg.num_layers == 0  # every layer of every merged forward
    assert g.replaced == ("self_attention",) and g.blocks == 5
    assert 20 < g.psnr_db < math.inf
