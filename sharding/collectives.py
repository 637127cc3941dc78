"""The sharded stream's collectives, traceable: ``torch.compile(fullgraph=True)`` captures them in the graph.

Every collective of a sharded forward (the TP all-to-alls and SP K/V all-gathers of
:func:`sharding.attention.sharded_attention`, the SP cache gather of :mod:`sharding.kv_shard`, the head
all-gather of :class:`sharding.rank_stream.RankStream`) goes through these two functions. They use
torch's *functional* collectives (``torch.distributed._functional_collectives``: ``_c10d_functional``
ops that return a new tensor, then ``wait_tensor``), not the in-place ``torch.distributed`` calls: an
in-place host collective cuts a compiled graph in two, a functional one is an op of the graph (the form
Dynamo traces and an XLA backend lowers to a device collective). In eager mode they run the same
collective on the same process group (and its timeout) and move the same bytes.

:func:`all_gather_start` / :func:`all_gather_wait` split one all-gather into its issue and its completion
(the functional op and its ``wait_tensor``) so a caller can issue a gather whose input is ready early
(the SP-sharded KV cache's share, written in earlier chunks) and wait for it only where its result is
used: in the graph, nothing between the two depends on it, so a scheduler may run it under that work.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol

__all__ = ["all_gather", "all_gather_start", "all_gather_wait", "all_to_all"]


def all_to_all(send: torch.Tensor, group: Any) -> torch.Tensor:
    """``send`` ``[n, ...]`` (n = the group's size): row ``i`` goes to the group's ``i``-th rank; returns
    ``[n, ...]`` whose row ``j`` came from the ``j``-th rank. Collective over ``group``."""
    out = funcol.all_to_all_single(send.contiguous(), None, None, group)
    return funcol.wait_tensor(out)


def all_gather(x: torch.Tensor, n: int, group: Any) -> torch.Tensor:
    """``[n, *x.shape]``: every rank's ``x`` (same shape on every rank) in group-rank order. Collective over
    ``group`` of ``n`` ranks."""
    out = funcol.wait_tensor(funcol.all_gather_single(x.contiguous(), 0, group))
    return out.view(n, *x.shape)


def all_gather_start(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Issue the all-gather of ``x`` over ``group`` (the ``_c10d_functional`` op, not yet waited for);
    :func:`all_gather_wait` completes it. Collective over ``group``: every rank issues it in the same order
    relative to its other collectives.

    Eagerly (not under ``torch.compile``) the gather completes here: on CPU gloo an issued gather left
    outstanding while other collectives of the forward run gave a rare heap corruption in a rank
    (``malloc(): unaligned tcache chunk detected``, one sharded-methods case in one of two full CI runs);
    eager CPU ranks gain nothing from the overlap. In a compiled graph the issue and the wait stay split
    (the graph the model prices)."""
    out = funcol.all_gather_single(x.contiguous(), 0, group)
    if not torch.compiler.is_compiling():
        out = funcol.wait_tensor(out)
    return out


def all_gather_wait(started: torch.Tensor, n: int, like: torch.Tensor) -> torch.Tensor:
    """``[n, *like.shape]``: the result of :func:`all_gather_start` of ``like`` in a group of ``n`` ranks
    (group-rank order), waited for here."""
    if started.numel() != n * like.numel():
        raise ValueError(
            f"all_gather_wait: the gathered tensor has {started.numel()} elements, expected n={n} x "
            f"{like.numel()} (like {tuple(like.shape)})"
        )
    return funcol.wait_tensor(started).view(n, *like.shape)
