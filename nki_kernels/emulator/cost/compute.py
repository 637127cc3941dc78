"""Compute-instruction pricing of the trn2 cost model v2 (TensorE, VectorE, ScalarE, GpSimdE).

``N`` = elements per partition streamed (``max(record.free_elems, free size of the first source)``);
time = cycles / engine clock.  Every figure is **modelled**; the parameters and their sources are in
:mod:`.params`.

* TensorE ``nc_matmul``: ``max(max(min(64, M), N) * f, M/4) + 10`` (+ ``matmul_small_tile_cycles`` when
  K, M or N < 128), ``f = 4`` with an fp32 source.  FP8 double-row (``meta perf_mode="double_row"``, or a
  3-D fp8 stationary ``[128, 2, M]``): ``M``, ``N`` are the per-row sizes, same cycles, 2x the FLOPs.
* TensorE transpose: ``max(P, min(64, F)) * f + 10``, ``f = 4`` for an fp32 source.
* ScalarE: ``max(64, N)`` (+64 reducing) (+``scalar_psum_access_cycles`` with a PSUM operand).
* VectorE: the ISA formulas with the v3 performance-mode factors; a PSUM operand adds
  ``vector_psum_access_cycles`` and gets the 2x factor only when the PSUM source is 2-byte.
* GpSimdE: ``150 + N``.  Vector/Scalar/GpSimd add 100 cycles when ``N < 128``.
"""

from __future__ import annotations

import math

from ..trace import TraceRecord
from .params import DEFAULT, Trn2CostParams

__all__ = [
    "instruction_cycles",
    "instruction_ns",
    "is_double_row",
    "is_transpose",
    "matmul_dims",
    "tensor_flops_of",
]

_TWO_BYTE = frozenset({"bfloat16", "float16"})
_FP8 = frozenset({"float8_e4m3", "float8_e4m3fn", "float8_e5m2", "float8_e5m2_x4", "float8_e4m3fn_x4"})
_FAST_TT_OPS = frozenset({"add", "subtract", "multiply", "sub", "mul"})
_FAST_REDUCE_OPS = frozenset({"add", "max", "maximum"})


def _free(shape: tuple[int, ...]) -> int:
    return math.prod(shape[1:]) if len(shape) > 1 else 1


def _meta_flag(meta: dict[str, object], *keys: str) -> bool:
    return any(bool(meta.get(k)) for k in keys)


def _alu_names(meta: dict[str, object]) -> tuple[str, ...]:
    """ALU op names from ``meta["alu"]`` (emulator) or ``meta["op"]``: a name or a tuple of names."""
    raw = meta.get("alu", meta.get("op", ""))
    items = raw if isinstance(raw, (tuple, list)) else (raw,)
    names = []
    for op in items:
        if op is None:
            continue
        name = getattr(op, "__name__", None) or str(op)
        names.append(name.rsplit(".", 1)[-1].lower())
    return tuple(names)


def _alu(meta: dict[str, object]) -> str:
    names = _alu_names(meta)
    return names[0] if len(names) == 1 else ""


def is_transpose(rec: TraceRecord) -> bool:
    """A TensorE transpose: ``op`` ``nc_transpose``/``transpose`` or ``meta is_transpose``."""
    return rec.op in ("nc_transpose", "transpose") or _meta_flag(rec.meta_dict(), "is_transpose")


def is_double_row(rec: TraceRecord) -> bool:
    """FP8 double-row matmul: ``meta perf_mode == "double_row"``, or an fp8 stationary of rank 3 with
    2 rows (``[128, 2, M]``)."""
    if str(rec.meta_dict().get("perf_mode", "")).rsplit(".", 1)[-1] == "double_row":
        return True
    if len(rec.shapes) >= 3 and len(rec.dtypes) >= 2:
        stat = rec.shapes[1]
        return len(stat) == 3 and stat[1] == 2 and rec.dtypes[1] in _FP8
    return False


def matmul_dims(rec: TraceRecord) -> tuple[int, int, int]:
    """``(K, M, N)`` of an ``nc_matmul``: from the shapes ``(dst, stationary, moving)`` for double-row
    (per-row sizes, K = 2 x partitions), else ``meta K, M, N``, else the shapes."""
    meta = rec.meta_dict()
    if is_double_row(rec) and len(rec.shapes) >= 3:
        stat, mov = rec.shapes[1], rec.shapes[2]
        return 2 * stat[0], stat[-1], mov[-1]
    if all(k in meta for k in ("K", "M", "N")):
        return int(str(meta["K"])), int(str(meta["M"])), int(str(meta["N"]))
    if len(rec.shapes) >= 3:
        stat, mov = rec.shapes[1], rec.shapes[2]
        return stat[0], _free(stat), _free(mov)
    raise ValueError(f"nc_matmul record needs meta K, M, N or shapes (dst, stationary, moving); got {rec}")


def tensor_flops_of(rec: TraceRecord) -> int:
    """Matmul FLOPs of one TensorE record (0 for transposes): ``rec.flops`` or ``2*K*M*N``."""
    if rec.engine != "tensor" or is_transpose(rec):
        return 0
    if rec.flops > 0:
        return rec.flops
    k, m, n = matmul_dims(rec)
    return 2 * k * m * n


