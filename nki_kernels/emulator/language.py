"""``nki.language`` (``nl``) for the emulator.

Creation ops allocate tensors; the math/reduction wrappers allocate a new SBUF tile and lower to the
``nki.isa`` instruction they stand for (so they show up in the trace as that instruction):
binary ops -> ``tensor_tensor`` (equal shapes) or ``tensor_scalar`` (scalar or (P,1) operand);
activation functions -> ``activation``; other unary ALU ops -> ``tensor_scalar``; ``copy`` ->
``tensor_copy``; reductions -> ``tensor_reduce``; ``matmul`` -> ``nc_matmul``; ``transpose`` ->
``nc_transpose``; ``load``/``store`` -> ``dma_copy``; ``load_transpose2d`` -> ``dma_transpose``.
"""

from __future__ import annotations

import builtins as _bi
import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from . import dtypes as _dt
from . import isa as _isa
from . import opdefs
from . import start_partition as _sp
from . import state as _state
from .creation import (  # noqa: F401 (nl creation ops, tile_size, buffer predicates)
    _filled,
    ds,
    empty_like,
    full,
    is_hbm,
    is_on_chip,
    is_psum,
    is_sbuf,
    ndarray,
    ones,
    shared_constant,
    shared_identity_matrix,
    tile_size,
    zeros,
    zeros_like,
)
from .dtypes import (  # noqa: F401 (re-exported NKI dtype constants)
    bfloat16,
    bool_,
    float4_e2m1fn_x4,
    float8_e4m3,
    float8_e4m3fn,
    float8_e4m3fn_x4,
    float8_e5m2,
    float8_e5m2_x4,
    float8_e8m0fnu,
    float16,
    float32,
    int8,
    int16,
    int32,
    tfloat32,
    uint8,
    uint16,
    uint32,
)
from .errors import MemorySpaceError, ShapeMismatchError
from .nkiobject import NKIObject  # noqa: F401 (nl.NKIObject)
from .tensor import (  # noqa: F401
    DynSlice,
    MemoryRegion,
    NkiTensor,
    allocate,
    check_buffer,
    hbm,
    private_hbm,
    psum,
    sbuf,
    shared_hbm,
)

DType = str


# ------------------------------------------------------------------------------------------- programs / loops


def program_id(axis: int = 0) -> int:
    if axis != 0:
        raise ValueError(f"program_id: only axis 0 exists in NKI 0.6 (kernel[lnc]), got {axis}")
    return _state.current().program_id


def num_programs(axes: int = 0) -> int:
    return _state.current().num_programs


def program_ndim() -> int:
    return 1


def affine_range(start: int, stop: int | None = None, step: int = 1) -> range:
    return range(start, stop, step) if stop is not None else range(start)


sequential_range = affine_range
static_range = affine_range
dynamic_range = affine_range


def fori_loop(lower: Any, upper: Any, body_fun: Callable[[Any], None], step: int = 1) -> None:
    """Runtime loop: calls ``body_fun(i)`` with a read-only VirtualRegister for i in [lower, upper)."""
    lo = int(lower.value if isinstance(lower, _isa.VirtualRegister) else lower)
    hi = int(upper.value if isinstance(upper, _isa.VirtualRegister) else upper)
    if not isinstance(step, int) or step <= 0:
        raise ValueError(f"fori_loop: step must be a positive compile-time int, got {step!r}")
    for i in range(lo, hi, step):
        body_fun(_isa.VirtualRegister(i, frozen=True))


def while_loop(init: Any, body_fun: Callable[[], Any]) -> None:
    """Runtime while loop: runs ``body_fun()`` while the register (init, then its return value) is
    non-zero."""
    cond = init
    guard = 0
    while int(cond.value if isinstance(cond, _isa.VirtualRegister) else cond):
        cond = body_fun()
        guard += 1
        if guard > 10_000_000:
            raise RuntimeError("while_loop: more than 10^7 iterations")


