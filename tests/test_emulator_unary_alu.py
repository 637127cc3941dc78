"""A unary ALU operator as ``op0`` / ``op1`` of ``tensor_scalar`` / ``tensor_scalar_reduce`` (NKI 0.6
docstrings: the operand "must be None or 0 when op0 is a unary operator (e.g., nl.abs)"; nki-library's
rmsnorm_quant and mlp_cte quantization use ``op0=nl.abs``): values against numpy, and the rules (a non-zero
operand, or an op that is no ALU op, still raise)."""

from __future__ import annotations

import numpy as np
import pytest

from nki_kernels.emulator import TensorSpec, run
from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import language as nl

pytestmark = pytest.mark.emulator


def _k(x, operand0):
    t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(t, x)
    a = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(a, t, nl.abs, operand0, op1=nl.multiply, operand1=2.0)
    m = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.sbuf)
    b = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar_reduce(
        dst=b, data=t, op0=nl.abs, operand0=operand0, reduce_op=nl.maximum, reduce_res=m
    )
    oa = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
    om = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(oa, a)
    nisa.dma_copy(om, m)
    return oa, om


@pytest.mark.parametrize("operand0", [0.0, None])
def test_abs_as_op0(operand0):
    x = np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32)
    (a, m), _ = run(_k, x, operand0)
    np.testing.assert_array_equal(a, np.abs(x) * 2)  # exact: |x| and *2 are exact in fp32
    np.testing.assert_array_equal(m[:, 0], np.abs(x).max(axis=1))


def test_unary_op_with_a_nonzero_operand_or_a_non_alu_op_is_refused():
    with pytest.raises(
        ValueError, match=r"op0=abs is a unary ALU op, its operand must be None or 0, got 1.0"
    ):
        run(_k, TensorSpec((32, 16), "float32"), 1.0, trace_only=True)

    def k2(x):
        t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(t, t, nl.exp, 0.0)

    with pytest.raises(ValueError, match=r"op0=exp is not a binary ALU op"):
        run(k2, TensorSpec((32, 16), "float32"), trace_only=True)
