"""Gated residual and the next adaLN norm + modulation as ONE NKI kernel (standalone NKI 0.6 API via
:mod:`nki_kernels._nki`): the pairs of Wan's block where a residual update feeds a norm (``x + gate * y``
then ``norm3``, the cross residual then ``norm2``, the FFN residual then the next block's ``norm1``).

Math, per frame ``g`` (rows as in :mod:`nki_kernels.elementwise`)::

    x_new  = x + gate[g] * y                                                   (x's dtype)
    branch = LayerNorm(x_new)(eps, no affine) * (1 + scale[g]) + shift[g]      (out_dtype)

Both outputs are exactly what :func:`~nki_kernels.elementwise.gate_residual_kernel` followed by
:func:`~nki_kernels.elementwise.adaln_norm_modulate_kernel` give for an fp32 ``x`` with a bf16 ``y`` (the
same instructions per element; the statistics read the stored ``x_new``), but ``x_new`` is not read back
from HBM: 12 bytes per element move instead of 16 (fp32 x in and out, bf16 y in, bf16 branch out).

Layouts: ``x`` ``[N, C]`` fp32, ``y`` ``[N, C]`` bf16 (Wan's fp32 residual stream and a bf16 branch),
``gate`` / ``shift`` / ``scale`` ``[G, C]`` fp32 (``G`` frames, ``N`` a multiple of ``G``); outputs
``x_new`` ``[N, C]`` fp32 and ``branch`` ``[N, C]`` in ``out_dtype`` (``"bfloat16"`` default, or
``"float32"``).

Design: tiles of <= 128 tokens of one frame; the three rows broadcast per frame on TensorE (three rotating
sets, as the adaLN kernel). A 3-stage software pipeline in program order: stage 0 (tile ``i + 2``) loads
x and y, GpSimdE ``t = gate * y`` (fp32), VectorE ``x += t``, stores ``x_new`` and runs VectorE
``bn_stats`` / ``bn_aggr`` on it; stage 1 (tile ``i + 1``) the ``rstd`` / ``-mean * rstd`` columns; stage
2 (tile ``i``) ScalarE normalises, GpSimdE multiplies by ``1 + scale`` and adds ``shift`` into the output
tile, which is stored. LNC: frames dealt round-robin.

Limits (:func:`fused_max_features`): ``C <= 1536`` (Wan2.1-1.3B's width) for the SBUF tiles.
"""

from __future__ import annotations

import math
from typing import Any

from nki_kernels._nki import nisa, nki, nl
from nki_kernels.elementwise import CHUNK, PMAX, ROT, SBUF_BUDGET, _Broadcast, _out_dtype, frame_tiles

__all__ = [
    "fused_max_features",
    "fused_tile_bytes",
    "gate_residual_adaln_emulated",
    "gate_residual_adaln_kernel",
]


def fused_tile_bytes(c: int) -> int:
    """SBUF bytes per partition of :func:`gate_residual_adaln_kernel`'s tiles for ``c`` features (a pure
    function): :data:`ROT` fp32 x and bf16 y tiles, 2 fp32 products, 2 fp32 normalised tiles, 2 output
    tiles (sized fp32), three sets of three fp32 row tiles, the fp32 row, the statistics, the ones row."""
    stats = ROT * (6 * math.ceil(c / CHUNK) + 4) * 4
    return c * (ROT * 4 + ROT * 2 + 2 * 4 + 2 * 4 + 2 * 4 + 9 * 4 + 4 + 4) + stats + PMAX * 4


def fused_max_features() -> int:
    """Largest ``C`` (a multiple of 512) whose tiles fit :data:`~nki_kernels.elementwise.SBUF_BUDGET`."""
    c = CHUNK
    while fused_tile_bytes(c + CHUNK) <= SBUF_BUDGET:
        c += CHUNK
    return c


