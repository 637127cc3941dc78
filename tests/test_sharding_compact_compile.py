"""The compact KV layout compiled whole (``kv_cache="sp_compact"``, ``compile=``): one graph serves every
merged forward of the stream, its chunks equal the eager compact stream and the unsharded pipeline, and
the graph the ranks run holds the collectives and kernel calls the end-to-end model prices for the
HBM-best placement (``perf.e2e.run.COMPACT`` in ``compile_mode="fullgraph"``).

References and tolerances:

* the eager ``sp_compact`` stream (itself equal, bit for bit, to the full ring: tests/test_sharding_compact
  .py): ``torch.equal``. The counting backend runs the captured graph as traced, so the compiled stream
  runs the same ops in the same order on the same values (tests/test_sharding_compile.py, same rule).
* the unsharded pipeline (:class:`rolling_forcing.pipeline.RollingForcingPipeline`, merged, the same
  switch given after the chunk of the window before): ``FP32_ISSUE_BOUND`` (tests/test_sharding_pipeline.py:
  sharding changes only the row counts of matmuls and the head counts of attention calls, a few ulps per
  op; measured 0.0 (bitwise) for merged TP1xSP2 there, and here for both streams below).

The streams are the compact eager test's: 12 blocks (block s >= 8 written into the slot of block s - 6,
which the same forward reads) and a re-caching switch at window 13 with the ring full (16 merged forwards,
compiled; the switch's update-only forward and 8 re-cache forwards, eager in every compiled stream), on
TP1xSP2 with absolute positions (the one plan with sp > 1 on 2 ranks), TP2xSP2 with 45-token blocks and
relative positions, and TP4xSP2 on 8 ranks (a rank whose last-layer tokens all lie in the update block).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from perf.e2e.chunk import chunk_model
from perf.e2e.compact import TEXT_ROLE, text_kv_collective
from perf.e2e.overlap import layer_program
from perf.e2e.params import E2EParams
from perf.e2e.run import COMPACT, COMPACT_MODES
from perf.footprint import merged_tokens
from perf.matmul_model import AnalyticMatmulProvider
from rolling_forcing.config import ModelConfig, PipelineConfig
from rolling_forcing.model import CausalWanModel
from rolling_forcing.pipeline import RollingForcingPipeline
from sharding.layer_comm import layer_collectives
from sharding.pipeline import ShardedRollingForcingPipeline, pipeline_plan
from sharding.plan import AttentionShape
from tests.compile_helpers import BlockTableKernels, counting_backend, priced_graph_kernels
from tests.numerics import FP32_ISSUE_BOUND
from tests.pipeline_helpers import TINY, text_embeds, tiny_model
from tests.pipeline_helpers import one_thread as one_thread  # autouse: one intra-op thread

P = PipelineConfig()
ODD = replace(TINY, name="tiny-odd", latent_height=6, latent_width=10)  # 45-token blocks
NB = 12
SWITCH = {13: (text_embeds(98), True)}  # start block 9: the sink and blocks 2..8 are re-cached
TOL = FP32_ISSUE_BOUND  # sharded vs unsharded, fp32 (module docstring)


def _sharded(
    model: CausalWanModel, cfg: ModelConfig, cores: int, positions: str, **kw: Any
) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    pipe = ShardedRollingForcingPipeline(
        model, cfg, P, cores=cores, positions=positions, merged=True, timeout_s=60.0, **kw
    )
    for w, (emb, recache) in SWITCH.items():
        pipe.set_prompt(emb, recache, window=w)
    chunks = list(pipe.stream(text_embeds(cfg=cfg), NB, generator=torch.Generator().manual_seed(7)))
    assert pipe.last_results is not None
    return torch.cat([c.latents for c in chunks], dim=1), pipe.last_results


def _unsharded(model: CausalWanModel, cfg: ModelConfig, positions: str) -> torch.Tensor:
    pipe = RollingForcingPipeline(model, cfg, P, positions=positions, merged=True)
    out = []
    for c in pipe.stream(text_embeds(cfg=cfg), NB, generator=torch.Generator().manual_seed(7)):
        out.append(c.latents)
        if c.window + 1 in SWITCH:
            emb, recache = SWITCH[c.window + 1]
            pipe.set_prompt(emb, recache=recache)
    return torch.cat(out, dim=1)


def _runs(cfg: ModelConfig, cores: int, positions: str, full: bool, **kw: Any) -> dict[str, Any]:
    """The compiled and eager compact streams, the unsharded reference and (``full``) the compiled
    full-ring stream."""
    model = tiny_model(cfg, 3) if cfg is ODD else tiny_model(cfg)
    out: dict[str, Any] = {"ref": _unsharded(model, cfg, positions)}
    args = (model, cfg, cores, positions)
    out["compiled"], out["ranks"] = _sharded(*args, kv_cache="sp_compact", compile=counting_backend, **kw)
    out["eager"], out["eager_ranks"] = _sharded(*args, kv_cache="sp_compact", **kw)
    if full:
        out["full"], out["full_ranks"] = _sharded(
            *args, kv_cache="sp_sharded", compile=counting_backend, **kw
        )
    return out


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    """TP1xSP2, absolute positions (the compact eager test's merged stream)."""
    return _runs(TINY, 2, "absolute", True)


@pytest.fixture(scope="module")
def runs4() -> dict[str, Any]:
    """TP2xSP2 on 45-token blocks (23 + 22 token shares, 68/68/67/67-token shards of the 270-token merged
    forward), relative positions (every cached block read as a roped copy of the assembled ring)."""
    return _runs(ODD, 4, "relative", False, tp=2)


def _check_equal(runs: dict[str, Any]) -> float:
    got, ref = runs["compiled"], runs["ref"]
    assert torch.equal(got, runs["eager"])
    if "full" in runs:
        assert torch.equal(got, runs["full"])  # the compiled full ring: the same stream
    err = float((got - ref).abs().max())
    assert err < TOL, f"compiled compact vs unsharded latents differ by {err}"
    assert float((ref[:, :3] - ref[:, -3:]).abs().max()) > 1e-2  # a non-trivial stream
    for r, e in zip(runs["ranks"], runs["eager_ranks"], strict=True):
        assert r["forwards"] == e["forwards"] and r["forwards"]["recache"] == 8
        assert e["graphs"] == [] and len(r["graphs"]) == 1  # one graph for every merged forward
        # the measured allocations of the compiled forward: the same buffers as the eager one's
        for key in ("cache_shape", "kv_bytes", "text_kv_bytes", "kv_gather_bytes", "text_gather_bytes"):
            assert r[key] == e[key], key
    return err


@pytest.mark.distributed
def test_compiled_compact_stream_equals_eager_and_unsharded(runs: dict[str, Any]) -> None:
    _check_equal(runs)


def _check_model_order(runs: dict[str, Any], cfg: ModelConfig, cores: int, tp: int) -> None:
    """Every rank's graph: per layer the cache share's gather, the TP all-to-all in, the new keys' gather,
    the text k/v gather, the all-to-all out, the issue order of the model's layer program
    (``perf.e2e.overlap.layer_program``, the text gather after the new keys' collectives), each with the
    bytes :func:`sharding.layer_comm.layer_collectives` / :func:`perf.e2e.compact.text_kv_collective`
    give for the stream's plan at its dtype (fp32): received = ``(n - 1) / n`` of the gathered result,
    sent = ``(n - 1) / n`` of the all-to-all's; then the head's all-gather."""
    plan = pipeline_plan(cfg, P, cores, tp=tp)
    assert (plan.tp, plan.shape.dtype_bytes) == (tp, 4) and plan.sp > 1
    colls = (
        *layer_collectives(
            plan, tokens=merged_tokens(cfg, P), cache_slots=P.buffer_slots - 1,
            tokens_per_block=P.tokens_per_block(cfg),
        ),
        text_kv_collective(cfg, plan.world_size, plan.model, act_bytes=plan.shape.dtype_bytes),
    )  # fmt: skip
    L = cfg.num_layers
    times = {"qkv_proj": 1.0, "attn_merged": 1.0, "cross_attn": 1.0}  # one component per stage
    program = [o.name.split(":")[1] for o in layer_program(times, colls, L) if o.engine == "comm"]
    assert program == ["kv_cache", "qkv_in", "kv_fresh", TEXT_ROLE, "out"] * L
    roles = {c.role: c for c in colls}
    size = {"sp": plan.sp, "tp": plan.tp, "world": plan.world_size}
    want = [
        (
            roles[n].op,
            not roles[n].independent,
            roles[n].bytes * size[roles[n].group] // (size[roles[n].group] - 1),
        )
        for n in program
    ]
    for r in runs["ranks"]:
        (g,) = r["graphs"]
        got = [(op, a, b) for (op, a), b in zip(g["collective_order"], g["collective_bytes"], strict=True)]
        assert got[:-1] == want, (got, want)
        assert got[-1][:2] == ("all_gather_into_tensor", True)  # the head's output, once per forward


@pytest.mark.distributed
def test_compiled_compact_tp2_sp2_odd_relative_stream_is_one_graph_in_the_model_order(
    runs4: dict[str, Any],
) -> None:
    _check_equal(runs4)
    _check_model_order(runs4, ODD, 4, 2)


@pytest.mark.distributed
def test_compiled_compact_tp4_sp2_stream_where_a_rank_skips_the_last_cross_attention() -> None:
    """8 ranks, TP4xSP2 (the plan of the model's 8-core placement): the last layer's 48 update tokens
    cover rank 0's whole 36-token shard of the 288-token merged forward, so rank 0 skips that layer's
    cross-attention; its text gather is still issued and waited for (``TextKVGather.finish``), the
    others read it: collectives stay matched, the stream equal and one graph per rank."""
    runs8 = _runs(TINY, 8, "absolute", False, tp=4)
    assert merged_tokens(TINY, P) // 8 < P.tokens_per_block(TINY)  # rank 0's shard inside the update block
    _check_equal(runs8)
    _check_model_order(runs8, TINY, 8, 4)


@pytest.mark.distributed
def test_compiled_compact_stream_is_one_graph(runs: dict[str, Any]) -> None:
    """One graph for every merged forward (warm-up, steady, the switch's and the tail's windows), as the
    full-ring compiled stream: the ring's map and the text shares are graph inputs, no recompile."""
    for r, f in zip(runs["ranks"], runs["full_ranks"]):
        assert len(r["graphs"]) == len(f["graphs"]) == 1, (r["graphs"], f["graphs"])
        assert r["forwards"]["merged"] == f["forwards"]["merged"] > 1


@pytest.mark.distributed
def test_compiled_compact_graph_is_what_the_model_prices(runs: dict[str, Any]) -> None:
    """The graph every rank runs against the chunk model of the HBM-best placement (``COMPACT``, compile
    mode ``"fullgraph"``, the report's), on the same 2 cores and the same plan:

    * per layer the collectives of the model's layer program (``perf.e2e.overlap``, the comm queue in
      issue order: the cache share's gather of the 7-slot ring, the new keys' gather, then the text k/v
      gather, ``perf.e2e.compact.text_kv_collective``), each with its graph op, its dependency on the
      layer's compute (``independent``) and its bytes (the model's received bytes are ``(n - 1) / n`` of
      the gathered result; the model prices bf16, the stream runs fp32), then the head's all-gather;
    * the collective count of the chunk, less the FSDP weight gathers the placement adds (priced, not
      built: the stream keeps the DiT weights replicated);
    * one forward graph (the model's NEFFs: that graph + the sampler's) and its kernel calls per forward.
    """
    assert COMPACT_MODES[0] == "fullgraph" and COMPACT["kv_cache"] == "sp_compact"
    prm = E2EParams()
    cm = chunk_model(
        TINY, P, cores=2, vae=None, kernels=BlockTableKernels(prm), matmul=AnalyticMatmulProvider(),
        params=prm, compile_mode="fullgraph", **COMPACT,
    )  # fmt: skip
    plan = ShardedRollingForcingPipeline(tiny_model(TINY), TINY, P, cores=2).plan
    assert (cm.tp, cm.sp) == (plan.tp, plan.sp) == (1, 2)
    (fo,) = cm.overlaps  # the merged forward
    roles = {c.role: c for c in fo.collectives}
    assert set(roles) == {"kv_cache", "kv_fresh", TEXT_ROLE}
    model_elem = AttentionShape(num_queries=1, num_keys=1).dtype_bytes  # the chunk model's plan shape
    text = text_kv_collective(TINY, plan.world_size, plan.model, act_bytes=model_elem)
    t = roles[TEXT_ROLE]
    assert (
        (t.group, t.bytes, t.independent)
        == (text.group, text.bytes, text.independent)
        == ("world", t.bytes, True)
    )
    program = [slot.op.name.split(":") for slot in fo.sched.on("comm")]  # "<layer>:<role>", issue order
    L = TINY.num_layers
    assert [int(ly) for ly, _ in program] == sorted(int(ly) for ly, _ in program)  # layer by layer
    assert len(program) == L * len(roles)
    size = {"sp": plan.sp, "tp": plan.tp, "world": plan.world_size}
    # bytes per priced unit: the text gather's per channel of dim (act_bytes); the stream's own per
    # channel of one head, which the chunk model's plan takes at AttentionShape's default head_dim (128,
    # Wan's; perf/e2e/chunk.py builds its plan without the model's) where tiny's heads are 16 wide
    shape = AttentionShape(num_queries=1, num_keys=1)
    unit = {"world": (model_elem, 4), "sp": (shape.dtype_bytes * shape.head_dim, 4 * TINY.head_dim)}
    want = []
    for _, role in program:
        c = roles[role]
        n = size[c.group]
        per_model, per_graph = unit[c.group]
        gathered = c.bytes * n // (n - 1)  # every rank's part: what the graph's all-gather returns
        assert gathered % per_model == 0
        want.append((c.op, not c.independent, gathered // per_model * per_graph))
    for r in runs["ranks"]:
        (g,) = r["graphs"]
        got = [
            (op, after, b)
            for (op, after), b in zip(g["collective_order"], g["collective_bytes"], strict=True)
        ]
        assert got[:-1] == want, (got, want)
        assert got[-1][:2] == ("all_gather_into_tensor", True)  # the head's output, once per forward
        priced_colls = cm.collectives - sum(
            c.collectives * c.calls for c in cm.components if c.group == "weight_comm"
        )
        assert sum(dict(g["collectives"]).values()) == priced_colls == L * len(roles) + 1
    assert cm.neffs == 2  # one forward graph + the sampler's
    text_comp = [c for c in cm.components if c.name == "text_kv_gather"]
    assert [(c.calls, c.collectives) for c in text_comp] == [(L, 1)]
    priced = priced_graph_kernels(cm)
    for r in runs["ranks"]:
        assert {k: n for k, n in r["graphs"][0]["kernels"] if k != "rope_tables"} == priced
