"""Cache bookkeeping of rolling_forcing.schedule against the worked per-window trace of the original
(github.com/TencentARC/RollingForcing @ a1477d0, ``pipeline/rolling_forcing_inference.py``).

Two independent checks: (1) the trace table rows, written out by hand; (2) a transliteration of the
original's contiguous-buffer bookkeeping (global/local end indices, placeholder write, eviction by
shifting) in frame units, compared for every window of streams of many lengths (hypothesis).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rolling_forcing.cache import RollingKVCache
from rolling_forcing.config import PipelineConfig, get_preset
from rolling_forcing.schedule import num_windows, segments, slot_of, window_plan, window_range

P = PipelineConfig()
NB = 20


def _denoise(w: int, nb: int = NB, mode: str = "absolute") -> list[tuple[int, int]]:
    plan = window_plan(P, nb, w, mode)
    return [(k.block, k.position) for k in plan.denoise.cache_keys]


def _update(w: int, nb: int = NB, mode: str = "absolute") -> list[tuple[int, int]]:
    plan = window_plan(P, nb, w, mode)
    return [(k.block, k.position) for k in plan.update.cache_keys]


def test_warmup_windows_attend_within_the_window_only() -> None:
    for w in range(5):
        plan = window_plan(P, NB, w)
        assert plan.kind == ("full" if w == 4 else "warmup")
        assert plan.blocks == tuple(range(w + 1))
        assert plan.levels == tuple(range(w, -1, -1))  # the last w+1 levels
        assert plan.denoise.cache_keys == () and plan.denoise.query_position == 0
        assert _update(w) == [(0, 0)]  # block 0 only, in slot 0, un-roped
        assert plan.write_slot == 0 and not plan.store_roped
        assert plan.fresh_block == w
    assert window_plan(P, NB, 4).finished_block == 0
    assert all(window_plan(P, NB, w).finished_block is None for w in range(4))


def test_window_5_sink_plus_window() -> None:
    plan = window_plan(P, NB, 5)
    assert _denoise(5) == [(0, 0)] and plan.denoise.query_position == 3
    assert plan.denoise.key_frames(3) == 18
    assert _update(5) == [(0, 0), (1, 3)]


def test_windows_6_7_10_11() -> None:
    assert _denoise(6) == [(0, 0), (1, 3)] and window_plan(P, NB, 6).denoise.query_position == 6
    assert _update(6) == [(0, 0), (1, 3), (2, 6)]
    assert _denoise(7) == [(0, 3), (2, 6)] and window_plan(P, NB, 7).denoise.query_position == 9
    assert _update(7) == [(b, 3 * b) for b in range(4)]
    assert _denoise(10) == [(0, 12), (5, 15)] and window_plan(P, NB, 10).denoise.query_position == 18
    assert _update(10) == [(b, 3 * b) for b in range(7)]  # sink @0, b1..b6: 21 frames
    assert _denoise(11) == [(0, 15), (6, 18)] and window_plan(P, NB, 11).denoise.query_position == 21
    assert _update(11) == [(b, 3 * b) for b in range(1, 8)]  # b1..b7, no sink
    for w in (6, 7, 10, 11):
        assert window_plan(P, NB, w).denoise.key_frames(3) == 21


def test_tail_windows_grow_the_working_cache() -> None:
    for i, w in enumerate(range(NB, NB + 4)):
        plan = window_plan(P, NB, w)
        s = w - 4
        assert plan.kind == "tail" and plan.fresh_block is None
        assert plan.levels == tuple(range(4, i, -1))  # the first n levels
        working = [b for b, _ in _denoise(w)[1:]]
        assert working == list(range(s - (2 + i), s))  # 2, 3, 4, 5 blocks
        assert _denoise(w)[0] == (0, 3 * s - 3 * len(working) - 3)
        assert plan.denoise.key_frames(3) == 21
        assert [b for b, _ in _update(w)] == list(range(s - 6, s + 1))  # last 7 blocks


def test_ring_slots_and_wrapping_segments() -> None:
    assert [slot_of(P, b) for b in range(17)] == [0] + [1 + (b - 1) % 7 for b in range(1, 17)]
    plan = window_plan(P, 12, 15)  # last tail window: working cache b6..b10 -> slots 6, 7, 1, 2, 3
    t = 10
    assert [k.slot for k in plan.denoise.cache_keys] == [0, 6, 7, 1, 2, 3]
    assert segments(plan.denoise.cache_keys, t) == [(0, 10), (60, 20), (10, 30)]


def test_relative_positions_have_the_same_offsets_and_stay_small() -> None:
    for w in range(num_windows(P, NB)):
        for pass_name in ("denoise", "update"):
            a = getattr(window_plan(P, NB, w, "absolute"), pass_name)
            r = getattr(window_plan(P, NB, w, "relative"), pass_name)
            assert [k.block for k in a.cache_keys] == [k.block for k in r.cache_keys]
            off_a = [a.query_position - k.position for k in a.cache_keys]
            off_r = [r.query_position - k.position for k in r.cache_keys]
            assert off_a == off_r
            assert not any(k.roped_in_cache for k in r.cache_keys)
            top = r.query_position + len(r.query_blocks) * 3
            assert top <= P.key_budget_frames


def _original_trace(
    nb: int, steps: int = 5
) -> list[tuple[list[tuple[int, int]] | None, list[tuple[int, int]]]]:
    """The original's bookkeeping in frame units: per window (denoise keys or None, update keys).

    Transliterated from the description of CausalWanSelfAttention.forward (kv-cache branch): buffer of
    24 frames, max attention 21 frames (constants of the original, whatever the step list), sink = first
    3 frames, placeholder write + index advance in the denoise pass, overwrite without advance in the
    update pass, eviction by shifting left; a window of ``steps`` blocks.
    """
    fpb, buf, max_att, sink = 3, 24, 21, 3
    content: list[int | None] = [None] * (buf // fpb)  # block id stored per 3-frame slot
    g_end = l_end = 0
    out = []
    for w in range(nb + steps - 1):
        s, e = max(0, w - steps + 1), min(nb - 1, w)
        start, qf = s * fpb, (e - s + 1) * fpb
        results = []
        for updating in (False, True):
            cache_end = start + fpb
            new = cache_end - g_end
            if new > 0 and new + l_end > buf:
                ev = new + l_end - buf
                rolled = l_end - ev - sink
                k0, ke, kr = sink // fpb, ev // fpb, rolled // fpb
                content[k0 : k0 + kr] = content[k0 + ke : k0 + ke + kr]
                new_l = l_end + cache_end - g_end - ev
            else:
                new_l = l_end + cache_end - g_end
            ls = new_l - fpb
            content[ls // fpb] = s
            if new > 0:
                g_end, l_end = cache_end, new_l
            if ls == 0:
                results.append(None if not updating else [(s, start)])
            elif updating:
                lo = max(0, new_l - max_att)
                keys = [(content[i], 3 * content[i]) for i in range(lo // fpb, new_l // fpb)]  # type: ignore[operator]
                results.append(keys)
            else:
                wcm = max_att - qf - sink
                lo = max(sink, ls - wcm)
                wc = [content[i] for i in range(lo // fpb, ls // fpb)]
                results.append([(0, start - len(wc) * fpb - 3)] + [(b, 3 * b) for b in wc])  # type: ignore[operator]
        out.append((results[0], results[1]))  # type: ignore[arg-type]
    return out


@given(st.integers(5, 45))
def test_schedule_equals_original_bookkeeping(nb: int) -> None:
    trace = _original_trace(nb)
    ring: dict[int, int] = {}
    for w, (den, upd) in enumerate(trace):
        plan = window_plan(P, nb, w)
        assert _denoise(w, nb) == (den or []), (w, _denoise(w, nb), den)
        assert _update(w, nb) == upd, (w, _update(w, nb), upd)
        # the ring really holds the blocks the schedule reads, at read time
        for k in plan.denoise.cache_keys:
            assert ring[k.slot] == k.block
        ring[plan.write_slot] = window_range(P, nb, w)[0]
        for k in plan.update.cache_keys:
            assert ring[k.slot] == k.block


STEP_LISTS = {3: (1000, 666, 333), 4: (1000, 750, 500, 250), 6: (1000, 833, 666, 500, 333, 166)}


@given(st.sampled_from(sorted(STEP_LISTS)), st.integers(0, 30))
def test_other_step_lists_follow_the_original_bookkeeping(steps: int, extra: int) -> None:
    """With 3, 4 or 6 steps the default config keeps the original's 21-frame budget: every window's keys
    (denoise and update) are the original's (a working cache of 3, 2 or 0 blocks in steady state)."""
    p = PipelineConfig(window_blocks=steps, denoising_steps=STEP_LISTS[steps])
    nb = steps + extra
    for w, (den, upd) in enumerate(_original_trace(nb, steps)):
        plan = window_plan(p, nb, w)
        assert [(k.block, k.position) for k in plan.denoise.cache_keys] == (den or []), (w, den)
        assert [(k.block, k.position) for k in plan.update.cache_keys] == upd, (w, upd)


