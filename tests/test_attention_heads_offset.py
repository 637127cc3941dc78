"""The every-head pass's softmax offset (nki_kernels.attention_heads): each row's own maximum rounded to
bf16 and added to the transposed scores by a matmul. Rounding moves the offset by up to 2^-9 of the row's
maximum, so a row whose scaled maximum is huge can lose every term to underflow (l = 0); the guard's lower
bound (``GUARD_L_MIN``) must then recompute that head with the exact running max.

Against ``reference.attention`` with the tolerance rule of ``tests/numerics.py`` (float64 reference of the
rounded inputs, 2x the reference's own error in bf16 + bf16's floor)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nki_kernels.attention import attention_emulated
from nki_kernels.emulator import run
from reference.attention import attention
from tests.numerics import assert_within, reference_error

pytestmark = pytest.mark.emulator
BF = torch.bfloat16


def test_a_row_whose_rounded_offset_underflows_it_is_recomputed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Query 7 of head 1 scores key 0 at 256 * 256 + 1 * 312 = 65,848 (scale 1; both factors exact in bf16);
    bf16's spacing there is 512, so the offset rounds to -66,048 and every exp of the row is at most
    exp(-200) = 0 in fp32: l = 0. The guard's lower bound trips head 1 alone (one running-max row max per
    tile more), head 0 stays on the fast path, and every row matches the reference (key 0's value for row
    7). Without the lower bound the row is 0 * inf = NaN."""
    from nki_kernels import _nki

    g = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(*s, generator=g) for s in ((1, 100, 2, 32), (1, 256, 2, 32), (1, 256, 2, 32)))
    q[0, 7, 1, :] = 0.0
    q[0, 7, 1, 0], q[0, 7, 1, 1] = 256.0, 1.0
    k[0, 0, 1, 0], k[0, 0, 1, 1] = 256.0, 312.0
    traces: list = []

    def launch(kernel: Any, *args: Any, lnc: int = 1, **kwargs: Any) -> tuple[Any, Any]:
        out, tr = run(kernel, *args, lnc=lnc, **kwargs)
        traces.append(tr)
        return out, tr

    monkeypatch.setattr(_nki, "launch", launch)
    out = attention_emulated(q.to(BF), k.to(BF), v.to(BF), scale=1.0)
    assert traces[0].count(op="tensor_reduce") == 1 + 1  # the guard's reduce + head 1's one tile
    ref_err, base_o = reference_error(attention, [q, k, v], BF, scale=1.0)
    assert torch.isfinite(out).all()
    assert_within(out, base_o, BF, ref_err, what="heads pass, a row with a huge rounded offset")
