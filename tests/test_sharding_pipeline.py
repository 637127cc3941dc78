"""The TP x SP sharded Rolling Forcing stream equals the unsharded pipeline; rank failures fail loudly.

Reference: :class:`rolling_forcing.pipeline.RollingForcingPipeline` (itself tested against the plain
reference loop) on the same weights, prompt and generator seed, in this process, in the same mode as the
sharded stream: merged (the default of both) against merged, two-pass (``merged=False``) against
two-pass.

Tolerance: 1e-5 absolute on the final latents (fp32), the issue's bound. Sharding changes no arithmetic
except the row count of every matmul (token shards) and the head count of every attention call, which
can change the fp32 summation order inside BLAS: a few ulps per op, compounded over 2 layers x every
forward of the stream. Measured: merged sharded vs merged unsharded 0.0 (bitwise) for TP2xSP1, TP1xSP2,
TP2xSP2 (45-token blocks) and TP4xSP2, absolute and relative positions; two-pass sharded vs two-pass
unsharded 0.0 (TP1xSP2, TP2xSP1) .. 1.5e-6 (TP2xSP2, TP4xSP1, TP1xSP4), latents of magnitude <= 5.4.

Prompt switches (``set_prompt(embeds, recache, window=w)``, a schedule fixed before the stream) are
compared with the unsharded ``set_prompt(embeds, recache)`` called after the chunk of window w-1: measured
0.0 (bitwise) for merged TP1xSP2 with two switches (recache off, then on) and two-pass TP2xSP1 (recache on).
Static shapes: every rank counts the input signatures of its forwards (x, timesteps, its token shard,
the MergedIndex tensors); a merged stream without a switch has one per rank, as the unsharded one.

Multi-process tests are few and small (2-core CI machine): one 2-rank merged stream, one 2-rank merged
stream with two prompt switches, one 2-rank two-pass stream (with a switch), one 4-rank merged stream
with token counts that do not divide the ranks, one stream where a rank dies, one CLI run with
``--cores 2``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import pytest
import torch
import torch.distributed as dist

import rolling_forcing.driver
import sharding.pipeline
from rolling_forcing.config import ModelConfig, PipelineConfig, get_preset
from rolling_forcing.model import CausalWanModel, Head
from rolling_forcing.pipeline import RollingForcingPipeline
from sharding.launch import LaunchError
from sharding.pipeline import ShardedRollingForcingPipeline, pipeline_plan
from tests.numerics import FP32_ISSUE_BOUND
from tests.pipeline_helpers import TINY, text_embeds, tiny_model
from tests.pipeline_helpers import one_thread as one_thread  # autouse: one intra-op thread

TOL = FP32_ISSUE_BOUND  # fp32 sharded-vs-unsharded bound (see the module docstring for the measured error)
TIMEOUT_S = 20.0
# 15 tokens per frame, 45 per block: every pass's token count is odd (splits 12/11/11/11 on 4 ranks)
ODD = dataclasses.replace(TINY, name="tiny-odd", latent_height=6, latent_width=10)
P = PipelineConfig()


def _unsharded(
    model: CausalWanModel,
    positions: str,
    num_blocks: int,
    merged: bool,
    switches: dict[int, tuple[torch.Tensor, bool]] | None = None,
) -> tuple[list, RollingForcingPipeline]:
    """The unsharded stream; ``switches``: window -> (embeds, recache), each given by ``set_prompt`` right
    after the chunk of the window before (the unsharded API: it takes effect at the next window)."""
    pipe = RollingForcingPipeline(model, model.cfg, P, positions=positions, merged=merged)
    out = []
    for c in pipe.stream(text_embeds(), num_blocks, generator=torch.Generator().manual_seed(7)):
        out.append(c)
        if switches and c.window + 1 in switches:
            emb, recache = switches[c.window + 1]
            pipe.set_prompt(emb, recache=recache)
    return out, pipe


def _signatures(result: dict) -> int:
    """Distinct forward input signatures of one rank's stream."""
    return len(result["signatures"])


