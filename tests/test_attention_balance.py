"""The re-balanced attention inner loop (nki_kernels/attention.py; docs/kernels/attention.md, "Engine
balance"): the instruction mix per 128 x 1024-key chunk read from the emulator trace against the design, the
pure eviction dealer and span plan, and the SBUF/PSUM fits at Wan's key length (the emulator checks capacity
and the start-partition rule while tracing)."""

from __future__ import annotations

from collections import Counter

import pytest

from nki_kernels.attention import attention_kernel
from nki_kernels.attention_tiles import KC_TWO_BYTE, VECTOR_EVICT, pair_plan, vector_evict_blocks
from nki_kernels.emulator import TensorSpec, run

pytestmark = pytest.mark.emulator


def _spec(n: int, h: int = 1, d: int = 128) -> TensorSpec:
    return TensorSpec((1, n, h, d), "bfloat16")


def _mix(lq: int, lk: int) -> Counter:
    """Compute instructions of a trace-only launch, keyed by (engine, op, first source buffer, function)."""
    _, tr = run(attention_kernel, _spec(lq), _spec(lk), _spec(lk), 0.1, False, trace_only=True)
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
    """One 128-query tile over 4 full 1024-key chunks: per chunk 2 QK^T matmuls, ONE VectorE max reduce
    straight from PSUM, ONE ScalarE exp straight from PSUM, 8 TensorE transposes, 8 PV matmuls; the P^T
    evictions split VectorE / ScalarE by the running dealer; no fp32 copy of S and no GpSimdE work (only
    the one-time memset of V's ones column)."""
    chunks = 4
    m = _mix(128, chunks * KC_TWO_BYTE)
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


@pytest.mark.parametrize("share", [None, (3, 5)])
def test_wan_key_length_fits_and_keeps_partition_rules(share: tuple[int, int] | None) -> None:
    """Lk = 32,760 (Wan's key budget) with one short query tile: K^T, V (+ ones column), the flash tiles and,
    with a DMA share, the P / P^T group tiles fit SBUF, S / P^T / PV fit the 8 PSUM banks; the emulator raises
    on any overflow or start-partition violation while tracing."""
    args = (_spec(40), _spec(32_760), _spec(32_760), 0.1, False) + ((share,) if share else ())
    _, tr = run(attention_kernel, *args, trace_only=True)
    assert tr.count(op="tensor_reduce") == 33  # 31 full chunks, a 512-key chunk and a 504-key tail
