"""A diffusers-format Wan model streamed by the project's driver == the project's own model on the weights.

The project's model (``CausalWanModel``, tiny preset, random weights) is the independent side: its weights
are moved into a diffusers ``WanTransformer3DModel`` built from hand-written hyper-parameters (diffusers'
strict ``load_state_dict``; the key map itself is checked against diffusers' forward in
tests/test_checkpoint.py). The wrapper, given that diffusers model or its ``save_pretrained`` directory,
must stream what the project's model streams, bit for bit: the forward is the same code on the same
tensors, so any difference is a wrong config inference or a wrong weight.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rolling_forcing import checkpoint as ck
from rolling_forcing.config import PipelineConfig, get_preset
from rolling_forcing.model import CausalWanModel
from rolling_forcing.pipeline import RollingForcingPipeline
from tests.pipeline_helpers import one_thread as one_thread  # autouse: one intra-op thread
from tests.pipeline_helpers import text_embeds, tiny_model
from tests.test_integrations_diffusers import docs_example

try:  # the `test` extra installs diffusers: without it these tests must fail, never skip
    import diffusers
except ImportError as exc:
    raise ImportError(
        "tests/test_integrations_diffusers_stream.py needs diffusers (WanTransformer3DModel): "
        "pip install -e '.[test]'"
    ) from exc

from nki_ardiff.integrations.diffusers_stream import (
    causal_wan_from_diffusers,
    model_config_from_diffusers,
    stream_from_diffusers,
)

# the tiny preset (12 heads of 16, 2 layers, text 16 x 32) on non-square 8 x 12 latents (4 x 6 tokens)
M = replace(get_preset("tiny"), latent_width=12)
LATENT = (M.latent_height, M.latent_width)
# a 2-step Rolling Forcing window: warm-up, steady windows, the sink leaving the update pass, in 5 blocks
SHORT = PipelineConfig(window_blocks=2, denoising_steps=(1000, 500))
NB = 5


def _diffusers_config() -> dict:
    """The tiny preset's hyper-parameters in diffusers' names (written out, not derived by the wrapper)."""
    return {
        "patch_size": (1, 2, 2),
        "num_attention_heads": 12,
        "attention_head_dim": 16,
        "in_channels": 16,
        "out_channels": 16,
        "text_dim": 32,
        "freq_dim": 64,
        "ffn_dim": 384,
        "num_layers": 2,
        "cross_attn_norm": True,
        "eps": 1e-6,
    }


def _as_diffusers(own: CausalWanModel, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    dm = diffusers.WanTransformer3DModel(**_diffusers_config())
    dm.load_state_dict(ck.wan_to_diffusers(own.state_dict()), strict=True)
    return dm.to(dtype).eval()


def _stream(pipe: RollingForcingPipeline, nb: int = NB) -> torch.Tensor:
    prompt = text_embeds(dtype=pipe.pipe_cfg.torch_dtype)
    chunks = pipe.stream(prompt, nb, generator=torch.Generator().manual_seed(7))
    return torch.cat([c.latents for c in chunks], dim=1)


@pytest.fixture(scope="module")
def own() -> CausalWanModel:
    return tiny_model(M, seed=3)


@pytest.mark.parametrize(
    "source, dtype, options",
    [
        ("model", torch.float32, {}),  # Rolling Forcing, merged static-shape forward (the default)
        ("directory", torch.float32, {"merged": False}),  # two-pass, weights read from save_pretrained
        ("pipeline_checkout", torch.float32, {"method": "self-forcing"}),  # a sequential method
        ("model", torch.bfloat16, {}),
    ],
)
def test_stream_equals_the_projects_model_on_the_same_weights(
    own: CausalWanModel, tmp_path: Path, source: str, dtype: torch.dtype, options: dict
) -> None:
    sequential = "method" in options
    pipe_cfg = replace(PipelineConfig() if sequential else SHORT, dtype=str(dtype).removeprefix("torch."))
    nb = 2 if sequential else NB
    dm = _as_diffusers(own, dtype)
    src: torch.nn.Module | Path = dm
    if source != "model":
        src = tmp_path / "ckpt"
        dm.save_pretrained(src / "transformer" if source == "pipeline_checkout" else src)
    pipe = stream_from_diffusers(src, pipe_cfg, latent_size=LATENT, text_len=M.text_len, **options)
    assert pipe.model_cfg == replace(M, name="diffusers")
    mine = own if dtype == torch.float32 else tiny_model(M, seed=3).to(dtype)
    want = _stream(RollingForcingPipeline(mine, M, pipe_cfg, **options), nb)
    got = _stream(pipe, nb)
    assert got.dtype == dtype and got.shape == want.shape and torch.isfinite(want).all()
    assert torch.equal(got, want)


def test_parameters_are_shared_not_copied(own: CausalWanModel) -> None:
    dm = _as_diffusers(own)
    model, _ = causal_wan_from_diffusers(dm, latent_size=LATENT, text_len=M.text_len)
    theirs = {id(p) for p in dm.parameters()}
    assert {id(p) for p in model.parameters()} == theirs and len(theirs) == len(list(own.parameters()))
    assert model.blocks[1].norm3.weight is dm.blocks[1].norm2.weight  # Wan norm3 <-> diffusers norm2
    x = torch.randn(1, 3, 16, *LATENT, generator=torch.Generator().manual_seed(0))
    t = torch.full((1,), 500.0)
    with torch.no_grad():
        before = model.forward_full(x.transpose(1, 2), t, text_embeds())
        dm.proj_out.bias.add_(1.0)  # an in-place change of the user's weights reaches the stream's model
        after = model.forward_full(x.transpose(1, 2), t, text_embeds())
    torch.testing.assert_close(after, before + 1.0, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("image_dim", 1280, r"config\.image_dim=1280: image-to-video"),
        ("added_kv_proj_dim", 1536, r"config\.added_kv_proj_dim=1536: image cross-attention"),
        ("pos_embed_seq_len", 514, r"config\.pos_embed_seq_len=514"),
        ("cross_attn_norm", False, r"config\.cross_attn_norm=False"),
        ("_class_name", "WanVACETransformer3DModel", r"config\._class_name is 'WanVACETransformer3DModel'"),
        ("patch_size", (2, 2, 2), r"patch_size must be \(1, ph, pw\)"),
    ],
)
def test_config_variants_are_refused_naming_the_field(field: str, value: object, match: str) -> None:
    cfg = {**_diffusers_config(), field: value}
    with pytest.raises(ValueError, match=match):
        model_config_from_diffusers(cfg, latent_size=LATENT, text_len=M.text_len)


def test_every_config_field_reaches_the_model_config() -> None:
    """Non-default values in every field the wrapper reads (eps, freq_dim, ffn_dim, text_dim, patch, in/out
    channels; ``out_channels=None`` means in_channels, as in diffusers), against a hand-written
    ModelConfig."""
    cfg = {
        **_diffusers_config(),
        "num_attention_heads": 3,
        "attention_head_dim": 8,
        "in_channels": 5,
        "out_channels": None,
        "text_dim": 7,
        "freq_dim": 10,
        "ffn_dim": 48,
        "num_layers": 4,
        "patch_size": [1, 2, 4],
        "eps": 1e-5,
        "rope_max_seq_len": 1024,
        "qk_norm": "rms_norm_across_heads",
    }
    got = model_config_from_diffusers(cfg, latent_size=(6, 8), text_len=9, name="mine")
    want = replace(
        get_preset("tiny"),
        name="mine",
        num_layers=4,
        dim=24,
        num_heads=3,
        ffn_dim=48,
        freq_dim=10,
        text_dim=7,
        text_len=9,
        latent_height=6,
        latent_width=8,
        patch_size=(1, 2, 4),
        in_channels=5,
        out_channels=5,
        eps=1e-5,
    )
    assert got == want
    got = model_config_from_diffusers({**cfg, "out_channels": 6}, latent_size=(6, 8), text_len=9, name="mine")
    assert got == replace(want, out_channels=6)


def test_arguments_are_checked() -> None:
    cfg = _diffusers_config()
    with pytest.raises(ValueError, match=r"^latent_size must be \(latent_height, latent_width\)"):
        model_config_from_diffusers(cfg, latent_size=(8,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"latent 8x7 must be divisible by patch 2x2"):
        model_config_from_diffusers(cfg, latent_size=(8, 7))
    with pytest.raises(ValueError, match=r"^text_len must be an int >= 1"):
        model_config_from_diffusers(cfg, latent_size=LATENT, text_len=0)
    with pytest.raises(ValueError, match=r"config lacks \['ffn_dim'\]"):
        model_config_from_diffusers({k: v for k, v in cfg.items() if k != "ffn_dim"}, latent_size=LATENT)
    with pytest.raises(TypeError, match=r"^source must be a diffusers WanTransformer3DModel"):
        causal_wan_from_diffusers(torch.nn.Linear(2, 2), latent_size=LATENT)


def test_stream_names_are_checked_before_any_weight_is_read(tmp_path: Path) -> None:
    """A mistyped backend or method is refused before the (here unreadable) weights are opened."""
    (tmp_path / "config.json").write_text(json.dumps(_diffusers_config()))
    (tmp_path / "diffusion_pytorch_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match=r"^backend must be one of"):
        stream_from_diffusers(tmp_path, latent_size=LATENT, text_len=M.text_len, backend="cuda")
    with pytest.raises(ValueError, match=r"^method must be one of"):
        stream_from_diffusers(tmp_path, latent_size=LATENT, text_len=M.text_len, method="rolling")
    with pytest.raises(ck.CheckpointError, match=r"is not a readable \.safetensors file"):  # reached last
        stream_from_diffusers(tmp_path, latent_size=LATENT, text_len=M.text_len)


def test_models_the_stream_cannot_share_are_refused(own: CausalWanModel, tmp_path: Path) -> None:
    dm = _as_diffusers(own)
    with pytest.raises(
        ValueError, match=r"parameters are torch.float32 but the stream runs in torch.bfloat16"
    ):
        stream_from_diffusers(dm, PipelineConfig(dtype="bfloat16"), latent_size=LATENT, text_len=M.text_len)
    mixed = _as_diffusers(own)
    mixed.blocks[0].norm2.to(torch.bfloat16)  # as from_pretrained(torch_dtype=...) leaves some modules
    with pytest.raises(ValueError, match=r"parameters of several dtypes .* call transformer.to\(dtype\)"):
        causal_wan_from_diffusers(mixed, latent_size=LATENT, text_len=M.text_len)
    dm.fuse_qkv_projections()  # adds to_qkv / to_kv parameters that have no Wan name
    with pytest.raises(ValueError, match=r"have no mapping .*unfuse_qkv_projections"):
        causal_wan_from_diffusers(dm, latent_size=LATENT, text_len=M.text_len)
    with pytest.raises(ValueError, match=r"has no config\.json"):
        causal_wan_from_diffusers(tmp_path, latent_size=LATENT, text_len=M.text_len)
    wan_dir = tmp_path / "wan"
    wan_dir.mkdir()
    (wan_dir / "config.json").write_text(json.dumps(_diffusers_config()))
    ck.save_safetensors(own.state_dict(), wan_dir / "model.safetensors")
    with pytest.raises(ValueError, match=r"holds Wan-layout weights; load them with CausalWanModel"):
        causal_wan_from_diffusers(wan_dir, latent_size=LATENT, text_len=M.text_len)


def test_a_forward_diffusers_would_change_is_refused_naming_the_module(own: CausalWanModel) -> None:
    """Cache hooks, a custom attention processor and an attention backend change what diffusers' forward
    runs; the stream runs the project's forward and would ignore them, so each is refused. The project's
    own processor (the same math) is accepted."""
    from diffusers import FirstBlockCacheConfig
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    from nki_ardiff.integrations.diffusers import install_nki_attention

    dm = _as_diffusers(own)
    dm.enable_cache(FirstBlockCacheConfig(threshold=0.1))
    with pytest.raises(ValueError, match=r"^transformer(\.\S+)? \(\w+\): diffusers hooks \['\w+'\]"):
        causal_wan_from_diffusers(dm, latent_size=LATENT, text_len=M.text_len)
    dm.disable_cache()
    causal_wan_from_diffusers(dm, latent_size=LATENT, text_len=M.text_len)  # hooks removed: accepted

    class Tweaked(WanAttnProcessor):  # a user's variant: other math under diffusers' processor type
        pass

    dm.blocks[1].attn2.set_processor(Tweaked())
    with pytest.raises(
        ValueError, match=r"^transformer\.blocks\.1\.attn2 \(WanAttention\): attention processor Tweaked"
    ):
        causal_wan_from_diffusers(dm, latent_size=LATENT, text_len=M.text_len)
    dm.set_attn_processor(WanAttnProcessor())
    dm.blocks[0].attn1.set_attention_backend("native")
    with pytest.raises(
        ValueError, match=r"^transformer\.blocks\.0\.attn1 \(WanAttention\): a diffusers attention backend"
    ):
        causal_wan_from_diffusers(dm, latent_size=LATENT, text_len=M.text_len)
    dm.reset_attention_backend()
    install_nki_attention(dm, backend="reference")
    model, _ = causal_wan_from_diffusers(dm, latent_size=LATENT, text_len=M.text_len)
    assert model.blocks[0].self_attn.q.weight is dm.blocks[0].attn1.to_q.weight


def test_installed_diffusers_has_no_rolling_kv_cache_api() -> None:
    """docs/integrate.md says the installed diffusers has no rolling KV cache for Wan (the open pull
    requests 13569 and 13681 on huggingface/diffusers), which is why the wrapper runs the project's own
    cache. When a release adds one, this fails and the docs and the wrapper must be revisited."""
    import diffusers.hooks

    params = set(inspect.signature(diffusers.WanTransformer3DModel.forward).parameters)
    assert params == {
        "self",
        "hidden_states",
        "timestep",
        "encoder_hidden_states",
        "encoder_hidden_states_image",
        "return_dict",
        "attention_kwargs",
    }
    names = {n.lower() for n in dir(diffusers.hooks)} | {n.lower() for n in dir(diffusers)}
    assert not {n for n in names if "rolling" in n or ("kv" in n and "cache" in n and "text" not in n)}


def test_docs_worked_example_streams_what_it_says() -> None:
    """docs/integrate.md's "your model, our stream": six chunks of 3 latent frames, 9 then 12 video frames."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(docs_example("stream"), "docs/integrate.md:stream", "exec"), {})
    want = [f"{b} (1, 3, 16, 8, 12) (1, {9 if b == 0 else 12}, 3, 64, 96)" for b in range(6)]
    assert out.getvalue().splitlines() == want