def _check_equal(sharded: ShardedRollingForcingPipeline, chunks: list, ref: list) -> tuple[float, float]:
    assert [(c.block, c.final, c.last, c.window) for c in chunks] == [
        (c.block, c.final, c.last, c.window) for c in ref
    ]
    out = torch.cat([c.latents for c in chunks], dim=1)
    want = torch.cat([c.latents for c in ref], dim=1)
    err = float((out - want).abs().max())
    assert err < TOL, f"sharded vs unsharded latents differ by {err}"
    assert float((want[:, :3] - want[:, -3:]).abs().max()) > 1e-2  # non-trivial stream
    results = sharded.last_results
    assert results is not None and len(results) == sharded.plan.world_size
    p = sharded.plan
    for r in results:
        # every rank ends with the same (all-gathered) latents
        assert float((r["latents"] - want).abs().max()) < TOL, f"rank {r['rank']}"
        # its KV cache holds only its head group and (SP-sharded) its SP index's tokens of every block:
        # [B, slots * t_s, H/tp, D], t_s = the near-equal split of the block's T tokens over sp
        g, s = r["rank"] % p.tp, r["rank"] // p.tp
        assert r["heads"] == (g * p.heads_per_core, (g + 1) * p.heads_per_core)
        cfg = sharded.model_cfg
        t = P.tokens_per_block(cfg)
        t_s = t // p.sp + (s < t % p.sp) if sharded.kv_cache == "sp_sharded" else t
        assert r["cache_shape"] == (1, P.buffer_slots * t_s, cfg.num_heads // p.tp, cfg.head_dim)
    return err, float(want.abs().max())


def _sharded(
    model: CausalWanModel,
    cfg: ModelConfig,
    nb: int,
    switches: dict[int, tuple[torch.Tensor, bool]] | None = None,
    **kw: object,
) -> tuple:
    sharded = ShardedRollingForcingPipeline(model, cfg, P, timeout_s=TIMEOUT_S, **kw)  # type: ignore[arg-type]
    for w, (emb, recache) in (switches or {}).items():
        sharded.set_prompt(emb, recache, window=w)
    chunks = []
    for c in sharded.stream(
        text_embeds(), nb, generator=torch.Generator().manual_seed(7), return_latents=True
    ):
        chunks.append(c)
        if switches:  # the ranks run ahead of the consumer: a switch now cannot be placed exactly
            with pytest.raises(RuntimeError, match="during a running sharded stream"):
                sharded.set_prompt(text_embeds(5), window=c.window + 1)
    return sharded, chunks


@pytest.mark.distributed
def test_2_ranks_merged_stream_equals_unsharded_merged() -> None:
    """Default 2-core plan (TP1 x SP2: the K/V all-gather) and default forward (merged: one 18-frame
    forward per window); 9 blocks: warm-up (padded windows, masked first update), steady windows,
    sink dropped from the update group (block >= 7), the ring wrapping (block 8 reuses slot 1), tail."""
    nb = 9
    model = tiny_model(TINY)
    ref, pipe = _unsharded(model, "absolute", nb, merged=True)
    sharded, chunks = _sharded(model, TINY, nb, cores=2, positions="absolute")
    assert sharded.merged is True  # the reference backend has ops.attention_block_table
    assert (sharded.plan.tp, sharded.plan.sp) == (1, 2)
    err, scale = _check_equal(sharded, chunks, ref)
    print(f"\n{sharded.plan.name} merged: max |sharded - unsharded| = {err:.3g} (|latents| <= {scale:.3g})")
    # static shapes: every forward of a rank has the same input signature (x, timesteps, the rank's
    # token shard, the MergedIndex tensors), like the unsharded merged stream's one; same forward count
    assert len(pipe.stats.signatures) == 1 and pipe.stats.forwards == {"merged": nb + P.window_blocks - 1}
    assert sharded.last_results is not None
    for r in sharded.last_results:
        assert r["forwards"] == dict(pipe.stats.forwards), f"rank {r['rank']}"
        assert _signatures(r) <= len(pipe.stats.signatures), f"rank {r['rank']}: {r['signatures']}"
    # the ranks' token shards differ in size only where the tokens do not divide the ranks (not here)
    sigs = [next(iter(r["signatures"])) for r in sharded.last_results]
    assert sigs[0] == sigs[1]


@pytest.mark.distributed
def test_2_ranks_merged_stream_with_prompt_switches_equals_unsharded() -> None:
    """``set_prompt(embeds, recache, window=w)`` before the sharded stream == the unsharded
    ``set_prompt(embeds, recache)`` after the chunk of window w-1. One stream, two switches: recache off
    at window 6, recache on at window 8 (4 clean blocks re-encoded under the new prompt); TP1 x SP2
    merged, so each switch also runs the old prompt's pending update alone first."""
    nb = 7
    model = tiny_model(TINY)
    switches = {6: (text_embeds(99), False), 8: (text_embeds(98), True)}
    base, _ = _unsharded(model, "absolute", nb, merged=True)
    ref, pipe = _unsharded(model, "absolute", nb, merged=True, switches=switches)
    # the switches change the stream from the first chunk after them, and not before
    first = min(i for i, c in enumerate(ref) if c.window >= 6)
    assert all(torch.equal(a.latents, b.latents) for a, b in zip(base[:first], ref[:first]))
    assert float((base[first].latents - ref[first].latents).abs().max()) > 1e-3
    sharded, chunks = _sharded(model, TINY, nb, switches, cores=2, positions="absolute")
    assert (sharded.plan.tp, sharded.plan.sp) == (1, 2) and sharded.merged is True
    err, scale = _check_equal(sharded, chunks, ref)
    print(f"\n{sharded.plan.name} merged, 2 switches: max |sharded - unsharded| = {err:.3g} (<= {scale:.3g})")
    assert sharded.last_results is not None
    for r in sharded.last_results:
        # the unsharded stream's 3 signatures: merged, the update run alone at a switch, and the
        # re-cache forwards (update-only forwards of the same shapes, counted as "recache")
        assert _signatures(r) <= len(pipe.stats.signatures) == 3, r["signatures"]
        assert r["forwards"] == dict(pipe.stats.forwards)
    # the schedule was consumed by that stream
    assert sharded._prompts == {}


@pytest.mark.distributed
def test_2_ranks_two_pass_stream_equals_unsharded_two_pass() -> None:
    """``merged=False`` stays selectable: TP2 x SP1 (the head all-to-all), two passes per window; with
    a re-caching prompt switch at window 10 (the two-pass switch path: no pending update)."""
    nb = 9
    model = tiny_model(TINY)
    switches = {10: (text_embeds(99), True)}
    ref, _ = _unsharded(model, "absolute", nb, merged=False, switches=switches)
    sharded, chunks = _sharded(model, TINY, nb, switches, cores=2, tp=2, positions="absolute", merged=False)
    assert sharded.merged is False and (sharded.plan.tp, sharded.plan.sp) == (2, 1)
    err, scale = _check_equal(sharded, chunks, ref)
    print(f"\n{sharded.plan.name} two-pass: max |sharded - unsharded| = {err:.3g} (<= {scale:.3g})")


@pytest.mark.distributed
def test_4_ranks_tp2_sp2_odd_token_counts_merged_equals_unsharded() -> None:
    """TP2 x SP2 merged (all-to-all and K/V all-gather, cache replicated within the head group, query
    shards cutting the update block and the window), token counts that do not divide the ranks,
    relative positions (every cached key re-roped from the cache as a copy)."""
    nb = 6
    model = tiny_model(ODD, 3)
    ref, _ = _unsharded(model, "relative", nb, merged=True)
    sharded, chunks = _sharded(model, ODD, nb, cores=4, tp=2, positions="relative")
    assert (sharded.plan.tp, sharded.plan.sp) == (2, 2) and sharded.merged is True
    assert P.tokens_per_block(ODD) % 4 != 0
    err, scale = _check_equal(sharded, chunks, ref)
    assert sharded.last_results is not None
    for r in sharded.last_results:  # shard sizes differ between ranks, each rank's stay fixed
        assert _signatures(r) == 1 and r["forwards"] == {"merged": nb + P.window_blocks - 1}, r["signatures"]
    print(f"\n{sharded.plan.name} (45-token blocks): max |sharded - unsharded| = {err:.3g} (<= {scale:.3g})")


class DyingHead(Head):
    """The model's head, except that rank 1 dies hard (no Python exception) at its 3rd call."""

    calls = 0

    def forward(self, x: torch.Tensor, e: torch.Tensor, frames: int) -> torch.Tensor:
        DyingHead.calls += 1
        if dist.is_initialized() and dist.get_rank() == 1 and DyingHead.calls == 3:
            os._exit(3)
        return super().forward(x, e, frames)


@pytest.mark.distributed
def test_rank_dying_mid_stream_raises_launch_error() -> None:
    model = tiny_model(TINY)
    head = DyingHead(TINY)
    head.load_state_dict(model.head.state_dict())
    model.head = head
    sharded = ShardedRollingForcingPipeline(model, TINY, P, cores=2, tp=2, timeout_s=5.0)
    got = []
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match="rank 1 exited with code 3") as info:
        for chunk in sharded.stream(
            text_embeds(), P.window_blocks, generator=torch.Generator().manual_seed(7)
        ):
            got.append(chunk.block)
    assert info.value.rank == 1
    # one head call per window (merged forward; the update frames skip the head): the 3rd is window
    # 2's, and the first block is final after window 4
    assert got == []
    assert time.monotonic() - t0 < 2 * 5.0 + 30


