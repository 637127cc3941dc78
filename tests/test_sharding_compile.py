"""The sharded stream compiled whole (``compile=``): one graph per forward with its collectives inside,
chunks equal to the eager stream, and the graph the ranks really run tied to what the end-to-end model
prices per forward (its collectives and its kernel calls; perf/e2e, ``compile_mode="fullgraph"``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from perf.e2e.chunk import chunk_model
from perf.e2e.params import E2EParams
from perf.matmul_model import AnalyticMatmulProvider
from rolling_forcing.config import PipelineConfig, get_preset
from rolling_forcing.model import CausalWanModel
from sharding.layer_comm import layer_collectives
from sharding.pipeline import ShardedRollingForcingPipeline
from tests.compile_helpers import BlockTableKernels, counting_backend, priced_graph_kernels
from tests.pipeline_helpers import text_embeds, tiny_model

M = get_preset("tiny")
P = PipelineConfig()
NB = 7  # 11 merged forwards: warm-up (growing windows, padded to the static shape), steady, tail


@pytest.fixture(scope="module")
def model() -> CausalWanModel:
    return tiny_model(M)


def _stream(model: CausalWanModel, tp: int, compile: Any) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    pipe = ShardedRollingForcingPipeline(model, M, P, cores=2, tp=tp, merged=True, compile=compile)
    chunks = list(pipe.stream(text_embeds(), NB, generator=torch.Generator().manual_seed(7)))
    assert pipe.last_results is not None
    return torch.cat([c.latents for c in chunks], dim=1), pipe.last_results


@pytest.mark.parametrize("tp", [1, 2], ids=["TP1xSP2", "TP2xSP1"])
def test_sharded_stream_compiles_to_one_graph_as_the_model_prices(model: CausalWanModel, tp: int) -> None:
    eager, eager_ranks = _stream(model, tp, None)
    got, ranks = _stream(model, tp, counting_backend)
    assert torch.equal(got, eager)  # the same collectives and ops, traced: bitwise the eager stream
    assert all(r["graphs"] == [] for r in eager_ranks)
    windows = NB + P.window_blocks - 1
    plan = ShardedRollingForcingPipeline(model, M, P, cores=2, tp=tp).plan
    for r in ranks:
        assert r["forwards"] == {"merged": windows}
        assert len(r["graphs"]) == 1, r["graphs"]  # one graph for every forward of the stream
        g = r["graphs"][0]
        coll = dict(g["collectives"])
        # per layer the collectives the model prices (sharding.layer_comm: SP: the cache share's gather,
        # then TP: all-to-all in, SP: the new keys' gather, TP: all-to-all out), per forward the head
        # all-gather; in graph order, and only the cache share's gather free of the forward's compute
        # (the dependency the overlap model hides it by)
        per_layer = layer_collectives(
            plan, tokens=24, cache_slots=P.buffer_slots, tokens_per_block=P.tokens_per_block(M)
        )
        assert sum(coll.values()) == M.num_layers * len(per_layer) + 1, coll
        assert coll.get("all_to_all_single", 0) == (2 * M.num_layers if plan.tp > 1 else 0)
        want = [(c.op, not c.independent) for c in per_layer] * M.num_layers
        assert [tuple(x) for x in g["collective_order"]] == [*want, ("all_gather_into_tensor", True)]
        kernels = dict(g["kernels"])
        assert kernels == {
            "attention_block_table": M.num_layers,
            "attention": M.num_layers,  # cross-attention
            "rope3d_tables": M.num_layers,  # q, k of the rank's token shard, all heads, before the all-to-all
            "rope_tables": 1,  # the cos/sin tables, once per forward (host-built rows, not a device kernel)
            "rope3d_positions_one": M.num_layers,  # the sink's roped copy (keys only)
            "kv_cache_write_at": M.num_layers,
        }
    if plan.name != "TP1xSP2":
        return
    # the end-to-end model of the same chunk (its own plan for 2 cores is this one): the same counts
    prm = E2EParams()
    cm = chunk_model(
        M, P, cores=2, vae=None, kernels=BlockTableKernels(prm), matmul=AnalyticMatmulProvider(), params=prm
    )
    assert (cm.tp, cm.sp) == (plan.tp, plan.sp)
    assert cm.neffs == 2  # compile_mode "fullgraph": one forward graph (+ the sampler graph)
    assert cm.collectives == sum(dict(ranks[0]["graphs"][0]["collectives"]).values())
    priced = priced_graph_kernels(cm)
    device_kernels = {k: n for k, n in ranks[0]["graphs"][0]["kernels"] if k != "rope_tables"}
    assert priced == device_kernels