def test_rolling_kv_cache_slots_views_and_reset() -> None:
    """The buffers behind the schedule: a written slot reads back through its k and v views, other slots
    stay untouched, and reset zeroes k and v of every layer and drops the text cache."""
    m, p = get_preset("tiny"), PipelineConfig()
    cache = RollingKVCache(m, p, batch=2, dtype=torch.float32)
    t = p.tokens_per_block(m)
    assert len(cache.layers) == m.num_layers and cache.layers[0].num_slots == p.buffer_slots
    assert cache.nbytes == m.num_layers * 2 * 2 * p.buffer_tokens(m) * m.num_heads * m.head_dim * 4
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, t, m.num_heads, m.head_dim, generator=g) for _ in range(2))
    layer = cache.layers[1]
    layer.write(2, k, v, backend="reference")
    bk, bv = layer.block(2)
    assert torch.equal(bk, k) and torch.equal(bv, v)
    assert not layer.k[:, : 2 * t].any() and not layer.v[:, 3 * t :].any()
    with pytest.raises(ValueError, match="slot must be in"):
        layer.write(p.buffer_slots, k, v, backend="reference")
    cache.set_text([(k, v)] * m.num_layers)
    cache.reset()
    assert all(not la.k.any() and not la.v.any() for la in cache.layers)
    with pytest.raises(RuntimeError, match="call set_text first"):
        cache.text_kv()
