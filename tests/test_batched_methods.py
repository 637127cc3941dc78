"""Every method at batch 2 equals its two batch elements streamed alone, in every forward mode.

A token slice of a ``[B, 2T, H, D]`` tensor is strided when B > 1 while the ops read ``[B, L, H, D]``
row-major: the sequential methods' batched (``merged=True``) forward once passed such a slice of v and
crashed at batch 2 only, and a forward that mixed up batch elements (one element's cache, prompt or
noise used for another) would pass every batch-1 test. So each batch-2 stream here (element i: prompt
``PROMPTS[i]``, noise from its own generator ``SEEDS[i]``, :class:`ElementNoise`) is compared with the
two batch-1 two-pass streams of the same elements, run separately: unsharded merged, two-pass and static
forwards, and the merged and two-pass forwards sharded over 2 gloo ranks (TP1 x SP2, the query shards
split at the update block's end), for every method in both position modes.

Bound: :data:`tests.numerics.FP32_ISSUE_BOUND` (1e-5), the fp32 stream-equivalence bound (merged vs
two-pass, sharded vs unsharded). Not bitwise: at batch 2 the patch embedding (Conv3d) and the time
embedding run batch-size-dependent CPU kernels (one forward differs by ~2e-6 per element); measured over
every case here (one intra-op thread): max 2.4e-6 (LongLive relative); the two elements differ by > 5.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rolling_forcing.attend import attend_cache
from rolling_forcing.cache import LayerKVCache
from rolling_forcing.config import PipelineConfig, get_preset
from rolling_forcing.model import CausalWanModel
from rolling_forcing.pipeline import RollingForcingPipeline
from rolling_forcing.schedule import KeyBlock
from rolling_forcing.stream import NoiseSource
from sharding.attention import build_groups
from sharding.launch import launch
from sharding.pipeline import pipeline_plan
from sharding.rank_stream import RankStream
from tests.numerics import FLOORS, FP32_ISSUE_BOUND  # fp32 stream equivalence (1e-5)
from tests.pipeline_helpers import one_thread as one_thread  # autouse: one intra-op thread
from tests.pipeline_helpers import text_embeds, tiny_model

M = get_preset("tiny")
P = PipelineConfig()
FPB = P.frames_per_block  # every method's block: 3 latent frames
# blocks per stream: Rolling Forcing's window fills once (5 blocks); LongLive evicts at block 4
NB = {"rolling-forcing": 5, "self-forcing": 4, "causvid": 4, "longlive": 5}
POSITIONS = ("absolute", "relative")
MODES = ("merged", "two-pass", "static")  # static: the sequential methods' static-shape forward
PROMPTS, SEEDS = (1, 2), (7, 8)  # batch element i's prompt seed and noise seed
TIMEOUT_S = 20.0


class ElementNoise(NoiseSource):
    """Each batch element's noise from its own generator (``seeds[i]``), drawn exactly as a batch-1
    stream of that element draws it (its initial noise up front, then every re-noise): element i of a
    batch-2 stream sees the noise of the batch-1 stream ``ElementNoise([seeds[i]], ...)``."""

    def __init__(self, seeds: list[int], num_blocks: int) -> None:
        shape = M.latent_frame_shape()
        super().__init__(len(seeds), shape, FPB, num_blocks, torch.float32, upfront=False)
        self.parts = [
            NoiseSource(1, shape, FPB, num_blocks, torch.float32, generator=torch.Generator().manual_seed(s))
            for s in seeds
        ]

    def initial(self, block: int) -> torch.Tensor:
        return torch.cat([p.initial(block) for p in self.parts])

    def renoise(self, num_frames: int) -> torch.Tensor:  # [B * n, C, H, W], element-major
        return torch.cat([p.renoise(num_frames) for p in self.parts])


def _inputs(elements: tuple[int, ...], method: str) -> tuple[torch.Tensor, ElementNoise]:
    """Prompts ``[len(elements), L, text_dim]`` and noise of the given batch elements."""
    text = torch.cat([text_embeds(PROMPTS[i]) for i in elements])
    return text, ElementNoise([SEEDS[i] for i in elements], NB[method])


def _stream(
    model: CausalWanModel, method: str, positions: str, mode: str, elements: tuple[int, ...]
) -> torch.Tensor:
    merged, static = mode != "two-pass", mode == "static"
    pipe = RollingForcingPipeline(
        model, M, P, method=method, positions=positions, merged=merged, static=static
    )
    text, noise = _inputs(elements, method)
    return torch.cat([c.latents for c in pipe.stream(text, NB[method], noise=noise)], dim=1)


@pytest.fixture(scope="module")
def model() -> CausalWanModel:
    return tiny_model(M)


_ALONE: dict[tuple[str, str], torch.Tensor] = {}


def _alone(model: CausalWanModel, method: str, positions: str) -> torch.Tensor:
    """The two batch-1 two-pass streams, element 0 then 1, stacked ``[2, F, C, H, W]`` (computed once)."""
    key = (method, positions)
    if key not in _ALONE:
        _ALONE[key] = torch.cat([_stream(model, method, positions, "two-pass", (i,)) for i in (0, 1)])
    return _ALONE[key]


def _check(got: torch.Tensor, want: torch.Tensor, method: str) -> None:
    assert got.shape == want.shape == (2, NB[method] * FPB, *M.latent_frame_shape())
    err = float((got - want).abs().max())  # NaN anywhere makes this NaN, and the bound fails
    assert err <= FP32_ISSUE_BOUND, err
    # the elements are different streams, so a mix-up of their caches, prompts or noise shows
    assert float((want[0] - want[1]).abs().max()) > 1.0


CASES = [
    (m, pos, mode)
    for m in NB
    for pos in POSITIONS
    for mode in MODES
    if not (mode == "static" and m == "rolling-forcing")  # its merged forward is the static one
]


@pytest.mark.parametrize(("method", "positions", "mode"), CASES)
def test_batch_2_equals_each_element_alone(
    model: CausalWanModel, method: str, positions: str, mode: str
) -> None:
    got = _stream(model, method, positions, mode, (0, 1))
    _check(got, _alone(model, method, positions), method)


SHARDED_CASES = [(m, pos, mode) for m in NB for pos in POSITIONS for mode in ("merged", "two-pass")]


def _rank_streams(rank: int, world: int, model: CausalWanModel, cases: list[tuple[str, str, str]]) -> dict:
    """On each of ``world`` gloo ranks: every case's batch-2 stream (rank 0 returns the latents)."""
    groups = build_groups(pipeline_plan(M, P, world), timeout_s=TIMEOUT_S)
    torch.set_num_threads(1)
    out: dict[tuple[str, str, str], torch.Tensor] = {}
    for method, positions, mode in cases:
        rs = RankStream(model, M, P, groups, positions=positions, method=method, merged=mode == "merged")
        text, noise = _inputs((0, 1), method)
        out[(method, positions, mode)] = torch.cat(
            [c.latents for c in rs.stream(text, NB[method], noise=noise)], dim=1
        )
    return out if rank == 0 else {}


