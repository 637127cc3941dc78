"""The FP8 attention option (P.V in e4m3 on double-row matmuls; nki_kernels/attention_fp8.py) on the
emulator against its reference (reference/attention_fp8.py) and against fp32 attention.

Tolerances:

* **Kernel vs the FP8 reference** (both quantise the same fp32 values): the kernel's fp32 scores come from
  another summation order than torch's, so an exponential sitting on an e4m3 rounding boundary may round
  the other way: one e4m3 ulp (at most ``2**-3`` of the value) for such a term. Allowed per row: two such
  flips of the row's largest term, i.e. ``2 * 2**-3 * (1 + 2**-4) * w_row * 2 max|v|`` on out (``w_row`` =
  the largest softmax weight ``exp(scale max_k s_k - lse)`` of the row, fp32; ``(1 + 2**-4)``: the term's
  own rounding) and ``2 * 2**-3 * (1 + 2**-4) * w_row`` on lse, plus one bf16 ulp of the output (``2**-8``
  relative: both round the same fp32 value to bf16, which a last-bit difference may flip) and fp32's
  ``2**-19`` floor of ``tests/numerics.py`` on lse.
* **Against fp32 attention** (stated bound): relative L2 error of out <= ``2**-4``, one e4m3 half-ulp (the
  worst relative error of one rounding; P's and V's roundings average over the keys, so the measured
  errors sit well below: ~1-2 %).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import nki_kernels.attention_stream as stream
from nki_kernels import attention_fp8 as kfp8
from nki_kernels.attention import attention_emulated, attention_kernel, attention_segments_emulated
from nki_kernels.attention_block_table import attention_block_table_emulated
from nki_kernels.emulator import TensorSpec, run
from nki_kernels.emulator.cost import is_double_row
from reference import attention as ref32
from reference import attention_fp8 as ref8
from tests.numerics import FLOORS

pytestmark = pytest.mark.emulator

BF = torch.bfloat16
FLIP = 2 * 2.0**-3 * (1 + 2.0**-4)
"""Two e4m3 ulps of a row's largest term (module docstring)."""


def _rand(seed: int, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).to(BF) for s in shapes]


def _launches(monkeypatch: pytest.MonkeyPatch) -> list:
    from nki_kernels import _nki

    traces: list = []

    def launch(kernel: Any, *args: Any, lnc: int = 1, **kwargs: Any) -> tuple[Any, Any]:
        out, tr = run(kernel, *args, lnc=lnc, **kwargs)
        traces.append(tr)
        return out, tr

    monkeypatch.setattr(_nki, "launch", launch)
    return traces


def _weights(q: torch.Tensor, k: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's largest softmax weight ``w_row`` ``[B, Lq, H]`` and exact lse (fp64)."""
    s = torch.einsum("bqhd,bkhd->bqhk", q.double(), k.double()) * scale
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s.amax(-1) - lse), lse


def _check_vs_reference(out, lse, r_out, r_lse, w, vmax, what: str) -> None:
    tol_o = FLIP * w[..., None] * 2 * vmax + 2.0**-8 * r_out.float().abs()
    err_o = (out.float() - r_out.float()).abs()
    assert torch.isfinite(out.float()).all(), f"{what}: non-finite out"
    assert (err_o <= tol_o).all(), f"{what}: out off by {float((err_o - tol_o).max()):.3e} over its bound"
    tol_l = FLIP * w + FLOORS[torch.float32]
    err_l = (lse - r_lse).abs()
    assert (err_l <= tol_l).all(), f"{what}: lse off by {float((err_l - tol_l).max()):.3e} over its bound"


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_constants_match_the_reference() -> None:
    """The kernel's P scale and its logarithm are the reference's."""
    assert kfp8.P_SCALE == ref8.P_SCALE and kfp8.LN_P_SCALE == ref8.LN_P_SCALE


def test_e4m3_rounding_matches_the_emulators_type() -> None:
    """``reference.attention_fp8.e4m3`` rounds like ml_dtypes' float8_e4m3 (the emulator's cast): every
    e4m3 value, midpoints between neighbours (ties to even), subnormals, and overflow to inf from 248."""
    import ml_dtypes
    import numpy as np

    vals = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3).astype(np.float32)
    fin = np.sort(vals[np.isfinite(vals)])
    mids = (fin[1:] + fin[:-1]) / 2
    x = np.concatenate([fin, mids, mids * (1 + 2.0**-20), [247.9, 248.0, 1e6, 2.0**-10, 3 * 2.0**-11]])
    x = np.concatenate([x, -x]).astype(np.float32)
    want = x.astype(ml_dtypes.float8_e4m3).astype(np.float32)
    got = ref8.e4m3(torch.from_numpy(x)).numpy()
    assert np.array_equal(got, want)


