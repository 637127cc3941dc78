"""The re-balanced attention inner loop (nki_kernels/attention.py; docs/kernels/attention.md, "Engine
balance"): the instruction mix per 128 x 1024-key chunk read from the emulator trace against the design, the
pure eviction dealer and span plan, and the SBUF/PSUM fits at Wan's key length (the emulator checks capacity
and the start-partition rule while tracing)."""

from __future__ import annotations

from collections import Counter

import pytest

from nki_kernels.attention import _chunks, attention_kernel
from nki_kernels.attention_tiles import (
    KC_TWO_BYTE,
    VECTOR_EVICT,
    merge_remainder,
    owned_pairs,
    pair_plan,
    vector_evict_blocks,
)
from nki_kernels.emulator import TensorSpec, run

pytestmark = pytest.mark.emulator


def _spec(n: int, h: int = 1, d: int = 128) -> TensorSpec:
    return TensorSpec((1, n, h, d), "bfloat16")


def _mix(lq: int, lk: int, static: bool = False) -> Counter:
    """Compute instructions of a trace-only launch, keyed by (engine, op, first source buffer, function)."""
    args = (_spec(lq), _spec(lk), _spec(lk), 0.1, False, None, None, static)
    _, tr = run(attention_kernel, *args, trace_only=True)
    mix: Counter = Counter()
    for r, n in tr.entries():
        if r.engine == "dma":
            continue
        meta = r.meta_dict()
        fn = meta.get("func") or meta.get("alu")
        src = r.buffers[1] if len(r.buffers) > 1 else r.buffers[0]
        mix[(r.engine, r.op, src, str(fn))] += n
        if (
            r.engine in ("vector", "scalar")
            and src == "psum"
            and r.shapes[0][-1] == 128
            and len(r.shapes[0]) == 3
        ):
            mix[(r.engine, "evicted_blocks")] += n * r.shapes[0][1]  # P^T blocks [128, nb, 128] per eviction
    return mix


def test_instruction_mix_per_chunk_matches_the_design() -> None:
    """Running max (``static=False``). One 128-query tile over 4 full 1024-key chunks: per chunk 2 QK^T
    matmuls, ONE VectorE max reduce
    straight from PSUM, ONE ScalarE exp straight from PSUM, 8 TensorE transposes, 8 PV matmuls; the P^T
    evictions split VectorE / ScalarE by the running dealer; no fp32 copy of S and no GpSimdE work (only
    the one-time memset of V's ones column)."""
    chunks = 4
    m = _mix(128, chunks * KC_TWO_BYTE, static=False)
    assert m[("tensor", "nc_matmul", "sbuf", "None")] == chunks * (2 + 8)  # QK^T + PV
    assert m[("tensor", "nc_transpose", "sbuf", "None")] == chunks * 8
    assert m[("vector", "tensor_reduce", "psum", "maximum")] == chunks
    assert m[("scalar", "activation", "psum", "exp")] == chunks
    assert m[("scalar", "activation", "sbuf", "exp")] == chunks - 1  # alpha, from the second chunk on
    nv = sum(vector_evict_blocks(8, n) for n in range(chunks))
    assert nv == 6  # 3/16 of 8 blocks: 1, 2, 1, 2
    assert m[("vector", "evicted_blocks")] == nv
    assert m[("scalar", "evicted_blocks")] == chunks * 8 - nv
    # nothing reads S but the max and the exp; GpSimdE only writes V's ones column once
    gpsimd = {k: v for k, v in m.items() if k[0] == "gpsimd"}
    assert gpsimd == {("gpsimd", "memset", "sbuf", "None"): 1}
    s_readers = [k for k in m if len(k) == 4 and k[2] == "psum" and k[1] in ("tensor_copy", "tensor_tensor")]
    assert all(k[1] == "tensor_copy" for k in s_readers)  # PSUM copies are P^T evictions / the first PV only
    assert (
        m[("vector", "tensor_copy", "psum", "None")] == chunks + 1
    )  # one VectorE eviction per chunk + o = PV


