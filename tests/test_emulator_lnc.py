"""LNC2 values that cross the two logical cores (nki_kernels/emulator/lnc.py, docs/emulator.md).

With values, the two programs take turns at ``core_barrier`` / ``sendrecv``: what one core writes to shared
HBM before a barrier is what the other reads after it; ``sendrecv`` delivers the peer's ``src`` into ``dst``.
Checked against hand-computed results.  What the hardware cannot complete is refused: a barrier or a receive
the other core never matches (``[lnc-deadlock]``, the hardware would hang), and a rule error on one core
surfaces instead of leaving the other waiting.  Full-arithmetic and trace-only traces agree.
"""

from __future__ import annotations

import numpy as np
import pytest

from nki_kernels import emulator as emu
from nki_kernels.emulator import TensorSpec, run
from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import language as nl

pytestmark = pytest.mark.emulator


def _exchange(x):
    """x: HBM [2, 128, 16] fp32.  Program p loads x[p], sends it to the other core, receives the other's
    x[1-p], writes received * 10 + own into out[p].  Expected: out[p] = 10 * x[1-p] + x[p]."""
    me = nl.program_id(0)
    out = nl.ndarray((2, 128, 16), nl.float32, buffer=nl.shared_hbm)
    own = nl.ndarray((128, 16), nl.float32, buffer=nl.sbuf)
    got = nl.ndarray((128, 16), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(own, x[me])
    nisa.sendrecv(own, got, send_to_rank=1 - me, recv_from_rank=1 - me, pipe_id=0)
    res = nl.ndarray((128, 16), nl.float32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=res, data=got, op0=nl.multiply, operand0=10.0, op1=nl.add, operand1=own)
    nisa.dma_copy(out[me], res)
    return out


def test_sendrecv_delivers_the_peers_data():
    x = np.random.default_rng(0).integers(-50, 50, size=(2, 128, 16)).astype(np.float32)
    out, tr = run(_exchange, x, lnc=2)
    np.testing.assert_array_equal(out[0], 10 * x[1] + x[0])  # small integers: exact in fp32
    np.testing.assert_array_equal(out[1], 10 * x[0] + x[1])
    _, tr_only = run(_exchange, TensorSpec((2, 128, 16), "float32"), lnc=2, trace_only=True)
    assert dict(tr.counts) == dict(tr_only.counts)


def _barrier_sum(x):
    """x: HBM [2, 64, 8] fp32.  Program p writes x[p] * (p + 2) into its half of a shared scratch, meets the
    other at a barrier, then reads the other half and writes own + other into out[p]."""
    me = nl.program_id(0)
    out = nl.ndarray((2, 64, 8), nl.float32, buffer=nl.shared_hbm)
    scratch = nl.ndarray((2, 64, 8), nl.float32, buffer=nl.shared_hbm)
    t = nl.ndarray((64, 8), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(t, x[me])
    nisa.tensor_scalar(t, t, nl.multiply, float(me + 2))
    nisa.dma_copy(scratch[me], t)
    nisa.core_barrier(scratch, (0, 1))
    other = nl.ndarray((64, 8), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(other, scratch[1 - me])
    nisa.tensor_tensor(t, t, other, nl.add)
    nisa.dma_copy(out[me], t)
    return out


def test_core_barrier_makes_the_other_cores_writes_visible():
    x = np.random.default_rng(1).integers(-20, 20, size=(2, 64, 8)).astype(np.float32)
    out, _ = run(_barrier_sum, x, lnc=2)
    both = 2 * x[0] + 3 * x[1]
    np.testing.assert_array_equal(out[0], both)
    np.testing.assert_array_equal(out[1], both)


def test_barrier_without_partner_is_refused():
    def k(x):
        s = nl.ndarray((1, 4), nl.float32, buffer=nl.shared_hbm)
        if nl.program_id(0) == 0:
            nisa.core_barrier(s, (0, 1))
        return s

    with pytest.raises(emu.LaunchError, match=r"\[lnc-deadlock\] program 0 waits for core_barrier #1"):
        run(k, np.zeros(1, np.float32), lnc=2)


def test_sendrecv_on_mismatched_pipes_is_refused():
    def k(x):
        me = nl.program_id(0)
        a = nl.ndarray((8, 8), nl.float32, buffer=nl.sbuf)
        b = nl.ndarray((8, 8), nl.float32, buffer=nl.sbuf)
        nisa.memset(a, 1.0)
        nisa.sendrecv(a, b, send_to_rank=1 - me, recv_from_rank=1 - me, pipe_id=me)  # pipes 0 and 1
        return x

    with pytest.raises(
        emu.LaunchError, match=r"\[lnc-deadlock\] program \d waits for sendrecv data .* while"
    ):
        run(k, np.zeros(1, np.float32), lnc=2)


def test_rule_error_on_one_core_surfaces_while_the_other_waits():
    def k(x):
        s = nl.ndarray((1, 4), nl.float32, buffer=nl.shared_hbm)
        if nl.program_id(0) == 1:
            nl.ndarray((129, 4), nl.float32, buffer=nl.sbuf)  # partition limit
        nisa.core_barrier(s, (0, 1))
        return s

    with pytest.raises(emu.PartitionLimitError, match=r"\[partition-limit\]"):
        run(k, np.zeros(1, np.float32), lnc=2)