@contextlib.contextmanager
def no_reorder() -> Iterator[None]:
    yield


def device_print(print_prefix: str, tensor: NkiTensor) -> None:
    v = tensor.read()
    print(print_prefix, None if v is None else np.asarray(v))


# --------------------------------------------------------------------------------------------- helpers


def _new_like(shape: tuple, dtype: Any) -> NkiTensor:
    return allocate(shape, dtype, sbuf)


def _tile(x: Any, fn: str) -> NkiTensor:
    if not isinstance(x, NkiTensor):
        raise TypeError(f"nl.{fn}: expected an NkiTensor, got {type(x).__name__}")
    if not x.buffer.on_chip:
        raise MemorySpaceError(
            f"[memory-space] nl.{fn}: operand {x._desc()} is in {x.buffer.name}; expected psum|sbuf "
            "(load it with nl.load first)"
        )
    return x


def _result_dtype(dtype: Any, *xs: Any) -> str:
    if dtype is not None:
        return _dt.normalize(dtype)
    tensors = [x for x in xs if isinstance(x, NkiTensor)]
    dts = [t.dtype for t in tensors]
    if _bi.all(d == dts[0] for d in dts):
        return dts[0]
    if any(_dt.is_float(d) for d in dts):
        return float32
    return int32


def _mk_binary(name: str) -> Callable[..., NkiTensor]:
    def fn(x: Any, y: Any, dtype: Any = None) -> NkiTensor:
        xt = isinstance(x, NkiTensor)
        yt = isinstance(y, NkiTensor)
        if not xt and not yt:
            raise TypeError(f"nl.{name}: at least one operand must be an NkiTensor")
        if xt and yt:
            _tile(x, name)
            _tile(y, name)
            if x.shape == y.shape:
                out = _new_like(x.shape, _result_dtype(dtype, x, y))
                _isa.tensor_tensor(out, x, y, fn)
                return out
            # (P,1) operand broadcast along the free dims -> tensor_scalar
            if y.shape[0] == x.shape[0] and y.size == y.shape[0]:
                out = _new_like(x.shape, _result_dtype(dtype, x, y))
                _isa.tensor_scalar(out, x, fn, y)
                return out
            if x.shape[0] == y.shape[0] and x.size == x.shape[0]:
                out = _new_like(y.shape, _result_dtype(dtype, x, y))
                _isa.tensor_scalar(out, y, fn, x, reverse0=True)
                return out
            raise ShapeMismatchError(
                f"[broadcast] nl.{name}: shapes {list(x.shape)} and {list(y.shape)} must be equal or one "
                "must be (P, 1) (use a broadcast view)"
            )
        t, s, rev = (x, y, False) if xt else (y, x, True)
        _tile(t, name)
        out = _new_like(t.shape, _result_dtype(dtype, t))
        _isa.tensor_scalar(out, t, fn, s, reverse0=rev)
        return out

    fn.__name__ = name
    fn.__qualname__ = name
    fn._nki_op = name  # type: ignore[attr-defined]
    fn.__doc__ = (
        f"Elementwise ``{name}`` of two tiles (or a tile and a scalar / (P,1) vector) into a new SBUF tile."
    )
    return fn


def _mk_unary(name: str) -> Callable[..., NkiTensor]:
    def fn(x: NkiTensor, dtype: Any = None) -> NkiTensor:
        _tile(x, name)
        out = _new_like(x.shape, _result_dtype(dtype, x))
        if name == "copy":
            _isa.tensor_copy(out, x)
        elif name in opdefs.ACTIVATION:
            _isa.activation(out, fn, x)
        elif name == "negative":
            _isa.tensor_scalar(out, x, multiply, -1.0)
        else:
            # nl-only helpers without a single instruction (cos, tan, floor, ...): computed on VectorE.
            _unary_vector(out, x, name)
        return out

    fn.__name__ = name
    fn.__qualname__ = name
    fn._nki_op = name  # type: ignore[attr-defined]
    fn.__doc__ = f"Elementwise ``{name}`` of a tile into a new SBUF tile."
    return fn


