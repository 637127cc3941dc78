"""``generate --noise auto|upfront|per-block``: which draw the CLI picks, that the per-block draw is a
different (not bit-identical) stream, and that the sharded stream draws it exactly as the unsharded one.

RNG order: the up-front draw takes all initial noise from the generator before the first re-noise draw;
the per-block draw takes each block's initial noise when it enters the window, between re-noise draws,
so the two orders give different samples of the same distribution. ``auto`` keeps the up-front order
(the originals', bit-identical to earlier runs) for every stream the original could run (at most
``max_blocks("absolute")`` blocks) and draws per block beyond, so memory stays constant in ``--seconds``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nki_ardiff.cli_checks import noise_upfront
from nki_ardiff.cli_options import GenerateOptions
from rolling_forcing.config import PipelineConfig
from rolling_forcing.pipeline import RollingForcingPipeline
from rolling_forcing.stream import NoiseSource
from sharding.pipeline import ShardedRollingForcingPipeline
from tests.numerics import FP32_ISSUE_BOUND
from tests.pipeline_helpers import TINY, text_embeds, tiny_model
from tests.pipeline_helpers import one_thread as one_thread  # autouse: one intra-op thread

P = PipelineConfig()
BLOCKS = 5


def test_auto_is_upfront_within_the_table_and_per_block_beyond() -> None:
    o = GenerateOptions(out=Path("x.mp4"))
    assert noise_upfront(o, 341) is True and noise_upfront(o, 342) is False  # 341 blocks = 1023 frames
    sf = GenerateOptions(out=Path("x.mp4"), method="self-forcing")  # its table: the 21-frame cache
    assert noise_upfront(sf, 7) is True and noise_upfront(sf, 8) is False
    assert noise_upfront(GenerateOptions(out=Path("x.mp4"), noise="upfront"), 10**6) is True
    assert noise_upfront(GenerateOptions(out=Path("x.mp4"), noise="per-block"), 5) is False


def _stream(upfront: bool) -> torch.Tensor:
    model = tiny_model()
    pipe = RollingForcingPipeline(model, TINY, P)
    g = torch.Generator().manual_seed(7)
    src = NoiseSource(1, TINY.latent_frame_shape(), P.frames_per_block, BLOCKS, torch.float32, generator=g,
                      upfront=upfront)  # fmt: skip
    return torch.cat([c.latents for c in pipe.stream(text_embeds(), BLOCKS, generator=g, noise=src)], dim=1)


def test_per_block_holds_no_up_front_tensor_and_differs_from_upfront() -> None:
    src = NoiseSource(1, TINY.latent_frame_shape(), 3, 10**7, torch.float32, upfront=False)  # 10M blocks
    assert src._initial is None  # nothing of the stream's length is allocated
    up, per = _stream(True), _stream(False)
    default = torch.cat(
        [c.latents for c in RollingForcingPipeline(tiny_model(), TINY, P).stream(
            text_embeds(), BLOCKS, generator=torch.Generator().manual_seed(7))], dim=1,
    )  # fmt: skip
    assert torch.equal(up, default)  # up front = the pipeline's default order, bitwise
    # a different RNG order: the samples differ by O(1) (a bug that ignored upfront would give 0.0)
    assert float((up - per).abs().max()) > 0.1


@pytest.mark.distributed
def test_sharded_per_block_equals_unsharded_per_block() -> None:
    """The ranks build the same per-block NoiseSource from the replicated generator (FP32 bound as in
    tests/test_sharding_pipeline.py: sharding changes only the summation order)."""
    sharded = ShardedRollingForcingPipeline(tiny_model(), TINY, P, cores=2, timeout_s=20.0)
    chunks = list(
        sharded.stream(text_embeds(), BLOCKS, generator=torch.Generator().manual_seed(7), upfront=False)
    )
    got = torch.cat([c.latents for c in chunks], dim=1)
    ref = _stream(False)
    assert float((got - ref).abs().max()) <= FP32_ISSUE_BOUND
    assert float((got - _stream(True)).abs().max()) > 0.1


def _peak_rss_mib(blocks: int, out: Path) -> float:
    """Peak RSS (MiB, measured by the kernel: wait4's ru_maxrss) of one CLI stream of ``blocks`` blocks."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "NKI_ARDIFF_BACKEND"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    args = [
        "generate",
        "--preset",
        "tiny",
        "--blocks",
        str(blocks),
        "--positions",
        "relative",
        "--no-warmup",
        "-q",
    ]
    p = subprocess.Popen(
        [sys.executable, "-m", "nki_ardiff", *args, "--out", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    assert p.returncode == 0
    return usage.ru_maxrss / 1024


@pytest.mark.slow
def test_cli_memory_is_flat_in_the_stream_length(tmp_path: Path) -> None:
    """``generate`` with the default ``--noise auto`` beyond the table (per block): the peak RSS of a
    1,500-block stream is that of a 300-block one. Up-front noise would add 1,200 x 3 x 16x8x8 fp32 =
    14.1 MiB (measured with --noise upfront: 370.4 -> 388.6 MiB peak VmHWM); the bound (6 MiB) leaves
    the rest to allocator noise and the report's per-chunk rows (~0.5 MiB). Measured with the default:
    367.6 -> 366.4 MiB."""
    short = _peak_rss_mib(300, tmp_path / "short.mp4")
    long = _peak_rss_mib(1500, tmp_path / "long.mp4")
    assert long - short < 6.0, (short, long)
