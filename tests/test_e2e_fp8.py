"""The fp8_linear chunk variant of the end-to-end model (perf/e2e/fp8.py): its matmul provider."""

from __future__ import annotations

import pytest

from perf.e2e.fp8 import FP8_MIN_DIM, TracedLinearFp8Provider

pytestmark = pytest.mark.emulator


def test_provider_prices_the_fp8_kernel_and_delegates_the_rest() -> None:
    prov = TracedLinearFp8Provider()
    fp8 = prov.linear(512, 1536, 1536)
    bf16 = prov.inner.linear(512, 1536, 1536)
    assert "linear_fp8" in fp8.source and "linear_fp8" not in bf16.source
    assert fp8.flops == bf16.flops == 2 * 512 * 1536 * 1536
    # half the weight bytes: the fp8 trace moves fewer DMA bytes than the bf16 one at the same shape
    assert fp8.dma_bytes < bf16.dma_bytes
    # the patch embedding (K = 64) and the output head (N = 64) stay bf16: the inner provider's profile
    assert prov.linear(512, 64, 1536) is prov.inner.linear(512, 64, 1536)
    assert prov.linear(512, 1536, FP8_MIN_DIM - 1) is prov.inner.linear(512, 1536, FP8_MIN_DIM - 1)
    with pytest.raises(ValueError, match="k must be a positive int"):
        prov.linear(512, 0, 1536)