def _unary_vector(out: NkiTensor, x: NkiTensor, name: str) -> None:
    from .trace import TraceRecord

    launch = _state.current()
    _sp.check_all("tensor_scalar", launch.hw.pmax, ("dst", out), ("data", x))
    key = ("nl_unary", name, x.shape, x.dtype, out.dtype, launch.program_id)
    _isa.emit(
        launch,
        key,
        lambda: TraceRecord(
            op="tensor_scalar", engine="vector", shapes=(out.shape, x.shape), dtypes=(out.dtype, x.dtype),
            buffers=(out.buffer.trace_name, x.buffer.trace_name), partitions=x.shape[0],
            free_elems=x.size // x.shape[0], bytes_read=x.size * x.itemsize,
            bytes_written=out.size * out.itemsize, flops=out.size, program_id=launch.program_id,
            meta=(("alu", name),),
        ),
    )  # fmt: skip
    _isa.use_rw(launch, x, out)
    if not launch.trace_only:
        with np.errstate(all="ignore"):
            v = opdefs.UNARY[name](_isa.fp32_values(x))
        _isa.store_values(out, np.asarray(v).reshape(out.shape))


add = _mk_binary("add")
subtract = _mk_binary("subtract")
multiply = _mk_binary("multiply")
divide = _mk_binary("divide")
maximum = _mk_binary("maximum")
minimum = _mk_binary("minimum")
abs_max = _mk_binary("abs_max")
abs_min = _mk_binary("abs_min")
power = _mk_binary("power")
equal = _mk_binary("equal")
not_equal = _mk_binary("not_equal")
less = _mk_binary("less")
less_equal = _mk_binary("less_equal")
greater = _mk_binary("greater")
greater_equal = _mk_binary("greater_equal")
bitwise_and = _mk_binary("bitwise_and")
bitwise_or = _mk_binary("bitwise_or")
bitwise_xor = _mk_binary("bitwise_xor")
left_shift = _mk_binary("left_shift")
right_shift = _mk_binary("right_shift")
logical_and = _mk_binary("logical_and")
logical_or = _mk_binary("logical_or")
logical_xor = _mk_binary("logical_xor")
fmod = _mk_binary("fmod")
mod = _mk_binary("mod")

abs = _mk_unary("abs")  # noqa: A001
square = _mk_unary("square")
exp = _mk_unary("exp")
log = _mk_unary("log")
sqrt = _mk_unary("sqrt")
rsqrt = _mk_unary("rsqrt")
tanh = _mk_unary("tanh")
sigmoid = _mk_unary("sigmoid")
relu = _mk_unary("relu")
gelu = _mk_unary("gelu")
gelu_apprx_sigmoid = _mk_unary("gelu_apprx_sigmoid")
gelu_apprx_tanh = _mk_unary("gelu_apprx_tanh")
gelu_dx = _mk_unary("gelu_dx")
gelu_apprx_sigmoid_dx = _mk_unary("gelu_apprx_sigmoid_dx")
silu = _mk_unary("silu")
silu_dx = _mk_unary("silu_dx")
softplus = _mk_unary("softplus")
mish = _mk_unary("mish")
erf = _mk_unary("erf")
erf_dx = _mk_unary("erf_dx")
reciprocal = _mk_unary("reciprocal")
copy = _mk_unary("copy")
sin = _mk_unary("sin")
cos = _mk_unary("cos")
tan = _mk_unary("tan")
arctan = _mk_unary("arctan")
ceil = _mk_unary("ceil")
floor = _mk_unary("floor")
trunc = _mk_unary("trunc")
negative = _mk_unary("negative")
sign = _mk_unary("sign")
invert = _mk_unary("invert")
logical_not = _mk_unary("logical_not")


def _invert_vector(out: NkiTensor, x: NkiTensor) -> None:  # pragma: no cover - kept for symmetry
    _unary_vector(out, x, "invert")


