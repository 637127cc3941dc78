"""The training forward of the demo DiT: one differentiable forward whose attention is the stream's.

A training sequence is ``[clean blocks 0 .. s-1 | window blocks s .. e]`` of one clip (latents
``[B, (e+1)*fpb, C, H, W]``). :func:`training_layout` turns a window of the Rolling Forcing stream into the
*passes* of that sequence, read off :mod:`rolling_forcing.schedule` in ``positions="relative"`` mode:

* every clean block b gets the key set of its cache-update pass (:func:`schedule.update_pass` of the
  window whose start block is b: the last ``key_budget_blocks`` blocks ending at b, the sink only while
  it is among them), at the positions that pass uses;
* the window's blocks get the key set of the window's denoise pass (:func:`schedule.denoise_pass`: the
  sink re-roped just before the working cache, the working cache, the window's own keys), at its
  positions.

Keys and values of a clean block at layer l are computed in this forward from its hidden state, which
(by induction over the layers and blocks) equals the one its update pass computed in the stream, where
they are what the KV cache holds; so the window's prediction equals the pipeline's for the same clean
context up to fp32 rounding (``tests/test_demo_train.py`` checks it against the real pipeline).
:func:`pass_attention` is the :data:`rolling_forcing.model.SelfAttnFn` doing that: per pass it ropes the
pass's queries and a copy of its keys at the pass's positions (interleaved-pair RoPE in fp32 with
:func:`nki_kernels.ops.rope_tables` factors, the reference's rotation) and runs softmax attention
(``torch.nn.functional.scaled_dot_product_attention``, differentiable).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nki_kernels import ops
from rolling_forcing import schedule
from rolling_forcing.config import ModelConfig, PipelineConfig
from rolling_forcing.model import CausalWanModel, Grid, SelfAttnFn, TextKV

__all__ = [
    "TrainLayout",
    "TrainPass",
    "pass_attention",
    "rope_pairs",
    "long_layout",
    "training_forward",
    "training_layout",
]


@dataclass(frozen=True)
class TrainPass:
    """Queries ``query_blocks`` blocks from sequence block ``query_block`` at frame position
    ``query_position``; ``keys`` = ``(sequence block, frame position of its first frame)`` in key order
    (a pass's own keys included)."""

    query_block: int
    query_blocks: int
    query_position: int
    keys: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class TrainLayout:
    """Window ``window`` of a ``num_blocks``-block stream as a training sequence (module docstring)."""

    num_blocks: int
    window: int
    start: int  # s: the clean blocks are 0 .. s-1
    end: int  # e (inclusive): the window is s .. e
    levels: tuple[int, ...]  # level index per window block, oldest first
    kind: str
    passes: tuple[TrainPass, ...]
    blocks: tuple[int, ...] = ()  # stream block of each sequence block (empty: the identity 0 .. e)

    @property
    def sequence_blocks(self) -> int:
        return self.end + 1

    @property
    def stream_blocks(self) -> tuple[int, ...]:
        """The stream block of each sequence block, oldest first (``0 .. e`` unless :func:`long_layout`)."""
        return self.blocks if self.blocks else tuple(range(self.end + 1))


def training_layout(cfg: PipelineConfig, num_blocks: int, window: int) -> TrainLayout:
    """The passes of window ``window`` of a ``num_blocks``-block stream (pure index maths; see the module
    docstring). Raises ``ValueError`` for a window outside the stream (:func:`schedule.window_range`)."""
    plan = schedule.window_plan(cfg, num_blocks, window, "relative")
    s, e, fpb = plan.start_block, plan.end_block, cfg.frames_per_block
    passes = []
    for b in range(s):  # the update pass that cached block b ran in the window starting at b
        up = schedule.update_pass(cfg, num_blocks, b + cfg.window_blocks - 1, "relative")
        assert up.query_blocks == (b,) and up.cache_keys[-1].block == b
        passes.append(TrainPass(b, 1, up.query_position, tuple((k.block, k.position) for k in up.cache_keys)))
    dn = plan.denoise
    own = tuple((s + i, dn.query_position + i * fpb) for i in range(plan.num_blocks))
    passes.append(
        TrainPass(
            s, plan.num_blocks, dn.query_position, tuple((k.block, k.position) for k in dn.cache_keys) + own
        )
    )
    return TrainLayout(num_blocks, window, s, e, plan.levels, plan.kind, tuple(passes))


def long_layout(cfg: PipelineConfig, num_blocks: int, window: int) -> TrainLayout:
    """Window ``window`` of a long stream as a short training sequence: the sink, the clean blocks the
    window's denoise pass reads (the working cache), the blocks *their* update passes read, then the window.

    So the window's denoise pass and the update passes of every clean block it reads are the stream's
    exactly (13 blocks at most: a full window reads 1 working block, whose update pass reads 7 blocks; the
    last tail window 5, reading 11). Older clean blocks' update passes lose the keys of blocks outside
    the sequence: exact for a DiT of up to 2 layers, an approximation from the third layer on (what
    reaches the window is those blocks' keys at layer >= 2 through the working cache's update passes).
    Windows whose clean context is all kept are :func:`training_layout` unchanged. Block indices of the
    passes are *sequence* indices; :attr:`TrainLayout.stream_blocks` maps them back."""
    full = training_layout(cfg, num_blocks, window)
    s, e = full.start, full.end
    read = {b for b, _ in full.passes[-1].keys if b < s}
    need = set(read)
    for p in full.passes[:-1]:
        if p.query_block in read:
            need |= {b for b, _ in p.keys}
    kept = (*sorted(need), *range(s, e + 1))
    if kept == tuple(range(e + 1)):
        return full
    seq = {b: i for i, b in enumerate(kept)}
    passes = []
    for p in full.passes:
        if p.query_block not in seq:
            continue
        keys = tuple((seq[b], pos) for b, pos in p.keys if b in seq)
        passes.append(TrainPass(seq[p.query_block], p.query_blocks, p.query_position, keys))
    start = seq[s]
    return TrainLayout(
        num_blocks, window, start, start + e - s, full.levels, full.kind, tuple(passes), tuple(kept)
    )


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of ``x`` ``[B, L, H, D]`` with factors ``[L, D//2]``: pair ``(x[2i], x[2i+1])`` is rotated as the
    complex number ``x[2i] + i x[2i+1]`` times ``cos + i sin`` (the reference's convention), in x's dtype,
    differentiable."""
    b, n, h, d = x.shape
    xp = x.reshape(b, n, h, d // 2, 2)
    x0, x1 = xp[..., 0], xp[..., 1]
    c, s = cos[None, :, None, :].to(x.dtype), sin[None, :, None, :].to(x.dtype)
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).reshape(b, n, h, d)


def pass_attention(layout: TrainLayout, model_cfg: ModelConfig, fpb: int) -> SelfAttnFn:
    """The :data:`SelfAttnFn` of ``layout``'s training sequence (module docstring).

    In the last layer of a forward with ``context_frames = s*fpb`` it receives q of the window only and
    skips the clean blocks' passes (their outputs are never read, as in the stream's update pass)."""
    hp, wp = model_cfg.grid_hw
    tpb = fpb * hp * wp
    top = max(max(pos for _, pos in p.keys) for p in layout.passes) + fpb
    top = max(top, max(p.query_position + p.query_blocks * fpb for p in layout.passes))
    cos, sin = ops.rope_tables((top, hp, wp), model_cfg.head_dim, 0, dtype=torch.float32)

    def rows(position: int, blocks: int) -> slice:
        return slice(position * hp * wp, (position + blocks * fpb) * hp * wp)

    def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Grid) -> torch.Tensor:
        offset = k.shape[1] - q.shape[1]
        cq, sq = cos.to(q.device), sin.to(q.device)
        outs = []
        for p in layout.passes:
            q0, q1 = p.query_block * tpb, (p.query_block + p.query_blocks) * tpb
            if q1 <= offset:
                continue
            if q0 < offset:
                raise ValueError(f"q starts inside pass of block {p.query_block} (offset {offset} tokens)")
            r = rows(p.query_position, p.query_blocks)
            qr = rope_pairs(q[:, q0 - offset : q1 - offset], cq[r], sq[r])
            kk = torch.cat([k[:, b * tpb : (b + 1) * tpb] for b, _ in p.keys], dim=1)
            vv = torch.cat([v[:, b * tpb : (b + 1) * tpb] for b, _ in p.keys], dim=1)
            ck = torch.cat([cq[rows(pos, 1)] for _, pos in p.keys])
            sk = torch.cat([sq[rows(pos, 1)] for _, pos in p.keys])
            kr = rope_pairs(kk, ck, sk)
            o = F.scaled_dot_product_attention(qr.transpose(1, 2), kr.transpose(1, 2), vv.transpose(1, 2))
            outs.append(o.transpose(1, 2))
        return torch.cat(outs, dim=1)

    return attn


def training_forward(
    model: CausalWanModel,
    layout: TrainLayout,
    pipe_cfg: PipelineConfig,
    x: torch.Tensor,
    timesteps: torch.Tensor,
    text_kv: TextKV,
    attn: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """Flow prediction of the window blocks ``[B, (e-s+1)*fpb, C, H, W]``.

    Args:
        x: the sequence ``[B, (e+1)*fpb, C, H, W]``: clean blocks 0..s-1 then the window's noisy blocks.
        timesteps: ``[B, (e+1)*fpb]`` float32 (0 on the clean blocks, the levels' timesteps on the window).
        text_kv: ``model.text_kv(text embeddings)``.
        attn: the self-attention (default :func:`pass_attention` of ``layout``).
    """
    fpb = pipe_cfg.frames_per_block
    if x.shape[1] != layout.sequence_blocks * fpb:
        raise ValueError(
            f"x must hold {layout.sequence_blocks} blocks ({layout.sequence_blocks * fpb} frames), got "
            f"{x.shape[1]} frames"
        )
    fn = attn if attn is not None else pass_attention(layout, model.cfg, fpb)
    return model.forward_with(x, timesteps, text_kv, fn, context_frames=layout.start * fpb)
