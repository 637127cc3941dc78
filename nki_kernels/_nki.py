"""The one place that decides which NKI implementation the kernels run on.

Every kernel module does ``from nki_kernels._nki import nki, nl, nisa``.  Those three names are lazy
proxies: nothing is imported, probed or read from the environment until an attribute is first used.
Resolution order:

1. ``NKI_ARDIFF_BACKEND=emulator`` forces the bundled emulator.
2. Otherwise the real standalone ``nki`` package (NKI 0.6, from the Neuron pip repository) if it imports.
3. Otherwise the emulator (:mod:`nki_kernels.emulator`).

``backend_name()`` returns ``"nki"`` or ``"emulator"``.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any

_resolved: dict[str, ModuleType] = {}
_backend: list[str] = []
_proxies: list[_LazyModule] = []


def _resolve() -> dict[str, ModuleType]:
    if _resolved:
        return _resolved
    forced = os.environ.get("NKI_ARDIFF_BACKEND", "").strip().lower()
    mods: dict[str, ModuleType] | None = None
    if forced != "emulator":
        try:
            real = importlib.import_module("nki")
            mods = {
                "nki": real,
                "nl": importlib.import_module("nki.language"),
                "nisa": importlib.import_module("nki.isa"),
            }
            _backend.append("nki")
        except ImportError:
            mods = None
    if mods is None:
        emu = importlib.import_module("nki_kernels.emulator")
        mods = {"nki": emu.nki, "nl": emu.language, "nisa": emu.isa}
        _backend.append("emulator")
    _resolved.update(mods)
    return _resolved


def backend_name() -> str:
    """``"nki"`` when the real NKI package runs the kernels, ``"emulator"`` otherwise."""
    _resolve()
    return _backend[0]


def reset() -> None:
    """Forget the resolution (tests that change ``NKI_ARDIFF_BACKEND`` call this)."""
    _resolved.clear()
    _backend.clear()
    for proxy in _proxies:
        key = object.__getattribute__(proxy, "_key")
        proxy.__dict__.clear()
        object.__setattr__(proxy, "_key", key)


class LazyKernel:
    """What ``@nki.jit`` returns through the shim: the kernel is handed to the resolved backend's
    ``nki.jit`` on first use (a call, ``kernel[lnc]``, or :meth:`resolve_kernel`), never at import.

    ``resolve_kernel()`` returns the backend's kernel object (the emulator's ``run`` and ``simulate``
    accept a ``LazyKernel`` through it).
    """

    def __init__(self, fn: Any, options: dict[str, Any]) -> None:
        self.fn = fn
        self.options = options
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = getattr(fn, "__doc__", None)
        self._kernels: dict[str, Any] = {}

    def resolve_kernel(self) -> Any:
        backend = backend_name()
        kernel = self._kernels.get(backend)
        if kernel is None:
            kernel = self._kernels[backend] = _resolve()["nki"].jit(self.fn, **self.options)
        return kernel

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve_kernel()(*args, **kwargs)

    def __getitem__(self, lnc: Any) -> Any:
        return self.resolve_kernel()[lnc]

    def __repr__(self) -> str:
        return f"<LazyKernel {self.__name__}>"


def _lazy_jit(fn: Any = None, **options: Any) -> Any:
    """``@nki.jit`` / ``@nki.jit(**options)`` through the shim (see :class:`LazyKernel`)."""
    if fn is None:
        return lambda f: LazyKernel(f, options)
    return LazyKernel(fn, options)


def launch(kernel: Any, *args: Any, lnc: int = 1, **kwargs: Any) -> tuple[Any, Any]:
    """Run a ``@nki.jit`` kernel on the resolved backend; returns ``(outputs, trace)``.

    Real NKI: ``kernel[lnc](*args)`` (the framework is chosen from the argument types: torch-xla tensors
    on a Neuron device, numpy arrays for a standalone launch); ``trace`` is ``None``. Emulator:
    :func:`nki_kernels.emulator.run`, which also returns the instruction trace.
    """
    if backend_name() == "nki":
        k = kernel.resolve_kernel() if isinstance(kernel, LazyKernel) else kernel
        return (k[lnc] if lnc != 1 else k)(*args, **kwargs), None
    from nki_kernels.emulator import run

    return run(kernel, *args, lnc=lnc, **kwargs)


class _LazyModule:
    """Attribute access resolves the backend once, then caches the attribute on the proxy itself, so
    kernels pay one dict lookup per ``nisa.X`` (``reset()`` clears the caches)."""

    def __init__(self, key: str) -> None:
        object.__setattr__(self, "_key", key)
        _proxies.append(self)

    def __getattr__(self, name: str) -> Any:
        key = object.__getattribute__(self, "_key")
        if key == "nki" and name == "jit":
            return _lazy_jit  # kernels decorate at import: resolution waits for the first launch
        value = getattr(_resolve()[key], name)
        object.__setattr__(self, name, value)
        return value

    def __repr__(self) -> str:
        key = object.__getattribute__(self, "_key")
        return f"<lazy NKI module {key!r} ({'resolved' if _resolved else 'unresolved'})>"


nki: Any = _LazyModule("nki")
nl: Any = _LazyModule("nl")
nisa: Any = _LazyModule("nisa")

__all__ = ["LazyKernel", "backend_name", "launch", "nisa", "nki", "nl", "reset"]