class _Marker:
    def __init__(self, name: str) -> None:
        self._nki_op = name

    def __repr__(self) -> str:
        return f"nl.{self._nki_op}"


bypass = _Marker("copy")
prelu = _Marker("prelu")
average = _Marker("average")


# --------------------------------------------------------------------------------------------- reductions


def _reduce(
    name: str, opfn: Any, x: NkiTensor, axis: Any, dtype: Any, keepdims: bool, negate: bool = False
) -> NkiTensor:
    _tile(x, name)
    ax = _isa.free_axes(axis, x.ndim, f"nl.{name}")
    kept = list(x.shape)
    for a in ax:
        kept[a] = 1
    shape = tuple(kept) if keepdims else tuple(s for i, s in enumerate(x.shape) if i not in ax)
    if len(shape) < 2:
        shape = shape + (1,) * (2 - len(shape))
    out = _new_like(shape, _result_dtype(dtype, x))
    _isa.tensor_reduce(out, opfn, x, ax, negate=negate, keepdims=keepdims)
    return out


def sum(x: NkiTensor, axis: Any, dtype: Any = None, keepdims: bool = False) -> NkiTensor:  # noqa: A001
    return _reduce("sum", add, x, axis, dtype, keepdims)


def max(x: NkiTensor, axis: Any, dtype: Any = None, keepdims: bool = False) -> NkiTensor:  # noqa: A001
    return _reduce("max", maximum, x, axis, dtype, keepdims)


def min(x: NkiTensor, axis: Any, dtype: Any = None, keepdims: bool = False) -> NkiTensor:  # noqa: A001
    return _reduce("min", minimum, x, axis, dtype, keepdims)


def prod(x: NkiTensor, axis: Any, dtype: Any = None, keepdims: bool = False) -> NkiTensor:
    return _reduce("prod", multiply, x, axis, dtype, keepdims)


def mean(x: NkiTensor, axis: Any, dtype: Any = None, keepdims: bool = False) -> NkiTensor:
    s = _reduce("mean", add, x, axis, float32, keepdims)
    ax = _isa.free_axes(axis, x.ndim, "nl.mean")
    n = math.prod(x.shape[a] for a in ax)
    return multiply(s, 1.0 / n, dtype=_result_dtype(dtype, x))


def var(x: NkiTensor, axis: Any, dtype: Any = None, keepdims: bool = False) -> NkiTensor:
    m = mean(x, axis, float32, keepdims=True)
    d = subtract(x, m.reshape((m.shape[0], 1)) if m.size == m.shape[0] else m, dtype=float32)
    return mean(square(d, dtype=float32), axis, dtype=_result_dtype(dtype, x), keepdims=keepdims)


def all(x: NkiTensor, axis: Any, dtype: Any = None) -> NkiTensor:  # noqa: A001
    return _reduce("all", logical_and, x, axis, dtype, False)


def softmax(x: NkiTensor, axis: Any = -1, dtype: Any = None) -> NkiTensor:
    """Softmax over the free dims ``axis`` of a 2-D tile: max, exp(x - max) with row sum, multiply by
    1/sum."""
    _tile(x, "softmax")
    P = x.shape[0]
    mx = _reduce("softmax", maximum, x, axis, float32, keepdims=False, negate=True)  # -max
    e = _new_like(x.shape, float32)
    s = _new_like((P, 1), float32)
    _isa.activation(e, exp, x, bias=mx.reshape((P, 1)), reduce_op=add, reduce_res=s)
    r = _new_like((P, 1), float32)
    _isa.reciprocal(r, s)
    out = _new_like(x.shape, _result_dtype(dtype, x))
    _isa.tensor_scalar(out, e, multiply, r)
    return out


