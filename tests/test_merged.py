"""Merged forward (update(w-1) + denoise(w) in one static-shape forward) vs the two-pass stream.

Also the static-shape ops it needs (``ops.attention_block_table``, ``ops.rope3d_positions``,
``ops.kv_cache_write_at``) against independent references, and one ``torch.compile(fullgraph=True)``
stream of 30 s of video (tiny preset) with no graph break and no recompilation.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nki_kernels import ops
from reference.attention import attention
from reference.kv_cache import kv_cache_write
from reference.rope3d import rope3d
from rolling_forcing import schedule
from rolling_forcing.config import PipelineConfig, get_preset
from rolling_forcing.merged import (
    EMPTY,
    SRC_COPY,
    SRC_FRESH,
    SRC_RING,
    MergedIndex,
    MergedLayout,
    merged_step,
)
from rolling_forcing.model import CausalWanModel
from rolling_forcing.pipeline import RollingForcingPipeline
from rolling_forcing.video import VideoSpec
from tests import numerics
from tests.pipeline_helpers import one_thread as one_thread  # autouse: one intra-op thread
from tests.pipeline_helpers import text_embeds, tiny_model

M = get_preset("tiny")
P = PipelineConfig()
# 12 blocks: warm-up, steady windows, the sink leaving the update pass (block 7), a ring wrap (block 8
# re-uses slot 1: tail working caches split into two ring segments) and the 4 tail windows
NB = 12
FP32_TOL = numerics.FP32_ISSUE_BOUND  # the fp32 equivalence bound (measured ~2e-6: reordered fp32 sums)


@pytest.fixture(scope="module")
def model() -> CausalWanModel:
    return tiny_model(M)


def _run(pipe: RollingForcingPipeline, nb: int = NB, switch_at: int | None = None, recache: bool = False):
    out = []
    dtype = pipe.pipe_cfg.torch_dtype
    for c in pipe.stream(text_embeds(dtype=dtype), nb, generator=torch.Generator().manual_seed(7)):
        out.append(c)
        if switch_at is not None and c.block == switch_at:
            pipe.set_prompt(text_embeds(99, dtype), recache=recache)
    return out


def _cat(chunks: list) -> torch.Tensor:
    return torch.cat([c.latents for c in chunks], dim=1).float()


# ---- equivalence ------------------------------------------------------------------------------


@pytest.mark.parametrize("positions", ["absolute", "relative"])
def test_merged_equals_two_pass_fp32(model: CausalWanModel, positions: str) -> None:
    two = RollingForcingPipeline(model, M, P, positions=positions, merged=False)
    one = RollingForcingPipeline(model, M, P, positions=positions, merged=True)
    a, b = _run(two), _run(one)
    assert [c.block for c in b] == [c.block for c in a] == list(range(NB))
    assert [c.window for c in b] == [c.window for c in a]
    err = float((_cat(a) - _cat(b)).abs().max())
    assert err < FP32_TOL, err
    assert float(_cat(a).abs().max()) > 0.1  # non-trivial output
    # one forward per window vs two; one input signature for the whole stream
    nw = schedule.num_windows(P, NB)
    assert one.stats.forwards == {"merged": nw}
    assert two.stats.forwards == {"denoise": nw, "update": nw}
    assert len(one.stats.signatures) == 1


@pytest.mark.parametrize("recache", [False, True])
def test_merged_prompt_switch_equals_two_pass(model: CausalWanModel, recache: bool) -> None:
    # the update pending at the switch belongs to the old prompt: merged mode runs it alone first
    two = RollingForcingPipeline(model, M, P, merged=False)
    a = _run(two, 9, switch_at=2, recache=recache)
    one = RollingForcingPipeline(model, M, P, merged=True)
    b = _run(one, 9, switch_at=2, recache=recache)
    assert float((_cat(a) - _cat(b)).abs().max()) < FP32_TOL
    assert one.stats.forwards["update"] == 1  # the flushed update: a second signature, only at the switch
    # the re-cache passes (one per clean block still cached) are the same in both modes, and counted
    n_re = two.stats.forwards.get("recache", 0)
    assert one.stats.forwards.get("recache", 0) == n_re and (n_re > 0) == recache
    assert len(one.stats.signatures) == 2 + int(recache)


def test_merged_bf16_within_tolerance(model: CausalWanModel) -> None:
    """bf16 merged vs the fp32 two-pass baseline within K x (bf16 two-pass's own error) + bf16 floor."""
    nb = 8
    base = _cat(_run(RollingForcingPipeline(model, M, P, merged=False), nb))
    m16 = tiny_model(M).to(torch.bfloat16)
    p16 = PipelineConfig(dtype="bfloat16")
    two16 = _cat(_run(RollingForcingPipeline(m16, M, p16, merged=False), nb))
    one16 = _cat(_run(RollingForcingPipeline(m16, M, p16, merged=True), nb))
    ref_err = numerics.max_abs_err(two16, base)
    assert ref_err > 0  # bf16 really differs from fp32 (else the tolerance below says nothing)
    numerics.assert_within(one16, base, torch.bfloat16, ref_err, "bf16 merged stream vs fp32 two-pass")


# ---- static shapes and compilation ------------------------------------------------------------


def test_compiled_30s_stream_one_graph_no_recompile(model: CausalWanModel) -> None:
    import torch._dynamo
    from torch._dynamo.utils import counters

    nb = VideoSpec().blocks_for_seconds(30.0, P.frames_per_block)  # >= 30 s x 16 fps of causal video
    assert nb * P.frames_per_block * VideoSpec().temporal_stride >= 30 * VideoSpec().fps
    compiles: list[int] = []

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        compiles.append(len(gm.graph.nodes))
        return gm.forward  # run the captured graph as is (the test is about capture, not codegen speed)

    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        pipe = RollingForcingPipeline(model, M, P, merged=True, compile=counting_backend)
        chunks = _run(pipe, nb)
    assert len(compiles) == 1, compiles
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert not counters["recompiles"], dict(counters["recompiles"])
    assert len(pipe.stats.signatures) == 1 and pipe.stats.total == schedule.num_windows(P, nb)
    two = _cat(_run(RollingForcingPipeline(model, M, P, merged=False), nb))
    assert float((_cat(chunks) - two).abs().max()) < FP32_TOL


@settings(max_examples=25, deadline=None)
@given(nb=st.integers(P.window_blocks, 60), positions=st.sampled_from(["absolute", "relative"]))
def test_merged_steps_static_and_complete(nb: int, positions: str) -> None:
    """Per window: same tensor shapes; the denoise group has exactly its window's fresh blocks (never a
    padded one) plus the two-pass denoise keys; the update group has the two-pass update keys of w-1."""
    lay = MergedLayout.from_configs(M, P, positions)
    shapes = set()
    for w in range(schedule.num_windows(P, nb)):
        step = merged_step(P, lay, nb, w, positions, w - 1 if w else None)
        idx = MergedIndex.from_step(step, lay)
        shapes.add(tuple(tuple(t.shape) for t in idx.tensors()))
        plan = schedule.window_plan(P, nb, w, positions)
        upd, den = step.table

        def keys(entries: tuple, copies: tuple = step.copies) -> list[tuple[int, int]]:
            out = []
            for src, blk in entries:
                if src == SRC_RING:
                    out.append((blk, -1))  # roped in the ring: slot, position baked in
                elif src == SRC_COPY:
                    out.append(copies[blk])  # (slot, position)
            return out

        fresh = [blk for src, blk in den if src == SRC_FRESH]
        assert fresh == list(range(1, plan.num_blocks + 1))
        exp_den = [(k.slot, -1 if k.roped_in_cache else k.position) for k in plan.denoise.cache_keys]
        assert keys(den) == exp_den
        assert step.window_frames == plan.num_blocks * P.frames_per_block
        if w == 0:
            assert not step.write_valid and all(src == EMPTY for src, _ in upd)
            continue
        prev = schedule.window_plan(P, nb, w - 1, positions)
        exp_upd = [(k.slot, -1 if k.roped_in_cache else k.position) for k in prev.update.cache_keys]
        assert keys(upd) == exp_upd
        assert step.write_valid and step.write_slot == prev.write_slot
        assert step.update_block == prev.start_block
        # the update block is among its own keys and is written before anything reads it
        assert prev.write_slot in [s for s, _ in keys(upd)]
    assert len(shapes) == 1


def test_merged_step_rejects_other_update_window() -> None:
    lay = MergedLayout.from_configs(M, P, "absolute")
    with pytest.raises(ValueError, match="update_window must be window - 1"):
        merged_step(P, lay, NB, 6, "absolute", 4)


def test_pipeline_merged_flags(model: CausalWanModel) -> None:
    assert RollingForcingPipeline(model, M, P).merged is True  # default on the reference backend
    assert RollingForcingPipeline(model, M, P, merged=False).merged is False
    with pytest.raises(TypeError, match="merged must be a bool"):
        RollingForcingPipeline(model, M, P, merged="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="compile= applies to the merged forward only"):
        RollingForcingPipeline(model, M, P, merged=False, compile=True)
    if not ops.has_kernel("attention_block_table", "emulator"):
        # no NKI block-table kernel yet: default is two-pass, explicit merged=True says why it cannot
        assert RollingForcingPipeline(model, M, P, backend="emulator").merged is False
        with pytest.raises(NotImplementedError, match="backend='emulator'"):
            RollingForcingPipeline(model, M, P, backend="emulator", merged=True)


# ---- the static-shape ops ---------------------------------------------------------------------


def _qkv(seed: int, b: int = 2, h: int = 3, d: int = 16, t: int = 5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, 3 * t, h, d, generator=g)
    srcs = [torch.randn(b, n * t, h, d, generator=g) for n in (4, 2)]
    vals = [torch.randn(b, n * t, h, d, generator=g) for n in (4, 2)]
    return q, srcs, vals, t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_block_table_equals_attention_on_gathered_keys(dtype: torch.dtype) -> None:
    q, srcs, vals, t = _qkv(0)
    q, srcs, vals = q.to(dtype), [s.to(dtype) for s in srcs], [v.to(dtype) for v in vals]
    table = torch.tensor([[[0, 3], [1, 1], [-1, 0], [0, 0]], [[1, 0], [-1, 0], [0, 2], [0, 1]]])
    out, lse = ops.attention_block_table(q, srcs, vals, table, [t, 2 * t], t, return_lse=True)
    for g, (lo, hi) in enumerate([(0, t), (t, 3 * t)]):
        ents = [(s, b) for s, b in table[g].tolist() if s >= 0]
        k = torch.cat([srcs[s][:, b * t : (b + 1) * t] for s, b in ents], dim=1)
        v = torch.cat([vals[s][:, b * t : (b + 1) * t] for s, b in ents], dim=1)
        ro, rl = attention(q[:, lo:hi], k, v, return_lse=True)
        assert torch.equal(out[:, lo:hi], ro)  # same reference arithmetic after the gather
        assert torch.equal(lse[:, lo:hi], rl)


def test_attention_block_table_empty_group_and_scale() -> None:
    q, srcs, vals, t = _qkv(1)
    table = torch.tensor([[[-1, 0]], [[0, 1]]])
    out, lse = ops.attention_block_table(q, srcs, vals, table, [t, 2 * t], t, scale=0.3, return_lse=True)
    assert torch.equal(out[:, :t], torch.zeros_like(out[:, :t])) and bool((lse[:, :t] == -torch.inf).all())
    ref = attention(q[:, t:], srcs[0][:, t : 2 * t], vals[0][:, t : 2 * t], scale=0.3)
    assert torch.equal(out[:, t:], ref)


def test_attention_block_table_errors() -> None:
    q, srcs, vals, t = _qkv(2)
    ok = torch.tensor([[[0, 0]], [[1, 1]]])

    def call(**kw: object) -> object:
        args: dict[str, object] = dict(
            q=q, k_sources=srcs, v_sources=vals, block_table=ok, q_groups=[t, 2 * t]
        )
        args.update(kw)
        return ops.attention_block_table(block_tokens=t, **args)  # type: ignore[arg-type]

    with pytest.raises(ValueError, match=r"block_table\[1, 0\] source=2"):
        call(block_table=torch.tensor([[[0, 0]], [[2, 0]]]))
    with pytest.raises(ValueError, match=r"block_table\[0, 0\] block=4 is out of source 0"):
        call(block_table=torch.tensor([[[0, 4]], [[1, 1]]]))
    with pytest.raises(ValueError, match=r"block_table\[0\] lists block \(0, 1\) twice"):
        call(block_table=torch.tensor([[[0, 1], [0, 1]], [[1, 1], [-1, 0]]]))
    with pytest.raises(TypeError, match="block_table must be an integer tensor"):
        call(block_table=ok.float())
    with pytest.raises(ValueError, match=r"block_table must be \[G, NB, 2\]"):
        call(block_table=torch.tensor([[[0, 0]]]))
    with pytest.raises(ValueError, match="q_groups .* sum to"):
        call(q_groups=[t, t])
    with pytest.raises(ValueError, match="must be a multiple of block_tokens"):
        call(
            k_sources=[srcs[0][:, :-1].contiguous(), srcs[1]],
            v_sources=[vals[0][:, :-1].contiguous(), vals[1]],
        )
    with pytest.raises(ValueError, match="k_sources has 2 tensors but v_sources has 1"):
        call(v_sources=vals[:1])
    with pytest.raises(TypeError, match=r"v_sources\[1\] dtype"):
        call(v_sources=[vals[0], vals[1].to(torch.bfloat16)])
    if not ops.has_kernel("attention_block_table", "emulator"):
        with pytest.raises(NotImplementedError, match="backend='emulator' has no NKI kernel"):
            call(backend="emulator")


def test_rope3d_positions_equals_rope3d_with_position_list() -> None:
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(2, 4 * 6, 3, 12, generator=g) for _ in range(2))
    pos = [7, 8, 9, 0]
    got = ops.rope3d_positions(q, k, (4, 2, 3), torch.tensor(pos))
    exp = rope3d(q, k, (4, 2, 3), 0, pos)
    assert torch.equal(got[0], exp[0]) and torch.equal(got[1], exp[1])
    with pytest.raises(ValueError, match=r"frame_positions must have shape \(4,\)"):
        ops.rope3d_positions(q, k, (4, 2, 3), torch.tensor(pos[:3]))
    with pytest.raises(TypeError, match="frame_positions must be an integer tensor"):
        ops.rope3d_positions(q, k, (4, 2, 3), torch.tensor(pos, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"frame_positions\[1\] must be >= 0"):
        ops.rope3d_positions(q, k, (4, 2, 3), torch.tensor([0, -1, 2, 3]))


def test_kv_cache_write_at_equals_kv_cache_write() -> None:
    g = torch.Generator().manual_seed(4)
    ck, cv = (torch.randn(2, 4 * 5, 3, 8, generator=g) for _ in range(2))
    k, v = (torch.randn(2, 5, 3, 8, generator=g) for _ in range(2))
    rk, rv = ck.clone(), cv.clone()
    kv_cache_write(rk, rv, k, v, 2)
    ops.kv_cache_write_at(ck, cv, k, v, torch.tensor(2))
    assert torch.equal(ck, rk) and torch.equal(cv, rv)
    with pytest.raises(ValueError, match="slot=4 out of range"):
        ops.kv_cache_write_at(ck, cv, k, v, torch.tensor(4))
    with pytest.raises(ValueError, match=r"slot must have shape \(\)"):
        ops.kv_cache_write_at(ck, cv, k, v, torch.tensor([2]))


def test_rope_tables_built_once_per_forward_not_per_layer(
    model: CausalWanModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eager merged stream: 2 table builds per forward (all frames + roped copies), whatever the depth."""
    counts = {"tables": 0, "rope": 0, "rope_one": 0, "forwards": 0}
    real_tables, real_rope, real_fwd = ops.rope_tables, ops.rope3d_tables, model.forward_with
    real_one = ops.rope3d_tables_one

    def tables(*a, **kw):
        counts["tables"] += 1
        return real_tables(*a, **kw)

    def rope(*a, **kw):
        counts["rope"] += 1
        return real_rope(*a, **kw)

    def rope_one(*a, **kw):
        counts["rope_one"] += 1
        return real_one(*a, **kw)

    def fwd(*a, **kw):
        counts["forwards"] += 1
        return real_fwd(*a, **kw)

    monkeypatch.setattr(ops, "rope_tables", tables)
    monkeypatch.setattr(ops, "rope3d_tables", rope)
    monkeypatch.setattr(ops, "rope3d_tables_one", rope_one)
    monkeypatch.setattr(model, "forward_with", fwd)
    _run(RollingForcingPipeline(model, M, P, merged=True), P.window_blocks)
    n, layers = counts["forwards"], M.num_layers
    assert n > 0 and counts["tables"] == 2 * n
    # per layer: q/k, and the roped copies' keys alone; the last layer ropes the update keys alone too
    assert counts["rope"] == n * layers and counts["rope_one"] == n * (layers + 1)
