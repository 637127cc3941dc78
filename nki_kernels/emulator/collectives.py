"""``nki.collectives`` for the emulator: a minimal documented surface (NKI 0.6,
aws-neuron/aws-neuron-sdk ``nki/api/nki/collectives/__init__.py``).

The emulator runs one rank (this kernel, rank 0), so only the data of that rank exists.  Every collective
checks its documented rules and is traced as one DMA record (``engine="dma"``, ``meta`` ``collective`` and
``ranks``: the cost model prices its local traffic and can add the collective's network time).  Values are
computed where one rank is the whole collective: a replica group whose rank list holding rank 0 has one
rank (all_reduce/all_gather/reduce_scatter/all_to_all of one rank copy src to dst), or a permute pair
(0, 0).  Anything that needs another rank's data raises :class:`LaunchError` unless the launch is
trace-only.  Not emulated: ``all_gather_v``, ``all_to_all_v`` and the ``collective_permute_implicit*``
family (absent).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import opdefs
from . import state as _state
from .errors import LaunchError, MemorySpaceError, ShapeMismatchError
from .isa import VirtualRegister, dma_record
from .tensor import NkiTensor

_REDUCE_OPS = ("add", "minimum", "maximum")


@dataclass(frozen=True)
class ReplicaGroup:
    """Disjoint rank lists that run a collective together, e.g. ``ReplicaGroup([[0, 1], [2, 3]])``."""

    replica_groups: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        groups = tuple(tuple(int(r) for r in g) for g in self.replica_groups)
        flat = [r for g in groups for r in g]
        if not groups or any(not g for g in groups) or len(flat) != len(set(flat)) or min(flat) < 0:
            raise ValueError(
                f"ReplicaGroup: rank lists must be non-empty, disjoint, ranks >= 0; got {groups}"
            )
        object.__setattr__(self, "replica_groups", groups)

    def ranks_of(self, rank: int) -> tuple[int, ...]:
        """The rank list holding ``rank`` (ValueError if none)."""
        for g in self.replica_groups:
            if rank in g:
                return g
        raise ValueError(f"rank {rank} is in no rank list of {self.replica_groups}")


def rank_id(name: Any = None) -> VirtualRegister:
    """This kernel's rank inside its collective group: 0 in the emulator (it runs one rank)."""
    return VirtualRegister(0, frozen=True)


def _lists(op: str, srcs: Any, dsts: Any) -> tuple[list[NkiTensor], list[NkiTensor]]:
    srcs, dsts = list(srcs), list(dsts)
    if not srcs or len(srcs) != len(dsts):
        raise ShapeMismatchError(
            f"[collective-lists] {op}: srcs and dsts must be equal-length non-empty lists"
        )
    ts = srcs + dsts
    if not all(isinstance(t, NkiTensor) for t in ts):
        raise TypeError(f"{op}: srcs and dsts must hold NkiTensors")
    onchip = {t._st.buffer.on_chip for t in ts}
    if len(onchip) > 1:
        raise MemorySpaceError(f"[memory-space] {op}: all tensors on HBM or all on SBUF, not mixed")
    if onchip == {True} and (len(srcs) > 1 or any(t._st.buffer.name != "sbuf" for t in ts)):
        raise MemorySpaceError(f"[memory-space] {op}: on-chip collectives take one SBUF tensor per list")
    return srcs, dsts


def _run(op: str, srcs: list, dsts: list, ranks: int, meta: tuple, fn: Any) -> None:
    launch = _state.current()
    for s, d in zip(srcs, dsts):
        dma_record(op, d, s, launch, (("collective", op), ("ranks", ranks)) + meta)
    if launch.trace_only:
        return
    if ranks != 1:
        raise LaunchError(
            f"[collective-ranks] {op}: a {ranks}-rank collective needs the other ranks' data; the emulator "
            "runs one rank (run with trace_only=True to trace and price it)"
        )
    for s, d in zip(srcs, dsts):
        fn(s, d)


def _copy(s: NkiTensor, d: NkiTensor) -> None:
    if s.size != d.size:
        raise ShapeMismatchError(
            f"[collective-shape] one-rank collective: src{list(s.shape)} vs dst{list(d.shape)}"
        )
    d.write(np.asarray(s.read()).reshape(d.shape))


def _reduce_op(op: str, x: Any) -> str:
    name = opdefs.op_name(x, "op")
    if name not in _REDUCE_OPS:
        raise ValueError(f"{op}: op must be nl.add, nl.minimum or nl.maximum, got {name}")
    return name


def _dim(op: str, collective_dim: Any, srcs: list, allowed_sbuf: tuple[int, ...]) -> int:
    d = int(collective_dim)
    ok = allowed_sbuf if srcs[0]._st.buffer.on_chip else (0,)
    if d not in ok:
        raise ValueError(f"{op}: collective_dim must be in {ok} for these tensors, got {collective_dim}")
    return d


