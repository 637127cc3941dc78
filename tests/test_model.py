"""CausalWanModel: Wan2.1 key names, shapes, per-frame behaviour, flow -> x0."""

from __future__ import annotations

import math

import pytest
import torch

from rolling_forcing.config import PipelineConfig, get_preset
from rolling_forcing.model import CausalWanModel, flow_to_x0, sinusoidal_embedding_1d

CFG = get_preset("tiny")


def _wan_keys(num_layers: int) -> set[str]:
    keys = {
        "patch_embedding.weight", "patch_embedding.bias",
        "text_embedding.0.weight", "text_embedding.0.bias",
        "text_embedding.2.weight", "text_embedding.2.bias",
        "time_embedding.0.weight", "time_embedding.0.bias",
        "time_embedding.2.weight", "time_embedding.2.bias",
        "time_projection.1.weight", "time_projection.1.bias",
        "head.head.weight", "head.head.bias", "head.modulation",
    }  # fmt: skip
    for i in range(num_layers):
        p = f"blocks.{i}."
        keys.add(p + "modulation")
        for a in ("self_attn", "cross_attn"):
            for lin in "qkvo":
                keys |= {f"{p}{a}.{lin}.weight", f"{p}{a}.{lin}.bias"}
            keys |= {f"{p}{a}.norm_q.weight", f"{p}{a}.norm_k.weight"}
        keys |= {p + "norm3.weight", p + "norm3.bias"}
        keys |= {p + "ffn.0.weight", p + "ffn.0.bias", p + "ffn.2.weight", p + "ffn.2.bias"}
    return keys


def test_state_dict_keys_are_wan_names() -> None:
    m = CausalWanModel(CFG)
    assert set(m.state_dict()) == _wan_keys(CFG.num_layers)
    sd = m.state_dict()
    assert sd["time_projection.1.weight"].shape == (6 * CFG.dim, CFG.dim)
    assert sd["blocks.0.modulation"].shape == (1, 6, CFG.dim)
    assert sd["head.head.weight"].shape == (CFG.patch_out, CFG.dim)
    assert sd["patch_embedding.weight"].shape == (CFG.dim, CFG.in_channels, *CFG.patch_size)


def test_wan_1_3b_parameter_count() -> None:
    # ~1.3B parameters for the real preset (meta device: no allocation)
    with torch.device("meta"):
        m = CausalWanModel(get_preset("wan2.1-1.3b"))
    n = sum(p.numel() for p in m.parameters())
    assert 1.2e9 < n < 1.5e9, n


def test_init_random_is_seeded_and_non_trivial() -> None:
    a = CausalWanModel(CFG).init_random(3)
    b = CausalWanModel(CFG).init_random(3)
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), na
        assert pa.abs().min() > 0 or pa.numel() > 1000, na


def test_sinusoidal_embedding_matches_formula() -> None:
    t = torch.tensor([0.0, 555.5556, 1000.0])
    e = sinusoidal_embedding_1d(8, t)
    for i, tv in enumerate(t.tolist()):
        for k in range(4):
            w = 10000 ** (-k / 4)
            assert math.isclose(e[i, k].item(), math.cos(tv * w), abs_tol=1e-12)
            assert math.isclose(e[i, 4 + k].item(), math.sin(tv * w), abs_tol=1e-12)


def test_forward_full_shape_and_frame_coupling() -> None:
    torch.manual_seed(0)
    m = CausalWanModel(CFG).init_random(0)
    x = torch.randn(2, CFG.in_channels, 3, CFG.latent_height, CFG.latent_width)
    ctx = torch.randn(2, CFG.text_len, CFG.text_dim)
    with torch.no_grad():
        y = m.forward_full(x, torch.tensor([900.0, 100.0]), ctx)
        assert y.shape == x.shape and torch.isfinite(y).all()
        # full attention: changing frame 2 changes frame 0's output
        x2 = x.clone()
        x2[:, :, 2] += 1
        y2 = m.forward_full(x2, torch.tensor([900.0, 100.0]), ctx)
        assert (y2[:, :, 0] - y[:, :, 0]).abs().max() > 1e-4
        # per-sample timestep matters, and samples are independent (sample 0's math is unchanged: measured
        # 0.0; atol 1e-6 (+ rtol 1e-5) only allows a few fp32 ulps of |y| <= ~5 for BLAS batch blocking)
        y3 = m.forward_full(x, torch.tensor([900.0, 500.0]), ctx)
        assert torch.allclose(y3[0], y[0], atol=1e-6) and (y3[1] - y[1]).abs().max() > 1e-4


