"""Communication of the weight placements: FSDP weight gathers and Megatron TP-linear all-reduces.

Collective times come from a ``sharding.plan.CommModel`` (alpha-beta; which line is used is the caller's
end of the parameter ranges).  All *modelled*.
"""

from __future__ import annotations

import math
from typing import Any

from perf.footprint import WEIGHT_PLACEMENTS, dit_block_param_count, dit_outside_param_count
from rolling_forcing.config import ModelConfig

__all__ = ["WEIGHT_VARIANTS", "all_reduce_s", "fsdp_gather", "params_gather", "tp_linear_comm"]

WEIGHT_VARIANTS = WEIGHT_PLACEMENTS
"""The weight placements the chunk model sweeps: every placement :func:`perf.footprint.footprint` knows."""


def all_reduce_s(comm_model: Any, group: int, nbytes: int, spans_chips: bool) -> float:
    """Modelled ring all-reduce of ``nbytes`` per rank: a reduce-scatter then an all-gather, each moving
    ``(p - 1) / p x nbytes`` per rank, each timed as ``CommModel.all_gather_s`` (``sharding.plan``)."""
    if group <= 1:
        return 0.0
    moved = math.ceil(nbytes * (group - 1) / group)
    return 2 * comm_model.all_gather_s(group, moved, spans_chips)


def fsdp_gather(
    m: ModelConfig, cores: int, comm_model: Any, weight_bytes: float = 2
) -> tuple[int, float, int, float]:
    """FSDP all-gather of one block's weights (and of the non-block weights) over ``cores`` ranks.

    Returns ``(block_bytes_received, block_s, outside_bytes_received, outside_s)`` per rank: each rank
    holds ``1 / cores`` and receives the other ``(cores - 1) / cores`` of ``params x weight_bytes``
    (:func:`perf.footprint.dit_block_param_count`, :func:`perf.footprint.dit_outside_param_count`),
    timed as one ring all-gather of ``CommModel`` (``sharding.plan``).
    """
    blk, blk_s = params_gather(dit_block_param_count(m), cores, comm_model, weight_bytes)
    out, out_s = params_gather(dit_outside_param_count(m), cores, comm_model, weight_bytes)
    return blk, blk_s, out, out_s


def params_gather(n_params: int, cores: int, comm_model: Any, weight_bytes: float = 2) -> tuple[int, float]:
    """FSDP all-gather of ``n_params`` weights of ``weight_bytes`` over ``cores`` ranks: ``(bytes received
    per rank, seconds)``; each rank holds ``ceil(bytes / cores)`` and receives the rest, timed as one ring
    all-gather of ``comm_model`` (spanning chips beyond ``cores_per_chip``)."""
    b = int(n_params * weight_bytes)
    recv = b - math.ceil(b / cores) if cores > 1 else 0
    return recv, comm_model.all_gather_s(cores, recv, cores > comm_model.cores_per_chip)


def tp_linear_comm(
    m: ModelConfig, tokens: int, tp: int, sp: int, comm_model: Any, act_bytes: int = 2
) -> tuple[int, float, int]:
    """Per-layer extra communication of Megatron column/row parallel linears inside a TP group.

    Wan's block has three row-parallel outputs (self-attention O, cross-attention O, FFN down), each
    reduced over the ``tp`` ranks: one all-reduce (as reduce-scatter + all-gather, Megatron sequence
    parallelism; same bytes) of the SP shard's activations ``ceil(tokens / sp) x dim x act_bytes``.  Wan's
    RMSNorm of q and k (and of the cross-attention q) spans all heads, so their sums of squares need two
    small all-reduces of ``ceil(tokens / sp) x fp32`` (q and k fused; cross q).  Returns
    ``(bytes moved per rank, seconds, collectives)``.  The attention all-to-all of the token-sharded plan
    is not needed (the column-parallel QKV output already is head-sharded); the caller keeps the SP K/V
    all-gather.
    """
    if tp <= 1:
        return 0, 0.0, 0
    ns = math.ceil(tokens / sp)
    spans = tp > comm_model.cores_per_chip
    big = ns * m.dim * act_bytes
    small_q, small_x = 2 * ns * 4, ns * 4
    t = 3 * all_reduce_s(comm_model, tp, big, spans)
    t += all_reduce_s(comm_model, tp, small_q, spans) + all_reduce_s(comm_model, tp, small_x, spans)
    moved = sum(2 * math.ceil(b * (tp - 1) / tp) for b in (big, big, big, small_q, small_x))
    return moved, t, 5
