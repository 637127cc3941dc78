"""What the compiled-stream tests (test_sharding_compile, test_sharding_compact_compile) share: a backend
that runs the captured graph as is, the analytic kernel provider with the merged forward's block-table call,
and the map from the end-to-end model's components to the graph's kernel ops."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import torch

from perf.e2e.chunk import ChunkModel
from perf.e2e.kernels import AnalyticKernels, KernelCost

# the e2e model's components and the nki_ardiff ops of the graph that run them (per layer)
MODEL_TO_GRAPH = {
    "attn_merged": "attention_block_table",
    "cross_attn": "attention",
    "rope3d": "rope3d_tables",  # each rank's token shard, all heads, before the TP all-to-all
    "rope3d_copies": "rope3d_positions_one",
    "kv_cache_write": "kv_cache_write_at",
}


def counting_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    """Runs the captured graph as is (the ranks record what it holds: sharding.compiled.GraphRecord)."""
    return gm.forward


@dataclass(frozen=True)
class BlockTableKernels(AnalyticKernels):
    """The analytic provider plus the merged forward's one block-table call (as TracedKernels prices it)."""

    def attention_groups(
        self, lqs: tuple[int, ...], blocks: int, block_tokens: int, heads: int, head_dim: int
    ) -> KernelCost:
        parts = [self.attention(n, blocks * block_tokens, heads, head_dim) for n in lqs]
        return replace(parts[0], time_s=sum(c.time_s for c in parts), time_high_s=None)


def priced_graph_kernels(cm: ChunkModel) -> dict[str, int]:
    """The kernel calls per forward graph that ``cm`` prices, under the graph's op names."""
    priced: Counter[str] = Counter()
    for c in cm.components:
        if c.name in MODEL_TO_GRAPH:
            priced[MODEL_TO_GRAPH[c.name]] += c.calls * c.launches
    return dict(priced)