def rms_norm(
    x: NkiTensor,
    w: NkiTensor,
    axis: Any,
    n: int,
    epsilon: float = 1e-6,
    dtype: Any = None,
    compute_dtype: Any = None,
) -> NkiTensor:
    """``x * rsqrt(mean(x^2) + eps) * w`` over the free axis of a 2-D tile; ``w`` is [1, F] broadcast
    or [P, F]."""
    _tile(x, "rms_norm")
    P = x.shape[0]
    sq = _new_like(x.shape, float32)
    ss = _new_like((P, 1), float32)
    _isa.activation(sq, square, x, reduce_op=add, reduce_res=ss)
    r = _new_like((P, 1), float32)
    _isa.tensor_scalar(r, ss, multiply, 1.0 / n, op1=add, operand1=float(epsilon))
    _isa.activation(r, rsqrt, r)
    y = _new_like(x.shape, float32)
    _isa.tensor_scalar(y, x, multiply, r)
    out = _new_like(x.shape, _result_dtype(dtype, x))
    wt = w if w.shape[0] == P else w.broadcast(0, P) if False else w
    if wt.shape[0] != P:
        raise ShapeMismatchError(
            f"[broadcast] nl.rms_norm: w{list(w.shape)} must have {P} partitions (broadcast it first)"
        )
    _isa.tensor_tensor(out, y, wt, multiply)
    return out


def where(condition: NkiTensor, x: Any, y: Any, dtype: Any = None) -> NkiTensor:
    """``x`` where ``condition`` (1.0/0.0 tile) is non-zero, else ``y`` (tiles of the condition's shape
    or scalars)."""
    _tile(condition, "where")
    out = _new_like(condition.shape, _result_dtype(dtype, x if isinstance(x, NkiTensor) else condition))
    if isinstance(y, NkiTensor):
        _isa.tensor_copy(out, y)
    else:
        _isa.memset(out, y if not _dt.is_int(out.dtype) else int(y))
    if isinstance(x, NkiTensor):
        _isa.tensor_copy_predicated(out, x, condition)
    else:
        xt = full(condition.shape, x, out.dtype)
        _isa.tensor_copy_predicated(out, xt, condition)
    return out


def expand_dims(x: NkiTensor, axis: int) -> NkiTensor:
    return x.expand_dim(axis)


def broadcast_to(x: NkiTensor, shape: Any, dtype: Any = None) -> NkiTensor:
    """Materialise ``x`` broadcast to ``shape`` in a new SBUF tile (free dims by stride-0 view; a
    [1, F] tile is broadcast across partitions by a TensorE matmul with a ones row)."""
    shape = tuple(int(s) for s in shape)
    v = x
    if v.shape[0] != shape[0]:
        if v.shape[0] != 1:
            raise ShapeMismatchError(
                f"[broadcast] nl.broadcast_to: cannot broadcast {list(x.shape)} to {list(shape)}"
            )
        ones_ = full((1, shape[0]), 1.0, x.dtype if x.dtype not in ("float32", "tfloat32") else float32)
        F = x.size
        ps = allocate((shape[0], F), float32, psum)
        _isa.nc_matmul(ps, ones_, x.reshape((1, F)) if x.ndim != 2 else x)
        v = ps.reshape((shape[0],) + x.shape[1:]) if x.ndim > 2 else ps
    for d in range(1, len(shape)):
        if v.shape[d] != shape[d]:
            v = v.broadcast(d, shape[d])
    out = _new_like(shape, _result_dtype(dtype, x))
    _isa.tensor_copy(out, v)
    return out


def transpose(x: NkiTensor, dtype: Any = None) -> NkiTensor:
    """2-D tile transpose on TensorE; the result is a PSUM tile of ``x.dtype``."""
    _tile(x, "transpose")
    if x.ndim != 2:
        raise ShapeMismatchError(f"nl.transpose: parameter {x._desc()} exceeds the 2 supported dims")
    out = allocate((x.shape[1], x.shape[0]), x.dtype, psum)
    _isa.nc_transpose(out, x)
    return out


