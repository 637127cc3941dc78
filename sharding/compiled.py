"""A sharded forward compiled whole: ``torch.compile(fullgraph=True)`` with its collectives inside the graph.

:class:`CompiledForward` wraps the function of one forward (:meth:`sharding.rank_stream.RankStream.
_merged_forward`) and, when asked to compile, records what every compiled graph holds: its collectives
(the ``_c10d_functional`` ops of :mod:`sharding.collectives`; the ``wait_tensor`` that completes each is
not counted) and its kernel calls (the ``nki_ardiff::*`` ops of :mod:`nki_kernels.ops`). These are the
counts the end-to-end model prices per forward (``perf.e2e``: one NEFF per forward, ``collectives`` and
``kernel calls`` per chunk), measured from the graph the rank really runs.

It also records, per collective in graph order, whether the collective depends on compute of the forward
(:attr:`GraphRecord.collective_order`: a matmul or a kernel call among its inputs' ancestors): a
collective that does not (the SP-sharded cache's share of a layer) may be issued before any compute of
the forward and run under it, the dependency the overlap model (``perf.e2e.overlap``) relies on; and the
bytes of its result (:attr:`GraphRecord.collective_bytes`), which the model's per-collective bytes are
checked against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CompiledForward", "GraphRecord", "graph_record", "COMPUTE_OPS"]

COMPUTE_OPS = frozenset({"linear", "matmul", "mm", "addmm", "bmm", "baddbmm", "einsum"})
"""Names of the torch/aten ops counted as compute of the forward (with every ``nki_ardiff`` kernel call)."""


@dataclass(frozen=True)
class GraphRecord:
    """What one compiled graph holds: ``collectives`` (name -> count, e.g. ``"all_to_all_single"``),
    ``kernels`` (``nki_ardiff`` op name -> count), its FX node count and :attr:`collective_order`."""

    nodes: int
    collectives: tuple[tuple[str, int], ...]
    kernels: tuple[tuple[str, int], ...]
    collective_order: tuple[tuple[str, bool], ...] = ()
    """Every collective in graph order: ``(name, after_compute)``, ``after_compute`` True when a compute
    op (:data:`COMPUTE_OPS` or a kernel call) of the graph is among its ancestors."""
    collective_bytes: tuple[int, ...] = ()
    """Per collective of :attr:`collective_order`, the bytes of its result on this rank (an all-gather's:
    every rank's part, padding included; from the traced tensor's shape and dtype), 0 if not traced."""

    @property
    def num_collectives(self) -> int:
        return sum(n for _, n in self.collectives)

    @property
    def num_kernel_calls(self) -> int:
        return sum(n for _, n in self.kernels)


def _op_name(target: Any) -> tuple[str, str] | None:
    """``(namespace, name)`` of an FX ``call_function`` target that is a torch op, else None."""
    name = getattr(target, "_qualified_op_name", None) or getattr(target, "name", None)
    if callable(name):
        name = name()
    if not isinstance(name, str) or "::" not in name:
        return None
    ns, op = name.split("::", 1)
    return ns, op.split(".")[0]


def _is_compute(target: Any, got: tuple[str, str] | None) -> bool:
    """True for a kernel call or a matmul-family op (:data:`COMPUTE_OPS`), whatever its namespace."""
    if got is not None:
        return got[0] == "nki_ardiff" or got[1] in COMPUTE_OPS
    return getattr(target, "__name__", "") in COMPUTE_OPS


def graph_record(gm: torch.fx.GraphModule) -> GraphRecord:
    """Count the collectives and kernel calls of a Dynamo graph and order its collectives (module
    docstring). Graph order is topological, so one pass marks every node that follows compute."""
    coll: dict[str, int] = {}
    kern: dict[str, int] = {}
    order: list[tuple[str, bool]] = []
    sizes: list[int] = []
    after: set[torch.fx.Node] = set()  # nodes with a compute op among their ancestors (or themselves)
    for node in gm.graph.nodes:
        follows = any(a in after for a in node.all_input_nodes)  # through every node kind (methods too)
        if node.op != "call_function":
            if follows or (node.op == "call_method" and node.target in COMPUTE_OPS):
                after.add(node)
            continue
        got = _op_name(node.target)
        if follows or _is_compute(node.target, got):
            after.add(node)
        if got is None:
            continue
        ns, op = got
        if ns == "_c10d_functional" and op != "wait_tensor":
            coll[op] = coll.get(op, 0) + 1
            order.append((op, follows))
            val = node.meta.get("example_value")
            sizes.append(val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0)
        elif ns == "nki_ardiff":
            kern[op] = kern.get(op, 0) + 1
    return GraphRecord(
        len(gm.graph.nodes),
        tuple(sorted(coll.items())),
        tuple(sorted(kern.items())),
        tuple(order),
        tuple(sizes),
    )


class CompiledForward:
    """``fn`` run eagerly (``compile`` None/False) or compiled with ``torch.compile(fullgraph=True)``.

    ``compile``: True (torch's default backend), a backend name (``"eager"``, ``"aot_eager"``,
    ``"inductor"``, ...) or a backend callable ``(gm, example_inputs) -> callable``. Every graph the
    backend receives is recorded in :attr:`graphs` (:func:`graph_record`) before it is handed on; a graph
    break raises (``fullgraph=True``), so one entry per compiled input signature.
    """

    def __init__(self, fn: Callable[..., torch.Tensor], compile: Any = None) -> None:
        self.fn, self.spec = fn, compile
        self.compiled = compile not in (None, False)
        self.graphs: list[GraphRecord] = []
        if not self.compiled:
            self._call: Callable[..., torch.Tensor] = fn
            return
        if compile is not True and not isinstance(compile, str) and not callable(compile):
            raise TypeError(f"compile must be None, a bool, a backend name or a callable, got {compile!r}")

        def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            self.graphs.append(graph_record(gm))
            if callable(compile):
                return compile(gm, example_inputs)
            from torch._dynamo import lookup_backend

            return lookup_backend("inductor" if compile is True else compile)(gm, example_inputs)

        self._call = torch.compile(fn, fullgraph=True, backend=backend)

    def __call__(self, *args: Any) -> torch.Tensor:
        return self._call(*args)
