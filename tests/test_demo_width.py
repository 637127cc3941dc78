"""``load_demo`` builds the DiT at the width of the weights it reads (``demo_config``): what
``train-demo`` writes at another width loads back bit for bit, older files without the recorded sizes
load from their shapes, and sizes that disagree or cannot make a model are refused naming the file."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from rolling_forcing.config import get_preset
from rolling_forcing.demo import DIT_FILE, WIDTH_KEYS, load_demo
from rolling_forcing.demo.train_dit import DitTrainConfig, DitTrainResult, new_models, save_dit


def _write(tmp_path: Path, **sizes: Any) -> tuple[Path, DitTrainResult]:
    torch.manual_seed(0)
    cfg = replace(get_preset("demo"), **sizes)
    model, text = new_models(cfg, DitTrainConfig())
    res = DitTrainResult(model.eval(), text.eval())
    save_dit(res, tmp_path)
    return tmp_path / DIT_FILE, res


@pytest.mark.parametrize(
    "sizes",
    [
        {"dim": 96, "ffn_dim": 160, "num_heads": 6, "num_layers": 1},
        {"dim": 64, "ffn_dim": 256, "num_heads": 2},
    ],
)
def test_weights_of_another_width_load_back_exactly(tmp_path: Path, sizes: dict[str, Any]) -> None:
    _, res = _write(tmp_path, **sizes)
    demo = load_demo(tmp_path, with_decoder=False)
    assert demo.model_cfg == replace(get_preset("demo"), **sizes)  # heads too: from the metadata
    want, got = res.model.state_dict(), demo.model.state_dict()
    assert list(got) == list(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_weights_without_recorded_sizes_load_from_their_shapes(tmp_path: Path) -> None:
    """Files written before the sizes were recorded (metadata ``{"preset": "demo"}`` only): layers, width
    and FFN from the shapes, heads the preset's."""
    path, res = _write(tmp_path, dim=96, ffn_dim=200, num_layers=2)
    save_file(load_file(str(path)), str(path), metadata={"preset": "demo"})
    cfg = load_demo(tmp_path, with_decoder=False).model_cfg
    assert (cfg.dim, cfg.ffn_dim, cfg.num_layers, cfg.num_heads) == (96, 200, 2, get_preset("demo").num_heads)


def test_recorded_sizes_are_the_model_written(tmp_path: Path) -> None:
    from safetensors import safe_open

    path, res = _write(tmp_path, dim=96, ffn_dim=160, num_heads=6)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    assert {k: int(meta[k]) for k in WIDTH_KEYS} == {k: getattr(res.model.cfg, k) for k in WIDTH_KEYS}


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        ({"dim": "128"}, "metadata dim=128 but the tensors' shapes say 96"),
        ({"num_heads": "5"}, "dim=96 must be divisible by num_heads=5"),
        ({"num_heads": "four"}, "metadata num_heads='four' is not an integer"),
    ],
)
def test_sizes_that_disagree_or_make_no_model_are_refused(
    tmp_path: Path, meta: dict[str, str], message: str
) -> None:
    path, _ = _write(tmp_path, dim=96, ffn_dim=160, num_heads=6)
    save_file(load_file(str(path)), str(path), metadata={"preset": "demo", **meta})
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*" + re.escape(message)):
        load_demo(tmp_path, with_decoder=False)


def test_a_state_dict_that_is_no_demo_dit_is_refused(tmp_path: Path) -> None:
    path, _ = _write(tmp_path)
    sd = load_file(str(path))
    del sd["patch_embedding.weight"]
    save_file(sd, str(path))
    with pytest.raises(ValueError, match=re.escape(f"{path}: not a demo DiT state dict")):
        load_demo(tmp_path, with_decoder=False)


def test_train_demo_at_another_width_writes_weights_load_demo_builds(tmp_path: Path) -> None:
    """``train_demo(model_cfg=...)`` trains the DiT at those sizes (smoke run), logs them, and
    ``load_demo`` builds the same sizes back from the files."""
    import json

    from rolling_forcing.demo.train import train_demo
    from rolling_forcing.demo.train_stage2 import Stage2Config

    sizes: dict[str, Any] = {"dim": 64, "ffn_dim": 96, "num_heads": 2, "num_layers": 1}
    cfg = replace(get_preset("demo"), **sizes)
    rep = train_demo(
        tmp_path, smoke=True, progress=False, threads=1, late=Stage2Config(steps=0), model_cfg=cfg
    )
    assert json.loads((rep.out_dir / "train_log.json").read_text())["model"] == sizes
    demo = load_demo(tmp_path)
    assert demo.model_cfg == cfg
    assert demo.model.blocks[0].ffn[0].weight.shape == (96, 64)


@pytest.mark.parametrize("change", [{"latent_height": 4}, {"text_dim": 32}, {"guidance_scale": 1.0}])
def test_train_demo_refuses_sizes_the_demo_data_fixes_before_any_work(
    tmp_path: Path, change: dict[str, Any]
) -> None:
    from rolling_forcing.demo.train import train_demo

    with pytest.raises(ValueError, match="model_cfg may differ from the demo preset only in num_layers, dim"):
        train_demo(tmp_path / "w", smoke=True, model_cfg=replace(get_preset("demo"), dim=64, **change))
    assert not (tmp_path / "w").exists()