def test_fp8_stream_against_reference_and_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """5 query tiles (the last of 44 rows) in units of at most 2, 2,100 keys (2 full chunks and a 52-key
    chunk: a partial block, and an odd block count in no chunk... the full chunks have 8 blocks = 4 pairs),
    2 heads, lse; later keys scoring higher and shifted values: the fast path alone, double-row PVs, within
    the flip bound of the FP8 reference and the stated bound of fp32 attention."""
    q, k, v = _rand(5, (1, 556, 2, 32), (1, 2100, 2, 32), (1, 2100, 2, 32))
    k[:, 2048:] *= 1.5
    v[:, 2048:] += 3.0
    monkeypatch.setattr(stream, "MAX_UNIT_TILES", 2)
    traces = _launches(monkeypatch)
    out, lse = attention_emulated(q, k, v, scale=0.2, return_lse=True, fp8=True)
    assert len(traces) == 1 and traces[0].count(op="tensor_reduce") == 5 * 2  # no guard recompute
    mm = traces[0].select(op="nc_matmul")
    dr = [r for r, c in mm for _ in range(c) if is_double_row(r)]
    # per head and tile: 4 pairs in each of the 2 full chunks, none in the 52-key chunk (one plain matmul)
    assert len(dr) == 2 * 5 * 2 * 4
    assert all(d == "float8_e4m3" for r in dr for d in r.dtypes[1:])
    r_out, r_lse = ref8.attention(q, k, v, scale=0.2, return_lse=True)
    w, _ = _weights(q, k, 0.2)
    _check_vs_reference(out, lse, r_out, r_lse, w, float(v.float().abs().max()), "fp8 stream")
    e_out = ref32.attention(q.float(), k.float(), v.float(), scale=0.2)
    assert isinstance(e_out, torch.Tensor)
    assert _rel_l2(out.float(), e_out) <= 2.0**-4


def test_fp8_odd_and_partial_blocks() -> None:
    """Lk = 2,900: chunks of 8, 8 and 7 blocks (a full-block odd count: 3 pairs + one plain) plus a
    partial block of 84 keys: every path of the PV plan, against the reference."""
    q, k, v = _rand(11, (1, 130, 1, 64), (1, 2900, 1, 64), (1, 2900, 1, 64))
    out, lse = attention_emulated(q, k, v, return_lse=True, fp8=True)
    sc = 1 / math.sqrt(64)
    r_out, r_lse = ref8.attention(q, k, v, scale=sc, return_lse=True)
    w, _ = _weights(q, k, sc)
    _check_vs_reference(out, lse, r_out, r_lse, w, float(v.float().abs().max()), "odd blocks")


def test_fp8_segments() -> None:
    """Three segments whose boundaries fall inside chunks and blocks: V's scales over the segments' keys
    (not the whole buffer: a large value outside them must not coarsen V's rounding)."""
    q, kb, vb = _rand(6, (1, 200, 1, 64), (1, 2600, 1, 64), (1, 2600, 1, 64))
    vb[:, 750] = 1000.0  # in the gap between segments 1 and 2
    segs = [(0, 700), (800, 1100), (2000, 500)]
    out, lse = attention_segments_emulated(q, kb, vb, segs, scale=0.15, return_lse=True, fp8=True)
    r_out, r_lse = ref8.attention_segments(q, kb, vb, segs, scale=0.15, return_lse=True)
    k, v = ref32.gather_segments(kb, segs), ref32.gather_segments(vb, segs)
    w, _ = _weights(q, k, 0.15)
    _check_vs_reference(out, lse, r_out, r_lse, w, float(v.float().abs().max()), "fp8 segments")


