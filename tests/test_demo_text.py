"""The demo text encoder: vocabulary errors before any model runs, shapes, padding, word order."""

from __future__ import annotations

import pytest
import torch

from rolling_forcing import procedural
from rolling_forcing.demo.text_encoder import DemoTextEncoder


def _enc() -> DemoTextEncoder:
    torch.manual_seed(0)
    return DemoTextEncoder(16, 32, num_layers=2, num_heads=4).eval()


def test_shapes_padding_and_ids() -> None:
    enc = _enc()
    prompts = ["a red circle bouncing on a gray background", "A Blue  square, bouncing"]
    ids = enc.tokenize(prompts)
    vocab = procedural.vocabulary()
    assert ids.shape == (2, 16) and ids.dtype == torch.int64
    assert [vocab[i - 1] for i in ids[0, :8].tolist()] == prompts[0].split()
    assert [vocab[i - 1] for i in ids[1, :4].tolist()] == ["a", "blue", "square", "bouncing"]
    assert ids[0, 8:].eq(0).all() and ids[1, 4:].eq(0).all()
    out = enc.encode(prompts)
    assert out.shape == (2, 16, 32) and out.dtype == torch.float32
    assert out[0, 8:].eq(0).all() and out[1, 4:].eq(0).all()  # the padded layout
    assert out[0, :8].abs().sum(-1).gt(0).all()
    assert torch.equal(enc.encode(prompts[0]), out[:1])  # a str is one prompt; batch rows independent


def test_order_matters_and_colour_binds() -> None:
    enc = _enc()
    a = enc.encode("a red circle and a blue square bouncing on a gray background")
    b = enc.encode("a blue circle and a red square bouncing on a gray background")
    assert not torch.allclose(a, b, atol=1e-4)
    # position 2 ("circle") sees the colour before it through attention
    assert (a[0, 2] - b[0, 2]).abs().max() > 1e-3


def test_unknown_word_lists_vocabulary_before_any_model_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    enc = _enc()

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("the model ran")

    monkeypatch.setattr(enc, "forward", boom)
    with pytest.raises(ValueError, match=r"'pink' is not in the vocabulary: a, and, background, black"):
        enc.encode(["a red circle", "a pink circle"])


def test_bad_prompts() -> None:
    enc = _enc()
    with pytest.raises(ValueError, match="no words"):
        enc.encode("  ")
    with pytest.raises(ValueError, match="at most text_len=16"):
        enc.encode(" ".join(["a red circle and"] * 5))
    with pytest.raises(TypeError, match="prompts must be"):
        enc.encode([])
    with pytest.raises(TypeError, match="prompts must be"):
        enc.encode([3])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="divisible"):
        DemoTextEncoder(16, 30, num_heads=4)