def test_static_offset_instruction_mix_drops_the_per_chunk_max() -> None:
    """Static offset (the default), bf16, every P^T on TensorE: ONE offset per query tile, K/V streamed
    (nki_kernels.attention_stream). The offset pass computes the tile's first-chunk scores S^T (keys on the
    partitions: 8 matmuls of 128 keys), ONE VectorE max straight from PSUM, ONE GpSimd max across the
    partitions and ONE 1-row broadcast matmul; then every chunk computes S^T again (8 matmuls), ONE exp from
    PSUM straight into P^T, its 8 PV and ONE o update: no row max, no alpha, no transpose, no eviction. The
    guard adds per (b, h) one 1x1 count matmul and per tile two flag updates (l <= 1e30, l >= 1e-18)."""
    chunks = 4
    m = _mix(128, chunks * KC_TWO_BYTE, static=True)
    assert m[("vector", "tensor_reduce", "psum", "maximum")] == 1  # the tile's first chunk, once
    assert m[("gpsimd", "tensor_partition_reduce", "sbuf", "None")] == 1
    assert m[("scalar", "activation", "psum", "exp")] == chunks
    assert m[("scalar", "activation", "sbuf", "exp")] == 0  # no alpha
    assert m[("tensor", "nc_transpose", "sbuf", "None")] == 0  # K^T arrives transposed, P^T is the exp's
    qk_pv = 8 + chunks * (8 + 8)
    assert m[("tensor", "nc_matmul", "sbuf", "None")] == qk_pv + 1 + 1  # + broadcast + guard count
    assert m[("scalar", "activation", "psum", "copy")] == 0  # no P^T eviction on either engine
    assert m[("vector", "tensor_copy", "psum", "None")] == 1  # only o = PV of the first chunk
    assert m[("vector", "tensor_tensor", "sbuf", "add")] == chunks - 1  # o += PV (PSUM) into SBUF
    assert m[("vector", "tensor_scalar", "sbuf", "('less_equal', 'minimum')")] == 1
    assert m[("vector", "tensor_scalar", "sbuf", "('greater_equal', 'minimum')")] == 1
    assert m[("vector", "tensor_scalar", "sbuf", "('multiply', 'minimum')")] == 0  # no running max


@pytest.mark.parametrize(
    ("nb", "split"), [(8, VECTOR_EVICT), (8, (1, 4)), (8, (3, 8)), (6, (5, 16)), (8, (0, 1))]
)
def test_vector_evict_dealer_is_exact_on_average(nb: int, split: tuple[int, int]) -> None:
    num, den = split
    got = [vector_evict_blocks(nb, n, split) for n in range(4 * den)]
    assert all(0 <= g <= nb for g in got)
    assert sum(got) == 4 * nb * num  # over 4*den chunks: exactly nb*num/den per chunk
    assert max(got) - min(got) <= 1  # dealt evenly


def test_pair_plan_maps_2048_key_spans_onto_1024_key_chunks() -> None:
    kc = 1024
    chunks = [(0, kc), (kc, kc), (2 * kc, kc), (3 * kc, kc), (4 * kc, kc), (5 * kc, 512), (5 * kc + 512, 77)]
    plan, n = pair_plan(chunks, kc, 2, 0, (1, 1))  # spans {0,1} {2,3} form one group of 2; chunk 4 is alone
    assert n == 1
    assert (
        plan
        == [(True, 0, False), (True, 1, False), (True, 2, False), (True, 3, True)] + [(False, 0, False)] * 3
    )
    plan, n = pair_plan(chunks, kc, 1, 0, (1, 2))  # groups of one span, every other one to the DMA
    assert n == 2 and plan[:4] == [(True, 0, False), (True, 1, True), (False, 0, False), (False, 0, False)]
    plan, _ = pair_plan(chunks, kc, 8, 0, (0, 1))
    assert not any(dma for dma, _, _ in plan)


def test_merge_remainder_one_chunk_of_two_equal_banks() -> None:
    kc = KC_TWO_BYTE
    got = merge_remainder(_chunks(32_760, kc), kc)
    assert got[-1] == (31 * kc, 1016) and len(got) == 32 and sum(n for _, n in got) == 32_760
    assert merge_remainder(_chunks(1736, kc), kc) == [(0, kc), (kc, 712)]
    assert merge_remainder(_chunks(2637, kc), kc) == _chunks(2637, kc)  # 589 is odd: no equal banks
    assert merge_remainder(_chunks(6444, kc), kc) == _chunks(6444, kc)  # a lone < 512 tail stays
    assert merge_remainder(_chunks(1536, kc), kc) == [(0, kc), (kc, 512)]
    for lk in range(1, 3 * kc, 37):
        for _c0, n in merge_remainder(_chunks(lk, kc), kc):
            assert 0 < n <= kc and n % -(-n // 512) == 0


def test_merged_remainder_chunk_matches_reference() -> None:
    """Lk = 1024 + 712: the remainder is one chunk whose S fills two banks of 356 columns (QK^T, max, exp,
    P^T and PV over unequal bank widths); against the fp32 reference with the tolerance of
    tests/numerics.py (derived from the bf16 reference's own error)."""
    import torch

    from nki_kernels.attention import attention_emulated
    from reference.attention import attention
    from tests.numerics import assert_within, reference_error

    g = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(1, n, 2, 64, generator=g) for n in (150, 1736, 1736))
    ref_err, (base_o, base_l) = reference_error(
        attention, [q, k, v], torch.bfloat16, scale=0.2, return_lse=True
    )
    out, lse = attention_emulated(q.bfloat16(), k.bfloat16(), v.bfloat16(), scale=0.2, return_lse=True)
    assert_within(out, base_o, torch.bfloat16, ref_err, what="attention merged remainder out")
    assert_within(lse, base_l, torch.bfloat16, ref_err, what="attention merged remainder lse")


