"""The streamed static pass (nki_kernels.attention_stream, nki_kernels.attention_block_table_stream): K/V
read chunk by chunk while the q^T / accumulators of a unit of query tiles stay resident.

Against ``reference.attention`` with the tolerance rule of ``tests/numerics.py`` (float64 reference of the
rounded inputs, 2x the reference's own error in bf16 + bf16's floor), at shapes that exercise what the
streaming adds: several units (``MAX_UNIT_TILES`` lowered), a partial last query tile, a partial last key
chunk and 128-key block, segment and block boundaries inside a chunk, empty block-table entries; and the
pure entry-piece plan against an independent enumeration."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import nki_kernels.attention_stream as stream
from nki_kernels.attention import attention_emulated, attention_segments_emulated
from nki_kernels.attention_block_table import attention_block_table_emulated
from nki_kernels.attention_block_table_stream import chunk_pieces
from nki_kernels.emulator import TensorSpec, run
from reference.attention import attention, attention_block_table, attention_segments
from tests.numerics import assert_within, reference_error

pytestmark = pytest.mark.emulator

BF = torch.bfloat16


def _rand(seed: int, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) for s in shapes]


@pytest.mark.parametrize(("c0", "kc", "t"), [(0, 1024, 4680), (4096, 1024, 4680), (1024, 1024, 300),
                                             (2048, 52, 100), (0, 1024, 16), (3072, 1000, 4000)])  # fmt: skip
def test_chunk_pieces_cover_each_key_once_at_its_place(c0: int, kc: int, t: int) -> None:
    """Every key position j of the chunk appears in exactly one piece, as row j - e*t of entry e = j // t,
    at partition j % 128 of chunk-local tile (j - c0) // 128; full-tile runs start at partition 0."""
    seen: dict[int, tuple[int, int, int, int]] = {}
    for e, tile, p0, rows, nt, row in chunk_pieces(c0, kc, t):
        if nt:
            assert p0 == 0 and rows == 128
            places = [(tile + u, p, row + u * 128 + p) for u in range(nt) for p in range(128)]
        else:
            assert 0 < rows <= 128 - p0
            places = [(tile, p0 + p, row + p) for p in range(rows)]
        for tl, part, r in places:
            j = e * t + r
            assert j not in seen, f"key {j} in two pieces"
            seen[j] = (e, tl, part, r)
    assert sorted(seen) == list(range(c0, c0 + kc))
    for j, (e, tl, part, r) in seen.items():
        assert (e, r, part, tl) == (j // t, j % t, j % 128, (j - c0) // 128)


def _launches(monkeypatch: pytest.MonkeyPatch) -> list:
    """Record the trace of every kernel launch the emulated entries make (a data run)."""
    from nki_kernels import _nki

    traces: list = []

    def launch(kernel: Any, *args: Any, lnc: int = 1, **kwargs: Any) -> tuple[Any, Any]:
        out, tr = run(kernel, *args, lnc=lnc, **kwargs)
        traces.append(tr)
        return out, tr

    monkeypatch.setattr(_nki, "launch", launch)
    return traces


def _fast_path_only(traces: list, tiles: int) -> None:
    """The data run's stream is the static pass alone: one offset max per query tile and no running-max
    recompute (which would add a row max per key chunk), so the output checked is the streamed one."""
    assert len(traces) == 1 and traces[0].count(op="tensor_reduce") == tiles


def _units(kernel_args: tuple, monkeypatch: pytest.MonkeyPatch, max_tiles: int) -> int:
    monkeypatch.setattr(stream, "MAX_UNIT_TILES", max_tiles)
    _, tr = run(*kernel_args, trace_only=True)
    return tr.count(op="tensor_partition_reduce")  # one cross-partition offset max per unit


def test_several_units_partial_tiles_and_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """5 query tiles (the last of 44 rows) in units of at most 2 tiles (2 + 2 + 1 per head), 2,100 keys
    (2 full chunks and a 52-key chunk: a partial 128-key block), 2 heads, lse: within the bf16 tolerance."""
    from nki_kernels.attention import attention_kernel

    q, k, v = _rand(5, (1, 556, 2, 32), (1, 2100, 2, 32), (1, 2100, 2, 32))
    k[:, 2048:] *= 2.0  # the 52-key chunk's keys score higher and carry shifted values: they must be right
    v[:, 2048:] += 3.0
    specs = tuple(TensorSpec(tuple(x.shape), "bfloat16") for x in (q, k, v))
    assert _units((attention_kernel, *specs, 0.2, True), monkeypatch, 2) == 3 * 2
    ref_err, (base_o, base_l) = reference_error(attention, [q, k, v], BF, scale=0.2, return_lse=True)
    traces = _launches(monkeypatch)
    out, lse = attention_emulated(q.to(BF), k.to(BF), v.to(BF), scale=0.2, return_lse=True)
    _fast_path_only(traces, 5 * 2)
    assert_within(out, base_o, BF, ref_err, what="streamed attention, 3 units, out")
    assert_within(lse, base_l, BF, ref_err, what="streamed attention, 3 units, lse")


def test_segments_split_inside_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three segments of a buffer whose boundaries (keys 700, 1,800) fall inside key chunks and inside
    128-key blocks, with gaps between them in the buffer: the chunk loads read each piece in place."""
    q, kb, vb = _rand(6, (1, 200, 1, 64), (1, 2600, 1, 64), (1, 2600, 1, 64))
    segs = [(0, 700), (800, 1100), (2000, 500)]
    kw = {"scale": 0.15, "return_lse": True}

    def ref(a, b, c):
        return attention_segments(a, b, c, segs, **kw)

    ref_err, (base_o, base_l) = reference_error(ref, [q, kb, vb], BF)
    traces = _launches(monkeypatch)
    out, lse = attention_segments_emulated(q.to(BF), kb.to(BF), vb.to(BF), segs, **kw)
    _fast_path_only(traces, 2)
    assert_within(out, base_o, BF, ref_err, what="streamed segments out")
    assert_within(lse, base_l, BF, ref_err, what="streamed segments lse")


def test_block_table_entries_inside_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of T = 100 keys (entries start mid-tile and several share a chunk), 2 sources, 24 entries
    (2,400 key slots) with empty entries, two query groups (one of 3 tiles in units of 2): within the bf16
    tolerance against the reference; the empty entries contribute nothing."""
    t, nb = 100, 24
    q, k0, k1, v0, v1 = _rand(7, (1, 300, 2, 32), (1, 14 * t, 2, 32), (1, 12 * t, 2, 32),
                              (1, 14 * t, 2, 32), (1, 12 * t, 2, 32))  # fmt: skip
    g = torch.Generator().manual_seed(8)
    rows = []
    for _ in range(2):
        code = torch.randperm(26, generator=g)[:nb]
        row = torch.stack([(code >= 14).long(), torch.where(code >= 14, code - 14, code)], dim=-1)
        row[torch.randperm(nb, generator=g)[:5]] = torch.tensor([-1, 0])
        rows.append(row)
    table = torch.stack(rows)
    groups = [44, 256]
    kw = {"scale": 0.2, "return_lse": True}
    monkeypatch.setattr(stream, "MAX_UNIT_TILES", 2)

    def ref(a, b0, b1, c0, c1):
        return attention_block_table(a, [b0, b1], [c0, c1], table, groups, t, **kw)

    ref_err, (base_o, base_l) = reference_error(ref, [q, k0, k1, v0, v1], BF)
    traces = _launches(monkeypatch)
    out, lse = attention_block_table_emulated(
        q.to(BF), [k0.to(BF), k1.to(BF)], [v0.to(BF), v1.to(BF)], table, groups, t, **kw
    )
    # 2 heads x (group 0: 1 tile, group 1: 2 tiles), + the stand-in block's max per group (table offsets)
    _fast_path_only(traces, 2 * (1 + 2) + 2)
    assert_within(out, base_o, BF, ref_err, what="streamed block table out")
    assert_within(lse, base_l, BF, ref_err, what="streamed block table lse")


def test_stream_chunks_and_the_streaming_condition() -> None:
    from nki_kernels.attention import _chunks, streams
    from nki_kernels.attention_tiles import merge_remainder

    assert stream.stream_chunks(2100) == [(0, 1024), (1024, 1024), (2048, 52)]
    assert stream.stream_chunks(32_760)[-1] == (31 * 1024, 1016)
    kc = 1024

    def chunks(lk: int) -> list[tuple[int, int]]:
        return merge_remainder(_chunks(lk, kc), kc)

    # a full chunk after the first: streamed (bf16, no DMA share); one chunk + a remainder: per-row offset
    assert streams(chunks(2048), True, (0, 1)) and not streams(chunks(2047), True, (0, 1))
    assert not streams(chunks(4096), False, (0, 1)) and not streams(chunks(4096), True, (1, 3))
