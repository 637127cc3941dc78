"""A self-made flash-attention-shaped NKI kernel used to check trace-only speed (not a project kernel).

Layouts: qT [H, D, Sq], kT [H, D, Sk], v [H, Sk, D] in HBM (bf16); out [H, Sq, D].  Per head, per
128-query tile, per 512-key tile: QK^T matmul, running max, exp with row sum, 4 PE transposes of P, 4
PV matmuls accumulating in PSUM, rescale.  Ragged last tiles use min().
"""

from __future__ import annotations

from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import language as nl
from nki_kernels.emulator import nki


@nki.jit
def attention_like(qT, kT, v):
    H, D, Sq = qT.shape
    Sk = kT.shape[2]
    out = nl.ndarray((H, Sq, D), qT.dtype, buffer=nl.shared_hbm)
    for h in range(H):
        for q0 in range(0, Sq, 128):
            nq = min(128, Sq - q0)
            q_sb = nl.ndarray((D, nq), qT.dtype, buffer=nl.sbuf)
            nisa.dma_copy(q_sb, qT[h, :, q0 : q0 + nq])
            m = nl.ndarray((nq, 1), nl.float32, buffer=nl.sbuf)
            nisa.memset(m, -3.0e38)
            l_sum = nl.ndarray((nq, 1), nl.float32, buffer=nl.sbuf)
            nisa.memset(l_sum, 0.0)
            o_acc = nl.ndarray((nq, D), nl.float32, buffer=nl.sbuf)
            nisa.memset(o_acc, 0.0)
            for k0 in range(0, Sk, 512):
                nk = min(512, Sk - k0)
                k_sb = nl.ndarray((D, nk), kT.dtype, buffer=nl.sbuf)
                nisa.dma_copy(k_sb, kT[h, :, k0 : k0 + nk])
                s_ps = nl.ndarray((nq, nk), nl.float32, buffer=nl.psum)
                nisa.nc_matmul(s_ps, q_sb, k_sb)
                mx = nl.ndarray((nq, 1), nl.float32, buffer=nl.sbuf)
                nisa.tensor_reduce(mx, nl.maximum, s_ps, axis=1)
                m_new = nl.ndarray((nq, 1), nl.float32, buffer=nl.sbuf)
                nisa.tensor_tensor(m_new, mx, m, nl.maximum)
                neg = nl.ndarray((nq, 1), nl.float32, buffer=nl.sbuf)
                nisa.tensor_scalar(neg, m_new, nl.multiply, -1.0)
                alpha = nl.ndarray((nq, 1), nl.float32, buffer=nl.sbuf)
                nisa.activation(alpha, nl.exp, m, bias=neg)  # exp(m_old - m_new)
                p = nl.ndarray((nq, nk), nl.bfloat16, buffer=nl.sbuf)
                rs = nl.ndarray((nq, 1), nl.float32, buffer=nl.sbuf)
                nisa.activation(p, nl.exp, s_ps, bias=neg, reduce_op=nl.add, reduce_res=rs,
                                reduce_cmd=nisa.reduce_cmd.reset_reduce)  # fmt: skip
                nisa.scalar_tensor_tensor(l_sum, l_sum, nl.multiply, alpha, nl.add, rs)
                pv_ps = nl.ndarray((nq, D), nl.float32, buffer=nl.psum)
                nchunks = (nk + 127) // 128
                for c in range(nchunks):
                    c0 = c * 128
                    nc = min(128, nk - c0)
                    pt_ps = nl.ndarray((nc, nq), nl.bfloat16, buffer=nl.psum)
                    nisa.nc_transpose(pt_ps, p[:, c0 : c0 + nc])
                    pt = nl.ndarray((nc, nq), nl.bfloat16, buffer=nl.sbuf)
                    nisa.tensor_copy(pt, pt_ps)
                    v_sb = nl.ndarray((nc, D), v.dtype, buffer=nl.sbuf)
                    nisa.dma_copy(v_sb, v[h, k0 + c0 : k0 + c0 + nc, :])
                    nisa.nc_matmul(pv_ps, pt, v_sb, accumulate=(c > 0))
                nisa.scalar_tensor_tensor(o_acc, o_acc, nl.multiply, alpha, nl.add, pv_ps)
                nisa.tensor_copy(m, m_new)
            r = nl.ndarray((nq, 1), nl.float32, buffer=nl.sbuf)
            nisa.reciprocal(r, l_sum)
            o = nl.ndarray((nq, D), qT.dtype, buffer=nl.sbuf)
            nisa.tensor_scalar(o, o_acc, nl.multiply, r)
            nisa.dma_copy(out[h, q0 : q0 + nq, :], o)
    return out


def instructions_per_call(H: int, Sq: int, Sk: int) -> int:
    """Exact instruction count of attention_like (for trace tests)."""
    n = 0
    for _q0 in range(0, Sq, 128):
        n += 4  # q load, 3 memsets
        for k0 in range(0, Sk, 512):
            nk = min(512, Sk - k0)
            chunks = (nk + 127) // 128
            n += 10 + 4 * chunks  # dma k, mm, reduce, tt, act, ts, act, stt, stt, copy m; per chunk 4
        n += 3  # reciprocal, scale, store
    return H * n
