"""The persistent floor, the shared DiT/VAE workspace, the per-frame VAE and the TAEHV items
(perf/footprint_phases.py, perf/footprint_vae.vae_frame_split, footprint(workspace=, vae_split=)) at
Wan2.1-1.3B 480x832 TP4xSP2, against counts worked by hand from the layer shapes (exact bytes, no
tolerance) or summed another way from the raw table perf/wan_vae_table.py."""

from __future__ import annotations

import math

import pytest

from perf import wan_vae_table as table
from perf.footprint import activation_peak_bytes, footprint, model_at_resolution, vae_probe
from perf.footprint_phases import (
    persistent_floor,
    shared_workspace,
    taehv_footprint,
    taehv_items,
    taehv_params,
    taehv_peak_elems,
    taehv_state_elems,
)
from perf.footprint_vae import layer_frames, vae_frame_split
from rolling_forcing.config import PipelineConfig, get_preset

P = PipelineConfig(dtype="bfloat16")
M = model_at_resolution(get_preset("wan2.1-1.3b"), 480, 832, 8)
VAE = vae_probe(M.latent_height, M.latent_width, P.frames_per_block)
COMPACT = {"weights": "fsdp", "vae_weights": "fsdp", "kv_cache": "sp_compact"}
HW = 60 * 104  # latent 480 / 8 x 832 / 8

# the decoder's causal convs per frame, by hand from the Wan2.1 decoder's stages (channels x resolution
# scale): conv_in 16 @1x; mid + up-block 0: 10 x 384 @1x; up-block 1: the 1x1x1 shortcut and the first
# 3x3x3 conv read 192 @2x, five more 384 @2x; up-block 2: 6 x 192 @4x; up-block 3 + conv_out: 7 x 96 @8x
CAUSAL_PER_FRAME = 16 * HW + 10 * 384 * HW + 2 * 192 * 4 * HW + 5 * 384 * 4 * HW + 6 * 192 * 16 * HW
CAUSAL_PER_FRAME += 7 * 96 * 64 * HW


def test_vae_causal_cache_by_hand():
    assert VAE.feat_cache_elems == 2 * CAUSAL_PER_FRAME == 929_909_760
    assert 2 * 7 * 96 * 64 * HW * 2 == 1_073_479_680  # the 7 full-res 96-channel convs: 1.07 GB of 1.86


def test_frame_split_peak_and_calls_by_hand_and_from_the_raw_table():
    """The largest call: the up-sampler's 3x3 Conv2d 192 -> 96 at 480x832 over 4 frames (460,062,720
    elements in + out); one output frame per call: a quarter. The raw table's 4-frame layers (their
    shapes' frame field is "4" in and out), counted from the strings, each become 4 calls."""
    split = vae_frame_split(VAE)
    assert VAE.peak_layer_elems == 4 * (192 + 96) * 480 * 832 == 460_062_720
    assert split.peak_layer_elems == (192 + 96) * 480 * 832 == 115_015_680
    assert split.feat_cache_elems == VAE.feat_cache_elems and split.first == VAE.first
    assert split.frame_split and not VAE.frame_split

    def frames(tok: str) -> str:
        dims = tok.split(",")
        return dims[0] if len(dims) == 4 else dims[2]

    four = sum(1 for _, i, o, _ in table.STEADY if frames(i) == "4" and frames(o) == "4")
    assert four > 0
    assert len(split.steady) == len(VAE.steady) + P.frames_per_block * 3 * four
    elems = sum(math.prod(r.in_shape) + math.prod(r.out_shape) for r in VAE.steady)
    assert elems == sum(math.prod(r.in_shape) + math.prod(r.out_shape) for r in split.steady)
    assert vae_frame_split(split) == split  # nothing left to split
    assert (layer_frames((4, 96, 8, 8)), layer_frames((1, 96, 2, 8, 8))) == (4, 2)
    with pytest.raises(ValueError, match="shape must be"):
        layer_frames((96, 8, 8))


