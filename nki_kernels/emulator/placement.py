"""Partition placement of on-chip tiles for the capacity check: a tile occupies only its own partitions.

An SBUF/PSUM tile of shape ``[p, ...]`` holds ``bytes/partition`` on each of its ``p`` partitions and nothing
on the others (the NKI 0.6 ``nl.ndarray(..., address=(partition_offset, byte_offset))`` docstring places a
tile at a partition offset; aws-neuron/nki-library's own SBUF allocator,
``src/nkilib_src/nkilib/core/utils/allocator.py``, allocates with ``address=(base_partition, ...)``).  A tile
without ``address=`` may sit at any start partition the engines can address for its size (the start-partition
rule, :mod:`~nki_kernels.emulator.start_partition`): ``p > 64`` starts at 0, ``33 <= p <= 64`` at 0 or 64,
``p <= 32`` at 0, 32, 64 or 96.

So every unplaced tile starts on a quadrant (32-partition) boundary and covers the first partition of each
quadrant it touches: the most loaded partition of a quadrant is its first, whose load is the bytes of all
tiles touching the quadrant.  :func:`min_peak` finds the placement of the unplaced tiles that minimises the
most loaded partition (exact branch and bound over quadrant loads, a bounded search).  A tile placed with
``address=`` is charged to every quadrant it touches (exact when it starts on a quadrant boundary, as the
start-partition rule requires of a compute operand of <= 32 partitions).  Fragmentation (byte offsets) is
not modelled, as before: the check is that the bytes fit per partition at every instruction.
"""

from __future__ import annotations

from collections.abc import Sequence

QUADRANT = 32
NQ = 4
_NODE_CAP = 200_000


def quadrants(parts: int, start: int | None) -> tuple[int, ...] | None:
    """Quadrants a tile of ``parts`` partitions covers: fixed for a placed tile (``start``) or one of more
    than 64 partitions, else None (its placement is free)."""
    if start is not None:
        return tuple(range(start // QUADRANT, (start + parts - 1) // QUADRANT + 1))
    if parts > 2 * QUADRANT:
        return tuple(range(-(-parts // QUADRANT)))
    return None


def min_peak(tiles: Sequence[tuple[int, int, int | None]], budget: int) -> tuple[int, bool]:
    """``tiles``: ``(partitions, bytes_per_partition, placed_start_partition_or_None)``.

    Returns ``(peak, exact)``: the smallest achievable load of the most loaded partition over all legal
    placements of the unplaced tiles, or, once a placement within ``budget`` is found, that placement's
    peak (<= budget).  ``exact`` is False only when the search stopped at its node cap without finding a
    placement within ``budget`` (``peak`` is then the best found, an upper bound of the minimum)."""
    load = [0] * NQ
    halves: list[int] = []
    quads: list[int] = []
    for parts, nbytes, start in tiles:
        q = quadrants(parts, start)
        if q is not None:
            for i in q:
                load[i] += nbytes
        elif parts > QUADRANT:
            halves.append(nbytes)
        else:
            quads.append(nbytes)
    halves.sort(reverse=True)
    quads.sort(reverse=True)
    items = [(b, 2) for b in halves] + [(b, 1) for b in quads]
    # greedy first (largest first, least loaded option): often within budget at once
    g = list(load)
    for b, w in items:
        _place(g, b, w, min(_options(g, w), key=lambda o: max(g[i] for i in o)))
    best = [max(g)]
    if best[0] <= budget or not items:
        return best[0], True
    rest = [0] * (len(items) + 1)  # byte-quadrants still to place after item i
    for i in range(len(items) - 1, -1, -1):
        rest[i] = rest[i + 1] + items[i][0] * items[i][1]
    nodes = [0]

    def search(i: int, cur: list[int]) -> bool:
        nodes[0] += 1
        if nodes[0] > _NODE_CAP:
            return False
        if i == len(items):
            best[0] = min(best[0], max(cur))
            return best[0] <= budget
        lower = max(max(cur), -(-(sum(cur) + rest[i]) // NQ))
        if lower >= best[0]:
            return False
        b, w = items[i]
        seen: set[tuple[int, ...]] = set()
        for o in _options(cur, w):
            sig = tuple(cur[j] for j in o)
            if sig in seen:  # symmetric to an option already tried
                continue
            seen.add(sig)
            if max(cur[j] for j in o) + b >= best[0]:
                continue
            _place(cur, b, w, o)
            done = search(i + 1, cur)
            _place(cur, -b, w, o)
            if done:
                return True
        return False

    search(0, list(load))
    return best[0], nodes[0] <= _NODE_CAP or best[0] <= budget


def _options(load: list[int], width: int) -> tuple[tuple[int, ...], ...]:
    if width == 2:
        return ((0, 1), (2, 3))
    return ((0,), (1,), (2,), (3,))


def _place(load: list[int], nbytes: int, width: int, option: tuple[int, ...]) -> None:
    for j in option:
        load[j] += nbytes
