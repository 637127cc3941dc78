"""Sharded self-attention on ``torch.distributed``: TP over heads x SP over queries (see ``sharding.plan``).

On CPU this runs on the gloo backend (``sharding.launch``). On Trainium the same code runs unchanged with
the XLA process group of torch-neuronx (``torch.distributed.init_process_group("xla")`` after
``import torch_xla.distributed.xla_backend``): only ``all_to_all_single`` and ``all_gather`` on
subgroups are used. The plan's TP and SP groups must then be legal Neuron collective group sizes,
which :func:`sharding.plan.plan` guarantees.

Rank layout: ``rank = s * tp + g`` (``g`` head group, ``s`` query shard). Every rank holds a contiguous
*token shard* of q, k, v ``[B, L_local, H, D]``: the global tokens are split over all ``tp * sp`` ranks
by :func:`token_splits` (the first ``L % world`` ranks get one token more), so lengths that do not divide
the ranks are handled; short shards are zero-padded for the collectives and the padding is sliced away
before attention (it is never attended).

Per call: one all-to-all in the TP group (q, k, v fused) regroups token shards into
(head group x query shard), one all-gather in the SP group (k, v fused) collects all keys of the local
heads, attention runs through ``nki_kernels.ops.attention`` on local heads and local queries, and one
inverse all-to-all (plus one for the lse if requested) restores token shards. With ``sp_extra`` (the
SP-sharded KV cache's share of the layer) one more SP all-gather, issued first and waited for only
before the local step: it does not depend on this call's q, k, v, so it may run under the projection
that made them and under the all-to-all (``perf.e2e.overlap`` prices what it hides).

The rolling KV cache is the pipeline's concern: per head group (:func:`local_heads`), sharded along SP by
:mod:`sharding.kv_shard`.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sharding.collectives import all_gather, all_gather_start, all_gather_wait, all_to_all
from sharding.plan import ShardingPlan

__all__ = [
    "ShardGroups",
    "build_groups",
    "token_splits",
    "local_tokens",
    "local_heads",
    "query_shard_tokens",
    "sharded_attention",
]

DEFAULT_TIMEOUT_S = 60.0


def token_splits(num_tokens: int, world_size: int) -> tuple[int, ...]:
    """Tokens held by each rank: ``num_tokens`` split into ``world_size`` contiguous near-equal chunks.

    The first ``num_tokens % world_size`` ranks hold one token more. Chunks may be empty when
    ``num_tokens < world_size``.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    base, extra = divmod(num_tokens, world_size)
    return tuple(base + (1 if r < extra else 0) for r in range(world_size))


def local_tokens(num_tokens: int, plan: ShardingPlan, rank: int) -> slice:
    """The global token range (along L) of ``rank``'s token shard (everything outside attention)."""
    splits = token_splits(num_tokens, plan.world_size)
    plan.head_group(rank)  # validates rank
    start = sum(splits[:rank])
    return slice(start, start + splits[rank])


def query_shard_tokens(num_tokens: int, plan: ShardingPlan, rank: int) -> slice:
    """The global token range of the queries ``rank`` attends: the union of its TP group's token shards."""
    splits = token_splits(num_tokens, plan.world_size)
    s = plan.query_shard(rank)
    start = sum(splits[: s * plan.tp])
    return slice(start, start + sum(splits[s * plan.tp : (s + 1) * plan.tp]))


def local_heads(plan: ShardingPlan, rank: int) -> slice:
    """The heads ``rank`` attends (its head group); the per-head-group KV cache holds these heads."""
    g = plan.head_group(rank)
    return slice(g * plan.heads_per_core, (g + 1) * plan.heads_per_core)


@dataclass(frozen=True)
class ShardGroups:
    """This rank's process groups for ``plan`` (``None`` where the group has a single rank)."""

    plan: ShardingPlan
    rank: int
    tp_group: Any
    sp_group: Any
    tp_ranks: tuple[int, ...]
    sp_ranks: tuple[int, ...]
    timeout_s: float


