"""The merged forward's attention priced as ONE block-table kernel call when the provider can (what the
pipeline runs), and as one call per group otherwise (perf/e2e/components.py, perf/e2e/kernels.py)."""

from __future__ import annotations

from typing import Any

import pytest

from perf.e2e import AnalyticKernels, E2EParams, chunk_model
from perf.e2e.kernels import KernelCost
from perf.matmul_model import AnalyticMatmulProvider
from rolling_forcing.config import PipelineConfig, get_preset

WAN = get_preset("wan2.1-1.3b")
PIPE = PipelineConfig()
P = E2EParams()


class _Groups:
    """Analytic kernels plus a block-table entry with a known cost; records its calls."""

    def __init__(self, params: E2EParams) -> None:
        self._base = AnalyticKernels(params)
        self.name = "groups"
        self.calls: list[tuple[Any, ...]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)

    def attention_groups(self, lqs, blocks, block_tokens, heads, head_dim) -> KernelCost:
        self.calls.append((lqs, blocks, block_tokens, heads, head_dim))
        return KernelCost(7e-3, 0, 0, {"vector": 7e-3}, "fixed groups")


def _chunk(kernels: Any) -> Any:
    return chunk_model(WAN, PIPE, cores=8, variant="merged", vae=None, kernels=kernels,
                       matmul=AnalyticMatmulProvider(), params=P)  # fmt: skip


def test_merged_forward_is_one_block_table_call_per_layer() -> None:
    k = _Groups(P)
    with_groups, per_group = _chunk(k), _chunk(AnalyticKernels(P))
    attn = [c for c in with_groups.components if c.group == "attention"]
    assert [c.name for c in attn] == ["attn_merged"]
    assert attn[0].time_s == pytest.approx(7e-3) and attn[0].calls == WAN.num_layers
    blk = PIPE.tokens_per_block(WAN)
    keys = PIPE.key_budget_tokens(WAN)
    win = PIPE.window_frames * WAN.tokens_per_frame
    # one core's query groups (SP2 halves them), every group over the key budget's blocks
    assert k.calls == [((blk // 2, win // 2), keys // blk, blk, WAN.num_heads // 4, WAN.head_dim)]
    # the same FLOPs as the two calls it replaces, one kernel call less per layer
    assert attn[0].flops == sum(c.flops for c in per_group.components if c.group == "attention")
    assert with_groups.kernel_calls == per_group.kernel_calls - WAN.num_layers


def test_two_pass_and_providers_without_the_entry_keep_one_call_per_group() -> None:
    k = _Groups(P)
    tw = chunk_model(WAN, PIPE, cores=8, variant="two_pass", vae=None, kernels=k,
                     matmul=AnalyticMatmulProvider(), params=P)  # fmt: skip
    assert k.calls == []
    assert sorted(c.name for c in tw.components if c.group == "attention") == [
        "denoise:attn_denoise",
        "update:attn_update",
    ]
    names = [c.name for c in _chunk(AnalyticKernels(P)).components if c.group == "attention"]
    assert names == ["attn_update", "attn_denoise"]
