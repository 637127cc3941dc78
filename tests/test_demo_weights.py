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


def test_nan_or_corrupt_demo_weights_are_refused_naming_them(tmp_path) -> None:
    """A NaN weight or a truncated file is an error naming the file/tensor, not a blank video."""
    import re
    import shutil

    import pytest
    from safetensors.torch import load_file, save_file

    from rolling_forcing.demo.autoencoder import load_autoencoder

    for f in WEIGHTS_DIR.glob("*.safetensors"):
        shutil.copy(f, tmp_path / f.name)
    dit = tmp_path / "dit.safetensors"
    sd = load_file(str(dit))
    key = sorted(sd)[0]
    sd[key] = sd[key].clone()
    sd[key].view(-1)[0] = float("nan")
    save_file(sd, str(dit))
    with pytest.raises(ValueError, match=re.escape(f"demo DiT weights tensor '{key}' has 1 non-finite")):
        load_demo(tmp_path)
    ae = tmp_path / "autoencoder.safetensors"
    ae.write_bytes(ae.read_bytes()[:1000])
    with pytest.raises(ValueError, match="not a readable .safetensors file"):
        load_autoencoder(ae)