def build_groups(plan: ShardingPlan, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> ShardGroups:
    """Create the TP groups (all-to-all) and SP groups (K/V all-gather) of ``plan``; collective call.

    Every rank must call this in the same order (``torch.distributed.new_group`` is collective). The
    default group must be initialised with ``plan.world_size`` ranks. Each group gets ``timeout_s`` so a
    dead or stuck rank makes the others raise instead of hanging.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("build_groups needs an initialised torch.distributed default group")
    world = dist.get_world_size()
    if world != plan.world_size:
        raise ValueError(
            f"plan needs world_size {plan.world_size} (tp={plan.tp} x sp={plan.sp}), got {world}"
        )
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    rank = dist.get_rank()
    timeout = datetime.timedelta(seconds=timeout_s)
    tp_group = sp_group = None
    if plan.tp > 1:
        for s in range(plan.sp):
            ranks = plan.tp_group_ranks(s)
            group = dist.new_group(list(ranks), timeout=timeout)
            if rank in ranks:
                tp_group = group
    if plan.sp > 1:
        for g in range(plan.tp):
            ranks = plan.sp_group_ranks(g)
            group = dist.new_group(list(ranks), timeout=timeout)
            if rank in ranks:
                sp_group = group
    return ShardGroups(
        plan=plan,
        rank=rank,
        tp_group=tp_group,
        sp_group=sp_group,
        tp_ranks=plan.tp_group_ranks(plan.query_shard(rank)),
        sp_ranks=plan.sp_group_ranks(plan.head_group(rank)),
        timeout_s=timeout_s,
    )


def _pad_tokens(x: torch.Tensor, length: int) -> torch.Tensor:
    """Zero-pad dim 1 of ``x`` to ``length``."""
    if x.shape[1] == length:
        return x
    pad = x.new_zeros((x.shape[0], length - x.shape[1], *x.shape[2:]))
    return torch.cat([x, pad], dim=1)


def _tp_all_to_all(chunks: list[torch.Tensor], group: Any) -> list[torch.Tensor]:
    """Send ``chunks[i]`` to the i-th rank of the TP group; return what each peer sent (same shapes)."""
    return list(all_to_all(torch.stack(chunks), group).unbind(0))


def _default_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None,
    return_lse: bool,
    backend: str | None,
) -> Any:
    from nki_kernels import ops  # imported on use: the kernels layer may pull in the emulator

    return ops.attention(q, k, v, scale=scale, return_lse=return_lse, backend=backend)


def sharded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    groups: ShardGroups,
    *,
    num_queries: int,
    num_keys: int | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    backend: str | None = None,
    attention_fn: Callable[..., Any] | None = None,
    sp_extra: torch.Tensor | None = None,
    after_keys: Callable[[], None] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of all queries over all keys, computed TP x SP-sharded; collective over all ranks.

    Args:
        q: this rank's token shard ``[B, Lq_local, H, D]``, ``Lq_local = token_splits(num_queries,
            world)[rank]`` (tokens ``local_tokens(num_queries, plan, rank)`` of the global sequence).
        k, v: this rank's token shard ``[B, Lk_local, H, D]`` of ``num_keys`` keys split the same way.
        groups: from :func:`build_groups`.
        num_queries, num_keys: global token counts (``num_keys`` defaults to ``num_queries``); passed
            explicitly so no extra collective is needed to agree on the split.
        scale: softmax scale (default ``1/sqrt(D)``). return_lse: also return the log-sum-exp.
        backend: forwarded to ``nki_kernels.ops.attention``.
        attention_fn: override of the local attention (same signature as ``nki_kernels.ops.attention``);
            default ``nki_kernels.ops.attention``.
        sp_extra: a tensor (any shape and dtype, the same on every SP rank of the group; the SP-sharded
            KV cache's share of the layer) all-gathered in its OWN collective, issued before the TP
            all-to-all and waited for just before ``attention_fn``: it does not depend on q, k, v, so
            the graph lets it overlap their projection and collectives (a fused gather with the keys
            would wait for them). ``attention_fn`` then also gets ``sp_extra=`` ``[sp,
            *sp_extra.shape]`` in SP-rank order (``[1, ...]`` when ``sp == 1``).
        after_keys: called once on every rank after the new keys' collectives (the TP all-to-all and the
            SP gather) and before ``attention_fn`` (even where this rank's query shard is empty): the
            point where a collective independent of this layer (the compact layout's text k/v gather,
            :class:`sharding.kv_shard.TextKVGather`) is issued, the collective stream being idle under
            the attention.

    Returns:
        out ``[B, Lq_local, H, D]`` (q's dtype) for this rank's tokens, and with ``return_lse`` the lse
        ``[B, Lq_local, H]`` (fp32), both equal to slicing the unsharded attention's result.

    Raises ValueError if shapes do not match the plan and token counts. Every collective uses the
    groups' timeout: a dead rank makes this raise instead of hanging.
    """
    plan = groups.plan
    rank, tp, world = groups.rank, plan.tp, plan.world_size
    nk = num_queries if num_keys is None else num_keys
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be [B, L, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    b, _, h, d = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, h, d):
        raise ValueError(f"k/v batch, heads, head_dim {tuple(k.shape)} do not match q {tuple(q.shape)}")
    if h != plan.num_heads:
        raise ValueError(f"q has {h} heads but the plan is for num_heads={plan.num_heads}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    q_splits = token_splits(num_queries, world)
    k_splits = token_splits(nk, world)
    if q.shape[1] != q_splits[rank]:
        raise ValueError(
            f"rank {rank}: q holds {q.shape[1]} tokens, token_splits({num_queries}) gives {q_splits[rank]}"
        )
    if k.shape[1] != k_splits[rank]:
        raise ValueError(
            f"rank {rank}: k/v hold {k.shape[1]} tokens, token_splits({nk}) gives {k_splits[rank]}"
        )
    if nk < 1:
        raise ValueError(f"num_keys must be >= 1, got {nk}")

    hpc = plan.heads_per_core
    tp_ranks = groups.tp_ranks
    qmax, kmax = max(q_splits), max(k_splits)

    # 0. the SP-sharded cache's share: its own all-gather, issued before anything that needs q, k, v.
    extra_started = None
    if sp_extra is not None and plan.sp > 1:
        extra_started = all_gather_start(sp_extra, groups.sp_group)

    # 1. all-to-all in the TP group: token shard (all heads) -> query shard s (heads of group g).
    if tp > 1:
        qkv = torch.cat([_pad_tokens(q, qmax), _pad_tokens(k, kmax), _pad_tokens(v, kmax)], dim=1)
        chunks = [qkv[:, :, j * hpc : (j + 1) * hpc] for j in range(tp)]
        recv = _tp_all_to_all(chunks, groups.tp_group)
        q_s = torch.cat([recv[j][:, : q_splits[r]] for j, r in enumerate(tp_ranks)], dim=1)
        k_s = torch.cat([recv[j][:, qmax : qmax + k_splits[r]] for j, r in enumerate(tp_ranks)], dim=1)
        v_s = torch.cat(
            [recv[j][:, qmax + kmax : qmax + kmax + k_splits[r]] for j, r in enumerate(tp_ranks)], dim=1
        )
    else:
        q_s, k_s, v_s = q, k, v

    # 2. all-gather k, v in the SP group: every key of the local heads.
    if plan.sp > 1:
        shard_len = [sum(k_splits[t * tp : (t + 1) * tp]) for t in range(plan.sp)]
        smax = max(shard_len)
        kv = torch.stack([_pad_tokens(k_s, smax), _pad_tokens(v_s, smax)])
        gathered = all_gather(kv, plan.sp, groups.sp_group)
        if sp_extra is not None:
            assert extra_started is not None
            extra_parts = all_gather_wait(extra_started, plan.sp, sp_extra)
        k_all = torch.cat([gathered[t][0][:, : shard_len[t]] for t in range(plan.sp)], dim=1)
        v_all = torch.cat([gathered[t][1][:, : shard_len[t]] for t in range(plan.sp)], dim=1)
    else:
        k_all, v_all = k_s, v_s
        if sp_extra is not None:
            extra_parts = sp_extra.unsqueeze(0)

    if after_keys is not None:
        after_keys()

    # 3. attention on local heads and local queries.
    fn = _default_attention if attention_fn is None else attention_fn
    extra_kw = {} if sp_extra is None else {"sp_extra": extra_parts}
    q_s, k_all, v_all = q_s.contiguous(), k_all.contiguous(), v_all.contiguous()
    if q_s.shape[1] == 0:  # fewer queries than SP ranks: this query shard is empty
        out_s = q_s.new_zeros(q_s.shape)
        lse_s = torch.zeros(q_s.shape[:3], dtype=torch.float32) if return_lse else None
    else:
        res = fn(q_s, k_all, v_all, scale=scale, return_lse=return_lse, backend=backend, **extra_kw)
        out_s, lse_s = (res[0], res[1]) if return_lse else (res, None)
    lse: torch.Tensor | None = None

    # 4. inverse all-to-all in the TP group: query shard (local heads) -> token shard (all heads).
    if tp > 1:
        offs = [sum(q_splits[tp_ranks[0] : r]) for r in tp_ranks]
        chunks = [_pad_tokens(out_s[:, o : o + q_splits[r]], qmax) for o, r in zip(offs, tp_ranks)]
        recv = _tp_all_to_all(chunks, groups.tp_group)
        out = torch.cat([x[:, : q_splits[rank]] for x in recv], dim=2)
        if lse_s is not None:
            lchunks = [_pad_tokens(lse_s[:, o : o + q_splits[r]], qmax) for o, r in zip(offs, tp_ranks)]
            lrecv = _tp_all_to_all(lchunks, groups.tp_group)
            lse = torch.cat([x[:, : q_splits[rank]] for x in lrecv], dim=2)
    else:
        out, lse = out_s, lse_s
    if return_lse:
        assert lse is not None
        return out, lse
    return out
