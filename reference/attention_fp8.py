"""Pure-PyTorch reference of the FP8 attention option (``fp8=True``): P.V in e4m3, Q.K^T in bf16.

What the kernels' streamed static pass computes with ``fp8=True`` (``nki_kernels/attention_stream.py``,
docs/kernels/attention_fp8.md), per batch b and head h:

* Scores ``s = q k^T`` in fp32 from the inputs as given (bf16 on the production path), as without the option.
* Offset per 128-query tile (tiles from the call's first query, or from each block-table group's first
  query): ``m_t`` = the largest unscaled score of the tile's rows against the first ``min(1024, Lk)`` keys
  (the kernel's first key chunk); ``nm_t = -scale * m_t + ln(P_SCALE)`` (fp32, two roundings).
* ``P = e4m3(exp(scale * s + nm_t))``: the ScalarE exp writes NeuronCore-v3 e4m3 (max finite 240; RNE;
  ``>= 248`` becomes inf, which the kernel's guard catches and recomputes in bf16). The first chunk's
  largest term is ``P_SCALE`` (so a later key may score ``ln(240 / P_SCALE)`` nats above the offset).
* V per (b, h) and channel d over the call's keys: ``v_scale = max(max_j |v_jd|, 2**-96) / 240`` (fp32),
  ``V8 = e4m3(v * (1 / v_scale))`` (the fp32 reciprocal, then one fp32 product, RNE).
* ``o = P V8`` and ``l = sum_j P`` in fp32 (exact products of e4m3 values); ``out = ((o * (1 / l)) *
  v_scale)`` in q's dtype, ``lse = log(l) - nm_t`` (fp32).

Q.K^T stays bf16: at head_dim 128 the FP8 double-row matmul cannot speed it up (its 256-row contraction is
twice the head dim) and a plain FP8 matmul runs at the bf16 rate on trn2 (docs/kernels/attention_fp8.md).

Depends on torch only. Every function takes the parameter names of :mod:`reference.attention`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from reference.attention import block_table_groups, gather_segments

E4M3_MAX = 240.0
"""Largest finite NeuronCore-v3 ``float8_e4m3`` value (the type TensorE's double-row matmul takes on trn2)."""

P_SCALE = 16.0
"""Value of the first key chunk's largest exponential in P (the exp's bias adds ``ln(P_SCALE)``): a later
key may score ``ln(240 / 16) = 2.7`` nats above the tile's first-chunk maximum before P overflows, and a
term stays a normal e4m3 value down to ``ln(16 / 2**-6) = 6.9`` nats below it (docs/kernels/attention_fp8.md,
"FP8 attention", for how it was chosen)."""

LN_P_SCALE = math.log(P_SCALE)
"""``ln(P_SCALE)`` as the kernel adds it to the offset (rounded to fp32 there)."""

FIRST_CHUNK = 1024
"""Keys of the kernel's first key chunk (the static offset's chunk)."""

TILE = 128
"""Queries per tile (one offset each)."""

_E4M3_TIES = 2.0**-9
"""Smallest positive e4m3 subnormal."""


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 ``x`` to NeuronCore-v3 e4m3 values (round to nearest even, subnormals down to 2**-9;
    ``|x| >= 248`` becomes ``+-inf`` and NaN stays NaN, as the ml_dtypes type the emulator casts to),
    returned as fp32."""
    x = x.float()
    fin = x.abs() < 248.0  # the rounding boundary above 240 (240 + half an ulp of 16)
    # torch's float8_e4m3fn carries the same values in [-240, 240] (only encodings above 240 differ)
    q = x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return torch.where(fin, q, x * math.inf)


def v_scales(v: torch.Tensor) -> torch.Tensor:
    """``[B, H, D]`` fp32: ``max(max_j |v[b, j, h, d]|, 2**-96) / 240`` over the keys of ``v``
    ``[B, Lk, H, D]``."""
    a = v.float().abs().amax(dim=1).clamp_min(2.0**-96)
    return a / E4M3_MAX


def quantize_v(v: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
    """``e4m3(v * (1 / v_scale))`` as fp32 ``[B, Lk, H, D]`` (the kernel's reciprocal, then one product)."""
    inv = torch.reciprocal(v_scale.float())  # [B, H, D]
    return e4m3(v.float() * inv[:, None])


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    return_lse: bool = False,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """FP8 (P.V) attention of q ``[B, Lq, H, D]`` over k, v ``[B, Lk, H, D]`` (module docstring).

    ``v_scale`` ``[B, H, D]`` fp32: V's dequantisation scale (default :func:`v_scales` of ``v``; the
    block table passes the scale of all its sources). Returns out ``[B, Lq, H, D]`` in q's dtype (and
    lse ``[B, Lq, H]`` fp32). Lk >= 1."""
    b, lq, h, d = q.shape
    lk = k.shape[1]
    if lk < 1:
        raise ValueError("attention (fp8): needs Lk >= 1 keys")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    vs = v_scales(v) if v_scale is None else v_scale.float()
    v8 = quantize_v(v, vs)  # [B, Lk, H, D]
    kf = k.float()
    sc = torch.tensor(scale, dtype=torch.float32)
    outs, lses = [], []
    for t0 in range(0, lq, TILE):
        qf = q[:, t0 : t0 + TILE].float()
        s = torch.einsum("bqhd,bkhd->bhqk", qf, kf)  # [B, H, n, Lk] fp32
        m = s[..., : min(FIRST_CHUNK, lk)].amax(dim=(2, 3))  # [B, H] the tile's first-chunk maximum
        nm = (-sc * m) + torch.tensor(LN_P_SCALE, dtype=torch.float32)
        p = e4m3(torch.exp(s * sc + nm[..., None, None]))
        o = torch.einsum("bhqk,bkhd->bqhd", p, v8)
        l_row = p.sum(dim=-1).permute(0, 2, 1)  # [B, n, H]
        r = torch.reciprocal(l_row.clamp_min(1e-30))
        outs.append(((o * r[..., None]) * vs[:, None]).to(q.dtype))
        lses.append(torch.log(l_row) - nm[:, None, :])
    out = torch.cat(outs, dim=1).contiguous()
    if return_lse:
        return out, torch.cat(lses, dim=1).contiguous()
    return out


def attention_segments(
    q: torch.Tensor,
    kv_k: torch.Tensor,
    kv_v: torch.Tensor,
    segments: Sequence[tuple[int, int]],
    scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention` over the concatenated ``(start, length)`` segments of ``[B, S, H, D]`` buffers
    (V's scale over the segments' keys)."""
    k = gather_segments(kv_k, segments)
    v = gather_segments(kv_v, segments)
    return attention(q, k, v, scale=scale, return_lse=return_lse)


def block_table_v_scale(v_sources: Sequence[torch.Tensor]) -> torch.Tensor:
    """V's scale of a block-table call: :func:`v_scales` over every token of every source."""
    return v_scales(torch.cat([s.float() for s in v_sources], dim=1))


def attention_block_table(
    q: torch.Tensor,
    k_sources: Sequence[torch.Tensor],
    v_sources: Sequence[torch.Tensor],
    block_table: torch.Tensor,
    q_groups: Sequence[int],
    block_tokens: int,
    scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention` per query group over its table's non-empty blocks (tiles from each group's first
    query; V's scale over all of ``v_sources``, :func:`block_table_v_scale`). A group without keys gives
    zeros and lse ``-inf``. With empty entries among a group's first 1,024 key positions the kernel's
    offset may differ from this one (docs/kernels/attention_fp8.md)."""
    vs = block_table_v_scale(v_sources)

    def attend(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        res = attention(qg, k, v, scale=scale, return_lse=True, v_scale=vs)
        assert isinstance(res, tuple)
        return res

    out, lse = block_table_groups(q, k_sources, v_sources, block_table, q_groups, block_tokens, attend)
    return (out, lse) if return_lse else out


__all__ = [
    "E4M3_MAX",
    "LN_P_SCALE",
    "P_SCALE",
    "attention",
    "attention_block_table",
    "attention_segments",
    "block_table_v_scale",
    "e4m3",
    "quantize_v",
    "v_scales",
]
