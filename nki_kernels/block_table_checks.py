"""The value rules of a block table ``[G, NB, 2]`` (entries ``(source, block)``), shared by the op layer
(:func:`nki_kernels.ops.attention_block_table`, checked when the op runs) and the kernel entry
(:func:`nki_kernels.attention_block_table.attention_block_table_emulated`). Pure Python, no torch, no NKI."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def check_table_values(
    table: Sequence[Sequence[Sequence[Any]]],
    sizes: Sequence[int],
    block_tokens: int,
    name: str = "block_table",
) -> None:
    """Raise ``ValueError`` naming the first bad entry ``name[g, n]`` of ``table`` (nested ``[G][NB][2]``
    ints): ``source`` must be ``-1`` (empty) or in ``[0, len(sizes))``; ``block`` within that source's
    ``sizes[source] // block_tokens`` blocks; no ``(source, block)`` twice in a group (its keys would count
    twice). ``sizes`` are the sources' token lengths."""
    for g, row in enumerate(table):
        seen: set[tuple[int, int]] = set()
        for n, (src, blk) in enumerate(row):
            if src == -1:
                continue
            if not 0 <= src < len(sizes):
                raise ValueError(
                    f"{name}[{g}, {n}] source={src} must be -1 (empty) or in [0, {len(sizes)}) "
                    f"(the number of k_sources)"
                )
            nblk = sizes[src] // block_tokens
            if not 0 <= blk < nblk:
                raise ValueError(
                    f"{name}[{g}, {n}] block={blk} is out of source {src}'s {nblk} blocks of "
                    f"{block_tokens} tokens"
                )
            if (src, blk) in seen:
                raise ValueError(f"{name}[{g}] lists block ({src}, {blk}) twice (keys would count twice)")
            seen.add((src, blk))
