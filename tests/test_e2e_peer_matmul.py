"""The peer rows' dense layers (perf/e2e/peer_matmul.py): linears at the peer's measured TensorE-active
fraction and VAE convs fitted to its one published VAE time."""

from __future__ import annotations

import pytest

from perf.e2e.components import vae_components
from perf.e2e.params import E2EParams
from perf.e2e.peer_matmul import PEER_MATMUL_ACTIVE, PEER_VAE, PeerMatmul, peer_matmul
from perf.footprint import vae_probe, vae_strides
from perf.matmul_model import AnalyticMatmulProvider, linear_profile

P = E2EParams()


def test_linear_at_the_measured_tensore_active_fraction() -> None:
    flops = 2 * 3510 * 1536 * 8960
    lo = linear_profile("ffn_up", 3510, 1536, 8960, PeerMatmul(P), end="optimistic")
    hi = linear_profile("ffn_up", 3510, 1536, 8960, PeerMatmul(P), end="pessimistic")
    assert lo.latency_s == pytest.approx(flops / (P.peak_flops_per_core * PEER_MATMUL_ACTIVE[0]))
    assert hi.latency_s == pytest.approx(flops / (P.peak_flops_per_core * PEER_MATMUL_ACTIVE[1]))


def test_vae_fit_reproduces_the_published_vae_time() -> None:
    pm = PeerMatmul(P)
    eff = pm.fitted_vae_efficiency()
    assert 0 < eff < 1
    sp = vae_strides()[1]
    probe = vae_probe(PEER_VAE["height"] // sp, PEER_VAE["width"] // sp, 3)
    comps = vae_components(probe, probe.steady, PEER_VAE["cores"], pm, P, "steady")
    assert sum(c.time_s for c in comps) == pytest.approx(PEER_VAE["chunk_s"], rel=1e-6)
    assert all("fitted" in c.source or c.name.startswith("vae_elementwise") or "efficiency" in c.source
               for c in comps)  # fmt: skip


def test_provider_selection_and_validation() -> None:
    assert isinstance(peer_matmul(PeerMatmul(P), P), PeerMatmul)
    analytic = AnalyticMatmulProvider()
    assert peer_matmul(analytic, P) is analytic  # no whole-linear pricing: kept as given
    with pytest.raises(ValueError, match="vae_efficiency must be in"):
        PeerMatmul(P, vae_efficiency=0.0)
    with pytest.raises(ValueError, match="k must be a positive int"):
        PeerMatmul(P).linear(1, 0, 1)
