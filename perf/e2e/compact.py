"""The collectives the compact KV layout and the FSDP VAE add to a chunk (all *modelled*).

The sharded stream's compact layout (``kv_cache="sp_compact"``, ``sharding/kv_shard.py``) keeps the text
k/v token-sharded over every rank and, per layer, all-gathers that layer's whole text k/v (all heads:
cross-attention runs token-sharded) into a one-layer buffer just before the block uses it
(:class:`sharding.kv_shard.TextKVGather`: each rank's share padded to the longest, ``ceil(text_len /
world)`` tokens). The gather reads only the cached text k/v (written once per prompt), so it needs no
compute of its layer; its one-layer buffer (``text_kv_gather_buffer`` of :func:`perf.footprint.footprint`)
is free once the previous layer's cross-attention has read it. :func:`text_kv_collective` gives it as a
:class:`sharding.layer_comm.LayerCollective` for :func:`perf.e2e.overlap.layer_program` (role
:data:`TEXT_ROLE`).

``vae_weights="fsdp"`` (footprint: ``1 / cores`` of the decoder's weights per core): the decoder's
weights all-gathered once per chunk's decode (:func:`vae_weight_gather`), charged in full (not hidden:
the decoder's per-layer prefetch is not modelled), an upper bound of its cost.
"""

from __future__ import annotations

import math
from typing import Any

from perf.e2e.weights import params_gather
from rolling_forcing.config import ModelConfig
from sharding.layer_comm import LayerCollective

__all__ = ["TEXT_ROLE", "KV_CACHES", "text_kv_gather_bytes", "text_kv_collective", "vae_weight_gather"]

TEXT_ROLE = "text_kv"
"""The role of the compact layout's per-layer text k/v all-gather in a layer program."""

KV_CACHES = ("sp_sharded", "sp_compact")
"""The KV cache layouts the chunk model prices (``sharding.kv_shard.KV_CACHE_LAYOUTS`` minus the
replicated cache)."""


def _count(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    return v


def text_kv_gather_bytes(m: ModelConfig, world: int, act_bytes: int = 2) -> int:
    """Bytes one rank receives in one layer's text k/v all-gather over ``world`` ranks: the other ranks'
    shares, each padded to the longest ``ceil(text_len / world)`` tokens, ``x dim x 2 (k, v) x
    act_bytes``. ``world == 1``: 0 (nothing to gather)."""
    _count("world", world)
    _count("act_bytes", act_bytes)
    return (world - 1) * math.ceil(m.text_len / world) * m.dim * 2 * act_bytes


def text_kv_collective(m: ModelConfig, world: int, comm_model: Any, act_bytes: int = 2) -> LayerCollective:
    """One layer's text k/v all-gather over all ``world`` ranks (module docstring), timed as one ring
    all-gather of ``comm_model`` (a ``sharding.plan.CommModel``; spans chips when ``world`` exceeds
    ``cores_per_chip``), ``independent`` (no compute of its layer), HBM traffic ``2 x bytes`` (read by
    the senders, written here) as the stream's other collectives count it."""
    b = text_kv_gather_bytes(m, world, act_bytes)
    spans = world > comm_model.cores_per_chip
    t, lat = comm_model.all_gather_s(world, b, spans), comm_model.all_gather_s(world, 0, spans)
    return LayerCollective(TEXT_ROLE, "world", b, t, 2 * b, True, lat)


def vae_weight_gather(
    decoder_params: int, cores: int, comm_model: Any, weight_bytes: float = 2
) -> tuple[int, float]:
    """FSDP all-gather of the VAE decoder's weights over ``cores`` ranks, once per decode: ``(bytes
    received per rank, seconds)``; each rank holds ``ceil(1 / cores)`` of ``decoder_params x
    weight_bytes`` and receives the rest (:func:`perf.e2e.weights.params_gather`, as the DiT's)."""
    _count("decoder_params", decoder_params)
    _count("cores", cores)
    return params_gather(decoder_params, cores, comm_model, weight_bytes)