@pytest.mark.parametrize("share", [None, (3, 5)])
def test_wan_key_length_fits_and_keeps_partition_rules(share: tuple[int, int] | None) -> None:
    """Lk = 32,760 (Wan's key budget) with one short query tile: K^T, V (+ ones column), the flash tiles and,
    with a DMA share, the P / P^T group tiles fit SBUF, S / P^T / PV fit the 8 PSUM banks; the emulator raises
    on any overflow or start-partition violation while tracing."""
    args = (_spec(40), _spec(32_760), _spec(32_760), 0.1, False, share, None, False)
    _, tr = run(attention_kernel, *args, trace_only=True)
    assert tr.count(op="tensor_reduce") == 32  # 31 full chunks and the 1016-key remainder (2 banks of 508)
    _, tr = run(attention_kernel, *args[:-1], True, trace_only=True)  # static: the first chunk's max only
    assert tr.count(op="tensor_reduce") == 1  # per row with a DMA share; per tile (streamed K/V) without


def test_row_max_covers_both_psum_banks_of_a_chunk() -> None:
    """bf16, one 1024-key chunk = two PSUM banks of S: for queries 0..19 the scaled scores of keys 0..511
    exceed those of keys 512..1023 by > 200, for queries 20..39 the other way round, so a row max that missed
    either bank overflows exp (non-finite rows) or underflows every weight. Baseline: float64 softmax of the
    bf16-rounded inputs. Tolerance: P is rounded to bf16 before PV and l is summed from the same rounded P, so
    each weight of the normalised average is off by <= 2 x 2^-9 relative: 2^-7 max|v| for out (+ its bf16
    rounding, 2^-9 max|out|), 2^-7 for lse; plus the fp32 rounding of an exp argument |x| (2 |x| 2^-24)."""
    import torch

    from nki_kernels.attention import attention_emulated

    b, lq, lk, h, d, scale = 1, 40, 1024 + 300, 1, 16, 4.0
    g = torch.Generator().manual_seed(12)
    e0 = torch.zeros(d)
    e0[0] = 1.0
    q = 0.3 * torch.randn(b, lq, h, d, generator=g)
    q[:, :20] += 8.0 * e0
    q[:, 20:] -= 8.0 * e0
    k = 0.3 * torch.randn(b, lk, h, d, generator=g)
    k[:, :512] += 4.0 * e0
    k[:, 512:1024] -= 4.0 * e0
    v = torch.randn(b, lk, h, d, generator=g)
    q, k, v = (t.bfloat16() for t in (q, k, v))
    x = scale * torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double())
    first, second = x[..., :512].amax(-1), x[..., 512:1024].amax(-1)
    assert ((first - second)[..., :20] > 200).all() and ((second - first)[..., 20:] > 200).all(), "data"
    want_l = torch.logsumexp(x, dim=-1)
    want_o = torch.einsum("bhqk,bkhd->bqhd", torch.exp(x - want_l[..., None]), v.double())
    out, lse = attention_emulated(q, k, v, scale=scale, return_lse=True)
    assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all(), "non-finite output"
    ext = 2 * x.abs().max().item() * 2.0**-24
    tol_o = 2.0**-7 * v.float().abs().max().item() + 2.0**-9 * want_o.abs().max().item() + ext
    assert (out.double() - want_o).abs().max().item() <= tol_o
    assert (
        lse.double() - want_l.permute(0, 2, 1)
    ).abs().max().item() <= 2.0**-7 + ext * want_l.abs().max().item()


@pytest.mark.parametrize(("b", "h", "nprog"), [(1, 1, 1), (2, 3, 1), (2, 3, 2), (1, 12, 2), (3, 5, 2)])
def test_owned_pairs_deal_every_head_once_in_order(b: int, h: int, nprog: int) -> None:
    """Both attention kernels split (b, h) over the LNC programs with owned_pairs: every pair exactly once,
    b-major order kept within a program, counts differing by at most one."""
    every = [(i, j) for i in range(b) for j in range(h)]
    dealt = [owned_pairs(b, h, pid, nprog) for pid in range(nprog)]
    assert dealt == [every[pid::nprog] for pid in range(nprog)]
    assert max(map(len, dealt)) - min(map(len, dealt)) <= 1
