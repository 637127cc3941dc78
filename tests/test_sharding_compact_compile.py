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
  op; measured 0.0 for merged TP1xSP2 there, and here).

The stream is the compact eager test's: 12 blocks (block s >= 8 written into the slot of block s - 6,
which the same forward reads) and a re-caching switch at window 13 with the ring full, absolute positions,
TP1xSP2 (the one plan with sp > 1 on 2 ranks).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch

from perf.e2e.chunk import chunk_model
from perf.e2e.compact import TEXT_ROLE, text_kv_collective
from perf.e2e.kernels import AnalyticKernels, KernelCost
from perf.e2e.params import E2EParams
from perf.e2e.run import COMPACT, COMPACT_MODES
from perf.matmul_model import AnalyticMatmulProvider
from rolling_forcing.config import PipelineConfig
from rolling_forcing.model import CausalWanModel
from rolling_forcing.pipeline import RollingForcingPipeline
from sharding.pipeline import ShardedRollingForcingPipeline
from sharding.plan import AttentionShape
from tests.numerics import FP32_ISSUE_BOUND
from tests.pipeline_helpers import TINY, text_embeds, tiny_model
from tests.pipeline_helpers import one_thread as one_thread  # autouse: one intra-op thread

P = PipelineConfig()
NB = 12
SWITCH = {13: (text_embeds(98), True)}  # start block 9: the sink and blocks 2..8 are re-cached
TOL = FP32_ISSUE_BOUND  # sharded vs unsharded, fp32 (module docstring)

# the e2e model's components and the nki_ardiff ops of the graph that run them (per layer)
MODEL_TO_GRAPH = {
    "attn_merged": "attention_block_table",
    "cross_attn": "attention",
    "rope3d": "rope3d_tables",
    "rope3d_copies": "rope3d_positions_one",
    "kv_cache_write": "kv_cache_write_at",
}


def counting_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    """Runs the captured graph as is (the ranks record what it holds: sharding.compiled.GraphRecord)."""
    return gm.forward


@dataclass(frozen=True)
class _BlockTableKernels(AnalyticKernels):
    """The analytic provider plus the merged forward's one block-table call (as TracedKernels prices it)."""

    def attention_groups(
        self, lqs: tuple[int, ...], blocks: int, block_tokens: int, heads: int, head_dim: int
    ) -> KernelCost:
        parts = [self.attention(n, blocks * block_tokens, heads, head_dim) for n in lqs]
        return replace(parts[0], time_s=sum(c.time_s for c in parts), time_high_s=None)


def _sharded(model: CausalWanModel, **kw: Any) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    pipe = ShardedRollingForcingPipeline(model, TINY, P, cores=2, positions="absolute", timeout_s=60.0, **kw)
    for w, (emb, recache) in SWITCH.items():
        pipe.set_prompt(emb, recache, window=w)
    chunks = list(pipe.stream(text_embeds(), NB, generator=torch.Generator().manual_seed(7)))
    assert pipe.last_results is not None
    return torch.cat([c.latents for c in chunks], dim=1), pipe.last_results


def _unsharded(model: CausalWanModel) -> torch.Tensor:
    pipe = RollingForcingPipeline(model, TINY, P, positions="absolute", merged=True)
    out = []
    for c in pipe.stream(text_embeds(), NB, generator=torch.Generator().manual_seed(7)):
        out.append(c.latents)
        if c.window + 1 in SWITCH:
            emb, recache = SWITCH[c.window + 1]
            pipe.set_prompt(emb, recache=recache)
    return torch.cat(out, dim=1)


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    """The compiled and eager compact streams, the compiled full-ring stream and the unsharded reference."""
    model = tiny_model(TINY)
    compiled, ranks = _sharded(model, kv_cache="sp_compact", merged=True, compile=counting_backend)
    eager, eager_ranks = _sharded(model, kv_cache="sp_compact", merged=True)
    full, full_ranks = _sharded(model, kv_cache="sp_sharded", merged=True, compile=counting_backend)
    return {
        "compiled": compiled, "ranks": ranks, "eager": eager, "eager_ranks": eager_ranks,
        "full": full, "full_ranks": full_ranks, "ref": _unsharded(model),
    }  # fmt: skip


@pytest.mark.distributed
def test_compiled_compact_stream_equals_eager_and_unsharded(runs: dict[str, Any]) -> None:
    got, ref = runs["compiled"], runs["ref"]
    assert torch.equal(got, runs["eager"])
    assert torch.equal(got, runs["full"])  # the compiled full ring: the same stream
    err = float((got - ref).abs().max())
    assert err < TOL, f"compiled compact vs unsharded latents differ by {err}"
    assert float((ref[:, :3] - ref[:, -3:]).abs().max()) > 1e-2  # a non-trivial stream
    for r, e in zip(runs["ranks"], runs["eager_ranks"]):
        assert r["forwards"] == e["forwards"] and r["forwards"]["recache"] == 8
        assert e["graphs"] == []
        # the measured allocations of the compiled forward: the same buffers as the eager one's
        for key in ("cache_shape", "kv_bytes", "text_kv_bytes", "kv_gather_bytes", "text_gather_bytes"):
            assert r[key] == e[key], key


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
        TINY, P, cores=2, vae=None, kernels=_BlockTableKernels(prm), matmul=AnalyticMatmulProvider(),
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
    priced: Counter[str] = Counter()
    for c in cm.components:
        if c.name in MODEL_TO_GRAPH:
            priced[MODEL_TO_GRAPH[c.name]] += c.calls * c.launches
    for r in runs["ranks"]:
        assert {k: n for k, n in r["graphs"][0]["kernels"] if k != "rope_tables"} == dict(priced)