def matmul(x: NkiTensor, y: NkiTensor, transpose_x: bool = False) -> NkiTensor:
    """``x @ y`` (or ``x.T @ y`` with transpose_x=True) into a new fp32 PSUM tile on TensorE."""
    _tile(x, "matmul")
    _tile(y, "matmul")
    if not transpose_x:
        xt_ps = allocate((x.shape[1], x.shape[0]), x.dtype, psum)
        _isa.nc_transpose(xt_ps, x)
        xt = allocate(xt_ps.shape, x.dtype, sbuf)
        _isa.tensor_copy(xt, xt_ps)
        del xt_ps
        x = xt
    out = allocate(
        (x.shape[1] if x.ndim == 2 else math.prod(x.shape[1:]), math.prod(y.shape[1:])), float32, psum
    )
    _isa.nc_matmul(out, x, y)
    return out


# --------------------------------------------------------------------------------------------- DMA wrappers


def load(src: NkiTensor, dtype: Any = None) -> NkiTensor:
    """Copy an HBM tensor/view into a new SBUF tile of the same shape (dim 0 = partitions)."""
    if not isinstance(src, NkiTensor):
        raise TypeError(f"nl.load: src must be an NkiTensor, got {type(src).__name__}")
    if src.buffer.on_chip:
        raise MemorySpaceError(
            "[memory-space] Expected operand 'src' of 'load' to be in address space 'hbm', but got a tile "
            f"in '{src.buffer.name}' instead ({src._desc()})"
        )
    shape = src.shape if src.ndim >= 2 else (1,) + src.shape
    out = allocate(shape, dtype or src.dtype, sbuf)
    _isa.dma_copy(out, src)
    return out


def store(dst: NkiTensor, value: NkiTensor) -> None:
    """Copy an SBUF tile into an HBM tensor/view (element counts must match)."""
    if not isinstance(dst, NkiTensor) or dst.buffer.on_chip:
        raise MemorySpaceError(
            f"[memory-space] Expected operand 'dst' of 'store' to be in address space 'hbm' "
            f"(got {getattr(dst, 'buffer', type(dst).__name__)!r})"
        )
    _isa.dma_copy(dst, value)


def load_transpose2d(src: NkiTensor, dtype: Any = None) -> NkiTensor:
    """HBM [N, M] -> new SBUF tile [M, N] with a DMA transpose (2-byte dtypes, M <= 128)."""
    if src.ndim != 2:
        raise ShapeMismatchError(f"nl.load_transpose2d: src {src._desc()} must be 2-D")
    out = allocate((src.shape[1], src.shape[0]), dtype or src.dtype, sbuf)
    # the wrapper's lowering is the compiler's choice (it may split the rows): every dma_transpose rule
    # applies except the hardware-DGE source-shape rule (src.shape[0] == 16 for a single 2-D instruction)
    launch = _state.current()
    axes = _isa.dma_transpose_rules(out, src, None, _isa.dge_mode.unknown, _isa.oob_mode.error, launch, False)
    _isa.dma_transpose_do(out, src, axes, False, launch)
    return out


def gather_flattened(data: NkiTensor, indices: NkiTensor, axis: int = 0, dtype: Any = None) -> NkiTensor:
    raise NotImplementedError("nl.gather_flattened is not emulated")


def random_seed(seed: Any) -> None:
    raise NotImplementedError("nl.random_seed is not emulated (no RNG model)")


def rand(shape: Any, dtype: Any, buffer: Any = sbuf, name: str = "") -> NkiTensor:
    raise NotImplementedError("nl.rand is not emulated (no RNG model)")


def dropout(x: NkiTensor, rate: Any, dtype: Any = None) -> NkiTensor:
    raise NotImplementedError("nl.dropout is not emulated (no RNG model)")


# Reductions used as op= values (legacy style ``op=nl.max``) map to their ALU op.
sum._nki_op = "add"  # type: ignore[attr-defined]
max._nki_op = "maximum"  # type: ignore[attr-defined]
min._nki_op = "minimum"  # type: ignore[attr-defined]
prod._nki_op = "multiply"  # type: ignore[attr-defined]
