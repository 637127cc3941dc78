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


class _LazyModule:
    """Attribute access resolves the backend once, then caches the attribute on the proxy itself, so
    kernels pay one dict lookup per ``nisa.X`` (``reset()`` clears the caches)."""

    def __init__(self, key: str) -> None:
        object.__setattr__(self, "_key", key)
        _proxies.append(self)

    def __getattr__(self, name: str) -> Any:
        value = getattr(_resolve()[object.__getattribute__(self, "_key")], name)
        object.__setattr__(self, name, value)
        return value

    def __repr__(self) -> str:
        key = object.__getattribute__(self, "_key")
        return f"<lazy NKI module {key!r} ({'resolved' if _resolved else 'unresolved'})>"


nki: Any = _LazyModule("nki")
nl: Any = _LazyModule("nl")
nisa: Any = _LazyModule("nisa")

__all__ = ["backend_name", "nisa", "nki", "nl", "reset"]
