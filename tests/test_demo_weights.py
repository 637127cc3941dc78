"""The shipped demo weights: they load into the ``demo`` preset, fit the size budget, and a short stream
decodes frames whose colours follow the prompt (a cheap check; perf/quality has the real detector)."""

from __future__ import annotations

import functools

import torch

from rolling_forcing import procedural
from rolling_forcing.config import PipelineConfig, get_preset
from rolling_forcing.demo import WEIGHTS_DIR, load_demo
from rolling_forcing.model import CausalWanModel
from rolling_forcing.pipeline import RollingForcingPipeline

PALETTE = {**procedural.COLORS, **procedural.BACKGROUNDS}


@functools.lru_cache(maxsize=1)
def _demo():  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    return load_demo()


@functools.lru_cache(maxsize=8)
def _colour_fractions(prompt: str, seed: int = 0, blocks: int = 6) -> dict[str, float]:
    """Fraction of the stream's pixels whose nearest palette colour is each name (all frames)."""
    demo = _demo()
    pipe = RollingForcingPipeline(demo.model, demo.model_cfg, PipelineConfig())
    demo.decoder.reset()
    frames = []
    with torch.inference_mode():
        emb = demo.text_encoder.encode(prompt)
        for chunk in pipe.stream(emb, blocks, generator=torch.Generator().manual_seed(seed)):
            frames.append(demo.decoder.decode(chunk.latents))
    pix = ((torch.cat(frames, dim=1)[0].clamp(-1, 1) + 1) * 127.5).permute(0, 2, 3, 1).reshape(-1, 3)
    names = list(PALETTE)
    ref = torch.tensor([PALETTE[n] for n in names], dtype=torch.float32)
    nearest = torch.cdist(pix, ref).argmin(dim=1)
    counts = torch.bincount(nearest, minlength=len(names)).float() / nearest.numel()
    return {n: float(c) for n, c in zip(names, counts)}


def test_shipped_weights_load_into_the_demo_preset() -> None:
    demo = _demo()
    assert demo.model_cfg == get_preset("demo")
    want = CausalWanModel(get_preset("demo")).state_dict()
    got = demo.model.state_dict()
    assert list(got) == list(want) and all(got[k].shape == want[k].shape for k in want)  # Wan key names
    assert demo.text_encoder.text_len == demo.model_cfg.text_len
    assert demo.decoder.temporal_stride == 4 and demo.decoder.spatial_stride == 8
    size = sum(p.stat().st_size for p in WEIGHTS_DIR.glob("*.safetensors"))
    assert size <= 20 * 2**20, f"shipped weights {size / 2**20:.1f} MiB > 20 MiB"


def test_stream_background_follows_the_prompt() -> None:
    for bg in ("gray", "navy", "black"):
        frac = _colour_fractions(f"a white circle bouncing on a {bg} background")
        assert max(frac, key=frac.__getitem__) == bg, frac


def test_stream_shape_colour_follows_the_prompt() -> None:
    """The prompt's shape colour covers more pixels than it does when the prompt names another colour
    (same seed, same noise): a comparison, so blur and the decoder's tint do not decide it."""
    for colour, other in (("red", "blue"), ("yellow", "purple")):
        a = _colour_fractions(f"a {colour} square bouncing on a black background")
        b = _colour_fractions(f"a {other} square bouncing on a black background")
        assert a[colour] > 2 * b[colour] and a[colour] > 0.001, (colour, a, b)  # >= ~0.1 % of the pixels
