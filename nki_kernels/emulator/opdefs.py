"""Numeric definitions of the ALU ops, activation functions and reductions used as ``op=`` values.

``nl`` functions carry their op name in ``fn._nki_op``; the ISA looks the name up here.  Arithmetic
is done in float32 (engines up-cast to fp32); bit-vector ops act on the raw integers.  Activation
functions are exact numpy formulas: the piecewise-polynomial approximation error of ScalarE and its
valid-input-range garbage are NOT modelled.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

_F32 = np.float32


def _erf(x: np.ndarray) -> np.ndarray:
    import torch

    return torch.special.erf(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))).numpy()


def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return (1.0 / (1.0 + np.exp(-x))).astype(_F32)


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(_F32(0), x).astype(_F32)


_SQRT_2_PI = math.sqrt(2.0 / math.pi)

UNARY: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "copy": lambda x: x,
    "square": lambda x: x * x,
    "sigmoid": _sigmoid,
    "relu": lambda x: np.maximum(x, _F32(0)),
    "gelu": lambda x: (0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))).astype(_F32),
    "gelu_apprx_tanh": lambda x: (0.5 * x * (1.0 + np.tanh(_SQRT_2_PI * (x + 0.044715 * x**3)))).astype(_F32),
    "gelu_apprx_sigmoid": lambda x: (x * _sigmoid(1.702 * x)).astype(_F32),
    "gelu_dx": lambda x: (
        0.5 * (1.0 + _erf(x / math.sqrt(2.0))) + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    ).astype(_F32),
    "gelu_apprx_sigmoid_dx": lambda x: (
        _sigmoid(1.702 * x) + 1.702 * x * _sigmoid(1.702 * x) * (1 - _sigmoid(1.702 * x))
    ).astype(_F32),
    "silu": lambda x: (x * _sigmoid(x)).astype(_F32),
    "silu_dx": lambda x: (_sigmoid(x) * (1 + x * (1 - _sigmoid(x)))).astype(_F32),
    "softplus": _softplus,
    "mish": lambda x: (x * np.tanh(_softplus(x))).astype(_F32),
    "erf": _erf,
    "erf_dx": lambda x: (2.0 / math.sqrt(math.pi) * np.exp(-x * x)).astype(_F32),
    "exp": np.exp,
    "log": np.log,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: (_F32(1) / np.sqrt(x)).astype(_F32),
    "tanh": np.tanh,
    "reciprocal": lambda x: (_F32(1) / x).astype(_F32),
    "sign": np.sign,
    "abs": np.abs,
    "sin": np.sin,
    "cos": np.cos,
    "tan": np.tan,
    "arctan": np.arctan,
    "ceil": np.ceil,
    "floor": np.floor,
    "trunc": np.trunc,
    "negative": np.negative,
    "invert": np.invert,
    "logical_not": lambda x: (x == 0).astype(_F32),
}

# ScalarE activation functions (nki.api.shared op table; cos/tan/ceil/... are nl-only wrappers).
ACTIVATION = frozenset(
    {
        "copy", "square", "sigmoid", "relu", "gelu", "gelu_apprx_tanh", "gelu_apprx_sigmoid", "gelu_dx",
        "gelu_apprx_sigmoid_dx", "silu", "silu_dx", "softplus", "mish", "erf", "erf_dx", "exp", "log",
        "sqrt", "rsqrt", "tanh", "reciprocal", "sign", "abs", "sin", "arctan",
    }
)  # fmt: skip


def _cmp(f: Callable[[Any, Any], Any]) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    return lambda a, b: f(a, b).astype(_F32)


BINARY: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "add": np.add,
    "subtract": np.subtract,
    "multiply": np.multiply,
    "divide": np.divide,
    "maximum": np.maximum,
    "minimum": np.minimum,
    "abs_max": lambda a, b: np.maximum(np.abs(a), np.abs(b)),
    "abs_min": lambda a, b: np.minimum(np.abs(a), np.abs(b)),
    "power": np.power,
    "equal": _cmp(np.equal),
    "not_equal": _cmp(np.not_equal),
    "less": _cmp(np.less),
    "less_equal": _cmp(np.less_equal),
    "greater": _cmp(np.greater),
    "greater_equal": _cmp(np.greater_equal),
    "logical_and": _cmp(lambda a, b: (a != 0) & (b != 0)),
    "logical_or": _cmp(lambda a, b: (a != 0) | (b != 0)),
    "logical_xor": _cmp(lambda a, b: (a != 0) ^ (b != 0)),
    "fmod": np.fmod,
    "mod": np.mod,
    "bitwise_and": np.bitwise_and,
    "bitwise_or": np.bitwise_or,
    "bitwise_xor": np.bitwise_xor,
    "left_shift": np.left_shift,
    "right_shift": np.right_shift,
}
BITVEC = frozenset({"bitwise_and", "bitwise_or", "bitwise_xor", "left_shift", "right_shift", "invert"})
# Reduce-legal ops and their identities (nki.api.shared: and/or/xor, add, subtract, multiply, max, min,
# logical and/or/xor).
REDUCE_IDENTITY: dict[str, float] = {
    "add": 0.0,
    "subtract": 0.0,
    "multiply": 1.0,
    "maximum": -np.inf,
    "minimum": np.inf,
    "logical_and": 1.0,
    "logical_or": 0.0,
    "logical_xor": 0.0,
    "bitwise_and": -1,
    "bitwise_or": 0,
    "bitwise_xor": 0,
}

_NUMPY_ALIASES: dict[Any, str] = {
    np.add: "add",
    np.subtract: "subtract",
    np.multiply: "multiply",
    np.maximum: "maximum",
    np.minimum: "minimum",
    np.exp: "exp",
    np.log: "log",
    np.sqrt: "sqrt",
    np.tanh: "tanh",
    np.abs: "abs",
    np.negative: "negative",
    np.max: "maximum",
    np.min: "minimum",
    np.sum: "add",
}


def op_name(op: Any, arg: str = "op") -> str:
    """Name of an ``op=`` value: an ``nl`` function (or, leniently, the matching numpy function)."""
    name = getattr(op, "_nki_op", None)
    if name is not None:
        return name
    try:
        if op in _NUMPY_ALIASES:
            return _NUMPY_ALIASES[op]
    except TypeError:
        pass
    raise TypeError(f"{arg}: expected an nl function such as nl.add or nl.exp, got {op!r}")


def reduce_fn(name: str, arg: str = "op") -> Callable[..., np.ndarray]:
    if name not in REDUCE_IDENTITY:
        raise ValueError(f"{arg}: {name} is not a legal reduce op (legal: {sorted(REDUCE_IDENTITY)})")
    f = BINARY[name]
    return f.reduce if isinstance(f, np.ufunc) else _generic_reduce(f)


def _generic_reduce(f: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Callable[..., np.ndarray]:
    def red(x: np.ndarray, axis: tuple[int, ...], keepdims: bool = False) -> np.ndarray:
        orig = x.shape
        x = np.moveaxis(x, axis, tuple(range(x.ndim - len(axis), x.ndim)))
        lead = x.shape[: x.ndim - len(axis)]
        flat = x.reshape(lead + (-1,))
        acc = flat[..., 0]
        for i in range(1, flat.shape[-1]):
            acc = f(acc, flat[..., i])
        if keepdims:
            out_shape = list(orig)
            for a in axis:
                out_shape[a] = 1
            acc = acc.reshape(out_shape)
        return acc

    return red