@pytest.fixture(scope="module")
def sharded(model: CausalWanModel) -> dict[Any, torch.Tensor]:
    """Every sharded case's batch-2 stream, from one launch of 2 ranks (one start-up for all)."""
    return launch(_rank_streams, 2, model, SHARDED_CASES, timeout_s=TIMEOUT_S * 3)[0]


@pytest.mark.distributed
@pytest.mark.parametrize(("method", "positions", "mode"), SHARDED_CASES)
def test_batch_2_sharded_equals_each_element_alone(
    model: CausalWanModel, sharded: dict, method: str, positions: str, mode: str
) -> None:
    _check(sharded[(method, positions, mode)], _alone(model, method, positions), method)


# ---- attend_cache's own_start (the batched forward's own keys read from the whole [B, 2T] buffer) -------
def _fp64_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Naive float64 softmax attention ``[B, L, H, D]`` (independent of every backend)."""
    sc = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / q.shape[3] ** 0.5
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(sc, dim=-1), v.double())


@pytest.mark.parametrize("copies", [False, True], ids=["in-place", "with-copies"])
def test_attend_cache_own_start_reads_the_own_tokens_of_a_batch_2_buffer(copies: bool) -> None:
    """Own keys as tokens ``[T, 2T)`` of ``[2, 2T, H, D]`` buffers (a strided slice at batch 2): without
    roped copies they are read in place (ops.attention_segments), with copies joined to them; both
    equal the contiguous own keys bitwise (reference backend: the same gather, the same attention)
    and, in place, float64 attention over [cached blocks, own keys] within the fp32 floor."""
    g = torch.Generator().manual_seed(3)
    t, grid = 4, (1, 2, 2)  # one frame of 2 x 2 tokens per block

    def rand(n: int) -> torch.Tensor:
        return torch.randn(2, n, 2, 8, generator=g)

    layer = LayerKVCache(rand(3 * t), rand(3 * t), t)
    own_k, own_v, q = rand(2 * t), rand(2 * t), rand(t)
    keys = (KeyBlock(0, 0, 0, not copies), KeyBlock(1, 2, 1, True))
    got = attend_cache(layer, q, keys, (own_k, own_v), grid, own_start=t)
    alone = (own_k[:, t:].contiguous(), own_v[:, t:].contiguous())
    assert torch.equal(got, attend_cache(layer, q, keys, alone, grid))
    if not copies:
        k_all = torch.cat([layer.k[:, :t], layer.k[:, 2 * t :], own_k[:, t:]], dim=1)
        v_all = torch.cat([layer.v[:, :t], layer.v[:, 2 * t :], own_v[:, t:]], dim=1)
        want = _fp64_attention(q, k_all, v_all)
        assert float((got.double() - want).abs().max()) <= FLOORS[torch.float32]
    with pytest.raises(ValueError, match=r"own_start must be an int in \[0, L=8\)"):
        attend_cache(layer, q, keys, (own_k, own_v), grid, own_start=2 * t)
    with pytest.raises(ValueError, match=r"own_start must be an int in \[0, L=8\)"):
        attend_cache(layer, q, keys, (own_k, own_v), grid, own_start=-1)
    with pytest.raises(ValueError, match="own_start=4 applies to own keys, but own=None"):
        attend_cache(layer, q, keys, None, grid, own_start=t)
