"""``nki.jit`` / ``nki.simulate`` for the emulator, plus the emulator's own :func:`run`.

Calling a jitted kernel runs its Python body eagerly on CPU.  Array arguments (numpy arrays, CPU torch
tensors) become HBM tensors that *share memory* with the caller's arrays where possible, so writes a
kernel makes into an input are visible to the caller (as the official simulator copies them back);
non-contiguous inputs are copied in and copied back after the launch.  Returned HBM tensors come back
as numpy arrays (torch tensors when any input was a torch tensor).  ``kernel[2]`` runs program 0 then
program 1, taking turns where one waits for the other at ``core_barrier`` / ``sendrecv`` (the official
simulator uses two threads; turns keep the order deterministic, :mod:`~nki_kernels.emulator.lnc`);
``shared_hbm`` allocations are shared between the two programs (the i-th allocation of either program).
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import dtypes as _dt
from . import state as _state
from .errors import LaunchError
from .hw import TRN2, HwConfig
from .lnc import Scheduler
from .tensor import NkiTensor, private_hbm, shared_hbm, wrap_array
from .trace import Trace


@dataclass(frozen=True)
class TensorSpec:
    """Placeholder input for trace-only runs: an HBM tensor of ``shape``/``dtype`` with no data."""

    shape: tuple[int, ...]
    dtype: Any = "float32"

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "dtype", _dt.normalize(self.dtype))


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach") and hasattr(x, "dtype")


def _torch_to_numpy_shared(t: Any) -> tuple[np.ndarray, bool]:
    """numpy array sharing ``t``'s memory when possible (bf16/fp8 through an integer view)."""
    import torch

    if t.device.type != "cpu":
        raise LaunchError(f"[launch] torch tensors must be on CPU for the emulator, got device {t.device}")
    dtype = _dt.normalize(t.dtype)
    contiguous = t.is_contiguous()
    src = t.detach() if contiguous else t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        arr = src.view(torch.int16).numpy().view(_dt.storage_dtype(dtype))
    elif t.dtype in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)):
        arr = src.view(torch.uint8).numpy().view(_dt.storage_dtype(dtype))
    elif t.dtype == torch.bool:
        arr = src.view(torch.uint8).numpy()
    else:
        arr = src.numpy()
    return arr, contiguous


