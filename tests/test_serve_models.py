"""``serve`` builds a preset's model as ``generate`` does (``nki_ardiff/cli_serve.py::build_parts``, over
``generate``'s builders): a ``--checkpoint`` and a local ``--vae`` (tiny shapes, a diffusers-layout DiT
and a small ``AutoencoderKLWan``) stream frames equal to the same model run offline through the public
stream API, each session with its own decoder cache over the shared VAE weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from nki_ardiff.cli_checks import check_model_sources
from nki_ardiff.cli_options import GenerateOptions
from nki_ardiff.cli_serve import build_parts
from rolling_forcing.config import PipelineConfig, get_preset
from rolling_forcing.decode import WanVAEStreamingDecoder, to_uint8_frames
from rolling_forcing.model import CausalWanModel
from rolling_forcing.pipeline import RollingForcingPipeline
from rolling_forcing.serve.app import create_app
from rolling_forcing.serve.config import ServeConfig
from rolling_forcing.stream import NoiseSource
from rolling_forcing.text import SeededTextEncoder
from rolling_forcing.video import VideoSpec
from tests.pipeline_helpers import one_thread as one_thread
from tests.test_serve import WS, max_block, receive


def test_served_checkpoint_and_vae_equal_the_offline_stream(tmp_path: Path) -> None:
    from diffusers import AutoencoderKLWan

    from rolling_forcing.checkpoint import save_safetensors, wan_to_diffusers

    mcfg = get_preset("tiny")
    ckpt = tmp_path / "dit.safetensors"
    save_safetensors(wan_to_diffusers(CausalWanModel(mcfg).init_random(5).state_dict()), ckpt)
    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=8, z_dim=mcfg.out_channels, dim_mult=[1, 2, 2, 2], num_res_blocks=1)
    vae.save_pretrained(str(tmp_path / "vae"))
    opts = GenerateOptions(out=tmp_path / "unused.mp4", preset="tiny", checkpoint=ckpt, vae=tmp_path)
    check_model_sources(opts, typed_prompts=True)
    parts = build_parts(opts)
    assert parts.weights == f"{ckpt} (diffusers key layout)"
    assert parts.decoder == f"AutoencoderKLWan from {tmp_path} (streaming, causal cache)"
    d1, d2 = parts.new_decoder(), parts.new_decoder()
    assert isinstance(d1, WanVAEStreamingDecoder) and d1 is not d2 and d1.vae is d2.vae  # shared weights
    # fps 8: a 1.5 s chunk deadline, so admission (a measured cost: the VAE decode took 412 ms of a 375 ms
    # budget at fps 32 on a busy 2-core machine) never refuses the one session; the frames are under test
    cfg = ServeConfig(
        preset="tiny", image_format="png", session_interval_s=0.0, calibration_chunks=1, fps=8.0,
        headroom=0.0, max_session_s=60.0,
    )  # fmt: skip
    seed, prompt = 3, "a lighthouse at dusk"
    got: dict[int, tuple[int, np.ndarray]] = {}
    with TestClient(create_app(cfg, parts=parts), base_url=WS.replace("ws://", "http://")) as client:
        assert client.get("/api/config").json()["model"]["weights"] == parts.weights
        r = client.post("/api/sessions", json={"prompt": prompt, "seed": seed})
        assert r.status_code == 201, r.text
        with client.websocket_connect(WS + r.json()["ws"]) as ws:
            receive(ws, got, lambda f, s: max_block(f) >= 2)
    # offline: the checkpoint's weights (init_random(5)), a VAE decoder of its own, the seeded prompt
    pc = PipelineConfig(positions="relative")
    model = CausalWanModel(mcfg).init_random(5).eval()
    dec = WanVAEStreamingDecoder.from_pretrained(tmp_path)
    num_blocks = VideoSpec().blocks_for_seconds(cfg.max_session_s, pc.frames_per_block)
    gen = torch.Generator().manual_seed(seed)
    noise = NoiseSource(
        1, mcfg.latent_frame_shape(), 3, num_blocks, torch.float32, generator=gen, upfront=False
    )
    emb = SeededTextEncoder(mcfg.text_len, mcfg.text_dim).encode([prompt])
    want: list[tuple[int, np.ndarray]] = []
    with torch.inference_mode():
        for chunk in RollingForcingPipeline(model, mcfg, pc).stream(emb, num_blocks, noise=noise):
            want += [(chunk.block, f) for f in to_uint8_frames(dec.decode(chunk.latents.float()))]
            if chunk.block >= max_block(got):
                break
    assert got and len(got) >= 9 + 12
    for index, (block, img) in got.items():
        assert want[index][0] == block
        np.testing.assert_array_equal(img, want[index][1], err_msg=f"frame {index} (block {block})")


def test_the_page_switch_mode_defaults_and_option() -> None:
    """The page preselects the served model's switch mode: restart for the demo model, continue for the
    others, ``--switch`` for any; a mode outside SWITCH_MODES is refused when the parts are made."""
    from rolling_forcing.serve.engine import ModelParts

    tiny = GenerateOptions(out=Path("serve.mp4"), preset="tiny")
    assert build_parts(tiny).describe()["switch"] == "continue"
    assert (
        build_parts(GenerateOptions(out=Path("serve.mp4"), preset="demo")).describe()["switch"] == "restart"
    )
    assert (
        build_parts(GenerateOptions(out=Path("serve.mp4"), preset="tiny", switch="recache")).switch
        == "recache"
    )
    parts = build_parts(tiny)
    with pytest.raises(ValueError, match="switch must be one of"):
        ModelParts(
            parts.preset,
            parts.model_cfg,
            parts.model,
            parts.encode,
            parts.new_decoder,
            "w",
            "t",
            "d",
            switch="cut",
        )
