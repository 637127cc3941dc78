"""Pure-PyTorch reference attention: full softmax in fp32, optional log-sum-exp, segment gather, merge.

Layouts follow the projection output viewed per head: q ``[B, Lq, H, D]``, k and v ``[B, Lk, H, D]``,
out ``[B, Lq, H, D]`` (the layout the output projection consumes). No causal mask (Rolling Forcing's
attention is block-bidirectional over whatever keys it is given).

Depends on torch only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

SCORE_BUDGET_ELEMENTS = 1 << 26
"""Max fp32 score elements held at once (256 MiB); longer queries are processed in row chunks."""


def default_scale(head_dim: int) -> float:
    """Softmax scale used when ``scale=None``: ``1 / sqrt(head_dim)``."""
    return 1.0 / math.sqrt(head_dim)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    return_lse: bool = False,
    fp8: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``softmax(q k^T * scale) v`` per batch and head, computed in fp32.

    Args:
        q: ``[B, Lq, H, D]``.
        k, v: ``[B, Lk, H, D]``.
        scale: softmax scale, default ``1/sqrt(D)``.
        return_lse: also return the natural log-sum-exp of the scaled scores.
        fp8: the FP8 option (P.V in e4m3 with a per-tile offset and per-channel V scales):
            :func:`reference.attention_fp8.attention` (Lk >= 1).

    Returns:
        out ``[B, Lq, H, D]`` in q's dtype, and if ``return_lse`` the lse ``[B, Lq, H]`` fp32. With Lk = 0
        the output is zeros and the lse is ``-inf`` (the neutral element of :func:`merge_attention`).
    """
    if fp8:
        from reference import attention_fp8

        return attention_fp8.attention(q, k, v, scale=scale, return_lse=return_lse)
    if scale is None:
        scale = default_scale(q.shape[-1])
    b, lq, h, _ = q.shape
    kf, vf = k.float(), v.float()
    # query rows are independent: process them in chunks so the fp32 score matrix stays bounded
    rows = max(1, SCORE_BUDGET_ELEMENTS // max(1, b * h * k.shape[1]))
    outs, lses = [], []
    for lo in range(0, lq, rows):
        qf = q[:, lo : lo + rows].float()
        s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
        lse = torch.logsumexp(s, dim=-1)  # [B, H, rows]
        p = torch.exp(s - lse[..., None]) if s.shape[-1] else s
        outs.append(torch.einsum("bhqk,bkhd->bqhd", p, vf).to(q.dtype))
        lses.append(lse.permute(0, 2, 1))
    out = torch.cat(outs, dim=1).contiguous() if outs else q.new_empty(q.shape)
    if return_lse:
        lse_all = (
            torch.cat(lses, dim=1).contiguous() if lses else q.new_empty((b, lq, h), dtype=torch.float32)
        )
        return out, lse_all
    return out


def gather_segments(kv: torch.Tensor, segments: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Concatenate ``kv[:, start:start+length]`` for each ``(start, length)`` in order (dim 1)."""
    return torch.cat([kv[:, int(s) : int(s) + int(n)] for s, n in segments], dim=1)


def attention_segments(
    q: torch.Tensor,
    kv_k: torch.Tensor,
    kv_v: torch.Tensor,
    segments: Sequence[tuple[int, int]],
    scale: float | None = None,
    return_lse: bool = False,
    fp8: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over the keys/values formed by ordered segments of a KV buffer.

    Args:
        q: ``[B, Lq, H, D]``.
        kv_k, kv_v: KV buffers ``[B, S, H, D]``.
        segments: ordered ``(start, length)`` token ranges over S; keys are their concatenation.
        scale, return_lse, fp8: as in :func:`attention`.

    The reference simply gathers the segments and calls :func:`attention`.
    """
    k = gather_segments(kv_k, segments)
    v = gather_segments(kv_v, segments)
    return attention(q, k, v, scale=scale, return_lse=return_lse, fp8=fp8)


def merge_attention(
    outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine partial attention results over disjoint key sets.

    Args:
        outs: partial outputs ``[B, Lq, H, D]`` (each normalised over its own keys).
        lses: their log-sum-exps ``[B, Lq, H]``.

    Returns:
        ``(out, lse)``: ``lse = logsumexp_i lse_i``, ``out = sum_i exp(lse_i - lse) * out_i`` (computed in
        fp32, out cast to ``outs[0].dtype``, lse fp32). Partials with ``lse = -inf`` (no keys) weigh zero.
    """
    if len(outs) != len(lses) or not outs:
        raise ValueError(f"outs and lses must be non-empty and of equal length, got {len(outs)}, {len(lses)}")
    lse_stack = torch.stack([x.float() for x in lses], dim=0)
    lse = torch.logsumexp(lse_stack, dim=0)
    w = torch.exp(lse_stack - lse[None])
    w = torch.nan_to_num(w, nan=0.0)  # all partials empty: -inf - -inf
    out = sum(w[i][..., None] * o.float() for i, o in enumerate(outs))
    assert isinstance(out, torch.Tensor)
    return out.to(outs[0].dtype), lse


def attention_block_table(
    q: torch.Tensor,
    k_sources: Sequence[torch.Tensor],
    v_sources: Sequence[torch.Tensor],
    block_table: torch.Tensor,
    q_groups: Sequence[int],
    block_tokens: int,
    scale: float | None = None,
    return_lse: bool = False,
    fp8: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Grouped attention whose keys are whole blocks picked from several KV sources by a block table.

    Args:
        q: ``[B, Lq, H, D]``; its tokens are split into consecutive query groups of ``q_groups`` tokens.
        k_sources, v_sources: KV sources, source i ``[B, S_i, H, D]`` (k and v alike), S_i a multiple of
            ``block_tokens``; block j of source i is tokens ``[j*block_tokens, (j+1)*block_tokens)``.
        block_table: integer ``[G, NB, 2]``: entry ``(g, n)`` = ``(source, block)`` is the n-th key block of
            query group g; ``source = -1`` marks an empty entry (no keys). Keys of a group are its non-empty
            entries concatenated in table order.
        q_groups: query tokens per group (G values, summing to Lq).
        block_tokens: tokens per key block.
        scale, return_lse: as in :func:`attention`.
        fp8: :func:`reference.attention_fp8.attention_block_table` (V's scales over every source).

    The reference gathers each group's blocks and calls :func:`attention` (a group with no keys gives
    zeros and lse ``-inf``). Returns ``out`` ``[B, Lq, H, D]`` (and lse ``[B, Lq, H]`` fp32).
    """
    if fp8:
        from reference import attention_fp8

        return attention_fp8.attention_block_table(
            q, k_sources, v_sources, block_table, q_groups, block_tokens, scale=scale, return_lse=return_lse
        )

    def attend(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        res = attention(qg, k, v, scale=scale, return_lse=True)
        assert isinstance(res, tuple)
        return res

    out, lse = block_table_groups(q, k_sources, v_sources, block_table, q_groups, block_tokens, attend)
    return (out, lse) if return_lse else out


def block_table_groups(
    q: torch.Tensor,
    k_sources: Sequence[torch.Tensor],
    v_sources: Sequence[torch.Tensor],
    block_table: torch.Tensor,
    q_groups: Sequence[int],
    block_tokens: int,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block-table gather of :func:`attention_block_table` (same layouts): each query group's
    non-empty blocks concatenated in table order and passed to ``attend(q_group, k, v) -> (out, lse)``;
    a group with no keys gives zeros and lse ``-inf``.
    Returns ``out`` ``[B, Lq, H, D]``, lse ``[B, Lq, H]``."""
    table = block_table.tolist()
    outs, lses = [], []
    lo = 0
    for g, nq in enumerate(q_groups):
        qg = q[:, lo : lo + int(nq)]
        lo += int(nq)
        ks, vs = [], []
        for src, blk in table[g]:
            if src < 0:
                continue
            a, b = blk * block_tokens, (blk + 1) * block_tokens
            ks.append(k_sources[src][:, a:b])
            vs.append(v_sources[src][:, a:b])
        if ks:
            o, lse = attend(qg, torch.cat(ks, dim=1), torch.cat(vs, dim=1))
        else:
            o = torch.zeros_like(qg)
            lse = torch.full(qg.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, dim=1).contiguous(), torch.cat(lses, dim=1).contiguous()


__all__ = [
    "attention",
    "attention_block_table",
    "block_table_groups",
    "attention_segments",
    "default_scale",
    "gather_segments",
    "merge_attention",
]
