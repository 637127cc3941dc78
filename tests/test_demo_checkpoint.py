"""``--preset demo --checkpoint DIR``: ``generate`` and ``serve`` stream the directory ``train-demo`` wrote
(its DiT at its own width, the text encoder trained with it and its autoencoder), frame for frame what
``load_demo(DIR)`` streams through the public API; a DiT file alone, a directory without the three files
and ``--use-ema`` are refused with one line before any model is built (the refusals are pinned beside
generate's in ``tests/test_serve_units.py``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from nki_ardiff.cli import app
from nki_ardiff.cli_checks import check_model_sources
from nki_ardiff.cli_options import GenerateOptions
from nki_ardiff.cli_serve import build_parts
from rolling_forcing.config import PipelineConfig, get_preset
from rolling_forcing.decode import to_uint8_frames
from rolling_forcing.pipeline import RollingForcingPipeline
from rolling_forcing.serve.app import create_app
from rolling_forcing.serve.config import ServeConfig
from rolling_forcing.stream import NoiseSource
from rolling_forcing.video import VideoWriter
from tests.test_serve import WS, max_block, offline_frames, receive

PROMPT = "a red circle and a blue square bouncing on a gray background"
NARROW = {"dim": 64, "ffn_dim": 256, "num_heads": 2}  # not the preset's width: read from the files


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rolling_forcing.demo.train import train_demo

    out = tmp_path_factory.mktemp("demo") / "w"
    cfg = replace(get_preset("demo"), **NARROW)
    train_demo(out, smoke=True, progress=False, threads=1, model_cfg=cfg)
    return out


def _offline(weights: Path | None, seed: int, blocks: int) -> list[np.ndarray]:
    """uint8 frames of a ``blocks``-block stream of ``load_demo(weights)`` through the public stream API, the
    noise drawn per block from ``seed`` as generate draws it."""
    from rolling_forcing.demo import load_demo

    demo = load_demo(weights)
    mcfg: Any = demo.model_cfg
    gen = torch.Generator().manual_seed(seed)
    noise = NoiseSource(1, mcfg.latent_frame_shape(), 3, blocks, torch.float32, generator=gen, upfront=False)
    out: list[np.ndarray] = []
    pipe = RollingForcingPipeline(demo.model, mcfg, PipelineConfig(positions="relative"))
    with torch.inference_mode():
        for chunk in pipe.stream(demo.text_encoder.encode([PROMPT]), blocks, generator=gen, noise=noise):
            out += list(to_uint8_frames(demo.decoder.decode(chunk.latents.float())))
    return out


def test_generate_streams_the_train_demo_directory(weights: Path, tmp_path: Path, monkeypatch) -> None:
    import json

    written: list[np.ndarray] = []
    real_write = VideoWriter.write

    def spy(self: VideoWriter, frames: np.ndarray) -> None:
        written.extend(frames.copy())
        real_write(self, frames)

    monkeypatch.setattr(VideoWriter, "write", spy)
    rep = tmp_path / "r.json"
    args = ["generate", "--checkpoint", str(weights), "--blocks", "5", "--seed", "2", "--noise", "per-block"]
    r = CliRunner().invoke(app, [*args, "--prompt", PROMPT, "--out", str(tmp_path / "a.mp4"),
                                 "--report-json", str(rep), "--no-progress"])  # fmt: skip
    assert r.exit_code == 0, r.output
    meta = json.loads(rep.read_text())["meta"]
    assert meta["weights"] == (
        f"{weights} (train-demo weights: DiT 4 layers x dim 64, with its text encoder and autoencoder)"
    )
    want = _offline(weights, 2, 5)
    assert len(written) == len(want) == 9 + 4 * 12
    for i, (got, ref) in enumerate(zip(written, want, strict=True)):
        np.testing.assert_array_equal(got, ref, err_msg=f"frame {i}")
    shipped = _offline(None, 2, 5)  # the same seed through the shipped weights is another video
    assert not np.array_equal(np.stack(written), np.stack(shipped))


def test_serve_streams_the_train_demo_directory(weights: Path, tmp_path: Path) -> None:
    opts = GenerateOptions(out=tmp_path / "unused.mp4", preset="demo", checkpoint=weights)
    check_model_sources(opts, typed_prompts=True)
    parts = build_parts(opts)
    assert parts.model_cfg == replace(get_preset("demo"), **NARROW)
    assert parts.weights.startswith(f"{weights} (train-demo weights: DiT 4 layers x dim 64")
    cfg = ServeConfig(
        preset="demo", image_format="png", session_interval_s=0.0, calibration_chunks=1, fps=8.0,
        headroom=0.0, max_session_s=60.0,
    )  # fmt: skip
    got: dict[int, tuple[int, np.ndarray]] = {}
    with TestClient(create_app(cfg, parts=parts), base_url=WS.replace("ws://", "http://")) as client:
        assert client.get("/api/config").json()["model"]["weights"] == parts.weights
        r = client.post("/api/sessions", json={"prompt": PROMPT, "seed": 4})
        assert r.status_code == 201, r.text
        with client.websocket_connect(WS + r.json()["ws"]) as ws:
            receive(ws, got, lambda f, s: max_block(f) >= 2)
    want = offline_frames(cfg, 4, [(0, PROMPT, "continue")], max_block(got) + 1, weights)
    assert got and len(got) >= 9 + 12
    for index, (block, img) in got.items():
        assert want[index][0] == block
        np.testing.assert_array_equal(img, want[index][1], err_msg=f"frame {index}")
