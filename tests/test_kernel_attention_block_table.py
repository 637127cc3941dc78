"""Block-table attention kernel (nki_kernels.attention_block_table) on the NKI emulator.

Against ``reference.attention.attention_block_table`` (fp32 softmax) with the tolerance rule of
``tests/numerics.py``; one traced kernel for every table; the merged stream on the emulator backend.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nki_kernels import ops
from nki_kernels.attention_block_table import attention_block_table_emulated, attention_block_table_kernel
from nki_kernels.emulator import TensorSpec, run
from reference.attention import attention_block_table
from tests import numerics
from tests.numerics import assert_within, reference_error

pytestmark = pytest.mark.emulator


def _data(b, h, d, t, src_blocks, lq, seed):
    g = torch.Generator().manual_seed(seed)
    ks = [torch.randn(b, n * t, h, d, generator=g) for n in src_blocks]
    vs = [torch.randn(b, n * t, h, d, generator=g) for n in src_blocks]
    q = torch.randn(b, lq, h, d, generator=g)
    return q, ks, vs


def _ref_flat(n_src, table, groups, t, **kw):
    """Reference over flat tensor args (so tests.numerics can cast every tensor to the low dtype)."""

    def fn(q, *kv):
        return attention_block_table(q, list(kv[:n_src]), list(kv[n_src:]), table, groups, t, **kw)

    return fn


def _check(q, ks, vs, table, groups, t, dtype, scale=None, lnc=1):
    kw = {"scale": scale, "return_lse": True}
    ref_err, (base_o, base_l) = reference_error(
        _ref_flat(len(ks), table, groups, t, **kw), [q, *ks, *vs], dtype
    )
    out, lse = attention_block_table_emulated(
        q.to(dtype), [k.to(dtype) for k in ks], [v.to(dtype) for v in vs], table, groups, t, lnc=lnc, **kw
    )
    assert out.dtype == dtype and out.shape == q.shape and lse.dtype == torch.float32
    what = f"block-table {dtype} groups={groups} T={t} table={table.tolist()}"
    # groups without keys: exactly zeros and -inf (compared separately: -inf - -inf is nan)
    empty = (table[:, :, 0] < 0).all(dim=1).tolist()
    lse, base_l = lse.clone(), base_l.clone()
    lo = 0
    for g, n in enumerate(groups):
        if empty[g]:
            assert torch.equal(out[:, lo : lo + n].float(), torch.zeros_like(out[:, lo : lo + n].float()))
            assert torch.isneginf(lse[:, lo : lo + n]).all()
            base_l[:, lo : lo + n] = 0.0
            lse[:, lo : lo + n] = 0.0
        lo += n
    assert_within(out, base_o, dtype, ref_err, what=what + " out")
    assert_within(lse, base_l, dtype, ref_err, what=what + " lse")
    return out, lse


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_blocks_several_sources_ring_order(dtype: torch.dtype) -> None:
    # 3 sources (ring of 5 blocks, fresh 3, copies 2); T = 150 (a full 128-row tile + a 22-row tail, so
    # blocks start mid-tile); group 0 reads a ring-wrapped run 3, 4, 0, 1 with an empty entry between;
    # group 1 reads sink copy + fresh blocks with empties first and last; group 2 has no keys at all.
    b, h, d, t = 2, 2, 32, 150
    q, ks, vs = _data(b, h, d, t, (5, 3, 2), lq=37 + 200 + 5, seed=1)
    table = torch.tensor(
        [
            [[0, 3], [0, 4], [-1, 0], [0, 0], [0, 1]],
            [[-1, 2], [2, 1], [1, 0], [1, 2], [-1, 0]],
            [[-1, 0], [-1, 0], [-1, 0], [-1, 0], [-1, 0]],
        ]
    )
    _check(q, ks, vs, table, [37, 200, 5], t, dtype)


def test_multi_chunk_bf16_dma_transposed_chunk() -> None:
    # 8 entries x 300 keys = 2400 key slots: one full 2048-key chunk (its P^T by the SBUF->SBUF DMA
    # transpose) and a 352-key tail; the empty entries sit in both chunks; lnc=2 deals the heads
    b, h, d, t = 1, 2, 64, 300
    q, ks, vs = _data(b, h, d, t, (6, 2), lq=130, seed=2)
    table = torch.tensor(
        [[[0, 5], [1, 1], [-1, 0], [0, 0], [0, 2], [1, 0], [-1, 3], [0, 3]], [[-1, 0]] * 7 + [[0, 4]]]
    )
    _check(q, ks, vs, table, [129, 1], t, torch.bfloat16, scale=0.2, lnc=2)


def test_grouped_dma_and_pe_transposes_agree_bitwise() -> None:
    """P^T by TensorE only, by the DMA one chunk per instruction, and by the DMA for groups of 2 and 3 chunks
    (their PV matmuls held back until the group is transposed) give bit-identical out and lse: 21 entries x
    300 keys = 3 full 2048-key chunks + a 156-key tail per query tile, with empty entries in every chunk."""
    b, h, d, t = 1, 1, 32, 300
    q, ks, vs = _data(b, h, d, t, (12, 9), lq=140, seed=6)
    g = torch.Generator().manual_seed(7)
    rows = []
    for _ in range(2):  # each group: the 21 distinct blocks of both sources in a random order, 4 left empty
        code = torch.randperm(21, generator=g)
        row = torch.stack([(code >= 12).long(), torch.where(code >= 12, code - 12, code)], dim=-1)
        row[torch.randperm(21, generator=g)[:4]] = torch.tensor([-1, 0])
        rows.append(row)
    table = torch.stack(rows).to(torch.int32)
    qb, kb, vb = q.bfloat16(), [k.bfloat16() for k in ks], [v.bfloat16() for v in vs]
    groups = (100, 40)
    res = {}
    for frac, group in (((0, 1), 1), ((1, 1), 1), ((1, 1), 2), ((1, 2), 3), ((2, 3), 2)):
        (o, lse), tr = run(
            attention_block_table_kernel,
            qb,
            kb,
            vb,
            table.numpy(),
            groups,
            t,
            0.2,
            True,
            frac,
            group,
            False,
        )  # fmt: skip  (running max: the transpose paths compared bit for bit)
        res[(frac, group)] = (o, lse, tr.count(op="nc_transpose"))
    base = res[((0, 1), 1)]
    for key, (o, lse, _) in res.items():
        assert torch.equal(o, base[0]) and torch.equal(lse, base[1]), key
    # with every group on the DMA no P^T block is left on TensorE (only the tails), whatever the group size
    assert res[((1, 1), 1)][2] == res[((1, 1), 2)][2] < base[2]
    _check(q, ks, vs, table, list(groups), t, torch.bfloat16, scale=0.2)


def test_large_scores_empty_entries_exact() -> None:
    # scale = 4 and keys/queries built so that scaled scores reach about -100: an empty entry filled with zero
    # keys would give a stabiliser of 0 and every valid exp of a query whose scores are all below -88 would
    # underflow; the duplicate-key fill keeps the row max a max over real keys, so the result stays exact.
    b, h, d, t = 1, 1, 16, 40
    q, ks, vs = _data(b, h, d, t, (4,), lq=60, seed=3)
    # keys lean along e0; the first 20 queries point the other way: all their scaled scores are ~ -130
    e0 = torch.zeros(d)
    e0[0] = 1.0
    ks = [0.3 * ks[0] + 4.0 * e0]
    q = q.clone()
    q[:, :20] = 0.3 * q[:, :20] - 8.0 * e0
    table = torch.tensor([[[-1, 0], [0, 2], [-1, 0], [0, 0]]])
    scale = 4.0
    out, lse = attention_block_table_emulated(q, ks, vs, table, [60], t, scale=scale, return_lse=True)
    ref_o, ref_l = attention_block_table(q, ks, vs, table, [60], t, scale=scale, return_lse=True)
    keys = torch.cat([ks[0][:, 2 * t : 3 * t], ks[0][:, :t]], dim=1)
    x = scale * torch.einsum("bqhd,bkhd->bhqk", q, keys)
    row_max = x.amax(dim=-1)
    assert (row_max < -88).any(), "the data must contain queries whose every scaled score is below -88"
    # fp32 rounding of an exp argument x costs a relative |x| * 2^-24 on its weight (the unit-scale floor
    # of tests/numerics.py does not cover |x| ~ 100): bound = floor + 2 * max|x| * 2^-24 * max|v|
    tol = numerics.FLOORS[torch.float32] + 2 * x.abs().max().item() * 2.0**-24 * vs[0].abs().max().item()
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert (out - ref_o).abs().max().item() <= tol
    assert (lse - ref_l).abs().max().item() <= tol * ref_l.abs().max().item()


@settings(max_examples=4, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    t=st.sampled_from([16, 128, 130]),
    nb=st.integers(1, 4),
    dtype=st.sampled_from(DTYPES),
)
def test_random_tables_match_reference(seed: int, t: int, nb: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(seed)
    src_blocks = (3, 2)
    q, ks, vs = _data(1, 2, 16, t, src_blocks, lq=70, seed=seed)
    cands = [(s, k) for s, n in enumerate(src_blocks) for k in range(n)]
    rows = []
    for _ in range(2):
        perm = torch.randperm(len(cands), generator=g).tolist()[:nb]
        row = [list(cands[i]) if torch.rand((), generator=g) < 0.7 else [-1, 0] for i in perm]
        rows.append(row)
    _check(q, ks, vs, torch.tensor(rows), [30, 40], t, dtype)


def test_one_trace_serves_every_table() -> None:
    """Table values are runtime data: two different tables (different sources, ring order, empties) give
    the identical instruction trace, equal to the trace-only trace where no table value exists at all."""
    b, h, d, t = 1, 2, 16, 40
    q, ks, vs = _data(b, h, d, t, (4, 2), lq=50, seed=4)
    groups = (20, 30)
    tabs = [
        torch.tensor([[[0, 1], [0, 2], [-1, 0]], [[1, 0], [1, 1], [0, 3]]], dtype=torch.int32),
        torch.tensor([[[-1, 0], [-1, 0], [-1, 0]], [[0, 3], [-1, 0], [0, 0]]], dtype=torch.int32),
    ]
    traces, outs = [], []
    for tab in tabs:
        out, tr = run(attention_block_table_kernel, q, ks, vs, tab.numpy(), groups, t, 0.25, False)
        traces.append(list(tr.entries()))
        outs.append(out)
        ref = attention_block_table(q, ks, vs, tab, groups, t, scale=0.25)
        # kernel vs fp32 reference: the fp32 floor of tests/numerics.py (fp32 ref_err = 0); measured 6.0e-07
        assert (out - ref).abs().max().item() <= numerics.tolerance(torch.float32, 0.0)
    assert not torch.equal(outs[0], outs[1])
    assert traces[0] == traces[1]
    specs = [TensorSpec(tuple(x.shape), "float32") for x in (q, *ks, *vs)]
    _, tr_only = run(
        attention_block_table_kernel,
        specs[0],
        specs[1:3],
        specs[3:5],
        TensorSpec((2, 3, 2), "int32"),
        groups,
        t,
        0.25,
        False,
        trace_only=True,
    )
    assert list(tr_only.entries()) == traces[0]
    # every key/value load is a runtime-offset DMA with out-of-bounds skip (no value-dependent loads)
    indirect = [r for r, _ in tr_only.entries() if r.op == "dma_copy" and ("indirect", "scalar") in r.meta]
    assert indirect


def test_op_dispatch_and_errors() -> None:
    q, ks, vs = _data(1, 1, 16, 8, (2, 2), lq=12, seed=5)
    table = torch.tensor([[[1, 1], [0, 0]], [[-1, 0], [0, 1]]])
    ref = ops.attention_block_table(q, ks, vs, table, [5, 7], 8, backend="reference", return_lse=True)
    emu = ops.attention_block_table(q, ks, vs, table, [5, 7], 8, backend="emulator", return_lse=True)
    tol = numerics.tolerance(torch.float32, 0.0)  # fp32 floor (fp32 ref_err = 0); measured 2.4e-07 and 0.0
    assert (emu[0] - ref[0]).abs().max().item() <= tol and (emu[1] - ref[1]).abs().max().item() <= tol
    assert ops.has_kernel("attention_block_table", "emulator")
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] block=2 is out of source 0"):
        attention_block_table_emulated(
            q, ks, vs, torch.tensor([[[1, 1], [0, 2]], [[-1, 0], [0, 1]]]), [5, 7], 8
        )
    with pytest.raises(ValueError, match=r"block_table\[1\] lists block \(0, 1\) twice"):
        attention_block_table_emulated(
            q, ks, vs, torch.tensor([[[1, 1], [0, 0]], [[0, 1], [0, 1]]]), [5, 7], 8
        )
    with pytest.raises(ValueError, match=r"source=2 must be -1 \(empty\) or in \[0, 2\)"):
        attention_block_table_emulated(
            q, ks, vs, torch.tensor([[[2, 0], [0, 0]], [[0, 1], [0, 0]]]), [5, 7], 8
        )
    with pytest.raises(ValueError, match="q_groups"):
        attention_block_table_emulated(q, ks, vs, table, [5, 6], 8)
    with pytest.raises(ValueError, match="block_table must be"):
        attention_block_table_emulated(q, ks, vs, table[:1], [5, 7], 8)
    with pytest.raises(TypeError, match="block_table must be an integer"):
        attention_block_table_emulated(q, ks, vs, table.float(), [5, 7], 8)
    with pytest.raises(ValueError, match=r"k_sources\[1\] length S=16 must be a positive multiple of 5"):
        attention_block_table_emulated(q, [ks[0][:, :15], ks[1]], [vs[0][:, :15], vs[1]], table, [5, 7], 5)
    with pytest.raises(TypeError, match=r"v_sources\[0\] dtype"):
        attention_block_table_emulated(q, ks, [vs[0].bfloat16(), vs[1]], table, [5, 7], 8)


# ---- the merged stream on the emulator backend ---------------------------------------------------


@pytest.fixture
def _one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.usefixtures("_one_thread")
def test_merged_stream_on_emulator_equals_reference() -> None:
    """6 blocks (warm-up windows with empty table entries and padded queries, steady windows, tail) of the
    tiny preset, fp32: the pipeline's default on the emulator backend is now the merged forward, and its
    stream equals the reference backend's merged stream within the issue's fp32 bound (1e-5)."""
    from rolling_forcing.config import PipelineConfig, get_preset
    from rolling_forcing.model import CausalWanModel
    from rolling_forcing.pipeline import RollingForcingPipeline

    m, p = get_preset("tiny"), PipelineConfig()
    model = CausalWanModel(m).init_random(0).eval()
    text = torch.randn(1, m.text_len, m.text_dim, generator=torch.Generator().manual_seed(1))
    res = {}
    for be in ("reference", "emulator"):
        pipe = RollingForcingPipeline(model, m, p, backend=be)
        assert pipe.merged is True, be
        chunks = list(pipe.stream(text, 6, generator=torch.Generator().manual_seed(7)))
        res[be] = torch.cat([c.latents for c in chunks], dim=1)
    err = (res["emulator"] - res["reference"]).abs().max().item()
    assert res["reference"].abs().max().item() > 0.1  # a real stream, not zeros
    bound = numerics.FP32_ISSUE_BOUND  # measured 1.4e-06
    assert err <= bound, f"merged stream emulator vs reference: max abs error {err:.3e} > {bound:.0e}"
