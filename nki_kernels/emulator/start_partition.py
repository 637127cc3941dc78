"""The start-partition rule of SBUF/PSUM accesses by the compute engines (pure index maths + the check).

NeuronCore architecture guide ("Data streaming",
https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/guides/architecture/trainium_inferentia2_arch.html,
aws-neuron/aws-neuron-sdk ``nki/guides/architecture/trainium_inferentia2_arch.rst``): an engine
instruction's SBUF/PSUM src/dst tensor occupies contiguous partitions, and the partition it starts at
depends on how many it occupies:

* ``64 < num_partitions <= 128``: ``start_partition`` must be 0;
* ``32 < num_partitions <= 64``: ``start_partition`` must be 0 or 64;
* ``0 < num_partitions <= 32``: ``start_partition`` must be one of 0/32/64/96.

Equivalently (with ``pmax = 128``): ``start % align == 0`` where ``align`` is 32 (a quadrant) for up to
32 partitions, 64 (a half) for 33-64, and 128 beyond.  The rule concerns the compute engines (TensorE,
VectorE, ScalarE, GpSimdE); DMA queues are not engines that stream partitions and are not subject to it.
``nc_stream_shuffle`` applies it with ``num_partitions`` = its active partitions (see its docstring).
"""

from __future__ import annotations

from typing import Any

from .errors import StartPartitionError

RULE_TEXT = (
    "an engine access of more than 64 partitions must start at partition 0, of 33-64 partitions at 0 or "
    "64, of 32 or fewer at 0/32/64/96 (NeuronCore architecture guide, 'Data streaming')"
)


def alignment(num_partitions: int, pmax: int = 128) -> int:
    """Start-partition alignment for an access of ``num_partitions`` partitions (``1 <= n <= pmax``).

    ``pmax // 4`` (a quadrant) for ``n <= pmax // 4``, ``pmax // 2`` (a half) for ``n <= pmax // 2``,
    else ``pmax`` (so the only legal start is 0).  Raises ``ValueError`` outside ``[1, pmax]`` or when
    ``pmax`` is not a positive multiple of 4.
    """
    if pmax < 4 or pmax % 4:
        raise ValueError(f"pmax must be a positive multiple of 4, got {pmax}")
    if not 1 <= num_partitions <= pmax:
        raise ValueError(f"num_partitions must be in [1, {pmax}], got {num_partitions}")
    q = pmax // 4
    if num_partitions <= q:
        return q
    if num_partitions <= 2 * q:
        return 2 * q
    return pmax


def allowed_starts(num_partitions: int, pmax: int = 128) -> tuple[int, ...]:
    """Every legal start partition of an access of ``num_partitions`` partitions, ascending."""
    a = alignment(num_partitions, pmax)
    return tuple(s for s in range(0, pmax, a) if s + num_partitions <= pmax)


def start_ok(start: int, num_partitions: int, pmax: int = 128) -> bool:
    """True when an access of ``num_partitions`` partitions may start at partition ``start``.

    ``start`` must be in ``[0, pmax)`` and the access must end inside the ``pmax`` partitions.
    """
    if start < 0 or start + num_partitions > pmax:
        return False
    return start % alignment(num_partitions, pmax) == 0


def rule_for(num_partitions: int, pmax: int = 128) -> str:
    """The clause of the rule that applies to ``num_partitions``, as text (for error messages)."""
    starts = "/".join(map(str, allowed_starts(num_partitions, pmax)))
    q = pmax // 4
    if num_partitions > 2 * q:
        band = f"more than {2 * q}"
    elif num_partitions > q:
        band = f"{q + 1}-{2 * q}"
    else:
        band = f"{q} or fewer"
    return f"an access of {band} partitions must start at partition {starts}"


def tensor_start(t: Any) -> int:
    """Start partition of an on-chip view: its element offset divided by the per-partition element count
    of its storage (on-chip storage is ``[partitions, free...]`` row-major)."""
    st = t._st
    return t.offset // (st.size // st.shape[0])


def check(op: str, arg: str, t: Any, pmax: int = 128, num_partitions: int | None = None) -> None:
    """Raise :class:`StartPartitionError` when the on-chip view ``t`` (operand ``arg`` of instruction
    ``op``) breaks the start-partition rule; ``num_partitions`` overrides ``t.shape[0]`` (stream shuffle's
    active partitions).  The message names the instruction, the operand, its start partition, its
    partition count and the rule."""
    n = t.shape[0] if num_partitions is None else num_partitions
    if not 1 <= n <= pmax:  # the partition-limit / operand-size rules report this
        return
    start = tensor_start(t)
    if start_ok(start, n, pmax):
        return
    raise StartPartitionError(
        f"[start-partition] {op}: operand {arg}={t._desc()} starts at partition {start} with {n} "
        f"partitions; {rule_for(n, pmax)} ({RULE_TEXT})"
    )


def check_all(op: str, pmax: int, *named: tuple[str, Any]) -> None:
    """:func:`check` every ``(arg, tensor)`` pair whose tensor is an on-chip view (others are skipped:
    scalars, ``None``, HBM tensors, which the instruction's own checks reject)."""
    for arg, t in named:
        st = getattr(t, "_st", None)
        if st is not None and st.buffer.on_chip:
            check(op, arg, t, pmax)
