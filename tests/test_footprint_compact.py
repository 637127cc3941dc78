"""The HBM formulas of the compact KV-cache layout and of FSDP-sharded VAE weights (``perf.footprint``) at
the Wan2.1-1.3B 480x832 TP4xSP2 configuration, against figures worked by hand from the model's shapes
(byte counts: exact, no tolerance). The compact layout's items are also checked against the sharded CPU
stream's allocations byte for byte (tests/test_footprint_check.py)."""

from __future__ import annotations

import math

import pytest

from perf.footprint import footprint, model_at_resolution, vae_probe
from rolling_forcing.config import PipelineConfig, get_preset

P = PipelineConfig(dtype="bfloat16")
M = model_at_resolution(get_preset("wan2.1-1.3b"), 480, 832, 8)
VAE = vae_probe(M.latent_height, M.latent_width, P.frames_per_block)


def test_compact_layout_items_by_hand() -> None:
    full = footprint(M, P, tp=4, sp=2, weights="fsdp", vae=VAE)
    co = footprint(M, P, tp=4, sp=2, weights="fsdp", vae=VAE, kv_cache="sp_compact", vae_weights="fsdp")
    # 4,680 tokens per block (3 frames x 30 x 52), 1,536 = 12 heads x 128, 30 layers, bf16
    assert co.item("kv_cache").per_chip == 7 * 4680 * 1536 * 2 * 30 * 2 == 6_038_323_200
    assert co.item("kv_cache").per_core == 7 * 2340 * 3 * 128 * 2 * 30 * 2
    assert full.item("kv_cache").per_chip == 8 * 4680 * 1536 * 2 * 30 * 2
    # the forward still sees every schedule slot: the gather buffer is the full ring's
    assert co.item("kv_gather_buffer") == full.item("kv_gather_buffer")
    assert co.item("kv_gather_buffer").per_core == 8 * 4680 * 3 * 128 * 2 * 2
    # text k/v: 512 tokens, 64 per core, the whole once per chip; one whole layer gathered per core
    assert co.item("text_kv").per_core == 64 * 1536 * 2 * 30 * 2
    assert co.item("text_kv").per_chip == 512 * 1536 * 2 * 30 * 2 == full.item("text_kv").per_chip // 8
    assert co.item("text_kv_gather_buffer").per_core == 512 * 1536 * 2 * 2
    # VAE: 73,295,603 decoder parameters, 1/8 per core; the largest layer a 384 -> 384 3x3x3 conv
    assert co.item("vae_weights").per_core == math.ceil(73_295_603 * 2 / 8)
    assert co.item("vae_gather_buffer").per_core == 2 * 384 * 384 * 27 * 2
    assert full.item("vae_weights").per_chip == 73_295_603 * 2 * 8
    # everything else unchanged
    for name in ("dit_weights", "weight_gather_buffer", "activations", "vae_workspace"):
        assert co.item(name) == full.item(name)
    saved = full.per_chip - co.per_chip
    assert saved == (
        4680 * 1536 * 2 * 30 * 2  # one ring slot
        + 512 * 1536 * 2 * 30 * 2 * 7
        - 512 * 1536 * 2 * 2 * 8  # text k/v shares minus gather buffers
        + 73_295_603 * 2 * 8
        - 8 * math.ceil(73_295_603 * 2 / 8)
        - 8 * 2 * 384 * 384 * 27 * 2  # VAE FSDP
    )


def test_compact_layout_arguments() -> None:
    with pytest.raises(ValueError, match="needs sp > 1"):
        footprint(M, P, tp=4, sp=1, kv_cache="sp_compact")
    with pytest.raises(ValueError, match="vae_weights must be one of"):
        footprint(M, P, tp=4, sp=2, vae_weights="shared")
    # Megatron TP linears: cross-attention head-sharded already, only the ring applies
    tl = footprint(M, P, tp=4, sp=2, weights="tp_linear", kv_cache="sp_compact")
    assert tl.item("text_kv").per_core == 512 * 1536 * 2 * 30 * 2 // 4
    assert "text_kv_gather_buffer" not in {i.name for i in tl.items}


def test_fsdp_gather_unit_of_one_linear() -> None:
    """FSDP gathering one linear at a time: the double buffer holds the largest linear, the time
    projection ``6 d^2 + 6 d`` (14.16 M) just above an FFN matrix ``d f + f`` (13.77 M)."""
    blk = footprint(M, P, tp=4, sp=2, weights="fsdp")
    lin = footprint(M, P, tp=4, sp=2, weights="fsdp", gather_unit="linear")
    assert lin.item("weight_gather_buffer").per_core == 2 * (6 * 1536 * 1536 + 6 * 1536) * 2
    assert 6 * 1536 * 1536 + 6 * 1536 > 1536 * 8960 + 8960
    assert blk.item("weight_gather_buffer").per_core == 2 * 46_440_704 * 2  # one block
    assert blk.per_chip - lin.per_chip == 8 * 2 * 2 * (46_440_704 - 14_164_992)
    with pytest.raises(ValueError, match="unit must be one of"):
        footprint(M, P, tp=4, sp=2, weights="fsdp", gather_unit="layer")