def _scaled(op: str, s: NkiTensor, d: NkiTensor, dim: int, n: int, gather: bool) -> None:
    want = list(s.shape)
    want[dim] = want[dim] * n if gather else want[dim] // n
    if (not gather and s.shape[dim] % n) or list(d.shape) != want:
        raise ShapeMismatchError(
            f"[collective-shape] {op}: dst{list(d.shape)} must be src{list(s.shape)} with dim {dim} "
            f"{'x' if gather else '/'} {n} ranks"
        )


def all_reduce(srcs: Sequence[NkiTensor], dsts: Sequence[NkiTensor], replica_group: ReplicaGroup, op: Any,
               priority: Any = None, name: Any = None) -> None:  # fmt: skip
    """Reduce (add / minimum / maximum) each src over the ranks of the group into dsts (same shapes)."""
    s, d = _lists("all_reduce", srcs, dsts)
    red = _reduce_op("all_reduce", op)
    for a, b in zip(s, d):
        if a.shape != b.shape:
            raise ShapeMismatchError(
                f"[collective-shape] all_reduce: src{list(a.shape)} vs dst{list(b.shape)}"
            )
    _run("all_reduce", s, d, len(replica_group.ranks_of(0)), (("alu", red),), _copy)


def all_gather(srcs: Sequence[NkiTensor], dsts: Sequence[NkiTensor], replica_group: ReplicaGroup,
               collective_dim: int, priority: Any = None, name: Any = None) -> None:  # fmt: skip
    """Concatenate every rank's src along ``collective_dim`` (0 for HBM; 0 or 1 for 2-D SBUF) into dst."""
    s, d = _lists("all_gather", srcs, dsts)
    dim = _dim("all_gather", collective_dim, s, (0, 1))
    n = len(replica_group.ranks_of(0))
    for a, b in zip(s, d):
        _scaled("all_gather", a, b, dim, n, True)
    _run("all_gather", s, d, n, (("dim", dim),), _copy)


def reduce_scatter(srcs: Sequence[NkiTensor], dsts: Sequence[NkiTensor], replica_group: ReplicaGroup,
                   collective_dim: int, op: Any, priority: Any = None, name: Any = None) -> None:  # fmt: skip
    """Reduce over the ranks with ``op`` and leave each rank its chunk of dim 0 (the only one supported)."""
    s, d = _lists("reduce_scatter", srcs, dsts)
    red = _reduce_op("reduce_scatter", op)
    dim = _dim("reduce_scatter", collective_dim, s, (0,))
    n = len(replica_group.ranks_of(0))
    for a, b in zip(s, d):
        _scaled("reduce_scatter", a, b, dim, n, False)
    _run("reduce_scatter", s, d, n, (("alu", red), ("dim", dim)), _copy)


def all_to_all(srcs: Sequence[NkiTensor], dsts: Sequence[NkiTensor], replica_group: ReplicaGroup,
               collective_dim: int, priority: Any = None, name: Any = None) -> None:  # fmt: skip
    """Split each src along dim 0 and exchange the chunks with every rank of the group (HBM only)."""
    s, d = _lists("all_to_all", srcs, dsts)
    if s[0]._st.buffer.on_chip:
        raise MemorySpaceError("[memory-space] all_to_all: tensors must be in HBM")
    dim = _dim("all_to_all", collective_dim, s, (0,))
    for a, b in zip(s, d):
        if a.shape != b.shape:
            raise ShapeMismatchError(
                f"[collective-shape] all_to_all: src{list(a.shape)} vs dst{list(b.shape)}"
            )
    _run("all_to_all", s, d, len(replica_group.ranks_of(0)), (("dim", dim),), _copy)


def collective_permute(srcs: Sequence[NkiTensor], dsts: Sequence[NkiTensor], source_target_pairs: Any,
                       priority: Any = None, name: Any = None) -> None:  # fmt: skip
    """Send src to the target of each (source, target) rank pair; HBM only, one tensor per list."""
    s, d = _lists("collective_permute", srcs, dsts)
    if len(s) != 1 or s[0]._st.buffer.on_chip:
        raise MemorySpaceError("[memory-space] collective_permute: exactly one HBM tensor per list")
    pairs = [(int(a), int(b)) for a, b in source_target_pairs]
    ranks = len({r for p in pairs for r in p})
    _run("collective_permute", s, d, 1 if pairs == [(0, 0)] else max(ranks, 2), (), _copy)


__all__ = [
    "ReplicaGroup",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "collective_permute",
    "rank_id",
    "reduce_scatter",
]