def _numpy_to_torch(a: np.ndarray, dtype: str) -> Any:
    import torch

    a = np.ascontiguousarray(a)
    if dtype == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    if dtype == "float8_e4m3fn":
        return torch.from_numpy(a.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    if dtype == "float8_e5m2":
        return torch.from_numpy(a.view(np.uint8).copy()).view(torch.float8_e5m2)
    if dtype == "bool_":
        return torch.from_numpy(a.copy()).to(torch.bool)
    if a.dtype.kind == "V":
        return torch.from_numpy(a.astype(np.float32))
    return torch.from_numpy(a.copy())


class _Binder:
    """Converts call arguments to HBM tensors and results back."""

    def __init__(self, trace_only: bool, lnc: int) -> None:
        self.trace_only = trace_only
        self.buffer = shared_hbm if lnc > 1 else private_hbm
        self.copy_back: list[tuple[Any, np.ndarray]] = []
        self.by_storage: dict[int, Any] = {}
        self.any_torch = False

    def to_tensor(self, x: Any, name: str) -> Any:
        if isinstance(x, NkiTensor):
            return x
        if isinstance(x, TensorSpec):
            if not self.trace_only:
                raise LaunchError(
                    f"[launch] argument {name} is a TensorSpec; TensorSpec inputs need trace_only=True"
                )
            return wrap_array(None, x.shape, x.dtype, self.buffer, name)
        if _is_torch(x):
            self.any_torch = True
            arr, shared = _torch_to_numpy_shared(x)
            dtype = _dt.normalize(x.dtype)
            return self._wrap(arr, dtype, name, x, shared)
        if isinstance(x, np.ndarray):
            dtype = _dt.normalize(x.dtype)
            return self._wrap(x, dtype, name, x, True)
        if isinstance(x, (list, tuple)) and any(
            isinstance(e, (np.ndarray, TensorSpec)) or _is_torch(e) for e in x
        ):
            return type(x)(self.to_tensor(e, f"{name}[{i}]") for i, e in enumerate(x))
        return x

    def _wrap(self, arr: np.ndarray, dtype: str, name: str, orig: Any, shared: bool) -> NkiTensor:
        shape = tuple(arr.shape) if arr.ndim else (1,)
        if self.trace_only:
            return wrap_array(None, shape, dtype, self.buffer, name)
        if arr.dtype == np.bool_:
            arr = arr.view(np.uint8)
        if shared and arr.flags.c_contiguous and arr.flags.writeable:
            flat = arr.reshape(-1)
        else:
            flat = np.ascontiguousarray(arr).reshape(-1).copy()
            self.copy_back.append((orig, flat))
        t = wrap_array(flat, shape, dtype, self.buffer, name)
        self.by_storage[id(t.storage)] = orig
        return t

    def finish(self) -> None:
        for orig, flat in self.copy_back:
            if _is_torch(orig):
                src = _numpy_to_torch(flat.reshape(tuple(orig.shape)), _dt.normalize(orig.dtype))
                orig.copy_(src)
            elif isinstance(orig, np.ndarray) and orig.flags.writeable:
                orig[...] = (
                    flat.reshape(orig.shape).view(orig.dtype)
                    if orig.dtype == np.bool_
                    else flat.reshape(orig.shape)
                )

    def from_result(self, r: Any, torch_out: bool) -> Any:
        if isinstance(r, NkiTensor):
            st = r.storage
            if self.trace_only or st.data is None:
                return TensorSpec(r.shape, r.dtype)
            orig = self.by_storage.get(id(st))
            if orig is not None and r.offset == 0 and r.shape == tuple(st.shape) and r.is_contiguous():
                return orig
            arr = np.array(r.read(), copy=True)
            return _numpy_to_torch(arr, r.dtype) if torch_out else arr
        if isinstance(r, tuple):
            return tuple(self.from_result(e, torch_out) for e in r)
        if isinstance(r, list):
            return [self.from_result(e, torch_out) for e in r]
        if isinstance(r, dict):
            return {k: self.from_result(v, torch_out) for k, v in r.items()}
        return r


def _launch(
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    lnc: int,
    trace_only: bool,
    keep_order: bool,
    hw: HwConfig | None,
    torch_out: bool | None = None,
    keep_events: bool = False,
) -> tuple[Any, Trace]:
    if lnc not in (1, 2):
        raise LaunchError(f"[lnc] kernel[lnc]: lnc must be 1 or 2 (logical NeuronCores on trn2), got {lnc!r}")
    if _state.active() is not None:
        raise LaunchError(
            "[launch] a kernel launch is already running; sub-kernels must be plain functions, not @nki.jit"
        )
    trace = Trace(
        kernel_name=getattr(fn, "__name__", "kernel"), keep_order=keep_order, keep_events=keep_events
    )
    launch = _state.Launch(hw or TRN2, trace, trace_only, lnc)
    binder = _Binder(trace_only, lnc)
    targs = tuple(binder.to_tensor(a, f"arg{i}") for i, a in enumerate(args))
    tkw = {k: binder.to_tensor(v, k) for k, v in kwargs.items()}
    results = []
    # The cyclic GC is paused during a launch: kernels allocate millions of small acyclic objects
    # (views, tiles) that reference counting frees; generation-0 collections only cost time.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    _state.push(launch)
    try:
        if lnc > 1 and not trace_only:  # values may cross the cores: the programs take turns (lnc.py)
            results = Scheduler(launch, lnc).run(fn, targs, tkw)
        else:
            for pid in range(lnc):
                launch.start_program(pid)
                results.append(fn(*targs, **tkw))
                launch.end_program()  # on-chip capacity under last-use liveness, placed-tile overlaps
    finally:
        _state.pop()
        if gc_was_enabled:
            gc.enable()
        launch.flush()
        launch.new_epoch()  # storages freed after the launch no longer touch its accounting
    binder.finish()
    out = binder.from_result(
        results[-1] if lnc > 1 else results[0], binder.any_torch if torch_out is None else torch_out
    )
    return out, trace


class Kernel:
    """A ``@nki.jit`` kernel.  Call it directly (lnc=1) or as ``kernel[2](...)``.

    ``last_trace`` holds the :class:`Trace` of the most recent call.
    """

    def __init__(self, fn: Callable[..., Any], lnc: int = 1, options: dict | None = None) -> None:
        self.fn = fn
        self.lnc = lnc
        self.options = dict(options or {})
        self.last_trace: Trace | None = None
        functools.update_wrapper(self, fn)

    def __getitem__(self, lnc: Any) -> Kernel:
        if isinstance(lnc, tuple):
            if len(lnc) != 1:
                raise LaunchError(f"[lnc] NKI 0.6 launches take one lnc value (1 or 2), got grid {lnc}")
            lnc = lnc[0]
        if not isinstance(lnc, int) or lnc not in (1, 2):
            raise LaunchError(f"[lnc] kernel[lnc]: lnc must be 1 or 2, got {lnc!r}")
        return Kernel(self.fn, lnc, self.options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out, trace = _launch(self.fn, args, kwargs, self.lnc, False, False, None)
        self.last_trace = trace
        return out

    def __repr__(self) -> str:
        return f"<emulated nki kernel {getattr(self.fn, '__name__', '?')} lnc={self.lnc}>"


def jit(fn: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
    """Decorator: ``@nki.jit`` or ``@nki.jit(...)``.  ``platform_target=`` is rejected (as in NKI >= 0.3)."""
    if "platform_target" in kwargs:
        raise TypeError(
            "nki.jit: platform_target= is not accepted since NKI 0.3.0 (use NEURON_PLATFORM_TARGET_OVERRIDE)"
        )
    if fn is None:
        return lambda f: Kernel(f, 1, kwargs)
    if isinstance(fn, Kernel):
        return fn
    return Kernel(fn, 1, kwargs)


def _unwrap(kernel: Any) -> Any:
    """Deferred-jit wrappers (objects with ``resolve_kernel()``, e.g. a kernel decorated through a lazy
    ``nki`` shim) stand for the kernel they resolve to."""
    resolve = getattr(kernel, "resolve_kernel", None)
    return resolve() if callable(resolve) else kernel


def simulate(kernel: Any) -> Callable[..., Any]:
    """``nki.simulate(kernel)(*args)``: run a jitted (or plain) kernel on the emulator."""
    kernel = _unwrap(kernel)
    k = kernel if isinstance(kernel, Kernel) else Kernel(kernel)
    return k


def run(
    kernel: Any,
    *args: Any,
    lnc: int | None = None,
    trace_only: bool = False,
    keep_order: bool = False,
    hw: HwConfig | None = None,
    keep_events: bool = False,
    **kwargs: Any,
) -> tuple[Any, Trace]:
    """Run ``kernel`` (a ``@nki.jit`` kernel, ``kernel[lnc]`` or a plain function) and return
    ``(outputs, trace)``.

    Args:
        kernel: the kernel.
        *args, **kwargs: kernel arguments; numpy arrays / CPU torch tensors become HBM tensors,
            :class:`TensorSpec` placeholders are accepted with ``trace_only=True``.
        lnc: logical cores (1 or 2); default: the kernel's own (``kernel[2]`` -> 2), else 1.
        trace_only: shapes, access patterns, rules and trace only; no arithmetic, outputs are TensorSpec.
        keep_order: also keep every record in program order in ``trace.order``.
        keep_events: also keep the ordered event log (every issued instruction with the memory regions it
            reads and writes, :meth:`Trace.iter_events`); off by default (no cost when off).
        hw: hardware limits (default :data:`~nki_kernels.emulator.hw.TRN2`).

    Returns:
        ``(outputs, trace)``: outputs as numpy arrays (torch tensors if any input was torch), the
        aggregated :class:`Trace` of all logical cores.
    """
    kernel = _unwrap(kernel)
    if isinstance(kernel, Kernel):
        fn = kernel.fn
        n = kernel.lnc if lnc is None else lnc
    else:
        fn = kernel
        n = 1 if lnc is None else lnc
    out, trace = _launch(fn, args, kwargs, n, trace_only, keep_order, hw, keep_events=keep_events)
    if isinstance(kernel, Kernel):
        kernel.last_trace = trace
    return out, trace


from . import collectives, isa, language  # noqa: E402  (nki.language / nki.isa / nki.collectives)

dtype = language.DType
"""``nki.dtype``: the type of dtype values (NKI dtypes are strings such as ``"bfloat16"``), used in
annotations (``def f(dt: nki.dtype)``)."""

__all__ = ["Kernel", "TensorSpec", "collectives", "dtype", "isa", "jit", "language", "run", "simulate"]