def test_persistent_floor_by_hand():
    """10,977,099,366 B in bf16: 7 ring slots of 4,680 tokens, one DiT copy, the text k/v once, one VAE
    copy, the causal cache; FP8 KV cache: the ring at 1.03125 B per element, 8.05 GB (over 8 GB)."""
    fl = persistent_floor(M, P, cores=8, vae=VAE)
    want = {
        "kv_cache": 7 * 4680 * 1536 * 2 * 30 * 2,
        "dit_weights": 1_418_996_800 * 2,
        "text_kv": 512 * 1536 * 2 * 30 * 2,
        "vae_weights": 73_295_603 * 2,
        "vae_causal_cache": 2 * CAUSAL_PER_FRAME * 2,
    }
    assert {i.name: i.per_chip for i in fl.items} == want
    assert fl.per_chip == sum(want.values()) == 10_977_099_366
    assert fl.item("kv_cache").per_core == math.ceil(want["kv_cache"] / 8)
    f8 = persistent_floor(M, P, cores=8, vae=VAE, kv_bytes=1.03125)
    assert f8.per_chip == int(7 * 4680 * 1536 * 2 * 30 * 1.03125) + sum(want.values()) - want["kv_cache"]
    assert 8e9 < f8.per_chip < 8.1e9
    assert fl.label.startswith("floor (bf16)") and f8.label.startswith("floor (fp8 KV cache)")
    # the floor is the lean placement's persistent items, per chip (an FSDP shard pads to 8 x ceil(/ 8))
    lean = footprint(M, P, tp=4, sp=2, vae=VAE, gather_unit="linear", workspace="shared", **COMPACT)
    for i in fl.items:
        assert 0 <= lean.item(i.name).per_chip - i.per_chip < 8


def test_shared_workspace_is_the_larger_phase_by_hand():
    """Per core, DiT phase: 2 x the time projection 6d^2 + 6d (the largest linear, 14,164,992 > FFN
    13,771,520) x 2 B + the 8-slot K/V gather of 3 heads + one layer's text k/v + the activations; VAE
    phase: 2 x the largest decoder conv + the largest call's in+out / 8. The DiT phase is the larger."""
    fp = footprint(M, P, tp=4, sp=2, vae=VAE, gather_unit="linear", workspace="shared", **COMPACT)
    dit = 2 * 14_164_992 * 2 + 8 * 4680 * 3 * 128 * 2 * 2 + 512 * 1536 * 2 * 2
    dit += activation_peak_bytes(M, P, 4, 2)["peak"]
    vae = 2 * 384 * 384 * 27 * 2 + math.ceil(460_062_720 * 2 / 8)
    assert fp.item("phase_workspace").per_core == max(dit, vae) == dit
    assert fp.item("phase_workspace").per_chip == 8 * dit
    floor = persistent_floor(M, P, cores=8, vae=VAE).per_chip
    assert fp.per_chip - (floor + 8 * dit) == 8 * math.ceil(73_295_603 * 2 / 8) - 73_295_603 * 2  # shard pad
    sep = footprint(M, P, tp=4, sp=2, vae=VAE, gather_unit="linear", vae_split="output_frame", **COMPACT)
    names = [i.name for i in sep.items]
    assert "vae_causal_cache" in names and "vae_workspace" not in names and "phase_workspace" not in names
    assert sep.item("vae_conv_workspace").per_chip == 115_015_680 * 2
    # the old placements keep the joint item, and it is the two new ones' sum
    old = footprint(M, P, tp=4, sp=2, vae=VAE, **COMPACT)
    new = footprint(M, P, tp=4, sp=2, vae=VAE, workspace="shared", **COMPACT)
    assert old.item("vae_workspace").per_chip == (VAE.feat_cache_elems + VAE.peak_layer_elems) * 2
    assert old.item("vae_workspace").per_chip == new.item("vae_causal_cache").per_chip + 460_062_720 * 2
    dit_blk = dit - 2 * 14_164_992 * 2 + 2 * 46_440_704 * 2  # block gathers: 2 x one whole block
    assert old.per_chip - new.per_chip == 8 * min(dit_blk, vae)  # the sum minus the max