def test_fp8_block_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of T = 100 keys from 2 sources, 24 entries, empty entries past the first chunk's 11 (their
    keys are not in the offsets), two query groups: the kernel against the reference (V's scales over
    every source token)."""
    t, nb = 100, 24
    q, k0, k1, v0, v1 = _rand(7, (1, 300, 2, 32), (1, 14 * t, 2, 32), (1, 12 * t, 2, 32),
                              (1, 14 * t, 2, 32), (1, 12 * t, 2, 32))  # fmt: skip
    g = torch.Generator().manual_seed(8)
    rows = []
    for _ in range(2):
        code = torch.randperm(26, generator=g)[:nb]
        row = torch.stack([(code >= 14).long(), torch.where(code >= 14, code - 14, code)], dim=-1)
        row[11 + torch.randperm(nb - 11, generator=g)[:4]] = torch.tensor([-1, 0])
        rows.append(row)
    table = torch.stack(rows)
    groups = [44, 256]
    monkeypatch.setattr(stream, "MAX_UNIT_TILES", 2)
    traces = _launches(monkeypatch)
    out, lse = attention_block_table_emulated(q, [k0, k1], [v0, v1], table, groups, t, scale=0.2,
                                              return_lse=True, fp8=True)  # fmt: skip
    assert len(traces) == 1 and traces[0].count(op="tensor_reduce") == 2 * (1 + 2) + 2  # fast path
    r_out, r_lse = ref8.attention_block_table(q, [k0, k1], [v0, v1], table, groups, t, scale=0.2,
                                              return_lse=True)  # fmt: skip
    vmax = float(torch.cat([v0, v1], 1).float().abs().max())
    lo = 0
    for gi, nq in enumerate(groups):
        ks = [(k0, k1)[s][:, b * t : (b + 1) * t] for s, b in table[gi].tolist() if s >= 0]
        w, _ = _weights(q[:, lo : lo + nq], torch.cat(ks, 1), 0.2)
        sl = slice(lo, lo + nq)
        _check_vs_reference(out[:, sl], lse[:, sl], r_out[:, sl], r_lse[:, sl], w, vmax, f"group {gi}")
        lo += nq


def test_fp8_overflow_and_low_rows_trip_the_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """A key of a later chunk scoring ~7 nats above the first chunk's maximum for 40 queries (P overflows
    e4m3: inf), and in a second head rows ~7-10 nats below their tile's maximum (terms subnormal or flushed,
    ``0 < l < 1``): both heads are
    recomputed by the bf16 running max and come back within bf16's tolerance of fp32 attention, where the
    FP8 reference is non-finite / far off."""
    q, k, v = _rand(9, (1, 160, 2, 64), (1, 2100, 2, 64), (1, 2100, 2, 64))
    k[..., 0], q[..., 0] = 0.0, 0.0
    k[:, 1500, 0, 0] = 12.0  # head 0: one later key, ~12 nats for the first 40 queries (offset ~4-5 nats)
    q[:, :40, 0, 0] = 8.0
    q[:, :, 1, 0] = -6.0  # head 1: first-chunk key 3 lifts rows 0..39 (q_0 > 0) ~10 nats above the rest
    q[:, :40, 1, 0] = 6.0
    k[:, 3, 1, 0] = 14.0
    k[:, 5, 1, 0] = -8.0  # ... and lifts the other rows' key 5 to a subnormal P: their l is in (0, 1)
    sc = 1 / math.sqrt(64)
    r_out, r_lse = ref8.attention(q, k, v, scale=sc, return_lse=True)
    assert not torch.isfinite(
        r_out[:, :40, 0].float()
    ).all()  # the reference overflows where the kernel trips
    assert torch.isfinite(r_lse[:, 40:128, 1]).all()  # l > 0 there: only the FP8 lower bound trips them
    traces = _launches(monkeypatch)
    out = attention_emulated(q, k, v, scale=sc, fp8=True)
    # both heads recomputed: per head 2 tiles x 3 key chunks of running max, after the 2 x 2 offset maxes
    assert traces[0].count(op="tensor_reduce") == 2 * 2 + 2 * 2 * 3
    e_out = ref32.attention(q.float(), k.float(), v.float(), scale=sc)
    bf_ref = ref32.attention(q, k, v, scale=sc)
    assert isinstance(e_out, torch.Tensor) and isinstance(bf_ref, torch.Tensor)
    bf_ref = bf_ref.float()
    bound = 2 * float((bf_ref - e_out).abs().max()) + FLOORS[BF]
    assert float((out.float() - e_out).abs().max()) <= bound


def test_trace_only_fp8_kernel_rules() -> None:
    """The option is refused where the streamed pass does not run (fp32, one key chunk, static=False)."""
    q, kv = TensorSpec((1, 128, 1, 64), "float32"), TensorSpec((1, 2100, 1, 64), "float32")
    vs = TensorSpec((1, 1, 64), "float32")
    with pytest.raises(ValueError, match="v_scale"):
        run(attention_kernel, q, kv, kv, 0.1, False, v_scale=vs, trace_only=True)
    qb, kb = TensorSpec((1, 128, 1, 64), "bfloat16"), TensorSpec((1, 512, 1, 64), "bfloat16")
    with pytest.raises(ValueError, match="v_scale"):
        run(attention_kernel, qb, kb, kb, 0.1, False, v_scale=vs, trace_only=True)
    kb2 = TensorSpec((1, 2100, 1, 64), "bfloat16")
    with pytest.raises(ValueError, match="v_scale"):
        run(attention_kernel, qb, kb2, kb2, 0.1, False, static=False, v_scale=vs, trace_only=True)