@nki.jit
def gate_residual_adaln_kernel(x, y, gate, shift, scale, eps, out_dtype="bfloat16"):
    """``(x + gate * y, adaLN(x + gate * y))`` per frame; see the module docstring."""
    N, C = x.shape
    G = gate.shape[0]
    if x.dtype != nl.float32 or y.dtype != nl.bfloat16:
        raise ValueError(f"gate_residual_adaln: x must be float32 and y bfloat16, got {x.dtype}, {y.dtype}")
    if fused_max_features() < C:
        raise ValueError(
            f"gate_residual_adaln: C={C} features exceed the SBUF tiles (at most {fused_max_features()})"
        )
    od = _out_dtype(out_dtype, x.dtype)
    f32 = nl.float32
    x_out = nl.ndarray((N, C), dtype=f32, buffer=nl.shared_hbm)
    branch = nl.ndarray((N, C), dtype=od, buffer=nl.shared_hbm)
    frames = list(range(G))[nl.program_id(0) :: nl.num_programs()]
    if not frames:
        return x_out, branch
    mine = [t for t in frame_tiles(N, G) if t[0] in frames]
    bc = _Broadcast(C, f32, 3, 3)
    xs = [nl.ndarray((PMAX, C), dtype=f32, buffer=nl.sbuf) for _ in range(ROT)]
    ys = [nl.ndarray((PMAX, C), dtype=y.dtype, buffer=nl.sbuf) for _ in range(ROT)]
    tmp = [nl.ndarray((PMAX, C), dtype=f32, buffer=nl.sbuf) for _ in range(2)]
    xn = [nl.ndarray((PMAX, C), dtype=f32, buffer=nl.sbuf) for _ in range(2)]
    os_ = [nl.ndarray((PMAX, C), dtype=od, buffer=nl.sbuf) for _ in range(2)]
    nch = math.ceil(C / CHUNK)
    st = [nl.ndarray((PMAX, 6 * nch), dtype=f32, buffer=nl.sbuf) for _ in range(ROT)]
    cols = [nl.ndarray((PMAX, 4), dtype=f32, buffer=nl.sbuf) for _ in range(ROT)]
    mods: list[Any] = []

    def residual_stats(i: int) -> None:  # stage 0: x_new = x + gate * y, stored; its statistics
        g, t0, rows = mine[i]
        if i == 0 or mine[i - 1][0] != g:
            mods.append(bc.load([(gate, g, False), (scale, g, True), (shift, g, False)]))
        else:
            mods.append(mods[-1])
        gt = mods[i][0]
        xt, yt, tf = xs[i % ROT][:rows, :], ys[i % ROT][:rows, :], tmp[i % 2][:rows, :]
        nisa.dma_copy(dst=xt, src=x[t0 : t0 + rows, :])
        nisa.dma_copy(dst=yt, src=y[t0 : t0 + rows, :])
        nisa.tensor_tensor(tf, yt, gt[:rows, :], nl.multiply, engine=nisa.gpsimd_engine)
        nisa.tensor_tensor(xt, xt, tf, nl.add, engine=nisa.vector_engine)
        nisa.dma_copy(dst=x_out[t0 : t0 + rows, :], src=xt)
        sti, cl = st[i % ROT], cols[i % ROT]
        for j, c0 in enumerate(range(0, C, CHUNK)):
            nisa.bn_stats(sti[:rows, 6 * j : 6 * j + 6], xt[:, c0 : min(C, c0 + CHUNK)])
        nisa.bn_aggr(cl[:rows, 0:2], sti[:rows, :])

    def rstd_cols(i: int) -> None:  # stage 1: rstd = (var + eps)^-0.5, nmr = -mean * rstd
        rows = mine[i][2]
        mean, var, rstd, nmr = (cols[i % ROT][:rows, j : j + 1] for j in range(4))
        nisa.activation(rstd, nl.rsqrt, var, bias=float(eps))
        nisa.tensor_scalar(
            nmr, mean, nl.multiply, rstd, op1=nl.multiply, operand1=-1.0, engine=nisa.vector_engine
        )

    def modulate(i: int) -> None:  # stage 2: ScalarE normalise, GpSimdE * (1 + scale) and + shift
        _, t0, rows = mine[i]
        _, s1, sh = mods[i]
        xt, xf, cl, ot = xs[i % ROT][:rows, :], xn[i % 2][:rows, :], cols[i % ROT], os_[i % 2][:rows, :]
        nisa.activation(xf, nl.copy, xt, bias=cl[:rows, 3:4], scale=cl[:rows, 2:3])
        nisa.tensor_tensor(xf, xf, s1[:rows, :], nl.multiply, engine=nisa.gpsimd_engine)
        nisa.tensor_tensor(ot, xf, sh[:rows, :], nl.add, engine=nisa.gpsimd_engine)
        nisa.dma_copy(dst=branch[t0 : t0 + rows, :], src=ot)

    stages = (residual_stats, rstd_cols, modulate)
    for i in range(len(mine) + len(stages) - 1):
        for lag, stage in enumerate(stages):
            if 0 <= i - lag < len(mine):
                stage(i - lag)
    return x_out, branch


def gate_residual_adaln_emulated(
    x: Any, y: Any, gate: Any, shift: Any, scale: Any, eps: float, lnc: int = 1, out_dtype: Any = None
) -> tuple[Any, Any]:
    """:func:`gate_residual_adaln_kernel` on the emulator: x torch ``[B, L, C]`` fp32, y ``[B, L, C]`` bf16
    (contiguous), gate / shift / scale ``[B, F, C]`` (sent as fp32; ``F`` divides ``L``); returns
    ``(x_new fp32, branch in out_dtype)`` ``[B, L, C]`` (``out_dtype`` a torch dtype, default bf16)."""
    import torch

    from nki_kernels._nki import launch
    from nki_kernels.elementwise import _rows
    from nki_kernels.linear import _to_numpy
    from nki_kernels.rope3d import _to_torch

    b, l, c = x.shape
    od = torch.bfloat16 if out_dtype is None else out_dtype
    (xo, br), _ = launch(
        gate_residual_adaln_kernel,
        _to_numpy(x.reshape(b * l, c)),
        _to_numpy(y.reshape(b * l, c)),
        _rows(gate),
        _rows(shift),
        _rows(scale),
        float(eps),
        "float32" if od == torch.float32 else "bfloat16",
        lnc=lnc,
    )
    return _to_torch(xo, torch.float32).reshape(b, l, c), _to_torch(br, od).reshape(b, l, c)
