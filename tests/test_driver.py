"""The one stream driver (``rolling_forcing.driver``): its pure helpers, its call order, and the two
streams that run on it.

* ``kept_clean_blocks`` against a replay of the ring (which blocks each slot holds after the update of
  block s); ``recache_passes`` against the update pass of the window that first cached each block;
  ``merged_input`` against its layout written out by hand.
* The call order of every update mode, seen through a recording ``StreamPasses`` (flows of zeros):
  which forwards run, with which held update, where a prompt switch flushes it, that the last call's
  update is never run, and which clean blocks are remembered for a re-cache.
* The unsharded stream and the 1-rank sharded stream (one spawned gloo rank, TP1 x SP1: every tensor of
  the stream has the unsharded shapes) run the same driver, so they must give **bitwise** equal chunks
  (``torch.equal``, no tolerance), with prompt switches and both re-cache kinds.
"""

from __future__ import annotations

import pytest
import torch

from rolling_forcing import schedule
from rolling_forcing.config import PipelineConfig
from rolling_forcing.driver import (
    DriverSpec,
    HeldUpdate,
    Plan,
    StreamDriver,
    UpdateMode,
    merged_input,
    num_calls,
)
from rolling_forcing.methods import get_method
from rolling_forcing.pipeline import RollingForcingPipeline
from rolling_forcing.schedule import WritePass
from rolling_forcing.sequential import RecachePlan
from rolling_forcing.stream import StreamState
from sharding.pipeline import ShardedRollingForcingPipeline
from tests.pipeline_helpers import TINY, text_embeds, tiny_model
from tests.pipeline_helpers import one_thread as one_thread  # autouse: one intra-op thread

P = PipelineConfig()
TIMEOUT_S = 20.0


# ---- pure helpers -------------------------------------------------------------------------------------
def _ring_replay(cfg: PipelineConfig, s: int) -> set[int]:
    """Blocks still held by a slot after blocks 0..s were written in order (a slot keeps its last writer)."""
    holder: dict[int, int] = {}
    for b in range(s + 1):
        holder[schedule.slot_of(cfg, b)] = b
    return set(holder.values())


@pytest.mark.parametrize("s", [0, 1, 5, 7, 8, 13, 40])
def test_kept_clean_blocks_are_the_blocks_still_cached(s: int) -> None:
    assert schedule.kept_clean_blocks(P, s) == _ring_replay(P, s)


def test_recache_passes_repeat_each_blocks_update_without_evicted_keys() -> None:
    nb, s = 14, 10
    present = sorted(_ring_replay(P, s))
    passes = schedule.recache_passes(P, nb, present, "absolute")
    assert [w.block for w in passes] == present  # oldest first, one per block
    for w in passes:
        upd = schedule.window_plan(P, nb, w.block + P.window_blocks - 1, "absolute")
        assert upd.start_block == w.block  # the window whose update pass first cached it
        assert (w.slot, w.store_roped) == (upd.write_slot, upd.store_roped)
        assert w.pass_.query_position == upd.update.query_position
        assert all(k.block in present for k in w.pass_.cache_keys)  # nothing evicted is read
        assert [k for k in upd.update.cache_keys if k.block in present] == list(w.pass_.cache_keys)
        assert w.pass_.cache_keys[-1].block == w.block  # itself, read back after the write


def test_merged_input_layout() -> None:
    g = torch.Generator().manual_seed(0)
    held = torch.randn(2, 3, 4, 2, 2, generator=g)
    x_win = torch.randn(2, 6, 4, 2, 2, generator=g)
    t_win = torch.tensor([[900.0] * 3 + [500.0] * 3] * 2)
    x, t = merged_input(held, x_win, t_win, 3, 12, 0)
    assert x.shape == (2, 12, 4, 2, 2) and t.dtype == torch.float32
    assert torch.equal(x[:, :3], held) and torch.equal(x[:, 3:9], x_win)
    assert not x[:, 9:].any()
    assert t[0].tolist() == [0.0] * 3 + [900.0] * 3 + [500.0] * 3 + [0.0] * 3
    xm, _ = merged_input(None, x_win, t_win, 3, 9, 0)  # masked update, no padding
    assert xm.shape[1] == 9 and not xm[:, :3].any() and torch.equal(xm[:, 3:], x_win)
    with pytest.raises(ValueError, match="frames=8 must hold the update block"):
        merged_input(held, x_win, t_win, 3, 8, 0)


def test_driver_spec_refuses_inconsistent_modes() -> None:
    rf = get_method("rolling-forcing")
    with pytest.raises(ValueError, match="merged_frames must be > 0 exactly for UpdateMode.MERGED"):
        DriverSpec(rf, P, "absolute", UpdateMode.MERGED)
    with pytest.raises(ValueError, match="merged_frames must be > 0 exactly"):
        DriverSpec(rf, P, "absolute", UpdateMode.TWO_PASS, 18)
    with pytest.raises(ValueError, match="positions must be one of"):
        DriverSpec(rf, P, "sideways", UpdateMode.TWO_PASS)


