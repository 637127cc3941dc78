"""Checkpoint loading: key layouts, wrappers, error listings, pickle safety, diffusers equivalence."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch

from rolling_forcing import checkpoint as ck

try:  # the `test` extra installs diffusers: without it the equivalence tests must fail, never skip
    import diffusers
except ImportError as exc:
    raise ImportError(
        "tests/test_checkpoint.py needs diffusers (WanTransformer3DModel, the independent model the "
        "checkpoint "
        "key map and the model are compared with): pip install -e '.[test]'"
    ) from exc


def _tiny_cfg() -> Any:
    from rolling_forcing.config import get_preset

    return get_preset("tiny")


def _diffusers_model(cfg: Any, seed: int = 0) -> torch.nn.Module:
    """A diffusers WanTransformer3DModel with the same hyper-parameters as ``cfg``, random weights."""
    torch.manual_seed(seed)
    model = diffusers.WanTransformer3DModel(
        patch_size=tuple(cfg.patch_size),
        num_attention_heads=cfg.num_heads,
        attention_head_dim=cfg.dim // cfg.num_heads,
        in_channels=cfg.in_channels,
        out_channels=cfg.out_channels,
        text_dim=cfg.text_dim,
        freq_dim=cfg.freq_dim,
        ffn_dim=cfg.ffn_dim,
        num_layers=cfg.num_layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=cfg.eps,
        rope_max_seq_len=1024,
    )
    # diffusers zero-/one-initialises norms and biases; randomise every tensor, at a scale where every
    # branch (gated self-attention, cross-attention, FFN, head) moves the output by O(1), so a wrong
    # mapping (swapped norms, q/k, modulation chunks) or a RoPE layout mismatch cannot go unnoticed.
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn_like(p)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * r)
            elif "scale_shift_table" in name:
                p.copy_(0.5 * r)
            elif p.ndim > 1:
                p.copy_(r / p[0].numel() ** 0.5)
            else:
                p.copy_(0.1 * r)
    return model.eval()


def _our_model(cfg: Any) -> torch.nn.Module:
    from rolling_forcing.model import CausalWanModel

    return CausalWanModel(cfg).eval()


# --------------------------------------------------------------------------------------------- mapping


def test_key_mapping_round_trip_and_names() -> None:
    cfg = _tiny_cfg()
    dmodel = _diffusers_model(cfg)
    dsd = dmodel.state_dict()
    wsd = ck.diffusers_to_wan(dsd)
    ours = _our_model(cfg).state_dict()
    # The renamed diffusers dict fits our model exactly: same keys, same shapes.
    report = ck.compare_keys(wsd, ours)
    assert report.ok, report.describe()
    back = ck.wan_to_diffusers(wsd)
    assert set(back) == set(dsd)
    assert all(back[k] is dsd[k] for k in dsd)
    assert ck.detect_format(dsd) == "diffusers" and ck.detect_format(wsd) == "wan"
    # Spot checks of the non-obvious renames.
    assert torch.equal(wsd["blocks.0.norm3.weight"], dsd["blocks.0.norm2.weight"])
    assert torch.equal(wsd["blocks.1.ffn.0.weight"], dsd["blocks.1.ffn.net.0.proj.weight"])
    assert torch.equal(wsd["head.modulation"], dsd["scale_shift_table"])
    assert torch.equal(wsd["blocks.0.modulation"], dsd["blocks.0.scale_shift_table"])
    assert torch.equal(wsd["time_projection.1.weight"], dsd["condition_embedder.time_proj.weight"])


@pytest.mark.parametrize("layout", ["wan", "diffusers"])
def test_load_both_layouts_from_safetensors(tmp_path, layout: str) -> None:
    cfg = _tiny_cfg()
    src = _our_model(cfg)
    with torch.no_grad():
        for p in src.parameters():
            p.copy_(torch.randn_like(p))
    state = src.state_dict()
    path = tmp_path / f"w_{layout}.safetensors"
    ck.save_safetensors(state if layout == "wan" else ck.wan_to_diffusers(state), path)
    dst = _our_model(cfg)
    assert ck.load_checkpoint(dst, path) == layout
    for k, v in dst.state_dict().items():
        assert torch.equal(v, state[k].to(v.dtype)), k


def test_rf_training_wrapper_and_ema(tmp_path) -> None:
    cfg = _tiny_cfg()
    model = _our_model(cfg)
    base = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    ema = {k: torch.randn_like(v) for k, v in base.items()}
    blob = {
        "generator": {f"model.{k}": v for k, v in base.items()},
        "generator_ema": {f"model.{k}": v for k, v in ema.items()},
        "critic": {"x": torch.zeros(1)},
    }
    path = tmp_path / "rf.pt"
    torch.save(blob, path)
    ck.load_checkpoint(model, path, use_ema=True)
    assert torch.equal(model.state_dict()["head.head.weight"], ema["head.head.weight"])
    ck.load_checkpoint(model, path, use_ema=False)
    assert torch.equal(model.state_dict()["head.head.weight"], base["head.head.weight"])
    plain = tmp_path / "plain.safetensors"
    ck.save_safetensors(base, plain)
    with pytest.raises(ck.CheckpointError, match="generator_ema"):
        ck.load_checkpoint(model, plain, use_ema=True)


def test_errors_list_missing_unexpected_and_misshaped(tmp_path) -> None:
    cfg = _tiny_cfg()
    model = _our_model(cfg)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    del state["blocks.0.self_attn.q.weight"]
    state["blocks.0.self_attn.extra.weight"] = torch.zeros(2)
    state["head.head.bias"] = torch.zeros(state["head.head.bias"].numel() + 1)
    path = tmp_path / "bad.safetensors"
    ck.save_safetensors(state, path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ck.CheckpointError) as info:
        ck.load_checkpoint(model, path)
    msg = str(info.value)
    assert "missing keys (1)" in msg and "blocks.0.self_attn.q.weight" in msg
    assert "unexpected keys (1)" in msg and "blocks.0.self_attn.extra.weight" in msg
    n = before["head.head.bias"].numel()
    assert "mis-shaped keys (1)" in msg and f"head.head.bias: checkpoint [{n + 1}] vs model [{n}]" in msg
    # The model is untouched after a failed load.
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


class _NotWeights:
    """A picklable object that is not a tensor: torch.load(weights_only=True) must refuse it."""

    def __init__(self) -> None:
        self.payload = 1


def test_non_weights_only_pickle_is_refused(tmp_path) -> None:
    path = tmp_path / "evil.pt"
    with open(path, "wb") as fh:
        pickle.dump({"generator": _NotWeights()}, fh, protocol=2)
    with pytest.raises(ck.CheckpointError, match="not weights-only"):
        ck.read_state_dict(path)


def test_unknown_layout_and_unsupported_keys() -> None:
    with pytest.raises(ck.CheckpointError, match="cannot tell the key layout"):
        ck.detect_format({"foo.weight": torch.zeros(1)})
    with pytest.raises(ck.CheckpointError, match="no mapping"):
        ck.diffusers_to_wan({"blocks.0.attn2.add_k_proj.weight": torch.zeros(1)})
    with pytest.raises(ck.CheckpointError, match="does not exist"):
        ck.read_state_dict("/nonexistent/x.safetensors")


# ------------------------------------------------------------------------------------ equivalence


def test_forward_full_equals_diffusers_wan_transformer(monkeypatch) -> None:
    """Same random weights: our single-pass forward == diffusers' WanTransformer3DModel (fp32, uniform t).

    Baseline: diffusers' own fp32 rounding error, measured against the same diffusers model run in
    float64 (``base``). The two fp32 implementations may differ by k=2 x base plus a floor of a few fp32
    ulps at the output scale. One known, documented difference is not rounding noise of that kind: Wan
    (and our model) compute the sinusoidal timestep embedding in float64, diffusers in float32
    (``get_timestep_embedding``), which shifts the angles t * w_k by up to ~1 ulp of t (6e-5 rad at
    t = 952). The test therefore checks (a) with diffusers' float32 sinusoid substituted into our model:
    within 2 x base + floor, i.e. everything else (mapping, RoPE layout, norms, modulation) is identical;
    (b) with Wan's float64 sinusoid: within 2 x (base + the measured effect of the sinusoid precision).
    """
    import copy

    from diffusers.models.embeddings import get_timestep_embedding

    import rolling_forcing.model as model_mod

    cfg = _tiny_cfg()
    dmodel = _diffusers_model(cfg, seed=1)
    ours = _our_model(cfg)
    ck.load_into(ours, ck.diffusers_to_wan(dmodel.state_dict()), source="diffusers tiny model")
    torch.manual_seed(2)
    b, f, h, w = 2, 3, cfg.latent_height, cfg.latent_width
    latents = torch.randn(b, cfg.in_channels, f, h, w)
    t = torch.tensor([952.381, 555.556])
    context = torch.randn(b, cfg.text_len, cfg.text_dim)
    context[:, cfg.text_len // 2 :] = 0.0  # zeroed padding, attended to (no mask) in both models
    with torch.no_grad():
        want = dmodel(latents, t, context, return_dict=False)[0]
        want64 = copy.deepcopy(dmodel).double()(
            latents.double(), t.double(), context.double(), return_dict=False
        )[0]
        got = ours.forward_full(latents, t, context)
        monkeypatch.setattr(
            model_mod,
            "sinusoidal_embedding_1d",
            lambda dim, pos: get_timestep_embedding(
                pos, dim, flip_sin_to_cos=True, downscale_freq_shift=0
            ).double(),
        )
        got_fp32_sin = ours.forward_full(latents, t, context)
    assert got.shape == want.shape == latents.shape
    scale = want.abs().max().item()
    base = (want.double() - want64).abs().max().item()
    floor = 4 * torch.finfo(torch.float32).eps * scale
    err_aligned = (got_fp32_sin - want).abs().max().item()
    err = (got - want).abs().max().item()
    sin_effect = (got - got_fp32_sin).abs().max().item()
    print(
        f"\ndiffusers equivalence (fp32, measured): max abs err {err:.3e} (max |out| {scale:.3f}); "
        f"with diffusers' fp32 timestep sinusoid {err_aligned:.3e}; diffusers' own fp32 error vs float64 "
        f"{base:.3e}; effect of float64 vs float32 sinusoid {sin_effect:.3e}"
    )
    assert err_aligned <= 2 * base + floor
    assert err <= 2 * (base + sin_effect) + floor
    assert err < 1e-4 * scale  # and, in absolute terms, far below any semantic mismatch (O(scale))


def test_forward_full_detects_a_wrong_mapping() -> None:
    """Sanity: a plausible mapping slip (self-attention q <-> k) breaks equivalence, so the test can fail.

    (Swapping norm_q/norm_k weights would not: their elementwise weights commute inside q . k.)"""
    cfg = _tiny_cfg()
    dmodel = _diffusers_model(cfg, seed=1)
    ours = _our_model(cfg)
    wsd = ck.diffusers_to_wan(dmodel.state_dict())
    for p in ("weight", "bias"):
        q, k = f"blocks.0.self_attn.q.{p}", f"blocks.0.self_attn.k.{p}"
        wsd[q], wsd[k] = wsd[k], wsd[q]
    ck.load_into(ours, wsd)
    latents = torch.randn(1, cfg.in_channels, 2, cfg.latent_height, cfg.latent_width)
    t = torch.tensor([800.0])
    context = torch.randn(1, cfg.text_len, cfg.text_dim)
    with torch.no_grad():
        want = dmodel(latents, t, context, return_dict=False)[0]
        got = ours.forward_full(latents, t, context)
    assert (got - want).abs().max().item() > 1e-3


def test_sharded_directory_with_index(tmp_path) -> None:
    """A diffusers-style checkout: transformer/ with two shards and an index json."""
    import json

    cfg = _tiny_cfg()
    src = _our_model(cfg).init_random(4)
    dsd = ck.wan_to_diffusers(src.state_dict())
    keys = sorted(dsd)
    half = len(keys) // 2
    tdir = tmp_path / "transformer"
    tdir.mkdir()
    weight_map = {}
    for i, part in enumerate((keys[:half], keys[half:])):
        name = f"diffusion_pytorch_model-0000{i + 1}-of-00002.safetensors"
        ck.save_safetensors({k: dsd[k] for k in part}, tdir / name)
        weight_map.update({k: name for k in part})
    (tdir / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"weight_map": weight_map})
    )
    dst = _our_model(cfg)
    assert ck.load_checkpoint(dst, tmp_path) == "diffusers"
    assert all(torch.equal(v, src.state_dict()[k]) for k, v in dst.state_dict().items())
