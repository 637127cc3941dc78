"""Communication of the weight placements: FSDP weight gathers and Megatron TP-linear all-reduces.

Collective times come from a ``sharding.plan.CommModel`` (alpha-beta; which line is used is the caller's
end of the parameter ranges).  All *modelled*.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from perf.e2e.components import Component
from perf.footprint import WEIGHT_PLACEMENTS, dit_block_param_count, dit_outside_param_count
from rolling_forcing.config import ModelConfig

__all__ = [
    "WEIGHT_VARIANTS",
    "all_reduce_s",
    "fsdp_gather",
    "params_gather",
    "tp_linear_comm",
    "LINEAR_UNITS",
    "linear_gather_units",
    "outside_gather_units",
    "linear_prefetch_exposed",
    "fsdp_linear_components",
]

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


LINEAR_UNITS = ("qkv_proj", "o_proj", "cross_q_proj", "cross_o_proj", "ffn_up", "ffn_down")
"""A block's per-linear FSDP gather units in compute order, named as the forward's linear components
(:func:`perf.e2e.components.forward_components`)."""

# the per-layer components that run before each unit's linear (the merged forward's data flow, as
# perf/e2e/overlap.py orders a layer); groups stand for all their components; the rest run after ffn_down
_BEFORE: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("adaln_norm1_mod",),
    "o_proj": ("rmsnorm_qk", "attention", "rope", "kv_write", "comm"),
    "cross_q_proj": ("gate_residual_sa", "norm3_affine"),
    "cross_o_proj": ("rmsnorm_cross_q", "cross_attention", "text_kv_gather"),
    "ffn_up": ("residual_cross", "adaln_norm2_mod"),
    "ffn_down": ("gelu_tanh",),
}


def linear_gather_units(m: ModelConfig) -> tuple[tuple[str, int], ...]:
    """``(unit, parameters)`` of one block's per-linear gathers (:data:`LINEAR_UNITS`): q,k,v ``3 (d^2 +
    d)`` + the q,k RMSNorms ``2d`` + the modulation ``6d``; o ``d^2 + d``; cross q ``d^2 + d`` + the cross
    q,k RMSNorms ``2d`` + LN3 ``2d``; cross o ``d^2 + d``; FFN up ``d f + f``; FFN down ``f d + d``.  The
    cross-attention k and v projections ``2 (d^2 + d)`` are not gathered per forward: they only make the
    text k/v, cached once per prompt (the sum is :func:`perf.footprint.dit_block_param_count` minus them)."""
    d, f = m.dim, m.ffn_dim
    sizes = (3 * (d * d + d) + 8 * d, d * d + d, d * d + d + 4 * d, d * d + d, d * f + f, f * d + d)
    return tuple(zip(LINEAR_UNITS, sizes, strict=True))


def outside_gather_units(m: ModelConfig) -> tuple[tuple[str, int], ...]:
    """``(unit, parameters)`` of the non-block linears gathered one by one, all before the forward
    (:func:`perf.footprint.dit_outside_param_count` in 7 pieces; the head carries its modulation ``2d``)."""
    d = m.dim
    _, ph, pw = m.patch_size
    return (
        ("patch_embed", m.in_channels * ph * pw * d + d),
        ("text_embed_in", m.text_dim * d + d),
        ("text_embed_out", d * d + d),
        ("time_embed_in", m.freq_dim * d + d),
        ("time_embed_out", d * d + d),
        ("time_proj", 6 * d * d + 6 * d),
        ("head", d * m.patch_out + m.patch_out + 2 * d),
    )


def linear_prefetch_exposed(
    gather_s: Sequence[float],
    before_s: Sequence[float],
    linear_s: Sequence[float],
    tail_s: float,
    layers: int,
) -> float:
    """Seconds the per-linear gathers add to ``layers`` identical layers (one unit per entry of the three
    sequences, in compute order; ``tail_s`` runs after a layer's last linear).

    Two timelines: the gathers, in order on one queue; the compute, in order: unit ``j``'s
    ``before_s[j]`` then its linear ``linear_s[j]``.  Double buffer: gather ``j`` starts when gather ``j -
    1`` is done and the linear two units back has run (its half of the buffer is free); linear ``j`` starts
    when its ``before_s`` is done and its gather has landed.  Returns the last compute end minus the total
    compute (0 when every gather hides); everything starts at 0 (the first gather is exposed in full)."""
    n = len(gather_s)
    if not n or len(before_s) != n or len(linear_s) != n:
        raise ValueError("linear_prefetch_exposed: gather_s, before_s, linear_s must be equal, non-empty")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(f"linear_prefetch_exposed: layers must be an int >= 1, got {layers!r}")
    if min(*gather_s, *before_s, *linear_s, tail_s) < 0:
        raise ValueError("linear_prefetch_exposed: times must be >= 0")
    queue = t = 0.0
    ends: list[float] = []
    for _ in range(layers):
        for j in range(n):
            start = max(queue, ends[-2] if len(ends) >= 2 else 0.0)
            queue = start + gather_s[j]
            t = max(t + before_s[j], queue) + linear_s[j]
            ends.append(t)
        t += tail_s
    return max(0.0, t - layers * (sum(before_s) + sum(linear_s) + tail_s))  # >= 0 up to rounding


def fsdp_linear_components(
    m: ModelConfig,
    layer_components: Sequence[Component],
    cores: int,
    comm_model: Any,
    weight_bytes: float = 2,
) -> list[Component]:
    """The per-linear FSDP gathers of one forward (``footprint(..., gather_unit="linear")``): the 7
    non-block gathers (:func:`outside_gather_units`) in full before it (``weight_gather_first``) and what
    the :data:`LINEAR_UNITS` gathers of every layer add to its compute (``weight_gather_exposed``,
    :func:`linear_prefetch_exposed` over the forward's per-layer components ``layer_components``: each
    unit's linear component, the components before it by the layer's data flow, the rest after
    ``ffn_down``).  Each gather is one collective (:func:`params_gather`; its barrier is charged per
    collective by the chunk model).  Assumes, as the block gather, that the gathers' DMA does not slow
    compute and that they do not queue behind the stream's own collectives."""
    per = [c for c in layer_components if c.per_layer]
    by_name = {c.name: c for c in per}
    missing = [u for u in LINEAR_UNITS if u not in by_name]
    if missing:
        raise ValueError(f"fsdp_linear_components: the forward has no {missing} components")
    used = set(LINEAR_UNITS)
    before = []
    for u in LINEAR_UNITS:
        keys = _BEFORE[u]
        cs = [c for c in per if c.name not in used and (c.name in keys or c.group in keys)]
        used |= {c.name for c in cs}
        before.append(sum(c.time_s for c in cs))
    tail = sum(c.time_s for c in per if c.name not in used)
    units = linear_gather_units(m)
    gathers = [params_gather(n, cores, comm_model, weight_bytes)[1] for _, n in units]
    exposed = linear_prefetch_exposed(
        gathers, before, [by_name[u].time_s for u in LINEAR_UNITS], tail, m.num_layers
    )
    outside = sum(params_gather(n, cores, comm_model, weight_bytes)[1] for _, n in outside_gather_units(m))
    tag = f"FSDP per-linear all-gather ({comm_model.name})"
    n_out = len(outside_gather_units(m))
    return [
        Component(
            "weight_gather_first", "weight_comm", outside, 1, 0, 0, False, f"{tag}: {n_out} non-block", n_out
        ),
        Component(
            "weight_gather_exposed", "weight_comm", exposed, 1, 0, 0, False,
            f"{tag}: {len(units)} per layer, double buffer, simulated", len(units) * m.num_layers,
        ),
    ]  # fmt: skip