def test_bad_inputs_raise() -> None:
    m = CausalWanModel(CFG)
    x = torch.randn(1, CFG.in_channels, 3, CFG.latent_height, CFG.latent_width)
    with pytest.raises(ValueError, match="text embeddings must be"):
        m.forward_full(x, torch.tensor([1.0]), torch.randn(1, CFG.text_len, CFG.text_dim + 1))
    with pytest.raises(ValueError, match="latents must be"):
        m.forward_full(x[:, :, :, :4], torch.tensor([1.0]), torch.randn(1, CFG.text_len, CFG.text_dim))


def test_flow_to_x0_uses_nearest_scheduler_sigma() -> None:
    p = PipelineConfig()
    table = p.scheduler_table()
    xt = torch.randn(1, 2, 4, 2, 2)
    flow = torch.randn(1, 2, 4, 2, 2)
    ts = torch.tensor([[p.timesteps[1], p.timesteps[4] + 0.01]])
    x0 = flow_to_x0(flow, xt, ts, table)
    for f, sigma in enumerate((p.sigmas[1], p.sigmas[4])):
        want = xt[0, f].double() - sigma * flow[0, f].double()
        # fp32 x0 vs float64 formula: measured 5.8e-08 (1 fp32 ulp of |x0| <= ~3 is 2.4e-07); 1e-6 ~ 4 ulps
        assert torch.allclose(x0[0, f].double(), want, atol=1e-6)


def _recording_attn(record: dict):
    """Self-attention with a fixed key set (the pass's own keys) that records each layer's k, v.

    Queries are the last ``q.shape[1]`` tokens (what ``forward_with`` hands over in the last layer when
    ``context_frames`` > 0), so its output for them equals the full pass's output for the same tokens.
    """
    from reference.attention import attention
    from reference.rope3d import rope3d

    def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid) -> torch.Tensor:
        record[layer] = (k.clone(), v.clone())
        record["q_tokens", layer] = q.shape[1]
        _, kr = rope3d(k, k, grid, 0)
        qpad = torch.cat([q.new_zeros(k.shape[0], k.shape[1] - q.shape[1], *k.shape[2:]), q], dim=1)
        qr, _ = rope3d(qpad, qpad, grid, 0)
        out = attention(qr[:, k.shape[1] - q.shape[1] :], kr, v)
        assert isinstance(out, torch.Tensor)
        return out

    return attn


@pytest.mark.parametrize("ctx", [0, 2, 3])
def test_forward_with_context_frames_skips_only_discarded_work(ctx: int) -> None:
    """context_frames: the output of the other frames and every layer's k/v equal the full forward's."""
    m = CausalWanModel(CFG).init_random(5).eval()
    g = torch.Generator().manual_seed(6)
    f = 3
    x = torch.randn(1, f, CFG.in_channels, CFG.latent_height, CFG.latent_width, generator=g)
    t = torch.tensor([[0.0, 952.38, 500.0]])
    text = m.text_kv(torch.randn(1, CFG.text_len, CFG.text_dim, generator=g))
    full_kv: dict = {}
    part_kv: dict = {}
    with torch.no_grad():
        full = m.forward_with(x, t, text, _recording_attn(full_kv))
        part = m.forward_with(x, t, text, _recording_attn(part_kv), context_frames=ctx)
    assert part.shape == (1, f - ctx, *x.shape[2:])
    # fp32: the same arithmetic per token, only the GEMM row count differs. Measured 0.0 (bitwise, here and
    # for every layer's k/v below); the 1e-5 x |out| bound (~84 fp32 ulps of the max) only allows a BLAS
    # that blocks a different row count differently (reordered K-sums)
    if ctx < f:
        assert float((part - full[:, ctx:]).abs().max()) < 1e-5 * float(full.abs().max())
    tpf = CFG.tokens_per_frame
    last = CFG.num_layers - 1
    # the context frames get no query in the last layer only (earlier layers feed the next layer's k/v)
    assert [part_kv["q_tokens", i] for i in range(CFG.num_layers)] == [f * tpf] * last + [(f - ctx) * tpf]
    for layer in range(CFG.num_layers):
        for a, b in zip(part_kv[layer], full_kv[layer]):
            assert float((a - b).abs().max()) < 1e-5 * float(b.abs().max()), layer


def test_forward_with_context_frames_validated() -> None:
    m = CausalWanModel(CFG).init_random(0).eval()
    x = torch.zeros(1, 2, CFG.in_channels, CFG.latent_height, CFG.latent_width)
    t = torch.zeros(1, 2)
    text = m.text_kv(torch.zeros(1, CFG.text_len, CFG.text_dim))
    with pytest.raises(ValueError, match=r"context_frames must be in \[0, F=2\], got 3"):
        m.forward_with(x, t, text, _recording_attn({}), context_frames=3)
    with pytest.raises(TypeError, match="context_frames must be an int"):
        m.forward_with(x, t, text, _recording_attn({}), context_frames=1.0)  # type: ignore[arg-type]
