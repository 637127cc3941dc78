"""The FP8 option of the streamed static attention pass (standalone NKI 0.6 API): P.V in e4m3 on TensorE's
double-row mode (docs/kernels/attention_fp8.md; reference ``reference/attention_fp8.py``).

With ``fp8=True`` the kernels' streamed pass (:mod:`nki_kernels.attention_stream`) changes in four places,
all through :class:`Fp8Pv`; everything else (Q.K^T in bf16, the per-tile offsets, the guard and its bf16
running-max recompute) is the bf16 pass:

* the tile offset becomes ``nm = -scale * m + ln(P_SCALE)`` (the same VectorE instruction, a second op), so
  the ScalarE exp writes ``P^T = exp(scale S^T + nm)`` straight into an e4m3 ring tile, the first key
  chunk's largest term equal to :data:`P_SCALE`;
* per unit, V's per-channel scales ``v_scale[b, h, :]`` (HBM ``[B, H, D]`` fp32, computed by the op over the
  call's keys) arrive in one stride-0 DMA broadcast over partitions and blocks; one VectorE reciprocal;
* per key chunk, ONE GpSimd ``tensor_tensor`` writes ``V8 = e4m3(V * (1 / v_scale))`` next to the bf16 V slot
  (its column D, the ones / validity column, times 1), issued half a chunk ahead of its first PV;
* the PV of a chunk is ``nc_matmul(perf_mode=double_row)`` per pair of 128-key blocks (stationary
  ``P^T [128, 2, 128]``, moving ``V8 [128, 2, D + 1]``, both e4m3: the emulator enforces the double-row
  rules), a plain e4m3 matmul for an odd or partial block; the output is ``(o * (1 / l)) * v_scale`` (one
  VectorE ``scalar_tensor_tensor``) and ``lse = log(l) - nm`` needs no change.
"""

from __future__ import annotations

import math
from typing import Any

from nki_kernels._nki import nisa, nl
from nki_kernels.hw_limits import PMAX

P_SCALE = 16.0
"""The first key chunk's largest exponential in P (``reference.attention_fp8.P_SCALE``, equal by test)."""

LN_P_SCALE = math.log(P_SCALE)
"""``ln(P_SCALE)``, added to every tile offset."""

FP8_GUARD_L_MIN = 1.0
"""The guard's lower bound on a row's ``l`` with FP8 P (in P's units, where the tile's first-chunk maximum
term is :data:`P_SCALE`): a row whose whole mass is below that of one term at 1/16 of it has its terms in
e4m3's subnormal range or flushed to zero, and is recomputed in bf16 with the running max. The upper bound
is the bf16 pass's: a term above 240 overflows to inf (``l`` = inf fails it)."""

_NB = 8
"""128-key blocks per 1,024-key chunk (``attention_stream.NB``)."""


class Fp8Pv:
    """The FP8 P.V work of one unit of the streamed pass (module docstring); a no-op shell when the
    stream's ``v_scale`` is None (``on`` False)."""

    def __init__(self, kv: Any, b: int, h: int, d: int) -> None:
        self.on = kv.v_scale is not None
        self.kv, self.b, self.h, self.d = kv, b, h, d
        if self.on:
            self.vs = nl.ndarray((PMAX, _NB, d), dtype=nl.float32, buffer=nl.sbuf)
            self.inv = nl.ndarray((PMAX, _NB, d + 1), dtype=nl.float32, buffer=nl.sbuf)

    def p_dtype(self, dt: Any) -> Any:
        """The P^T ring's dtype: e4m3 with FP8, else the inputs' ``dt``."""
        return nl.float8_e4m3 if self.on else dt

    def offset_shift(self) -> dict[str, Any]:
        """The second op of the offsets' ``tensor_scalar`` (``+ ln(P_SCALE)``), none without FP8."""
        return {"op1": nl.add, "operand1": LN_P_SCALE} if self.on else {}

    def start(self, slot0: dict[str, Any], kc0: int) -> None:
        """V's scales of (b, h) broadcast to ``[128, 8, D]``, their reciprocals (column D: 1), and the unit's
        first chunk quantised."""
        if not self.on:
            return
        d, vsc = self.d, self.kv.v_scale
        H = vsc.shape[1]
        src = vsc.ap(pattern=[[0, PMAX], [0, _NB], [1, d]], offset=(self.b * H + self.h) * d)
        nisa.dma_copy(dst=self.vs, src=src)
        nisa.reciprocal(self.inv[:, :, :d], self.vs)
        nisa.memset(self.inv[:, :, d : d + 1], 1.0, engine=nisa.vector_engine)
        self.quantize(slot0, 0, kc0)

    def quantize(self, slot: dict[str, Any], c: int, kc: int) -> None:
        """``slot["v8"] = e4m3(slot["v"] * inv)`` over the chunk's ``kc`` keys (ONE GpSimd instruction, one
        more for a partial last block). ``c``: the chunk's index (for the reader)."""
        if not self.on:
            return
        d, v = self.d, slot["v"]
        if "v8" not in slot:
            slot["v8"] = nl.ndarray((PMAX, _NB, d + 1), dtype=nl.float8_e4m3, buffer=nl.sbuf)
        v8 = slot["v8"]
        nbf, kr = divmod(kc, PMAX)
        if nbf:
            nisa.tensor_tensor(v8[:, :nbf, :], v[:, :nbf, : d + 1], self.inv[:, :nbf, :], nl.multiply,
                               engine=nisa.gpsimd_engine)  # fmt: skip
        if kr:
            nisa.tensor_tensor(v8[:kr, nbf, :], v[:kr, nbf, : d + 1], self.inv[:kr, nbf, :], nl.multiply,
                               engine=nisa.gpsimd_engine)  # fmt: skip

    def pv(self, pv: Any, p: Any, slot: dict[str, Any], kc: int) -> None:
        """``pv[:, :D + 1] = sum_blocks P^T_blk^T V8_blk`` for a chunk of ``kc`` keys: double-row matmuls
        over block pairs, a plain e4m3 matmul for an odd full block and for a partial last block."""
        d, v8 = self.d, slot["v8"]
        nbf, kr = divmod(kc, PMAX)
        steps: list[tuple[int, int, int]] = [(j, 2, PMAX) for j in range(0, nbf - 1, 2)]
        if nbf % 2:
            steps.append((nbf - 1, 1, PMAX))
        if kr:
            steps.append((nbf, 1, kr))
        for n, (j, w, rows) in enumerate(steps):
            if w == 2:
                nisa.nc_matmul(pv[:, : d + 1], stationary=p[:, j : j + 2, :], moving=v8[:, j : j + 2, :],
                               accumulate=n > 0, perf_mode=nisa.matmul_perf_mode.double_row)  # fmt: skip
            else:
                nisa.nc_matmul(pv[:, : d + 1], stationary=p[:rows, j, :], moving=v8[:rows, j, :],
                               accumulate=n > 0)  # fmt: skip

    def output(self, ob: Any, o: Any, rl: Any, qr: int) -> None:
        """``ob[:qr] = (o * (1 / l)) * v_scale`` (one VectorE instruction)."""
        nisa.scalar_tensor_tensor(ob[:qr], o, nl.multiply, rl[:qr], nl.multiply, self.vs[:qr, 0, :])
