"""The tiny streaming decoder's separate row (perf/e2e/taehv.py): its conv FLOPs against a count by hand per
stage, and its pricing calls the conv kernel once per conv and latent frame at one core's rows."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from perf.e2e.params import E2EParams
from perf.e2e.taehv import taehv_components, taehv_conv_flops, taehv_decoder


def test_conv_flops_equal_a_count_by_hand() -> None:
    # MACs per latent position, by stage (k = 3 unless said):
    # latent size: 16->256 (9*16*256) + 3 memory blocks of 512->256, 256->256, 256->256
    s0 = 9 * 16 * 256 + 3 * (9 * 512 * 256 + 2 * 9 * 256 * 256)
    # x2: time grow 256->256 (1x1, 1 frame), 256->128, 3 memory blocks of 256->128, 128->128, 128->128
    s1 = 256 * 256 + 9 * 256 * 128 + 3 * (9 * 256 * 128 + 2 * 9 * 128 * 128)
    # x4: time grow 128->256 (1x1, 1 frame), then 2 frames: 128->64 and 3 memory blocks of 128->64, 64->64 x2
    s2 = 128 * 256 + 2 * (9 * 128 * 64 + 3 * (9 * 128 * 64 + 2 * 9 * 64 * 64))
    # x8: time grow 64->128 (1x1, 2 frames), then 4 frames: 64->64 and 64->3
    s3 = 2 * 64 * 128 + 4 * (9 * 64 * 64 + 9 * 64 * 3)
    per_position = s0 + 4 * s1 + 16 * s2 + 64 * s3
    assert per_position == 43_601_920
    for h, w, n in ((60, 104, 3), (5, 7, 1)):
        assert taehv_conv_flops(h, w, n) == 2 * n * h * w * per_position
    # 3 steady latent frames at 480x832: 1.63 TFLOP, 1/25 of the Wan VAE decoder's 40.47
    assert taehv_conv_flops(60, 104, 3) / 1e12 == pytest.approx(1.632, abs=1e-3)


@dataclass
class _Prof:
    t: float

    def at(self, end: str) -> float:
        return self.t if end == "pessimistic" else self.t / 2


class _Recorder:
    name = "recorder"

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int, int, int, tuple[int, int, int]]] = []

    def conv(self, c_in, c_out, frames, h, w, ksize):
        self.calls.append((c_in, c_out, frames, h, w, ksize))
        return _Prof(1e-6 * (len(self.calls)))


def test_pricing_calls_the_conv_kernel_per_conv_at_one_cores_rows() -> None:
    rec = _Recorder()
    convs, passes = taehv_decoder()
    comps = {c.name: c for c in taehv_components(60, 104, 3, 8, rec, E2EParams(), "pessimistic")}
    assert len(rec.calls) == len(convs) == 35  # 3 input convs, 27 memory-block convs, 3 grows, 2 output
    for (c_in, c_out, frames, h, w, ks), c in zip(rec.calls, convs, strict=True):
        assert (c_in, c_out, frames, ks) == (c.c_in, c.c_out, c.frames, (1, c.k, c.k))
        assert (h, w) == (math.ceil(60 * c.scale / 8), 104 * c.scale)
    assert rec.calls[-1] == (64, 3, 4, 60, 832, (1, 3, 3))  # RGB at 480x832 (60 rows per core), 4 frames
    n = len(rec.calls)
    assert comps["taehv_convs"].time_s == pytest.approx(3 * 1e-6 * n * (n + 1) / 2)
    assert comps["taehv_convs"].launches == 3 * 35 and comps["taehv_elementwise"].launches == 3 * len(passes)
    assert comps["taehv_convs"].flops == taehv_conv_flops(60, 104, 3)
    assert "unknown" in comps["taehv_convs"].source
