"""Derive ``perf/wan_vae_table.py`` (the Wan2.1 VAE decoder's layer table) from diffusers.

``python -m tools.wan_vae_table`` (needs diffusers, the ``hf``/``test`` extra) builds diffusers'
``AutoencoderKLWan()`` (default config = Wan2.1 VAE) on torch's meta device, records every leaf layer's
input, output and weight shapes during a decode, and writes them as linear forms in the latent height
``h`` and width ``w`` so that the performance model needs no diffusers at run time.
``tests/test_wan_vae_table.py`` checks the committed table against this live probe.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

Shape = tuple[int, ...]
Layer = tuple[str, Shape, Shape, Shape]  # kind, in_shape, out_shape, weight_shape
# one dimension as (a, b, c): a*h + b*w + c for latent height h and width w
Form = tuple[int, int, int]

TABLE_PATH = Path(__file__).resolve().parent.parent / "perf" / "wan_vae_table.py"


def diffusers_probe(latent_h: int, latent_w: int, frames: int) -> dict[str, Any]:
    """Live probe: layer records of the first latent frame and of ``frames`` steady frames after it,
    decoder (+ post_quant_conv) parameter count and the config's strides."""
    import torch
    from diffusers import AutoencoderKLWan

    with torch.device("meta"):
        vae: Any = AutoencoderKLWan()
    vae.eval()
    recs: list[Layer] = []

    def hook(mod: Any, inp: Any, out: Any) -> None:
        w = getattr(mod, "weight", None)
        ws = tuple(w.shape) if isinstance(w, torch.Tensor) else ()
        recs.append((type(mod).__name__, tuple(inp[0].shape), tuple(out.shape), ws))

    handles = [mod.register_forward_hook(hook) for mod in vae.decoder.modules() if not list(mod.children())]
    try:
        with torch.no_grad():
            vae.decode(torch.empty(1, vae.config.z_dim, 1, latent_h, latent_w, device="meta"))
            n_first = len(recs)
            vae.decode(torch.empty(1, vae.config.z_dim, 1 + frames, latent_h, latent_w, device="meta"))
    finally:
        for h in handles:
            h.remove()
    return {
        "first": recs[:n_first],
        "steady": recs[2 * n_first :],
        "decoder_params": sum(p.numel() for p in vae.decoder.parameters())
        + sum(p.numel() for p in vae.post_quant_conv.parameters()),
        "spatial_stride": int(vae.config.scale_factor_spatial),
        "temporal_stride": int(vae.config.scale_factor_temporal),
    }


def _fit(v0: int, vh: int, vw: int, h0: int, w0: int, dh: int, dw: int) -> Form:
    a, ra = divmod(vh - v0, dh)
    b, rb = divmod(vw - v0, dw)
    if ra or rb:
        raise ValueError(f"dimension not linear in the latent size: {v0}, {vh}, {vw}")
    return (a, b, v0 - a * h0 - b * w0)


def _fit_layers(base: list[Layer], by_h: list[Layer], by_w: list[Layer], h0: int, w0: int, dh: int, dw: int):
    if not (len(base) == len(by_h) == len(by_w)):
        raise ValueError("layer count depends on the latent size")
    out = []
    for l0, lh, lw in zip(base, by_h, by_w, strict=True):
        if not (l0[0] == lh[0] == lw[0]) or l0[3] != lh[3] or l0[3] != lw[3]:
            raise ValueError(f"layer kind or weight depends on the latent size: {l0}")
        forms = tuple(
            tuple(_fit(x0, xh, xw, h0, w0, dh, dw) for x0, xh, xw in zip(s0, sh, sw, strict=True))
            for s0, sh, sw in ((l0[1], lh[1], lw[1]), (l0[2], lh[2], lw[2]))
        )
        out.append((l0[0], forms[0], forms[1], l0[3]))
    return out


def derive() -> dict[str, Any]:
    """Fit the table from probes at three latent sizes; check it reproduces a fourth."""
    h0, w0, dh, dw = 3, 5, 4, 6
    p0 = diffusers_probe(h0, w0, 2)
    ph = diffusers_probe(h0 + dh, w0, 2)
    pw = diffusers_probe(h0, w0 + dw, 2)
    per_frame = len(p0["steady"]) // 2
    if p0["steady"][:per_frame] != p0["steady"][per_frame:]:
        raise ValueError("steady latent frames do not repeat the same layers")
    first = _fit_layers(p0["first"], ph["first"], pw["first"], h0, w0, dh, dw)
    steady = _fit_layers(
        p0["steady"][:per_frame], ph["steady"][:per_frame], pw["steady"][:per_frame], h0, w0, dh, dw
    )
    return {
        "decoder_params": p0["decoder_params"],
        "spatial_stride": p0["spatial_stride"],
        "temporal_stride": p0["temporal_stride"],
        "first": first,
        "steady": steady,
    }


def _dim_token(form: Form) -> str:
    """``(a, b, c)`` as ``"ah+bw+c"``, zero terms dropped, unit coefficients bare (``"8h"``, ``"w"``)."""
    if min(form) < 0:
        raise ValueError(f"negative coefficient in {form}")
    a, b, c = form
    terms = [f"{'' if k == 1 else k}{v}" for k, v in ((a, "h"), (b, "w")) if k] + (
        [str(c)] if c or not (a or b) else []
    )
    return "+".join(terms)


def _shape_token(forms: tuple[Form, ...]) -> str:
    return ",".join(_dim_token(f) for f in forms)


def render(table: dict[str, Any]) -> str:
    import diffusers

    lines = [
        '"""Wan2.1 VAE decoder layer table (generated: ``python -m tools.wan_vae_table``; do not edit).',
        "",
        f"Derived from diffusers {diffusers.__version__} ``AutoencoderKLWan()`` (default config = the Wan2.1",
        "VAE; https://github.com/huggingface/diffusers, models/autoencoders/autoencoder_kl_wan.py) on the",
        "meta device. Each layer is ``(kind, in_shape, out_shape, weight_shape)``; the activation shapes are",
        'comma-separated dimensions, each ``"ah+bw+c"`` (zero terms dropped) for latent height ``h`` and',
        "width ``w``.",
        "``FIRST``: the layer calls of the first latent frame; ``STEADY``: those of each later frame.",
        '"""',
        "",
        f"DECODER_PARAMS = {table['decoder_params']}",
        f"SPATIAL_STRIDE = {table['spatial_stride']}",
        f"TEMPORAL_STRIDE = {table['temporal_stride']}",
    ]
    for name in ("first", "steady"):
        lines.append(f"{name.upper()} = (")
        for layer in table[name]:
            kind, ins, outs, ws = layer
            lines.append(f'    ("{kind}", "{_shape_token(ins)}", "{_shape_token(outs)}", {ws!r}),')
        lines.append(")")
    return "\n".join(lines) + "\n"


def main() -> int:
    TABLE_PATH.write_text(render(derive()))
    print(f"wrote {TABLE_PATH}", file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
