"""Dense layers of the measured peer's rows, priced from the peer's own measurements (*modelled*).

The peer (github.com/yahavb/rolling_forcing) runs its linear layers as XLA-compiled matmuls and its VAE
decoder with its own kernels, not this project's ``nki_kernels.linear`` / ``nki_kernels.conv3d``.  Pricing
its rows with our kernels would again measure our kernels, not the end-to-end accounting.  So for the peer
rows only (:func:`perf.e2e.run.run_model`):

* linears run at the TensorE-active fraction its profiles publish for its matmul NEFFs, 65-69 %
  (:data:`PEER_MATMUL_ACTIVE`: 69 % at the optimistic end, 65 % at the pessimistic end);
* the VAE decoder's convolutions run at one efficiency fitted to its one published VAE time (~135 ms per
  chunk at 480x640 on 16 cores, :data:`PEER_VAE`), after our modelled elementwise passes of that decode
  are taken off.  The fit uses a VAE measurement, not the fps the calibration checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from perf.e2e.params import E2EParams
from perf.matmul_model import BlockProfile

__all__ = ["PEER_MATMUL_ACTIVE", "PEER_VAE", "PeerMatmul"]

PEER_MATMUL_ACTIVE = (0.69, 0.65)
"""(optimistic, pessimistic) TensorE-active fraction of the peer's matmul NEFFs (measured by the peer,
github.com/yahavb/rolling_forcing profiles quoted in docs/ROOFLINE_RF_1_3B.md)."""

PEER_VAE = {"height": 480, "width": 640, "cores": 16, "chunk_s": 0.135}
"""The peer's published VAE decode time per chunk and where (docs/ROOFLINE_RF_1_3B.md, 13.95 fps run)."""


def _profile(flops: int, t_lo: float, t_hi: float, dims: tuple[int, int, int], source: str) -> BlockProfile:
    return BlockProfile(
        block_m=dims[0],
        block_n=dims[1],
        k=dims[2],
        latency_s=t_lo,
        engine_busy_s={"tensor": t_lo},
        dma_bytes=0,
        flops=flops,
        instructions=0,
        source=source,
        latency_high_s=t_hi,
        model="measured efficiency",
        engine_busy_high_s={"tensor": t_hi},
    )


@dataclass
class PeerMatmul:
    """Matmul provider of the peer rows (module docstring); ``vae_efficiency`` overrides the fit."""

    params: E2EParams = field(default_factory=E2EParams)
    vae_efficiency: float | None = None
    name: str = "peer (its measured matmul / VAE efficiency)"

    def __post_init__(self) -> None:
        if self.vae_efficiency is not None and not 0 < self.vae_efficiency <= 1:
            raise ValueError(f"PeerMatmul.vae_efficiency must be in (0, 1], got {self.vae_efficiency}")

    def linear(self, m: int, k: int, n: int) -> BlockProfile:
        for arg, v in (("m", m), ("k", k), ("n", n)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"PeerMatmul.linear: {arg} must be a positive int, got {v!r}")
        flops = 2 * m * k * n
        peak = self.params.peak_flops_per_core
        lo, hi = PEER_MATMUL_ACTIVE
        src = f"peer matmul NEFFs at {hi:.0%}-{lo:.0%} TensorE-active (measured by the peer)"
        return _profile(flops, flops / (peak * lo), flops / (peak * hi), (m, n, k), src)

    def block(self, block_m: int, k: int, block_n: int) -> BlockProfile:
        return self.linear(block_m, k, block_n)

    def conv(
        self, c_in: int, c_out: int, frames: int, h: int, w: int, ksize: tuple[int, int, int]
    ) -> BlockProfile:
        eff = self.vae_efficiency if self.vae_efficiency is not None else self.fitted_vae_efficiency()
        taps = math.prod(ksize)
        flops = 2 * frames * h * w * c_in * taps * c_out
        t = flops / (self.params.peak_flops_per_core * eff)
        src = f"peer VAE convs at {eff:.1%} of peak (fitted to its ~135 ms per chunk at 480x640, 16 cores)"
        return _profile(flops, t, t, (frames * h * w, c_out, c_in * taps), src)

    def fitted_vae_efficiency(self) -> float:
        """Conv efficiency that makes the modelled VAE decode of :data:`PEER_VAE`'s configuration take its
        published time (:func:`_fit_vae`)."""
        if self.vae_efficiency is None:
            self.vae_efficiency = _fit_vae(self.params)
        return self.vae_efficiency


def _fit_vae(params: E2EParams) -> float:
    """The conv efficiency ``e`` with ``conv + mid-attention time at e + elementwise = PEER_VAE time``: both
    conv and mid-attention times scale as ``1 / e`` (the decode modelled at ``e = 1`` gives their sum)."""
    from perf.e2e.components import vae_components
    from perf.footprint import vae_probe, vae_strides

    sp = vae_strides()[1]
    probe = vae_probe(int(PEER_VAE["height"]) // sp, int(PEER_VAE["width"]) // sp, 3)
    comps = vae_components(
        probe, probe.steady, int(PEER_VAE["cores"]), PeerMatmul(params, 1.0), params, "fit"
    )
    ew = sum(c.time_s for c in comps if c.name.startswith("vae_elementwise"))
    at_one = sum(c.time_s for c in comps if not c.name.startswith("vae_elementwise"))
    left = float(PEER_VAE["chunk_s"]) - ew
    if left <= 0:
        raise ValueError("peer VAE fit: the modelled elementwise passes exceed the published VAE time")
    return min(1.0, at_one / left)


def peer_matmul(matmul: Any, params: E2EParams) -> Any:
    """The peer rows' matmul provider: :class:`PeerMatmul` when ``matmul`` prices whole linears (the traced
    providers), else ``matmul`` itself (the ``--analytic`` fallback)."""
    return PeerMatmul(params) if hasattr(matmul, "linear") else matmul