def test_per_linear_gather_buffer_by_hand():
    blk = footprint(M, P, tp=4, sp=2, vae=VAE, **COMPACT)
    lin = footprint(M, P, tp=4, sp=2, vae=VAE, gather_unit="linear", **COMPACT)
    assert blk.item("weight_gather_buffer").per_chip == 8 * 2 * 46_440_704 * 2
    assert lin.item("weight_gather_buffer").per_chip == 8 * 2 * (6 * 1536 * 1536 + 6 * 1536) * 2
    assert blk.per_chip - lin.per_chip == 8 * 2 * (46_440_704 - 14_164_992) * 2  # 1.03 GB per chip


def test_footprint_rejects_bad_phase_options():
    kw = {"tp": 4, "sp": 2, "vae": VAE, **COMPACT}
    with pytest.raises(ValueError, match="workspace must be one of"):
        footprint(M, P, workspace="pooled", **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="vae_split must be one of"):
        footprint(M, P, vae_split="tile", **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="need vae"):
        footprint(M, P, tp=4, sp=2, workspace="shared", weights="fsdp")
    with pytest.raises(ValueError, match="need vae"):
        footprint(M, P, tp=4, sp=2, vae_split="output_frame")
    with pytest.raises(ValueError, match="gather_unit must be one of"):
        footprint(M, P, gather_unit="layer", **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="only applies to weights='fsdp'"):
        footprint(M, P, tp=4, sp=2, gather_unit="linear")
    with pytest.raises(ValueError, match="cores must be a positive int"):
        persistent_floor(M, P, cores=0, vae=VAE)
    with pytest.raises(ValueError, match="act_bytes must be > 0"):
        persistent_floor(M, P, cores=8, vae=VAE, act_bytes=0)
    joint = footprint(M, P, **kw)
    with pytest.raises(ValueError, match="split vae_workspace first"):
        shared_workspace(list(joint.items))
    with pytest.raises(ValueError, match="needs items of both phases"):
        shared_workspace([i for i in joint.items if not i.name.startswith("vae")])


def test_taehv_items_by_hand():
    """The published TAEHV decoder (github.com/madebyollin/taehv): 16 -> 256 conv (bias), 3 memory blocks
    of 2n -> n, n -> n, n -> n convs (biases) per stage at 256, 128, 64, 1x1 time-grow convs n -> n x
    (1, 2, 2) and 3x3 projections 256 -> 128 -> 64 -> 64 (no biases), 64 -> 3 (bias)."""

    def mem(n: int) -> int:
        return 3 * ((2 * n * n * 9 + n) + 2 * (n * n * 9 + n))

    want = 16 * 256 * 9 + 256 + mem(256) + 256 * 256 + 256 * 128 * 9 + mem(128) + 128 * 256 + 128 * 64 * 9
    want += mem(64) + 64 * 128 + 64 * 64 * 9 + 64 * 3 * 9 + 3
    assert taehv_params() == want == 9_844_611
    state = 3 * (256 * HW + 128 * 4 * HW + 64 * 16 * HW)
    assert taehv_state_elems(60, 104) == state == 33_546_240
    assert taehv_peak_elems(60, 104) == (64 + 128) * 480 * 832  # the last time-grow: 64 in, 2 x 64 out
    items = {i.name: i for i in taehv_items(60, 104, 8)}
    assert items["vae_causal_cache"].per_chip == state * 2
    assert items["vae_weights"].per_core == math.ceil(want * 2 / 8)
    assert items["vae_gather_buffer"].per_core == 2 * 512 * 256 * 9 * 2
    fp = taehv_footprint(M, P, tp=4, sp=2, gather_unit="linear", **COMPACT)
    lean = footprint(M, P, tp=4, sp=2, vae=VAE, gather_unit="linear", workspace="shared", **COMPACT)
    wan = sum(lean.item(n).per_chip for n in ("vae_weights", "vae_causal_cache"))
    tae = items["vae_weights"].per_chip + items["vae_causal_cache"].per_chip
    assert fp.per_chip == lean.per_chip - wan + tae  # same DiT phase workspace (it is the larger one)
    assert fp.label.startswith("tiny decoder")
    with pytest.raises(ValueError, match="latent_h must be a positive int"):
        taehv_state_elems(0, 104)
    with pytest.raises(ValueError, match="workspace must be one of"):
        taehv_footprint(M, P, tp=4, sp=2, workspace="pooled", **COMPACT)