def test_bad_plans_and_inputs_raise_before_spawning(monkeypatch: pytest.MonkeyPatch) -> None:
    micro = get_preset("micro")  # 4 tokens per frame, 12 per block
    with pytest.raises(ValueError, match="needs at least one token per rank"):
        pipeline_plan(micro, P, 16)  # TP4 x SP4 exists, but a 12-token block cannot feed 16 ranks
    with pytest.raises(ValueError, match="num_cores"):
        pipeline_plan(TINY, P, 0)
    with pytest.raises(ValueError, match="illegal|group size|balanced"):
        pipeline_plan(TINY, P, 3)  # 3 ranks: not a legal Neuron collective group size
    model = tiny_model(TINY)
    with pytest.raises(ValueError, match="positions"):
        ShardedRollingForcingPipeline(model, TINY, P, cores=2, positions="sideways")
    with pytest.raises(TypeError, match="merged must be a bool"):
        ShardedRollingForcingPipeline(model, TINY, P, cores=2, merged="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="compile= applies to Rolling Forcing's merged forward only"):
        ShardedRollingForcingPipeline(model, TINY, P, cores=2, compile=True, merged=False)
    with pytest.raises(ValueError, match="compile= applies to Rolling Forcing's merged forward only"):
        ShardedRollingForcingPipeline(model, TINY, P, cores=2, compile=True, method="self-forcing")
    with monkeypatch.context() as m:  # a backend without the block-table attention: two-pass default
        # the mode rule of every stream lives in rolling_forcing.driver.resolve_update_mode
        m.setattr(rolling_forcing.driver.ops, "has_kernel", lambda op, backend=None: False)
        assert ShardedRollingForcingPipeline(model, TINY, P, cores=2).merged is False
        with pytest.raises(NotImplementedError, match="attention_block_table"):
            ShardedRollingForcingPipeline(model, TINY, P, cores=2, merged=True)
    sharded = ShardedRollingForcingPipeline(model, TINY, P, cores=2)

    def no_launch(*args: object, **kwargs: object) -> None:
        raise AssertionError("ranks were launched for a stream the caller should have rejected")

    monkeypatch.setattr(sharding.pipeline, "launch", no_launch)  # rejected in the caller, no ranks spawned
    with pytest.raises(ValueError, match="window_blocks"):
        next(sharded.stream(text_embeds(), P.window_blocks - 1))
    with pytest.raises(ValueError, match="text embeddings"):
        next(sharded.stream(torch.zeros(1, TINY.text_len, TINY.text_dim + 1), P.window_blocks))
    # prompt switch schedule: bad arguments at set_prompt, a window past the stream or a batch that
    # differs from the stream's at stream(), before any rank is spawned
    with pytest.raises(TypeError, match="window must be an int"):
        sharded.set_prompt(text_embeds(), window=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="window must be >= 0"):
        sharded.set_prompt(text_embeds(), window=-1)
    with pytest.raises(TypeError, match="recache must be a bool"):
        sharded.set_prompt(text_embeds(), "yes", window=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="text embeddings"):
        sharded.set_prompt(torch.zeros(1, 3), window=1)
    with pytest.raises(
        NotImplementedError, match="restart=True: the sharded stream has no restarting switch"
    ):
        sharded.set_prompt(text_embeds(), window=1, restart=True)
    nw = P.window_blocks + P.window_blocks - 1  # windows of a window_blocks-block stream
    sharded.set_prompt(text_embeds(), window=nw)
    with pytest.raises(ValueError, match=f"window={nw} is outside the stream's windows"):
        next(sharded.stream(text_embeds(), P.window_blocks))
    sharded.set_prompt(torch.cat([text_embeds(), text_embeds()]), window=1)
    with pytest.raises(ValueError, match="batch 2 != stream batch 1"):
        next(sharded.stream(text_embeds(), P.window_blocks))


@pytest.mark.distributed
def test_cli_generate_cores_2_writes_the_same_video(tmp_path) -> None:
    """``rolling-forcing generate --cores 2``: rank 0's chunks reach the parent, which writes the video
    and the measured report; merged by default like ``--cores 1``, ``--two-pass`` selectable; the frames
    equal the unsharded run's (latents within 1.5e-6 of each other, so a uint8 pixel can flip by at
    most 1 at a rounding boundary)."""
    from typer.testing import CliRunner

    from nki_ardiff.cli import app
    from rolling_forcing.video import read_video

    videos, reports = [], []
    for cores, flags in ((1, []), (2, []), (2, ["--two-pass"])):
        out, rep = tmp_path / f"c{cores}{len(flags)}.mp4", tmp_path / f"c{cores}{len(flags)}.json"
        args = ["generate", "--preset", "tiny", "--blocks", str(P.window_blocks), "--seed", "3"]
        args += ["--out", str(out), "--report-json", str(rep), "--no-progress", "--no-warmup", *flags]
        res = CliRunner().invoke(app, [*args, "--cores", str(cores)])
        assert res.exit_code == 0, res.output
        if cores == 2:  # the layout `rolling-forcing plan --cores 2` prints for the tiny preset
            assert "plan TP1xSP2" in res.output
        videos.append(read_video(out).astype("int16"))
        reports.append(json.loads(rep.read_text()))
    assert videos[0].shape == videos[1].shape == videos[2].shape and videos[0].std() > 1.0
    assert int(abs(videos[0] - videos[1]).max()) <= 1 and int(abs(videos[0] - videos[2]).max()) <= 1
    assert [r["meta"]["merged"] for r in reports] == [True, True, False]
    sharded = reports[1]
    assert sharded["summary"]["kind"] == "measured" and sharded["summary"]["chunks"] == P.window_blocks
    assert sharded["meta"]["cores"] == 2 and "--cores 2" in sharded["meta"]["command"]
    assert "--two-pass" in reports[2]["meta"]["command"]
