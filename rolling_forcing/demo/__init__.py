"""The trained demo model: a small causal DiT streaming 64x64 procedural scenes on CPU.

* :mod:`rolling_forcing.demo.text_encoder` -- word-level text encoder over the procedural vocabulary
* :mod:`rolling_forcing.demo.train_attention` -- the training forward with the stream's key sets
* :mod:`rolling_forcing.demo.train_dit` -- DiT + text encoder training
* :mod:`rolling_forcing.demo.train` -- ``train_demo``: retrain everything (autoencoder, then DiT)
* :func:`load_demo` -- the shipped weights (``rolling_forcing/demo/weights/``) as a ready model

Nothing is loaded at import time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
"""Where the shipped weights live (package data)."""

DIT_FILE = "dit.safetensors"
TEXT_FILE = "text_encoder.safetensors"
AE_FILE = "autoencoder.safetensors"


class DemoModel(NamedTuple):
    """What :func:`load_demo` returns."""

    model_cfg: Any  # rolling_forcing.config.ModelConfig (the "demo" preset at the weights' width)
    model: Any  # rolling_forcing.model.CausalWanModel, eval mode
    text_encoder: Any  # rolling_forcing.demo.text_encoder.DemoTextEncoder, eval mode
    decoder: Any  # rolling_forcing.demo.autoencoder.DemoStreamingDecoder (None if with_decoder=False)


def _read(path: Path, what: str) -> tuple[dict[str, Any], dict[str, str]]:
    from rolling_forcing.tensor_io import check_finite, read_safetensors

    if not path.is_file():
        raise ValueError(f"{what}: {str(path)!r} does not exist (retrain with `rolling-forcing train-demo`)")
    tensors, meta = read_safetensors(path, ValueError)
    for k, t in tensors.items():
        if t.is_floating_point():
            check_finite(t, f"{what} tensor {k!r}", ValueError)
    return tensors, meta


WIDTH_KEYS = ("num_layers", "dim", "ffn_dim", "num_heads")
"""The DiT sizes :func:`rolling_forcing.demo.train_dit.save_dit` records in ``dit.safetensors``' metadata."""


def demo_config(state_dict: dict[str, Any], meta: dict[str, str], path: Path) -> Any:
    """The ``demo`` preset at the width of a demo DiT's weights (a ``ModelConfig``).

    ``num_layers``, ``dim`` and ``ffn_dim`` are read from the tensors' shapes (``blocks.N.``,
    ``patch_embedding.weight`` ``[dim, C, 1, ph, pw]``, ``blocks.0.ffn.0.weight`` ``[ffn_dim, dim]``), so
    weights written before the sizes were recorded still load; ``num_heads`` (not a shape) comes from the
    metadata, else the preset's (right for every such file: ``train_demo`` could not change the heads before
    it recorded them). Sizes recorded in the metadata must agree with the shapes.

    Raises ``ValueError`` naming ``path`` for a state dict without those tensors, metadata that disagrees
    with the shapes, or sizes the preset cannot take (``ModelConfig``'s rules, e.g. ``dim`` divisible by
    ``num_heads``).
    """
    from dataclasses import replace

    from rolling_forcing.config import get_preset

    base = get_preset("demo")
    try:
        sizes: dict[str, Any] = {
            "dim": int(state_dict["patch_embedding.weight"].shape[0]),
            "ffn_dim": int(state_dict["blocks.0.ffn.0.weight"].shape[0]),
            "num_layers": len({k.split(".")[1] for k in state_dict if k.startswith("blocks.")}),
        }
    except (KeyError, IndexError, AttributeError) as exc:
        raise ValueError(f"{path}: not a demo DiT state dict (no tensor {exc})") from None
    for key in WIDTH_KEYS:
        if key not in meta:
            continue
        try:
            value = int(meta[key])
        except ValueError:
            raise ValueError(f"{path}: metadata {key}={meta[key]!r} is not an integer") from None
        if key in sizes and sizes[key] != value:
            raise ValueError(f"{path}: metadata {key}={value} but the tensors' shapes say {sizes[key]}")
        sizes[key] = value
    try:
        return replace(base, **sizes)
    except ValueError as exc:
        raise ValueError(f"{path}: sizes {sizes} do not make a demo DiT: {exc}") from None


def load_demo(
    weights_dir: str | Path | None = None, *, dtype: Any = None, with_decoder: bool = True
) -> DemoModel:
    """Load the demo DiT (``dit.safetensors``, Wan key names, ``demo`` preset), its text encoder
    (``text_encoder.safetensors``) and the autoencoder's streaming decoder (``autoencoder.safetensors``)
    from ``weights_dir`` (default: the shipped :data:`WEIGHTS_DIR`).

    Args:
        dtype: the DiT's torch dtype (default float32).
        with_decoder: False skips the autoencoder (``decoder`` is None).

    The DiT's sizes (layers, width, FFN, heads) are the weights' (:func:`demo_config`): the ``demo``
    preset's for the shipped weights, and the width of any ``train-demo`` output, wider or narrower.

    Raises ``ValueError`` naming the file for a missing file or weights that do not fit the preset.
    """
    import torch

    from rolling_forcing.demo.text_encoder import DemoTextEncoder
    from rolling_forcing.model import CausalWanModel

    root = WEIGHTS_DIR if weights_dir is None else Path(weights_dir)
    sd, dit_meta = _read(root / DIT_FILE, "demo DiT weights")
    cfg = demo_config(sd, dit_meta, root / DIT_FILE)
    model = CausalWanModel(cfg)
    try:
        model.load_state_dict(sd)
    except RuntimeError as exc:
        raise ValueError(f"{root / DIT_FILE}: weights do not fit the demo preset: {exc}") from None
    model = model.to(dtype or torch.float32).eval()
    tsd, meta = _read(root / TEXT_FILE, "demo text encoder weights")
    text = DemoTextEncoder(
        cfg.text_len, cfg.text_dim, int(meta.get("num_layers", 2)), int(meta.get("num_heads", 4))
    )
    try:
        text.load_state_dict(tsd)
    except RuntimeError as exc:
        raise ValueError(f"{root / TEXT_FILE}: weights do not fit the demo text encoder: {exc}") from None
    text.eval()
    decoder = None
    if with_decoder:
        from rolling_forcing.demo.autoencoder import DemoStreamingDecoder, load_autoencoder

        path = root / AE_FILE
        if not path.is_file():
            raise ValueError(f"demo autoencoder weights: {str(path)!r} does not exist")
        decoder = DemoStreamingDecoder(load_autoencoder(path))
    return DemoModel(cfg, model, text, decoder)


__all__ = [
    "AE_FILE",
    "DIT_FILE",
    "TEXT_FILE",
    "WEIGHTS_DIR",
    "WIDTH_KEYS",
    "DemoModel",
    "demo_config",
    "load_demo",
]