# ---- the driver's call order --------------------------------------------------------------------------
class _Recorder:
    """StreamPasses that records each call and predicts zero flow."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def denoise_pass(self, st: StreamState, plan: Plan, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        self.calls.append(("denoise", plan.index))
        return torch.zeros_like(x)

    def merged_pass(
        self, st: StreamState, plan: Plan, held: HeldUpdate | None, x: torch.Tensor, t: torch.Tensor
    ) -> torch.Tensor:
        self.calls.append(("merged", plan.index, None if held is None else held.plan.index, x.shape[1]))
        return torch.zeros_like(x[:, 3:])

    def update_pass(
        self, st: StreamState, write: WritePass, x: torch.Tensor, t: torch.Tensor, kind: str
    ) -> None:
        self.calls.append((kind, write.block, x.shape[1]))

    def recache_pass(self, st: StreamState, rp: RecachePlan, x: torch.Tensor, t: torch.Tensor) -> None:
        self.calls.append(("recache", rp.blocks, x.shape[1]))


def _drive(method: str, mode: UpdateMode, nb: int, switch: dict[int, bool], frames: int = 0):
    model = tiny_model(TINY)
    meth = get_method(method)
    spec = DriverSpec(meth, P, "relative", mode, frames)
    rec = _Recorder()
    drv = StreamDriver(model, spec, rec)
    st = drv.start(TINY, text_embeds(), nb)
    sw = {w: (text_embeds(9), rc) for w, rc in switch.items()}
    chunks = list(drv.run(st, lambda p: sw.get(p.index)))
    return rec.calls, chunks, st


def test_driver_merged_mode_holds_each_update_and_flushes_it_at_a_switch() -> None:
    nb = 6
    calls, chunks, st = _drive("rolling-forcing", UpdateMode.MERGED, nb, {7: True}, frames=18)
    nw = num_calls(get_method("rolling-forcing"), P, nb)
    merged = [c for c in calls if c[0] == "merged"]
    assert [c[1] for c in merged] == list(range(nw)) and all(c[3] == 18 for c in merged)
    # each call carries the previous call's update, except the first and the one after the switch
    assert [c[2] for c in merged] == [None, *range(6), None, *range(7, nw - 1)]
    i = calls.index(("merged", 7, None, 18))
    # before window 7: window 6's update alone, then one re-cache pass per clean block still cached
    present = sorted(schedule.kept_clean_blocks(P, 2))  # window 6 updates block 6 - 4 = 2
    assert calls[i - 1 - len(present) : i] == [("update", 2, 3)] + [("recache", b, 3) for b in present]
    assert [c.block for c in chunks] == list(range(nb)) and chunks[-1].last
    # the last window's update never runs: the last block remembered is the one carried by the last call
    assert max(st.clean) == nw - 2 - (P.window_blocks - 1)


def test_driver_two_pass_and_batched_modes() -> None:
    nb, steps = 3, get_method("longlive").steps
    calls, _, _ = _drive("longlive", UpdateMode.TWO_PASS, nb, {2 * steps: True})
    want = []
    for b in range(nb):
        if b == 2:
            want.append(("recache", (0, 1), 6))
        want += [("denoise", b * steps + i) for i in range(steps)] + [("update", b, 3)]
    assert calls == want
    calls, _, _ = _drive("longlive", UpdateMode.BATCHED, nb, {2 * steps: False})
    # block 1's first call carries the update of block 0's last call; block 1's update runs alone
    # before the switch; block 2's (the last) never runs
    assert [c for c in calls if c[0] != "denoise"] == [("merged", steps, steps - 1, 6), ("update", 1, 3)]
    assert len([c for c in calls if c[0] == "denoise"]) == nb * steps - 1


# ---- the unsharded and the 1-rank sharded stream: one driver, bitwise equal chunks -----------------------
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("method", "merged", "nb", "switches"),
    [
        ("rolling-forcing", True, 8, {5: False, 7: True}),  # windows (a chunk ends window 4 on)
        ("longlive", False, 6, {4: True}),  # switches at block starts (window = block x steps)
    ],
)
def test_unsharded_and_1_rank_sharded_streams_are_bitwise_equal(
    method: str, merged: bool, nb: int, switches: dict[int, bool]
) -> None:
    model = tiny_model(TINY)
    steps = get_method(method).steps
    at = {(b * steps if method != "rolling-forcing" else b): rc for b, rc in switches.items()}
    pipe = RollingForcingPipeline(model, TINY, P, method=method, merged=merged)
    ref = []
    for c in pipe.stream(text_embeds(), nb, generator=torch.Generator().manual_seed(7)):
        ref.append(c)
        nxt = (c.block + 1) * steps if method != "rolling-forcing" else c.window + 1
        if nxt in at:
            pipe.set_prompt(text_embeds(90 + nxt), recache=at[nxt])
    sh = ShardedRollingForcingPipeline(
        model, TINY, P, cores=1, method=method, merged=merged, timeout_s=TIMEOUT_S
    )
    for w, rc in at.items():
        sh.set_prompt(text_embeds(90 + w), rc, window=w)
    got = list(sh.stream(text_embeds(), nb, generator=torch.Generator().manual_seed(7)))
    assert [(c.block, c.window, c.last) for c in got] == [(c.block, c.window, c.last) for c in ref]
    assert all(torch.equal(a.latents, b.latents) for a, b in zip(got, ref))
    assert float(torch.cat([c.latents for c in ref], 1).abs().max()) > 0.1  # a non-trivial stream
    # the same forwards by kind (the sharded counts are the rank's)
    assert sh.last_results is not None
    assert sh.last_results[0]["forwards"] == dict(pipe.stats.forwards)
    assert pipe.stats.forwards["recache"] > 0
