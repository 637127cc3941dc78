"""NKI 0.6 dtypes for the emulator.

In NKI 0.6 a dtype is a plain string constant (``nl.float32 == "float32"``).  The emulator stores
elements in numpy arrays; low-precision floats use :mod:`ml_dtypes` (round-to-nearest-even casts, as the
official simulator does with ``NKI_PRECISE_FP=1``).

Mapping (NKI name -> storage dtype):

* ``bool_`` -> ``uint8`` (NKI stores booleans as bytes)
* ``tfloat32`` -> ``float32`` (the 10-bit mantissa truncation of TensorE tf32 is not modelled)
* ``float8_e4m3`` -> ``ml_dtypes.float8_e4m3`` (Neuron's "legacy" e4m3, max finite 240)
* ``float8_e4m3fn`` / ``float8_e5m2`` / ``float8_e8m0fnu`` -> the ml_dtypes types of the same name
* x4-packed types (``float8_e5m2_x4``, ``float8_e4m3fn_x4``, ``float4_e2m1fn_x4``) -> ``uint32`` raw bits
  (trn3 only; the emulator stores them but no engine decodes them).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import ml_dtypes
import numpy as np

bool_ = "bool_"
int8 = "int8"
int16 = "int16"
int32 = "int32"
uint8 = "uint8"
uint16 = "uint16"
uint32 = "uint32"
float16 = "float16"
float32 = "float32"
bfloat16 = "bfloat16"
tfloat32 = "tfloat32"
float8_e4m3 = "float8_e4m3"
float8_e4m3fn = "float8_e4m3fn"
float8_e5m2 = "float8_e5m2"
float8_e5m2_x4 = "float8_e5m2_x4"
float8_e4m3fn_x4 = "float8_e4m3fn_x4"
float8_e8m0fnu = "float8_e8m0fnu"
float4_e2m1fn_x4 = "float4_e2m1fn_x4"

_STORAGE: dict[str, np.dtype] = {
    bool_: np.dtype(np.uint8),
    int8: np.dtype(np.int8),
    int16: np.dtype(np.int16),
    int32: np.dtype(np.int32),
    uint8: np.dtype(np.uint8),
    uint16: np.dtype(np.uint16),
    uint32: np.dtype(np.uint32),
    float16: np.dtype(np.float16),
    float32: np.dtype(np.float32),
    bfloat16: np.dtype(ml_dtypes.bfloat16),
    tfloat32: np.dtype(np.float32),
    float8_e4m3: np.dtype(ml_dtypes.float8_e4m3),
    float8_e4m3fn: np.dtype(ml_dtypes.float8_e4m3fn),
    float8_e5m2: np.dtype(ml_dtypes.float8_e5m2),
    float8_e8m0fnu: np.dtype(ml_dtypes.float8_e8m0fnu),
    float8_e5m2_x4: np.dtype(np.uint32),
    float8_e4m3fn_x4: np.dtype(np.uint32),
    float4_e2m1fn_x4: np.dtype(np.uint32),
}
ALL_DTYPES: tuple[str, ...] = tuple(_STORAGE)
FLOAT_DTYPES = frozenset(
    {float16, float32, bfloat16, tfloat32, float8_e4m3, float8_e4m3fn, float8_e5m2, float8_e8m0fnu}
)
INT_DTYPES = frozenset({bool_, int8, int16, int32, uint8, uint16, uint32})
PACKED_DTYPES = frozenset({float8_e5m2_x4, float8_e4m3fn_x4, float4_e2m1fn_x4})

_NP_TO_NKI: dict[np.dtype, str] = {}
for _name, _dt in _STORAGE.items():
    if _name not in (bool_, tfloat32) and _name not in PACKED_DTYPES:
        _NP_TO_NKI.setdefault(_dt, _name)
_NP_TO_NKI[np.dtype(np.bool_)] = bool_

_TORCH_NAMES = {
    "torch.float32": float32,
    "torch.float16": float16,
    "torch.bfloat16": bfloat16,
    "torch.int8": int8,
    "torch.int16": int16,
    "torch.int32": int32,
    "torch.uint8": uint8,
    "torch.uint16": uint16,
    "torch.uint32": uint32,
    "torch.bool": bool_,
    "torch.float8_e4m3fn": float8_e4m3fn,
    "torch.float8_e5m2": float8_e5m2,
}


def normalize(dtype: Any, *, arg: str = "dtype") -> str:
    """Return the NKI dtype string for ``dtype`` (an NKI string, numpy/ml_dtypes dtype or torch dtype)."""
    if isinstance(dtype, str):
        if dtype in _STORAGE:
            return dtype
        if dtype == "bool":
            return bool_
        raise TypeError(f"{arg}: unknown NKI dtype {dtype!r}; expected one of {ALL_DTYPES}")
    tname = str(dtype)
    if tname.startswith("torch."):
        if tname in _TORCH_NAMES:
            return _TORCH_NAMES[tname]
        raise TypeError(f"{arg}: torch dtype {tname} has no NKI equivalent")
    try:
        npdt = np.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"{arg}: cannot interpret {dtype!r} as a dtype") from e
    if npdt in _NP_TO_NKI:
        return _NP_TO_NKI[npdt]
    raise TypeError(f"{arg}: numpy dtype {npdt} has no NKI equivalent")


def storage_dtype(dtype: str) -> np.dtype:
    """numpy dtype used to store elements of NKI dtype ``dtype``."""
    return _STORAGE[dtype]


@cache
def itemsize(dtype: str) -> int:
    return int(_STORAGE[dtype].itemsize)


def is_float(dtype: str) -> bool:
    return dtype in FLOAT_DTYPES


def is_int(dtype: str) -> bool:
    return dtype in INT_DTYPES


def sentinel(dtype: str) -> float | int:
    """Fill value of fresh allocations, as the official simulator: NaN for floats, 4 for integers."""
    if dtype in FLOAT_DTYPES and dtype != float8_e8m0fnu:
        return float("nan")
    return 4


def cast(values: np.ndarray, dtype: str) -> np.ndarray:
    """Cast engine results (fp32/fp64/int) to the storage of ``dtype``.

    Floats: round-to-nearest-even through ml_dtypes/numpy.  Integers from floats: round half to even and
    saturate to the integer range (NaN becomes 0), as the NKI 0.6 simulator does.
    """
    target = _STORAGE[dtype]
    src = np.asarray(values)
    if dtype in FLOAT_DTYPES:
        if src.dtype.kind in "iub":
            src = src.astype(np.float32)
        if dtype in (float32, tfloat32):
            return src.astype(np.float32, copy=False)
        if src.dtype != np.float32 and src.dtype != np.float64:
            src = src.astype(np.float32)
        return src.astype(target)
    if dtype in PACKED_DTYPES:
        return src.astype(target)
    if src.dtype.kind not in "iub":
        f = np.rint(src.astype(np.float64))
        f = np.nan_to_num(f, nan=0.0)
        info = np.iinfo(target)
        f = np.clip(f, info.min, info.max)
        return f.astype(target)
    if src.dtype == target:
        return src
    info = np.iinfo(target)
    return np.clip(src.astype(np.int64), info.min, info.max).astype(target)


def to_fp32(values: np.ndarray) -> np.ndarray:
    """Up-cast stored elements to float32 for engine math (ints are converted exactly up to 2**24)."""
    if values.dtype == np.float32:
        return values
    return values.astype(np.float32)
