"""The carried Wan2.1 VAE decoder table (perf/wan_vae_table.py) equals diffusers' AutoencoderKLWan."""

from __future__ import annotations

import pytest

try:  # the `test` extra installs diffusers: without it this check must fail, never skip
    import diffusers  # noqa: F401
except ImportError as exc:
    raise ImportError(
        "tests/test_wan_vae_table.py needs diffusers (AutoencoderKLWan, the source of the carried VAE "
        "table): pip install -e '.[test]'"
    ) from exc

from perf.footprint import VaeLayer, vae_probe, vae_strides
from tools.wan_vae_table import diffusers_probe


@pytest.mark.parametrize(("h", "w", "frames"), [(60, 104, 3), (9, 5, 1)])
def test_carried_table_equals_diffusers_probe(h: int, w: int, frames: int) -> None:
    """480x832 (the 1.3B preset's latent 60x104, 3 frames a block) and a small odd size not among the
    three sizes the table was fitted from: every layer's kind and shapes, params and strides agree."""
    live = diffusers_probe(h, w, frames)
    got = vae_probe(h, w, frames)
    assert got.first == tuple(VaeLayer(*r) for r in live["first"])
    assert got.steady == tuple(VaeLayer(*r) for r in live["steady"])
    assert got.decoder_params == live["decoder_params"]
    assert vae_strides() == (live["temporal_stride"], live["spatial_stride"])
