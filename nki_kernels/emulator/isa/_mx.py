"""Microscaling (MX) instructions of NKI 0.6: ``quantize_mx`` (VectorE) and ``nc_matmul_mx`` (TensorE).

Both are "available only on NeuronCore-v4 and newer" (0.6 docstrings, aws-neuron/aws-neuron-sdk @ 81ce03a,
``nki/api/nki/isa/__init__.py``; layout: ``nki/deep-dives/mxfp-matmul.rst``): on trn2 (``nc_version`` 3,
the emulator's default) they raise ``LaunchError [nc-version]`` as the hardware has no such instruction;
``HwConfig(nc_version=4)`` runs them.

Layout (both): a ``[P, F]`` tile of a 4-packed type (``float8_e4m3fn_x4``, ``float8_e5m2_x4``; stored as
uint32, byte ``i`` = lane ``i``) holds ``[P, F, 4]`` fp8 values; the contraction of ``nc_matmul_mx`` runs over
the partitions and the 4 lanes.  One scale per group of 8 partitions x 4 lanes (one x4 element column): group
``g`` of partitions ``8g .. 8g+7``.  Scale tile: ``[P // 8, F]`` when ``P <= 32``; ``[P, F]`` when ``P > 32``,
group ``g``'s scales on partition ``32 * (g // 4) + g % 4`` (the first 4 partitions of its quadrant).  A scale
is ``float8_e8m0fnu`` (or uint8 holding its biased exponent): value ``2 ** (byte - 127)``.

``quantize_mx(dst, src, dst_scale)``: ``src`` ``[P, 4F]`` fp16/bf16 (P a multiple of 32, <= 128), ``dst``
``[P, F]`` fp8 x4, lanes = 4 consecutive ``src`` elements of a partition.  Group scale
``X = 2 ** (floor(log2(amax)) - (Emax - 1))`` (``Emax`` 8 for e4m3fn, 15 for e5m2; ``2 ** -127`` for an
all-zero group), values ``src / X`` cast to fp8 (round to nearest even).

``nc_matmul_mx(dst, stationary, moving, stationary_scale, moving_scale, tile_position, tile_size,
accumulate)``: ``dst[M, N] = sum_{p, i} S[p, m, i] * s_S[g(p), m] * V[p, n, i] * s_V[g(p), n]`` in fp32, dst
PSUM fp32 or bf16 (accumulate as ``nc_matmul``).  ``stationary [P, M]`` (M even, <= 128), ``moving [P, N]``
(N <= 4096 for fp32 dst, 8192 for bf16), P equal, a multiple of 32, <= 128; row tiling only:
``tile_size=(row, 128)`` with row in {32, 64, 128} >= P, ``tile_position=(start_row, 0)``, start_row a
multiple of row below 128; both set or neither.  ``float4_e2m1fn_x4`` operands are not emulated (raise).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from .. import dtypes as _dt
from .. import state as _state
from ..errors import DtypeError, LaunchError, MatmulTileError, MemorySpaceError, ShapeMismatchError
from ..tensor import NkiTensor, psum, sbuf
from ._common import _emit, _rec
from ._enums import NkiInstruction
from ._events import _use
from ._rules import _free, _onchip

_FP8 = {"float8_e4m3fn_x4": (ml_dtypes.float8_e4m3fn, 8), "float8_e5m2_x4": (ml_dtypes.float8_e5m2, 15)}
_SCALE_DTYPES = ("float8_e8m0fnu", "uint8")


def _v4(op: str, launch: _state.Launch) -> None:
    if launch.hw.nc_version < 4:
        raise LaunchError(
            f"[nc-version] {op} is available only on NeuronCore-v4 and newer (this launch: nc_version="
            f"{launch.hw.nc_version}, trn2 is 3); HwConfig(nc_version=4) emulates a v4 core"
        )


def _sbuf(op: str, launch: _state.Launch, *named: tuple[str, NkiTensor]) -> None:
    for arg, t in named:
        _onchip(t, op, arg, launch)
        if t._st.buffer is not sbuf:
            raise MemorySpaceError(f"[memory-space] {op}: {arg}={t._desc()} must be in SBUF")


def scale_rows(p: int) -> tuple[int, np.ndarray]:
    """Rows of the scale tile for ``p`` data partitions: ``(tile partitions, row of each group)``."""
    groups = np.arange(p // 8)
    if p <= 32:
        return p // 8, groups
    return p, 32 * (groups // 4) + groups % 4


def _scale_rule(op: str, arg: str, scale: NkiTensor, p: int, f: int) -> np.ndarray:
    if scale.dtype not in _SCALE_DTYPES:
        raise DtypeError(f"[mx-dtype] {op}: {arg} must be float8_e8m0fnu or uint8, got {scale.dtype}")
    rows, at = scale_rows(p)
    if scale.shape[0] != rows or _free(scale) != f:
        raise ShapeMismatchError(
            f"[mx-scale-shape] {op}: {arg}{list(scale.shape)} must be [{rows}, {f}] for {p} data partitions "
            f"({'P // 8 rows' if p <= 32 else 'P rows, scales on the first 4 partitions of each quadrant'})"
        )
    return at


def _scale_bytes(scale: NkiTensor) -> np.ndarray:
    raw = np.ascontiguousarray(np.asarray(scale.read()))
    return raw.view(np.uint8)


def _unpack(t: NkiTensor) -> np.ndarray:
    """fp32 values ``[P, F, 4]`` of an fp8 x4 tile."""
    fp8 = _FP8[t.dtype][0]
    raw = np.ascontiguousarray(np.asarray(t.read()).reshape(t.shape[0], -1)).astype("<u4")
    return raw.view(np.uint8).view(fp8).astype(np.float32).reshape(t.shape[0], -1, 4)


def quantize_mx(dst: NkiTensor, src: NkiTensor, dst_scale: NkiTensor, name: Any = None) -> NkiInstruction:
    """Quantize fp16/bf16 ``src [P, 4F]`` to MXFP8 ``dst [P, F]`` x4 and its scales (module docstring)."""
    launch = _state.current()
    op = "quantize_mx"
    _v4(op, launch)
    _sbuf(op, launch, ("dst", dst), ("src", src), ("dst_scale", dst_scale))
    if src.dtype not in ("float16", "bfloat16"):
        raise DtypeError(f"[mx-dtype] {op}: src must be float16 or bfloat16, got {src.dtype}")
    if dst.dtype not in _FP8:
        raise DtypeError(f"[mx-dtype] {op}: dst must be float8_e5m2_x4 or float8_e4m3fn_x4, got {dst.dtype}")
    p, fs = src.shape[0], _free(src)
    if p % 32 or p > 128:
        raise ShapeMismatchError(f"[mx-partitions] {op}: src partitions {p} must be a multiple of 32, <= 128")
    if fs % 4:
        raise ShapeMismatchError(f"[mx-free] {op}: src free size {fs} must be a multiple of 4")
    if dst.shape[0] != p or _free(dst) != fs // 4:
        raise ShapeMismatchError(
            f"[mx-shape] {op}: dst{list(dst.shape)} must be [{p}, {fs // 4}] for src{list(src.shape)}"
        )
    at = _scale_rule(op, "dst_scale", dst_scale, p, fs // 4)
    key = (op, dst.shape, dst.dtype, src.shape, src.dtype, dst_scale.shape, launch.program_id)
    _emit(launch, key, lambda: _rec(op, "vector", (dst, src, dst_scale), launch, flops=src.size))
    _use(launch, (src,), (dst, dst_scale))
    if launch.trace_only:
        return NkiInstruction(op)
    fp8, emax = _FP8[dst.dtype]
    x = _dt.to_fp32(np.asarray(src.read())).reshape(p // 8, 8, fs // 4, 4)
    amax = np.abs(x).max(axis=(1, 3))  # [groups, F]
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - (emax - 1), -127.0)
    e = np.clip(e, -127, 127)
    q = (x / np.exp2(e)[:, None, :, None]).astype(fp8)  # round to nearest even
    packed = q.reshape(p, fs // 4, 4).view(np.uint8).reshape(p, fs).view("<u4").reshape(dst.shape)
    dst.write(packed.astype(np.uint32))
    sc = np.array(_scale_bytes(dst_scale)).reshape(dst_scale.shape[0], -1)
    sc[at] = (e + 127).astype(np.uint8)
    dst_scale.write(sc.view(np.asarray(dst_scale.read()).dtype).reshape(dst_scale.shape))
    return NkiInstruction(op)


def _tiling(op: str, p: int, tile_position: Any, tile_size: Any) -> None:
    if (tile_position is None) != (tile_size is None):
        raise MatmulTileError(f"[mx-tiling] {op}: tile_position and tile_size must both be set or both unset")
    if tile_size is None:
        return
    row, col = (int(v) for v in tile_size)
    start, start_col = (int(v) for v in tile_position)
    if col != 128 or row not in (32, 64, 128):
        raise MatmulTileError(
            f"[mx-tiling] {op}: tile_size must be (32|64|128, 128) (row tiling only), got {tile_size}"
        )
    if start_col != 0 or start % row or start >= 128:
        raise MatmulTileError(
            f"[mx-tiling] {op}: tile_position must be (start_row, 0), start_row a multiple of {row} "
            "below 128, "
            f"got {tile_position}"
        )
    if p > row:
        raise MatmulTileError(f"[mx-tiling] {op}: stationary partitions {p} exceed the row tile {row}")


def nc_matmul_mx(
    dst: NkiTensor,
    stationary: NkiTensor,
    moving: NkiTensor,
    stationary_scale: NkiTensor,
    moving_scale: NkiTensor,
    tile_position: Any = None,
    tile_size: Any = None,
    accumulate: Any = None,
    name: Any = None,
) -> NkiInstruction:
    """MX matmul with dequantization (module docstring); ``dst [M, N]`` in PSUM, fp32 or bf16."""
    launch = _state.current()
    op = "nc_matmul_mx"
    _v4(op, launch)
    _sbuf(op, launch, ("stationary", stationary), ("moving", moving), ("stationary_scale", stationary_scale),
          ("moving_scale", moving_scale))  # fmt: skip
    _onchip(dst, op, "dst", launch)
    if dst._st.buffer is not psum:
        raise MemorySpaceError(f"[memory-space] {op}: dst={dst._desc()} must be in PSUM")
    for t, a in ((stationary, "stationary"), (moving, "moving")):
        if t.dtype == "float4_e2m1fn_x4":
            raise NotImplementedError(f"{op}: float4_e2m1fn_x4 {a} is not emulated (fp8 x4 only)")
        if t.dtype not in _FP8:
            raise DtypeError(f"[mx-dtype] {op}: {a} must be a 4-packed MX type, got {t.dtype}")
    if dst.dtype not in ("float32", "bfloat16"):
        raise DtypeError(f"[mx-dtype] {op}: dst must be float32 or bfloat16, got {dst.dtype}")
    p, m, n = stationary.shape[0], _free(stationary), _free(moving)
    if moving.shape[0] != p or p % 32 or p > 128:
        raise MatmulTileError(
            f"[matmul-contraction] {op}: stationary and moving partitions ({p}, {moving.shape[0]}) must be "
            "equal, "
            "a multiple of 32 and <= 128"
        )
    if m % 2 or m > 128:
        raise MatmulTileError(f"[matmul-stationary] {op}: stationary free size {m} must be even and <= 128")
    nmax = 4096 if dst.dtype == "float32" else 8192
    if n > nmax:
        raise MatmulTileError(
            f"[matmul-moving] {op}: moving free size {n} exceeds {nmax} for a {dst.dtype} dst"
        )
    if dst.shape[0] != m or _free(dst) != n:
        raise ShapeMismatchError(f"[matmul-dst] {op}: dst{list(dst.shape)} must be [{m}, {n}]")
    at_s = _scale_rule(op, "stationary_scale", stationary_scale, p, m)
    at_m = _scale_rule(op, "moving_scale", moving_scale, p, n)
    _tiling(op, p, tile_position, tile_size)
    meta = (
        ("K", 4 * p),
        ("M", m),
        ("N", n),
        ("dtype", stationary.dtype),
        ("is_transpose", False),
        ("mx", True),
    )
    key = (op, dst.shape, dst.dtype, stationary.shape, stationary.dtype, moving.shape, moving.dtype,
           launch.program_id)  # fmt: skip
    _emit(launch, key, lambda: _rec(op, "tensor", (dst, stationary, moving, stationary_scale, moving_scale),
                                    launch, flops=2 * 4 * p * m * n, meta=meta))  # fmt: skip
    reads: tuple = (stationary, moving, stationary_scale, moving_scale)
    _use(launch, reads + ((dst,) if accumulate is not False else ()), (dst,))
    if launch.trace_only:
        return NkiInstruction(op)
    ss = np.exp2(
        _scale_bytes(stationary_scale).reshape(stationary_scale.shape[0], -1)[at_s].astype(np.float64) - 127
    )
    sm = np.exp2(_scale_bytes(moving_scale).reshape(moving_scale.shape[0], -1)[at_m].astype(np.float64) - 127)
    a = _unpack(stationary) * np.repeat(ss, 8, axis=0)[:, :, None].astype(np.float32)  # [P, M, 4]
    b = _unpack(moving) * np.repeat(sm, 8, axis=0)[:, :, None].astype(np.float32)  # [P, N, 4]
    res = np.einsum("pmi,pni->mn", a, b, dtype=np.float32).reshape(dst.shape)
    wm = dst.written_mask_view()
    if accumulate is False or wm is None:
        out = res
    else:
        cur = _dt.to_fp32(np.asarray(dst.read()))
        if accumulate is True and not wm.all():
            _state.warn(f"{op} accumulate=True onto PSUM {dst._desc()} elements never written by a matmul")
        out = cur + res if accumulate is True else np.where(wm, cur + res, res)
    dst.write(_dt.cast(out, dst.dtype))
    if wm is not None:
        wm[...] = True
    return NkiInstruction(op)
