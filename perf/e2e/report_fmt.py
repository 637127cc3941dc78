"""Number formats of the generated report (ms, GB, fps ranges)."""

from __future__ import annotations

from perf.e2e.chunk import ChunkModel


def _ms(s: float) -> str:
    return f"{s * 1e3:,.2f}"


def _gb(b: float) -> str:
    return f"{b / 1e9:,.2f}"


def _fps(lo: ChunkModel, hi: ChunkModel) -> str:
    """fps at the pessimistic then the optimistic end."""
    return f"{lo.fps:.2f}-{hi.fps:.2f}"


def _chunk_ms(lo: ChunkModel, hi: ChunkModel) -> str:
    return f"{_ms(lo.chunk_s)}-{_ms(hi.chunk_s)}"
