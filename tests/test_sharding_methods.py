"""The sharded stream serves the sequential methods from the same plans: sharded == unsharded at fp32
(the fp32 stream-equivalence bound) for Self-Forcing, CausVid and LongLive (with a re-cached prompt
switch on TP2 x SP2), two-pass, batched (``merged=True``) and static (``static=True``), each against the
unsharded stream in the same mode (the same driver; only the forwards are sharded)."""

from __future__ import annotations

import pytest
import torch

from rolling_forcing.config import PipelineConfig
from rolling_forcing.methods import METHODS
from rolling_forcing.pipeline import RollingForcingPipeline
from sharding.pipeline import ShardedRollingForcingPipeline
from tests.numerics import FP32_ISSUE_BOUND
from tests.pipeline_helpers import TINY, text_embeds, tiny_model
from tests.pipeline_helpers import one_thread as one_thread  # autouse: one intra-op thread

P = PipelineConfig()
TIMEOUT_S = 20.0


@pytest.mark.parametrize(
    ("method", "positions", "nb", "cores", "tp", "switch_block"),
    [
        ("self-forcing", "relative", 9, 2, None, None),  # evicts twice (7-block window)
        ("causvid", "absolute", 5, 2, None, None),
        ("longlive", "absolute", 8, 4, 2, 5),  # TP2 x SP2; re-cache of blocks 2..4, sink protected
    ],
)
def test_sharded_method_equals_unsharded(
    method: str, positions: str, nb: int, cores: int, tp: int | None, switch_block: int | None
) -> None:
    model = tiny_model(TINY)
    new = text_embeds(99)
    ref = RollingForcingPipeline(model, TINY, P, method=method, positions=positions)
    want = []
    for c in ref.stream(text_embeds(), nb, generator=torch.Generator().manual_seed(7)):
        want.append(c.latents)
        if switch_block is not None and c.block + 1 == switch_block:
            ref.set_prompt(new, recache=True)
    sharded = ShardedRollingForcingPipeline(
        model, TINY, P, cores=cores, tp=tp, positions=positions, method=method, timeout_s=TIMEOUT_S
    )
    assert sharded.merged is False
    if switch_block is not None:
        sharded.set_prompt(new, True, window=switch_block * METHODS[method].steps)
    got = [
        c.latents
        for c in sharded.stream(
            text_embeds(), nb, generator=torch.Generator().manual_seed(7), return_latents=True
        )
    ]
    out, ref_out = torch.cat(got, dim=1), torch.cat(want, dim=1)
    err = float((out - ref_out).abs().max())
    assert err < FP32_ISSUE_BOUND, err
    assert float(ref_out.abs().max()) > 0.1
    results = sharded.last_results
    assert results is not None and len(results) == cores
    counts = results[0]["forwards"]
    steps = METHODS[method].steps
    assert counts["denoise"] == nb * steps and counts["update"] == nb
    assert counts.get("recache", 0) == (1 if switch_block is not None else 0)


def test_sharded_method_refusals() -> None:
    model = tiny_model(TINY)
    with pytest.raises(ValueError, match="static=True is for sequential methods"):
        ShardedRollingForcingPipeline(model, TINY, P, cores=2, static=True)
    with pytest.raises(ValueError, match="needs merged=True or None"):
        ShardedRollingForcingPipeline(model, TINY, P, cores=2, method="causvid", merged=False, static=True)
    sh = ShardedRollingForcingPipeline(model, TINY, P, cores=2, method="longlive")
    sh.set_prompt(text_embeds(99), True, window=6)  # inside block 1 (4 steps per block)
    with pytest.raises(ValueError, match="falls inside a block"):
        next(sh.stream(text_embeds(), 4))
    with pytest.raises(ValueError, match="at most 7 blocks"):
        next(
            ShardedRollingForcingPipeline(model, TINY, P, cores=2, method="causvid").stream(text_embeds(), 8)
        )


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("method", "positions", "nb", "cores", "tp", "switch_block", "mode"),
    [
        # TP1 x SP2, 48-token blocks: the batched forward's query shards split at the update block's end
        ("longlive", "relative", 7, 2, None, 4, {"merged": True}),
        ("self-forcing", "absolute", 5, 4, 2, None, {"static": True}),  # TP2 x SP2, static shapes
    ],
)
def test_sharded_batched_and_static_equal_unsharded(
    method: str, positions: str, nb: int, cores: int, tp: int | None, switch_block: int | None, mode: dict
) -> None:
    model = tiny_model(TINY)
    new = text_embeds(99)
    ref = RollingForcingPipeline(model, TINY, P, method=method, positions=positions, **mode)
    want = []
    for c in ref.stream(text_embeds(), nb, generator=torch.Generator().manual_seed(7)):
        want.append(c.latents)
        if switch_block is not None and c.block + 1 == switch_block:
            ref.set_prompt(new, recache=True)
    sharded = ShardedRollingForcingPipeline(
        model, TINY, P, cores=cores, tp=tp, positions=positions, method=method, timeout_s=TIMEOUT_S, **mode
    )
    assert sharded.merged is True
    if switch_block is not None:
        sharded.set_prompt(new, True, window=switch_block * METHODS[method].steps)
    got = [c.latents for c in sharded.stream(text_embeds(), nb, generator=torch.Generator().manual_seed(7))]
    out, ref_out = torch.cat(got, dim=1), torch.cat(want, dim=1)
    err = float((out - ref_out).abs().max())
    print(f"\n{method} {mode} {sharded.plan.name}: max |sharded - unsharded| = {err:.3g}")
    assert err < FP32_ISSUE_BOUND, err
    assert float(ref_out.abs().max()) > 0.1
    results = sharded.last_results
    assert results is not None and len(results) == cores
    for r in results:  # the same forwards as the unsharded stream in the same mode
        assert r["forwards"] == dict(ref.stats.forwards), r["rank"]
    kind = "static" if mode.get("static") else "batched"
    assert ref.stats.forwards[kind] > 0
