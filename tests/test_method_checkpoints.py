"""Each method's released checkpoint layout loads: Self-Forcing/CausVid generator dicts, LongLive's FSDP
EMA names and its base + PEFT LoRA (merged at load, checked against the LoRA applied un-merged)."""

from __future__ import annotations

import pickle

import pytest
import torch

from rolling_forcing import checkpoint as ck
from rolling_forcing.config import get_preset
from rolling_forcing.lora import load_lora, lora_pairs, merge_lora
from rolling_forcing.model import CausalWanModel

M = get_preset("tiny")
RANK = 4


def _model(seed: int = 0) -> CausalWanModel:
    return CausalWanModel(M).init_random(seed).eval()


def _block_linears(model: CausalWanModel) -> list[str]:
    """Every nn.Linear inside a transformer block (LongLive's LoRA targets)."""
    return [n for n, m in model.named_modules() if n.startswith("blocks.") and isinstance(m, torch.nn.Linear)]


def _peft_lora(model: CausalWanModel, seed: int = 3) -> dict[str, torch.Tensor]:
    """A PEFT-style LoRA state dict (``base_model.model.<module>.lora_A/B.weight``), non-zero A and B."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name in _block_linears(model):
        lin = model.get_submodule(name)
        assert isinstance(lin, torch.nn.Linear)
        sd[f"base_model.model.{name}.lora_A.weight"] = torch.randn(RANK, lin.in_features, generator=g) * 0.1
        sd[f"base_model.model.{name}.lora_B.weight"] = torch.randn(lin.out_features, RANK, generator=g) * 0.1
    return sd


@pytest.mark.parametrize("wrapper", ["model.", "model._fsdp_wrapped_module."])
def test_generator_training_layouts(tmp_path, wrapper: str) -> None:
    """Self-Forcing / CausVid / LongLive training files: {"generator", "generator_ema"} with a ``model.``
    prefix; LongLive's FSDP-gathered EMA also has ``_fsdp_wrapped_module.`` inside block names."""
    src = _model(1).state_dict()
    inner = {
        k.replace("blocks.", "blocks._fsdp_wrapped_module.") if "fsdp" in wrapper else k: v
        for k, v in src.items()
    }
    blob = {"generator": {f"{wrapper}{k}": v for k, v in inner.items()}, "generator_ema": {}}
    path = tmp_path / "gen.pt"
    torch.save(blob, path)
    model = _model(0)
    assert ck.load_checkpoint(model, path) == "wan"
    assert all(torch.equal(v, src[k]) for k, v in model.state_dict().items())


def test_longlive_base_plus_lora_merged_equals_lora_applied(tmp_path) -> None:
    """Merged at load (W + (alpha/r) B A) equals the LoRA applied un-merged in the forward (hooks adding
    (alpha/r) B A x to each block linear): fp32, bound from the reordered sums (measured ~1e-6)."""
    base = _model(1)
    lora = _peft_lora(base)
    alpha = 8.0
    base_path, lora_path = tmp_path / "longlive_base.pt", tmp_path / "lora.pt"
    torch.save({"generator": {f"model.{k}": v for k, v in base.state_dict().items()}}, base_path)
    torch.save({"generator_lora": lora}, lora_path)
    merged = _model(0)
    ck.load_checkpoint(merged, base_path, lora=lora_path, lora_alpha=alpha)

    applied = _model(1)
    for name in _block_linears(applied):
        a = lora[f"base_model.model.{name}.lora_A.weight"]
        b = lora[f"base_model.model.{name}.lora_B.weight"]

        def hook(mod: torch.nn.Module, inp: tuple, out: torch.Tensor, a=a, b=b) -> torch.Tensor:
            return out + (alpha / RANK) * (inp[0] @ a.T) @ b.T

        applied.get_submodule(name).register_forward_hook(hook)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, M.in_channels, 3, M.latent_height, M.latent_width, generator=g)
    ctx = torch.randn(1, M.text_len, M.text_dim, generator=g)
    t = torch.tensor([700.0])
    with torch.no_grad():
        y_m, y_a, y_0 = (m.forward_full(x, t, ctx) for m in (merged, applied, base))
    assert float((y_m - y_0).abs().max()) > 1e-2  # the LoRA changes the model
    assert float((y_m - y_a).abs().max()) < 1e-4


def test_lora_formats_and_errors(tmp_path) -> None:
    model = _model(0)
    lora = _peft_lora(model)
    # PEFT adapter names and safetensors are accepted; alpha None = the rank (LongLive: scale 1)
    named = {k.replace(".weight", ".default.weight"): v for k, v in lora.items()}
    path = tmp_path / "lora.safetensors"
    ck.save_safetensors(named, path)
    pairs = load_lora(path)
    assert set(pairs) == set(_block_linears(model))
    name = "blocks.0.self_attn.q"
    w0 = model.state_dict()[f"{name}.weight"]
    out = merge_lora(model.state_dict(), pairs)
    a, b = pairs[name]
    assert torch.allclose(out[f"{name}.weight"], w0 + b @ a, atol=1e-6)
    with pytest.raises(ck.CheckpointError, match="only lora_A"):
        lora_pairs({k: v for k, v in lora.items() if not k.endswith(f"{name}.lora_B.weight")})
    with pytest.raises(ck.CheckpointError, match="no weight in the base"):
        merge_lora({}, pairs)
    bad = dict(lora)
    bad[f"base_model.model.{name}.lora_B.weight"] = torch.zeros(3, RANK)
    with pytest.raises(ck.CheckpointError, match="do not fit"):
        merge_lora(model.state_dict(), lora_pairs(bad))
    with pytest.raises(ck.CheckpointError, match="not 2-D lora_A/lora_B"):
        lora_pairs({"blocks.0.ffn.0.weight": torch.zeros(2, 2)})
    evil = tmp_path / "evil.pt"
    with open(evil, "wb") as fh:
        pickle.dump({"generator_lora": _NotWeights()}, fh, protocol=2)
    with pytest.raises(ck.CheckpointError, match="not weights-only"):
        load_lora(evil)


class _NotWeights:
    """A picklable object that is not a tensor: torch.load(weights_only=True) must refuse it."""

    def __init__(self) -> None:
        self.payload = 1