def _tensor_cycles(rec: TraceRecord, p: Trn2CostParams) -> float:
    srcs = rec.dtypes[1:] if len(rec.dtypes) > 1 else rec.dtypes
    fp32 = any(d == "float32" for d in srcs)
    if is_transpose(rec):
        src = rec.shapes[1] if len(rec.shapes) > 1 else (rec.partitions, rec.free_elems)
        parts, free = src[0], _free(src)
        f = p.transpose_fp32_factor if fp32 else 1.0
        return max(parts, min(p.transpose_min_cycles, free)) * f + p.matmul_overhead_cycles
    k, m, n = matmul_dims(rec)
    factor = p.matmul_fp32_factor if fp32 else 1.0
    moving = max(min(p.matmul_min_cycles, m), n) * factor
    load_stat = m / p.load_stationary_divisor
    body = max(moving, load_stat) if p.load_stationary_overlapped else moving + load_stat
    small = p.matmul_small_tile_cycles if min(k, m, n) < 128 else 0
    return body + p.matmul_overhead_cycles + small


def _vector_cycles(rec: TraceRecord, n: int, p: Trn2CostParams) -> float:
    meta = rec.meta_dict()
    alu = _alu(meta)
    low_set = _TWO_BYTE | _FP8 if p.vector_fp8_perf_mode else _TWO_BYTE
    src_bufs = rec.buffers[1:]
    src_dt = rec.dtypes[1:] if len(rec.dtypes) > 1 else rec.dtypes
    psum_src_low = any(b == "psum" and d in low_set for b, d in zip(src_bufs, src_dt))
    psum = "psum" in rec.buffers
    low = bool(rec.dtypes) and all(d in low_set for d in rec.dtypes)
    contiguous = bool(meta.get("contiguous", True))
    floor = p.vector_min_ii_cycles
    op = rec.op
    if op == "tensor_reduce":
        return float(n / 2 if low and alu in _FAST_REDUCE_OPS else n)
    if op == "memset":
        return max(floor, n / 2 if rec.dtypes and rec.dtypes[0] in low_set else n)
    if op == "reciprocal" or "reciprocal" in _alu_names(meta):
        return max(floor, p.vector_reciprocal_factor * n)
    if op == "tensor_tensor":
        src_low = all(d in low_set for d in src_dt)
        sbuf_srcs = all(b == "sbuf" for b in src_bufs)
        fast = "psum" in src_bufs or (src_low and sbuf_srcs and (alu in _FAST_TT_OPS or alu == ""))
        cyc = float(n if fast else 2 * n)
        if p.vector_perf_mode and src_low and sbuf_srcs:
            cyc /= p.vector_perf_other_factor
        return max(floor, cyc)
    cyc = float(n)
    if p.vector_perf_mode and op in ("tensor_copy", "tensor_scalar"):
        if psum:
            if psum_src_low:
                cyc /= p.vector_perf_other_factor
        elif low and contiguous:
            cyc /= p.vector_perf_sbuf_factor
        elif low:
            cyc /= p.vector_perf_other_factor
    return max(floor, cyc)


def instruction_cycles(rec: TraceRecord, params: Trn2CostParams | None = None) -> float:
    """Engine cycles of one compute instruction (module docstring formulas; clocks applied by the caller).

    Raises ``ValueError`` for a non-compute engine (DMA is priced by :mod:`.dma`).
    """
    p = params or DEFAULT
    if rec.engine == "tensor":
        return _tensor_cycles(rec, p)
    if rec.engine not in ("vector", "scalar", "gpsimd"):
        raise ValueError(f"instruction_cycles: engine must be a compute engine, got {rec.engine!r}")
    n = rec.free_elems
    if len(rec.shapes) > 1:
        n = max(n, _free(rec.shapes[1]))
    psum = "psum" in rec.buffers
    if rec.engine == "scalar":
        cyc = float(max(p.scalar_min_ii_cycles, n))
        reduces = rec.op.endswith("_reduce") or _meta_flag(
            rec.meta_dict(), "reduce", "reduce_res", "has_reduce"
        )
        # the emulator records a reducing activation as shapes (dst, data, reduce_res[P, 1])
        if reduces or (rec.op == "activation" and len(rec.shapes) >= 3 and _free(rec.shapes[-1]) == 1):
            cyc += p.scalar_accumulate_cycles
        if psum:
            cyc += p.scalar_psum_access_cycles
    elif rec.engine == "gpsimd":
        cyc = float(p.gpsimd_start_cycles + n)
    else:
        cyc = _vector_cycles(rec, n, p)
        if psum:
            cyc += p.vector_psum_access_cycles
    if n < p.small_instruction_elems:
        cyc += p.small_instruction_overhead_cycles
    return cyc + p.access_start_cycles


def instruction_ns(rec: TraceRecord, params: Trn2CostParams | None = None) -> float:
    """Modelled time of one compute instruction in ns: cycles / engine clock."""
    p = params or DEFAULT
    return instruction_cycles(rec, p) / p.clock_ghz(rec.engine)
