"""A sharded forward compiled whole: ``torch.compile(fullgraph=True)`` with its collectives inside the graph.

:class:`CompiledForward` wraps the function of one forward (:meth:`sharding.rank_stream.RankStream.
_merged_forward`) and, when asked to compile, records what every compiled graph holds: its collectives
(the ``_c10d_functional`` ops of :mod:`sharding.collectives`; the ``wait_tensor`` that completes each is
not counted) and its kernel calls (the ``nki_ardiff::*`` ops of :mod:`nki_kernels.ops`). These are the
counts the end-to-end model prices per forward (``perf.e2e``: one NEFF per forward, ``collectives`` and
``kernel calls`` per chunk), measured from the graph the rank really runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CompiledForward", "GraphRecord", "graph_record"]


@dataclass(frozen=True)
class GraphRecord:
    """What one compiled graph holds: ``collectives`` (name -> count, e.g. ``"all_to_all_single"``),
    ``kernels`` (``nki_ardiff`` op name -> count) and its FX node count."""

    nodes: int
    collectives: tuple[tuple[str, int], ...]
    kernels: tuple[tuple[str, int], ...]

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


def graph_record(gm: torch.fx.GraphModule) -> GraphRecord:
    """Count the collectives and kernel calls of a Dynamo graph (see the module docstring)."""
    coll: dict[str, int] = {}
    kern: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        got = _op_name(node.target)
        if got is None:
            continue
        ns, op = got
        if ns == "_c10d_functional" and op != "wait_tensor":
            coll[op] = coll.get(op, 0) + 1
        elif ns == "nki_ardiff":
            kern[op] = kern.get(op, 0) + 1
    return GraphRecord(len(gm.graph.nodes), tuple(sorted(coll.items())), tuple(sorted(kern.items())))


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
